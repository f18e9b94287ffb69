"""On-call readers against a controller at scale: the cycle period quiet and with N concurrent
readers of the report API.

    .venv/bin/python bench/report_readers.py --hosts 1000 --models 50 --readers 200 --phase-s 60
    .venv/bin/python bench/report_readers.py --hosts 4 --models 2 --readers 200 --phase-s 60

The scenario is bench/controller_scale.py's (one Mosquitto, the fleet simulator child with its fake
Prometheus, a real Controller with its real report server on a loopback port). After the rollout
the controller's cycles run as the service runs them (one start per `--interval-s`; a late cycle is
not made up for) for three phases of `--phase-s`: quiet, with `--readers` concurrent readers, quiet
again. The readers run in a child process (fleetplan/harness/report_readers.py, aiohttp): each loops GET /plan and GET /api/report (the
`--paths`) as fast as it is answered, ignoring Retry-After, as a load tool would.

Printed per phase: cycles, the period (start to start) mean and max, the cycle's wall time mean
and max, and the largest gap between two consecutive decisions (cycle ends) in quiet periods (the
mean period of the quiet phases): above 2, a decision came more than one cycle late. For the
readers: answers by status, latency p50/p99, and how stale /api/report was: the most cycles
finished before a request was sent that the answer did not show yet. For the report snapshot:
gathers (on the event loop) and renders (worker thread) with their mean cost, and the sizes served.

The last line: quiet_period_s, loaded_period_s, period_ratio, quiet_cycle_s, loaded_cycle_s,
max_gap_periods (loaded phase), answers_200, answers_503, max_stale_cycles.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controller_scale import Bench, calibrate_demand, log, policy_doc, profiles_for

# ---------------------------------------------------------------------------------------------
# the controller side


class Timed:
    """Wall time of the snapshot's gathers (event loop) and renders (worker thread)."""

    def __init__(self) -> None:
        self.gather_s: list[float] = []
        self.render_s: list[float] = []

    def install(self, ctrl: Any) -> None:
        from fleetplan.controller.report_snapshot import Gathered, Rendered, ReportSnapshot, render

        def timed_render(g: Gathered) -> Rendered:
            t0 = time.perf_counter()
            try:
                return render(g)
            finally:
                self.render_s.append(time.perf_counter() - t0)

        snap = ReportSnapshot(timed_render)
        refresh = snap.refresh

        def timed_refresh(c: Any) -> None:
            t0 = time.perf_counter()
            refresh(c)
            if snap.serving:
                self.gather_s.append(time.perf_counter() - t0)

        snap.refresh = timed_refresh  # type: ignore[method-assign,assignment]
        ctrl.reports = snap


