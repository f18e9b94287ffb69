"""The fault suite's cold-start row: `count` cold starts in a row, each a fresh lab and a fresh
controller (an empty state database) with a steady load near a sizing boundary, watched for
`seconds` after the first replica served. Goal: no replica drained or stopped within its first
minute (wall, i.e. 20 simulated minutes at the lab's 20x) unless its host failed; plus the suite's
usual ones (no duplicate engine, no orphan, no failed request). Per cold start: the replicas
started and drained, each drain's age, the replicas at the end.

The lab is the suite's (bench/faults.py: `--hosts` x 8 H100, simulated engines at 20x, the e2e
policy `rig_tools.policy_doc` with min 1 replica), so a cold start here is the suite's warm-up
done ten times over, each from nothing."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetplan.harness.demo import EngineOptions, Rig
from fleetplan.harness.fault_core import FaultResult, FaultSuiteCore
from fleetplan.harness.rig_tools import (
    ISL,
    MAX_NUM_SEQS,
    MODEL,
    OSL,
    ControllerProc,
    K,
    Load,
    policy_doc,
    wait_until,
)
from fleetplan.harness.rig_tools import ready_replicas as serving

YOUNG_S = 60.0  # a replica younger than this (wall seconds) is not to be drained
HOST_FAILED = ("offline", "lost")  # a removal whose reason names one of these: its host failed


@dataclass
class ColdStart:
    """One cold start: the replicas started, the drains and stops (replica, age in wall s, reason)."""

    index: int
    starts: list[str] = field(default_factory=list)
    removals: list[tuple[str, float | None, str]] = field(default_factory=list)
    replicas_end: int = 0
    first_ready_s: float | None = None  # from the controller's start

    def young(self) -> list[tuple[str, float | None, str]]:
        """Removals of replicas younger than YOUNG_S whose host did not fail."""
        return [(r, age, why) for r, age, why in self.removals
                if (age is None or age < YOUNG_S) and not any(w in why for w in HOST_FAILED)]

    def line(self) -> str:
        drains = ", ".join(f"{r} at {'?' if a is None else f'{a:.1f}'} s ({why[:60]})" for r, a, why in self.removals)
        return (f"cold start {self.index}: first replica serving after "
                f"{'-' if self.first_ready_s is None else f'{self.first_ready_s:.1f}'} s; {len(self.starts)} started, "
                f"{len(self.removals)} drained/stopped{': ' + drains if drains else ''}; {self.replicas_end} at the end")


def _history(state_db: Path) -> tuple[dict[str, float], list[tuple[str, float, str]]]:
    """(replica id -> when its start was published, [(replica id, when, reason)] of the drains and
    stops that did something), wall seconds of the controller, from its database."""
    with contextlib.closing(sqlite3.connect(f"file:{state_db}?mode=ro", uri=True, timeout=10)) as db:
        rows = db.execute("SELECT kind, replica_id, created_s, reason FROM actions WHERE status NOT IN "
                          "('deferred', 'failed', 'planned', 'cancelled') ORDER BY action_id").fetchall()
    starts = {str(r[1]): float(r[2]) for r in rows if r[0] == "start"}
    removals = [(str(r[1]), float(r[2]), str(r[3])) for r in rows if r[0] in ("drain", "stop")]
    return starts, removals


async def cold_start(work: Path, index: int, *, hosts: int, rps: float, seconds: float, seed: int,
                     res: FaultResult, log: Callable[[str], None]) -> ColdStart:
    """One cold start in `work` (removed after); its requests, duplicates and orphans added to `res`."""
    out = ColdStart(index)
    rig = Rig(work / "rig", hosts=hosts, gpus_per_host=8,
              engine=EngineOptions(time_scale=K, startup_s=40.0, build_s=200.0, max_num_seqs=MAX_NUM_SEQS))
    ctrl: ControllerProc | None = None
    load: Load | None = None
    sampler: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(rig.start)
        over: dict[str, Any] = {"min_replicas": 1, "max_replicas": 2 * hosts,
                                "hosts": [(h.name, 8) for h in rig.lab.hosts]}
        (work / "controller").mkdir(parents=True, exist_ok=True)
        ctrl = ControllerProc(rig, work / "controller", policy_doc(**over))
        t0 = time.monotonic()
        await asyncio.to_thread(ctrl.start)
        c = ctrl
        await wait_until(lambda: serving(c.report()), 90, "the first replica serving")
        out.first_ready_s = time.monotonic() - t0
        load = Load(rig.lab.nginx_url, MODEL, speed=K, isl=ISL, osl=OSL, seed=seed + index)
        load.start(rps)
        core = FaultSuiteCore(rig, ctrl, load)
        core._min_present = None
        sampler = asyncio.create_task(core._sample())  # duplicate engines, every 0.5 s
        t_load = time.monotonic()
        await asyncio.sleep(seconds)
        t_end = time.monotonic()
        await core.wait_for(lambda: load is not None and load.unfinished_before(t_end) == 0, 30)
        sent = load.sent_between(t_load, t_end)
        res.sent += len(sent)
        ok = sum(1 for _, r in sent if r.outcome == "ok")
        res.ok += ok
        res.failed += len(sent) - ok
        res.unexplained += len(sent) - ok
        ids = await asyncio.to_thread(core.fleet_ids) or set()
        engines = await asyncio.to_thread(core._engines)
        res.orphans += len(set(engines) - ids)
        res.duplicates += len(core._dups)
        out.replicas_end = len(ids)
        starts, removals = await asyncio.to_thread(_history, ctrl.state_db)
        out.starts = sorted(starts)
        out.removals = [(rid, (t - starts[rid]) if rid in starts else None, why) for rid, t, why in removals]
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        if load is not None:
            await load.stop()
        if ctrl is not None:
            await asyncio.to_thread(ctrl.stop)
        await asyncio.to_thread(rig.stop)
        shutil.rmtree(work, ignore_errors=True)
    log(out.line())
    return out


async def cold_starts(work: Path, *, count: int, hosts: int, rps: float, seconds: float, seed: int,
                      log: Callable[[str], None] = print) -> FaultResult:
    """The `cold_starts` row: `count` cold starts one after the other (see the module docstring)."""
    res = FaultResult("cold_starts", lab=False)
    runs: list[ColdStart] = []
    for i in range(1, count + 1):
        try:
            runs.append(await cold_start(work / f"cold-{i}", i, hosts=hosts, rps=rps, seconds=seconds, seed=seed,
                                         res=res, log=log))
        except Exception as exc:  # a lab that would not start: say so, go on with the next
            res.missed.append(f"cold start {i}: harness error: {type(exc).__name__}: {str(exc)[:300]}")
    starts = [len(r.starts) for r in runs]
    drains = [len(r.removals) for r in runs]
    young = [(r.index, *y) for r in runs for y in r.young()]
    res.notes.append(f"{len(runs)} cold starts at {rps:g} simulated rps, {seconds:g} s each after the first "
                     f"replica served: starts per cold start {starts}, drains/stops {drains}, replicas at the end "
                     f"{[r.replicas_end for r in runs]}")
    if young:
        res.missed.append(f"{len(young)} replica(s) drained within their first {YOUNG_S:g} s: "
                          + "; ".join(f"cold start {i}: {rid} at {'?' if a is None else f'{a:.1f}'} s ({why[:80]})"
                                      for i, rid, a, why in young))
    if res.failed:
        res.missed.append(f"{res.failed} requests failed (goal: none)")
    return res
