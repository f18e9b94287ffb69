"""The fault suite's control-plane faults: on-call readers of the report API, a sick Prometheus
(trickling, wrong-shaped, late) and steps of the controller's wall clock. Each `_fault_NAME`
injects the fault, measures its own goals while it lasts (Injection.missed names each goal missed,
with its figure), and returns; `FaultSuite.run_one` measures the usual ones (requests, duplicates,
orphans, scale-downs, recovery)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleetplan.controller.clocks import observe_deadlines
from fleetplan.harness.fault_core import FaultSuiteCore, Injection
from fleetplan.harness.prom_proxy import Sickness
from fleetplan.harness.report_readers import NO_RETRY_AFTER
from fleetplan.harness.rig_tools import MODEL, policy_doc
from fleetplan.shared.atomic import atomic_write_text

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")  # Debian's libfaketime
# scheduling noise allowed on top of a bound made of measured times (a busy 2-core machine)
SLACK_S = 0.5
STEPPED = re.compile(r"the clock stepped ([+-]\d+) s")


# libfaketime 0.9.10 under FAKETIME_DONT_FAKE_MONOTONIC fails clock_nanosleep(CLOCK_MONOTONIC,
# TIMER_ABSTIME) with EINVAL, and Python's time.sleep (and subprocess's timed waits, e.g. the nginx
# reload) use it: a process run by faketime_env sleeps with select() instead (this sitecustomize)
SLEEP_SHIM = """\"\"\"Written by fleetplan.harness.fault_controlplane.faketime_env: time.sleep by select().\"\"\"
import select
import time


def _sleep(seconds):
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        select.select([], [], [], left)


time.sleep = _sleep
"""


def faketime_env(offset_file: Path) -> dict[str, str] | None:
    """The environment that runs a process under libfaketime with its wall clock offset by what
    `offset_file` says ("+0", "-3600"; read again every second), the monotonic clock untouched (and
    time.sleep by select(): SLEEP_SHIM); None when libfaketime is not installed (Debian: apt-get
    install libfaketime)."""
    if not FAKETIME_LIB.exists():
        return None
    if not offset_file.exists():
        atomic_write_text(offset_file, "+0\n")
    site = offset_file.parent / "faketime-site"
    site.mkdir(parents=True, exist_ok=True)
    atomic_write_text(site / "sitecustomize.py", SLEEP_SHIM)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME_TIMESTAMP_FILE": str(offset_file),
            "FAKETIME_CACHE_DURATION": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1", "PYTHONPATH": path}


@dataclass(frozen=True)
class Cycle:
    cycle_id: int
    started_s: float
    finished_s: float | None
    status: str
    summary: dict[str, Any]


class HealthWatch:
    """GET /healthz every 0.5 s until stopped: the answers that were not 200."""

    def __init__(self, url: str) -> None:
        self.url = url + "/healthz"
        self.polls = 0
        self.bad: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> HealthWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                try:
                    r = await client.get(self.url)
                    if r.status_code != 200:
                        self.bad.append(f"{r.status_code} {r.text[:120]!r}")
                except httpx.HTTPError as exc:
                    self.bad.append(type(exc).__name__)
                self.polls += 1
                await asyncio.sleep(0.5)

    async def stop(self) -> str | None:
        """None when every answer was a 200, else what was not (a missed goal)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not self.bad:
            return None
        return f"/healthz not 200 in {len(self.bad)} of {self.polls} polls (first: {self.bad[0]})"