class Run:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.bench = Bench(args, work)
        self.timed = Timed()
        self.cycles: list[dict[str, Any]] = []  # phase, start, end, cycle_id
        self.readers: dict[str, Any] = {}
        self.reader_proc: subprocess.Popen[bytes] | None = None
        self.errors: list[str] = []

    async def setup(self) -> None:
        from fleetplan.harness.procs import free_port
        from fleetplan.planner.policy import load_policy_dict
        from fleetplan.shared.benchfiles import save_profiles

        a, b = self.args, self.bench
        target = a.replicas or a.hosts
        doc = policy_doc(b.models, a.tp, a.max_actions or target)
        (self.work / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        policy = load_policy_dict(doc, "bench")
        profiles = profiles_for(b.models, a.tp)
        save_profiles(self.work / "profiles.json", profiles)
        demand, planned = await asyncio.to_thread(calibrate_demand, policy, profiles, b.models, a.hosts,
                                                  a.gpus_per_host, target, a.tp)
        log(f"demand {sum(demand.values()):.1f} rps over {len(b.models)} models plans {planned} replicas")
        await asyncio.to_thread(b.start_mosquitto)
        prom_port = free_port()
        b.start_fleet(demand, prom_port)
        b.ctrl = b.make_controller(prom_port)
        self.timed.install(b.ctrl)
        await b.ctrl.start()
        await asyncio.wait_for(b.ctrl.link.connected.wait(), 30)
        await b.wait_online()

    async def cycle(self, phase: str) -> dict[str, Any]:
        ctrl = self.bench.ctrl
        start = time.time()
        summary = await ctrl.cycle()
        end = time.time()
        rows = ctrl.store.cycles(limit=1)
        rec = {"phase": phase, "start": start, "end": end, "cycle_id": rows[0]["cycle_id"] if rows else None,
               "summary": summary}
        self.cycles.append(rec)
        if "error" in summary:
            self.errors.append(f"{phase} cycle: {summary['error']}")
        return rec

    async def rollout(self) -> None:
        t0 = time.perf_counter()
        while True:
            started = time.perf_counter()
            rec = await self.cycle("rollout")
            s = rec["summary"]
            ready, active = self.bench.counts()
            acted = any(s.get(k, 0) for k in ("start", "drain", "stop", "deferred"))
            if s.get("planned_replicas") and ready >= s["planned_replicas"] == active and not acted:
                break
            if time.perf_counter() - t0 > self.args.rollout_timeout_s:
                raise RuntimeError(f"rollout not finished after {self.args.rollout_timeout_s:.0f} s ({ready}/{active})")
            await asyncio.sleep(max(0.0, self.args.interval_s - (time.perf_counter() - started)))
        log(f"rollout done: {ready} replicas ready, {time.perf_counter() - t0:.1f} s")

    async def phase(self, name: str, duration_s: float) -> None:
        """Cycles as the service runs them (controller/runner.py _cycle_loop) for `duration_s`."""
        loop = asyncio.get_running_loop()
        until = loop.time() + duration_s
        next_s = loop.time()
        while loop.time() < until:
            if loop.time() < next_s:
                await asyncio.sleep(next_s - loop.time())
                continue
            next_s = loop.time() + self.args.interval_s
            rec = await self.cycle(name)
            log(f"[{name}] cycle {rec['cycle_id']}: {rec['end'] - rec['start']:.2f} s")

    def start_readers(self, duration_s: float) -> Path:
        out = self.work / "readers.json"
        cfg = {"url": self.bench.ctrl.report_url, "paths": self.args.paths.split(","), "readers": self.args.readers,
               "duration_s": duration_s, "out": str(out)}
        path = self.work / "readers-config.json"
        path.write_text(json.dumps(cfg))
        self.reader_proc = subprocess.Popen([sys.executable, "-m", "fleetplan.harness.report_readers", str(path)],
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        return out

    def stop_readers(self) -> None:
        proc, self.reader_proc = self.reader_proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    async def run(self) -> None:
        a = self.args
        try:
            await self.setup()
            await self.rollout()
            await self.phase("quiet", a.phase_s)
            out = self.start_readers(a.phase_s)
            await asyncio.sleep(1.0)  # the readers' connections are up
            await self.phase("readers", a.phase_s)
            proc = self.reader_proc
            if proc is not None:
                await asyncio.to_thread(proc.wait, 120)
            self.readers = json.loads(out.read_text()) if out.exists() else {}
            await self.phase("quiet-after", a.phase_s)
        finally:
            self.stop_readers()
            if self.bench.ctrl is not None:
                await self.bench.ctrl.stop()

    # ---- figures -------------------------------------------------------------------------------
    def report(self) -> str:
        phases = {name: [c for c in self.cycles if c["phase"] == name] for name in ("quiet", "readers", "quiet-after")}
        quiet_periods = [b["start"] - a["start"] for k in ("quiet", "quiet-after") for a, b in itertools.pairwise(phases[k])]
        qp = statistics.mean(quiet_periods) if quiet_periods else math.nan
        figures: dict[str, dict[str, float]] = {}
        for name, rows in phases.items():
            if len(rows) < 2:
                continue
            periods = [b["start"] - a["start"] for a, b in itertools.pairwise(rows)]
            walls = [c["end"] - c["start"] for c in rows]
            gaps = [b["end"] - a["end"] for a, b in itertools.pairwise(rows)]
            figures[name] = {"period": statistics.mean(periods), "period_max": max(periods),
                             "wall": statistics.mean(walls), "wall_max": max(walls), "gap": max(gaps) / qp}
            f = figures[name]
            log(f"{name}: {len(rows)} cycles, period mean {f['period']:.2f} s max {f['period_max']:.2f} s; cycle wall "
                f"mean {f['wall']:.2f} s max {f['wall_max']:.2f} s; largest gap between decisions {f['gap']:.2f} "
                "quiet periods")
        r = self.readers
        status = r.get("status", {})
        stale = self.max_stale(r.get("seen", []))
        log(f"readers: {self.args.readers} x {self.args.paths}: answers {status}, p50 {r.get('p50_s', math.nan):.3f} s, "
            f"p99 {r.get('p99_s', math.nan):.3f} s; /api/report at most {stale} cycles behind the last finished")
        g, rn = self.timed.gather_s, self.timed.render_s
        cur = self.bench.ctrl.reports.current if self.bench.ctrl is not None else None
        sizes = f"; /api/report {len(cur.report) / 1e3:.0f} kB, /plan {len(cur.page) / 1e3:.0f} kB" if cur else ""
        log(f"snapshot: {len(g)} gathers on the loop (mean {statistics.mean(g) * 1000 if g else math.nan:.1f} ms, "
            f"max {max(g, default=math.nan) * 1000:.1f} ms), {len(rn)} renders in the worker thread (mean "
            f"{statistics.mean(rn) * 1000 if rn else math.nan:.1f} ms){sizes}; {len(self.cycles)} cycles in all")
        for e in self.errors:
            log(f"error: {e}")
        q = [figures[k] for k in ("quiet", "quiet-after") if k in figures]
        qw = statistics.mean(f["wall"] for f in q) if q else math.nan
        lf = figures.get("readers", {})
        lp = lf.get("period", math.nan)
        return (f"quiet_period_s={qp:.3f} loaded_period_s={lp:.3f} period_ratio={lp / qp:.2f} "
                f"quiet_cycle_s={qw:.3f} loaded_cycle_s={lf.get('wall', math.nan):.3f} "
                f"max_gap_periods={lf.get('gap', math.nan):.2f} answers_200={status.get('200', 0)} "
                f"answers_503={status.get('503', 0)} max_stale_cycles={stale}")

    def max_stale(self, seen: list[list[float]]) -> int:
        """The most cycles that had finished before a request was sent and that its answer did not show."""
        ends = sorted((c["end"], c["cycle_id"]) for c in self.cycles if c["cycle_id"] is not None)
        worst = 0
        times = [e for e, _ in ends]
        for sent, cid in seen:
            i = bisect.bisect_left(times, sent)
            worst = max(worst, sum(1 for _, c in ends[:i] if c > cid))
        return worst


async def _main(run: Run) -> None:
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    await run.run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--readers", type=int, default=200)
    ap.add_argument("--paths", default="/plan,/api/report", help="what each reader GETs in turn (comma-separated)")
    ap.add_argument("--phase-s", type=float, default=60.0, help="each phase: quiet, readers, quiet again")
    ap.add_argument("--interval-s", type=float, default=3.0, help="one cycle start per this many seconds")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=None, help="replicas the demand asks for (default: --hosts)")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--max-actions", type=int, default=None)
    ap.add_argument("--ready-delay-s", type=float, default=2.0)
    ap.add_argument("--status-interval-s", type=float, default=15.0)
    ap.add_argument("--connect-timeout-s", type=float, default=300.0)
    ap.add_argument("--rollout-timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("fleetplan.audit").setLevel(logging.WARNING)
    import aiomqtt  # noqa: F401  (its logger's level is set on import: quiet it after)

    logging.getLogger("mqtt").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="fleetplan-readers-"))
    log(f"report readers bench: {args.hosts} hosts, {args.models} models, {args.readers} readers of {args.paths}, "
        f"{args.phase_s:.0f} s per phase, a cycle every {args.interval_s:g} s; work dir {work}")
    run = Run(args, work)
    line = ""
    try:
        asyncio.run(_main(run))
    except (KeyboardInterrupt, asyncio.CancelledError):
        run.errors.append("interrupted")
    except Exception as exc:
        run.errors.append(f"{type(exc).__name__}: {exc}")
        log(f"!! bench failed: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            line = run.report()
        run.stop_readers()
        run.bench.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    log(line)
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