class ControlPlaneFaults(FaultSuiteCore):
    """On-call readers, a sick Prometheus, the wall clock stepped (issue 36)."""

    # ---------------------------------------------------------------------------------------------
    # what the controller's database says of its cycles

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.ctrl.state_db}?mode=ro", uri=True, timeout=10)

    def _cycles(self, after: int = 0, last: int | None = None) -> list[Cycle]:
        """The cycles after cycle `after` (or the `last` ones), oldest first."""
        with contextlib.closing(self._db()) as db:
            if last is not None:
                rows = db.execute("SELECT cycle_id, started_s, finished_s, status, summary FROM cycles "
                                  "ORDER BY cycle_id DESC LIMIT ?", (last,)).fetchall()[::-1]
            else:
                rows = db.execute("SELECT cycle_id, started_s, finished_s, status, summary FROM cycles "
                                  "WHERE cycle_id > ? ORDER BY cycle_id", (after,)).fetchall()
        return [Cycle(int(r[0]), float(r[1]), None if r[2] is None else float(r[2]), str(r[3]),
                      json.loads(r[4]) if r[4] else {}) for r in rows]

    def _last_cycle_id(self) -> int:
        got = self._cycles(last=1)
        return got[0].cycle_id if got else 0

    def _quiet(self) -> tuple[int, float, float]:
        """(the last cycle's id, the mean period start to start, the longest cycle) of the last 12
        finished cycles: the controller before the fault."""
        rows = [c for c in self._cycles(last=12) if c.finished_s is not None]
        if len(rows) < 3:
            raise RuntimeError(f"only {len(rows)} finished cycles in the store: no quiet period to compare with")
        period = statistics.mean(b.started_s - a.started_s for a, b in itertools.pairwise(rows))
        longest = max((c.finished_s or c.started_s) - c.started_s for c in rows)
        return rows[-1].cycle_id, period, longest

    def _known_from(self, after: int) -> int | None:
        """The first cycle after `after` whose observation knows the model's demand (not stale)."""
        with contextlib.closing(self._db()) as db:
            rows = db.execute("SELECT cycle_id, payload FROM observations WHERE cycle_id > ? ORDER BY cycle_id",
                              (after,)).fetchall()
        for cid, payload in rows:
            m = (json.loads(payload).get("models") or {}).get(MODEL) or {}
            if m and not m.get("stale", True) and m.get("rate_rps") is not None:
                return int(cid)
        return None

    def _actions_in(self, cycle_id: int) -> list[str]:
        with contextlib.closing(self._db()) as db:
            rows = db.execute("SELECT kind, replica_id, status, reason FROM actions WHERE cycle_id = ?",
                              (cycle_id,)).fetchall()
        return [f"{r[0]} {r[1]} ({r[2]}: {r[3]})" for r in rows]

    def _cycle_wall_s(self) -> float:
        return float(policy_doc(**self._policy_over)["scaling"]["cycle_s"]) / self.ctrl.time_scale

    async def _first(self, pred: Callable[[], Any], until: float, poll_s: float = 0.25) -> tuple[Any, float | None]:
        """(what `pred` returned, when: time.monotonic()) the first time it is truthy before `until`."""
        while time.monotonic() < until:
            got = await asyncio.to_thread(pred)
            if got:
                return got, time.monotonic()
            await asyncio.sleep(poll_s)
        return None, None

    def _error_cycles(self, cycles: list[Cycle]) -> list[str]:
        return [f"cycle {c.cycle_id}: {c.summary.get('error', c.status)}" for c in cycles if c.status == "error"]

    # ---------------------------------------------------------------------------------------------
    # on-call readers

    async def _fault_report_readers(self) -> Injection:
        """`readers` concurrent readers of /plan and /api/report for `sick_s` (a child process,
        ignoring Retry-After). Goals: every answer a 200 or a 503 with Retry-After; cycles finished
        >= window / (1.5 x the quiet period); no gap between decisions (cycle ends) over 2 quiet
        periods; /healthz 200 throughout."""
        cid0, period, _ = await asyncio.to_thread(self._quiet)
        work = self.ctrl.work
        out, cfg = work / "readers.json", work / "readers-config.json"
        out.unlink(missing_ok=True)
        cfg.write_text(json.dumps({"url": self.ctrl.url, "paths": ["/plan", "/api/report"], "readers": self.readers,
                                   "duration_s": self.sick_s, "out": str(out)}))
        health = HealthWatch(self.ctrl.url).start()
        t = time.monotonic()
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fleetplan.harness.report_readers", str(cfg),
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            with contextlib.suppress(TimeoutError):  # a request is given up after 120 s
                await asyncio.wait_for(proc.wait(), self.sick_s + 150)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        window_s = time.monotonic() - t
        missed = [m for m in [await health.stop()] if m]
        got = json.loads(out.read_text()) if out.exists() else {"status": {}}
        status: dict[str, int] = got["status"]
        cycles = await asyncio.to_thread(self._cycles, cid0 - 1)
        ends = [c.finished_s for c in cycles if c.finished_s is not None]
        done = len(ends) - 1  # the first is the last quiet cycle
        gap = max((b - a for a, b in itertools.pairwise(ends)), default=0.0)
        loaded = [b.started_s - a.started_s for a, b in itertools.pairwise(cycles[1:])]
        loaded_period = statistics.mean(loaded) if loaded else float("nan")
        others = {k: n for k, n in status.items() if k not in ("200", "503")}
        notes = [f"{self.readers} readers for {window_s:.0f} s: answers {dict(sorted(status.items()))}, p50 "
                 f"{got.get('p50_s', float('nan')):.2f} s, p99 {got.get('p99_s', float('nan')):.2f} s",
                 f"{done} cycles finished, period {loaded_period:.2f} s (quiet {period:.2f} s, "
                 f"{loaded_period / period:.2f}x), longest gap between decisions {gap:.2f} s = {gap / period:.2f} periods"]
        if not status:
            missed.append("the readers reported nothing")
        if others:
            missed.append(f"answers other than 200 or 503 with Retry-After: {others}"
                          + (f" ({NO_RETRY_AFTER}: {status[NO_RETRY_AFTER]})" if NO_RETRY_AFTER in status else ""))
        if done < int(window_s / (1.5 * period)):
            missed.append(f"{done} cycles finished in {window_s:.0f} s (goal >= {int(window_s / (1.5 * period))})")
        if gap > 2 * period:
            missed.append(f"a gap of {gap / period:.2f} quiet periods between decisions (goal <= 2)")
        missed += self._error_cycles(cycles[1:])
        return Injection(t, notes=notes, missed=missed)

    # ---------------------------------------------------------------------------------------------
    # a sick Prometheus

    def _prometheus_alert(self) -> str | None:
        return next((a for a in self._alerts() if "prometheus" in a.lower() and "query" in a), None)

    async def _sick_prometheus(self, sickness: Sickness) -> Injection:
        """The controller's Prometheus (the proxy) sick for `sick_s`. Goals: an alert naming
        Prometheus and the query within a cycle; no cycle with an error; the gap between cycle starts
        at most max(quiet period, observe deadline + the longest quiet cycle); the model's demand
        known within 2 cycles of healing; no request failed (and the usual: no scale-down)."""
        proxy = self.prom_proxy
        if proxy is None:
            raise RuntimeError("the sick-Prometheus faults need the controller's Prometheus behind "
                               "fleetplan.harness.prom_proxy (bench/faults.py starts it)")
        cid0, period, longest = await asyncio.to_thread(self._quiet)
        _, observe_s = observe_deadlines(self._cycle_wall_s(), None, None)
        bound_s = max(period, observe_s + longest)
        log_from = self._log_size()
        health = HealthWatch(self.ctrl.url).start()
        t = time.monotonic()
        proxy.set(sickness)
        # sick at least until the alert is due (a cycle stretched by a busy machine may be late with it)
        alert, t_alert = await self._first(self._prometheus_alert, t + max(self.sick_s, period + bound_s + SLACK_S))
        await asyncio.sleep(max(0.0, t + self.sick_s - time.monotonic()))
        proxy.set(Sickness.PASS)
        t_heal = time.monotonic()
        cid_heal = await asyncio.to_thread(self._last_cycle_id)
        known, _ = await self._first(lambda: self._known_from(cid_heal), t_heal + 10 * bound_s)
        missed = [m for m in [await health.stop()] if m]
        cycles = await asyncio.to_thread(self._cycles, cid0 - 1)
        cycles = [c for c in cycles if c.cycle_id <= max(cid_heal, known or 0)]
        gap = max((b.started_s - a.started_s for a, b in itertools.pairwise(cycles)), default=0.0)
        notes = [f"Prometheus {sickness.value} for {t_heal - t:.0f} s",
                 f"alert after {t_alert - t:.1f} s: {alert[:160]!r}" if alert and t_alert else "NO alert",
                 f"{len(cycles) - 1} cycles, longest gap between starts {gap:.2f} s (bound {bound_s:.2f} s: quiet "
                 f"period {period:.2f} s, observe deadline {observe_s:g} s + longest quiet cycle {longest:.2f} s)",
                 f"demand known {known - cid_heal} cycles after healing" if known else "demand NOT known after healing"]
        if t_alert is None:
            missed.append("no alert naming Prometheus and the query")
        elif t_alert - t > period + bound_s + SLACK_S:
            missed.append(f"the alert came {t_alert - t:.1f} s after the fault (goal: within a cycle, "
                          f"<= {period + bound_s + SLACK_S:.1f} s)")
        if gap > bound_s + SLACK_S:
            missed.append(f"a gap of {gap:.2f} s between cycles (goal <= {bound_s:.2f} s + {SLACK_S:g} s)")
        if known is None or known - cid_heal > 2:
            missed.append("the demand not known within 2 cycles of healing")
        missed += self._error_cycles(cycles[1:])
        tracebacks = sum(1 for ln in self._log_since(log_from) if ln.startswith("Traceback"))
        if tracebacks:
            missed.append(f"{tracebacks} tracebacks in the controller's log")
        return Injection(t_heal, notes=notes, missed=missed, no_failures=True)  # recovery counts from healing

    async def _fault_prometheus_wrong_shape(self) -> Injection:
        return await self._sick_prometheus(Sickness.WRONG_SHAPE)

    async def _fault_prometheus_trickle(self) -> Injection:
        return await self._sick_prometheus(Sickness.TRICKLE)

    async def _fault_prometheus_late(self) -> Injection:
        return await self._sick_prometheus(Sickness.LATE)

    # ---------------------------------------------------------------------------------------------
    # the controller's wall clock stepped

    def _step_alert(self, step_s: float) -> str | None:
        for a in self._alerts():
            m = STEPPED.search(a)
            if m is not None and abs(float(m.group(1)) - step_s) <= 2:
                return a
        return None

    async def _step_clock(self, step_s: float) -> Injection:
        """The controller's wall clock stepped by `step_s` (libfaketime's offset file), under load.
        Goals: the alert "the clock stepped ±N s" within a cycle; no action on the step's cycle;
        /healthz 200 throughout; no drain or stop (a ready timeout) in the window; the demand known
        within 2 cycles of the step; no request failed."""
        if self.clock_file is None:
            raise RuntimeError("the clock faults need the controller under libfaketime "
                               "(bench/faults.py does it when Debian's libfaketime is installed)")
        cid0, period, longest = await asyncio.to_thread(self._quiet)
        mark = await asyncio.to_thread(self._action_mark)
        health = HealthWatch(self.ctrl.url).start()
        t = time.monotonic()
        self.clock_offset_s += step_s
        atomic_write_text(self.clock_file, f"{self.clock_offset_s:+.0f}\n")
        alert, t_alert = await self._first(lambda: self._step_alert(step_s), t + 10 * (period + longest))
        await asyncio.sleep(max(0.0, t + max(4 * period, 8.0) - time.monotonic()))  # past the scale-down delay
        missed = [m for m in [await health.stop()] if m]
        cycles = await asyncio.to_thread(self._cycles, cid0)
        step_cid = next((c.cycle_id for c in cycles if "stepped" in str(c.summary.get("deferred", ""))), None)
        notes = [f"wall clock offset {self.clock_offset_s:+.0f} s",
                 f"alert after {t_alert - t:.1f} s: {alert[:120]!r}" if alert and t_alert else "NO clock alert"]
        if t_alert is None:
            missed.append(f"no alert 'the clock stepped {step_s:+.0f} s'")
        elif t_alert - t > period + longest + SLACK_S:
            missed.append(f"the alert came {t_alert - t:.1f} s after the step (goal: within a cycle, "
                          f"<= {period + longest + SLACK_S:.1f} s)")
        if step_cid is None:
            missed.append("no cycle took the step (no 'stepped: no action' cycle)")
        else:
            acted = await asyncio.to_thread(self._actions_in, step_cid)
            known = await asyncio.to_thread(self._known_from, step_cid - 1)
            notes.append(f"cycle {step_cid} took the step: {len(acted)} actions; demand known "
                         + (f"{known - step_cid} cycles after it" if known else "NOT again"))
            if acted:
                missed.append(f"actions on the step's cycle {step_cid}: {acted}")
            if known is None or known - step_cid > 2:
                missed.append("the demand not known within 2 cycles of the step")
        removed = await asyncio.to_thread(self._removals_since, mark, True)
        if removed:
            missed.append("drains or stops after the step: " + ", ".join(f"{k} {r} ({why})" for r, k, _, why in removed))
        missed += self._error_cycles(cycles)
        return Injection(t, notes=notes, missed=missed, no_failures=True)

    async def _fault_clock_step_back(self) -> Injection:
        return await self._step_clock(-3600.0)

    async def _fault_clock_step_forward(self) -> Injection:
        return await self._step_clock(3600.0)
