"""The fault suite (issue 11): each fault on the lab with load flowing, one line per fault.

    .venv/bin/python bench/faults.py [--faults NAME,...] [--seconds 20] [--rps 0.8] [--hosts 3]

One lab for the whole run (Mosquitto, Prometheus, nginx, --hosts simulated hosts x 8 H100, one agent
per host; simulated engines, time 20x), one controller subprocess and its state database, one steady
Poisson load through nginx (--rps simulated requests/s of llama-3.1-70b, ISL 1024 / OSL 256; the default
0.8 rps needs 2 TP4 replicas with a margin: a load at a sizing boundary scales down on its own and
would hide whether a fault caused a scale-down). The faults run one after the other, each from a settled fleet; what each does
and how it is measured: fleetplan/harness/fault_suite.py and docs/faults.md.

Per fault: requests sent / ok / failed / unexplained (failed and not in flight on a killed process),
duplicates (two engines for one replica id), orphans (engines no desired state names), scale-downs
the fault caused, time to recover (s). Then a summary table; exit 1 when a goal is missed (0
duplicate, 0 orphan, 0 scale-down, 0 unexplained failure, recovered), after printing everything,
with the controller's log lines of the faults that missed one.

Two rows are measured off the shared lab, after its faults: `cold_starts` (--cold-starts fresh labs
and controllers, each watched --cold-seconds: no replica drained in its first minute) and
`store_week` (bench/store_growth.py's `run` for --store-days with the default retention: the store
within its bound).

The bad messages are built by the generators of tests/unit/controller/test_wire_fuzz.py (loaded
like bench/fuzz_wire.py does): the hostile tokens (NaN, Infinity, 1e999, 5,000-digit integers,
200,000-level nesting) put into the host's real status, huge versions in statuses and acks, a status
naming another host, and mutated statuses and acks that the parser rejects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fleetplan.harness.demo import EngineOptions, Rig
from fleetplan.harness.fault_coldstart import cold_starts
from fleetplan.harness.fault_controlplane import faketime_env
from fleetplan.harness.fault_suite import (
    ALL_FAULTS,
    HEADER,
    LAB_FAULTS,
    BadPayloads,
    FaultResult,
    FaultSuite,
    summary,
)
from fleetplan.harness.prom_proxy import PromProxy
from fleetplan.harness.rig_tools import (
    ISL,
    MAX_NUM_SEQS,
    MODEL,
    OSL,
    ControllerProc,
    K,
    Load,
    policy_doc,
    ready_replicas,
    wait_until,
)

LOG_INTEREST = re.compile(r"WARNING|ERROR|Traceback|drain|stop|offline|lost|reject|controller running|MQTT connected",
                          re.IGNORECASE)


def log_excerpt(lines: Sequence[str]) -> list[str]:
    """The controller log lines that explain a missed goal: warnings, errors, drains, stops, restarts,
    and each decision (a JSON line) that acted or planned no replica, in one short line."""
    out: list[str] = []
    for ln in lines:
        if ln.startswith("{"):
            try:
                d = json.loads(ln)
            except ValueError:
                continue
            acts = [a for a in d.get("actions") or [] if not str(a.get("reason", "")).startswith("drain in progress")]
            planned = (d.get("plan") or {}).get("replicas")
            if acts or planned == 0:
                what = ", ".join(f"{a.get('kind')} {a.get('replica_id')} ({a.get('reason')})" for a in acts)
                out.append(f"decision cycle {d.get('cycle_id')}: plan {planned} replicas; {what or 'no action'}"
                           f"; why: {'; '.join(d.get('why') or [])}"[:400])
        elif LOG_INTEREST.search(ln):
            out.append(ln[:400])
    return out


def _examples(strategy: Any, n: int) -> list[Any]:
    """n examples of a hypothesis strategy, the same every run."""
    from hypothesis import HealthCheck, given, settings

    got: list[Any] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x: Any) -> None:
        got.append(x)

    collect()
    return got


def bad_payloads(n_generated: int) -> BadPayloads:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fuzz_wire import _load_properties

    m = _load_properties()

    def rejected(parse: Callable[..., Any], host: str) -> Callable[[bytes], bool]:
        def check(p: bytes) -> bool:
            try:
                parse(p, host=host)
            except m.ProtocolError:
                return True
            return False
        return check

    def make(status: dict[str, Any]) -> list[tuple[str, bytes]]:
        host = str(status["host"])
        ack = {**m.ACK, "host": host}
        out: list[tuple[str, bytes]] = []
        for name in ("updated_s", "desired_version", "gpu_count"):
            out += [("status", m.encode({**status, name: tok})) for tok in m.RAW_TOKENS]
        for v in (2**63, 2**64, -(2**63)):
            out.append(("status", m.encode({**status, "desired_version": v})))
            out.append(("ack", m.encode({**ack, "version": v})))
        out += [("ack", m.encode({**ack, "version": tok})) for tok in m.RAW_TOKENS]
        out += [("status", m.encode(tok)) for tok in m.RAW_TOKENS]  # the whole document
        out.append(("status", m.encode({**status, "host": host + "-other"})))  # not the topic's host
        is_bad_status, is_bad_ack = rejected(m.parse_status, host), rejected(m.parse_ack, host)
        out += [("status", p) for p in _examples(m.payloads(status), n_generated) if is_bad_status(p)]
        out += [("ack", p) for p in _examples(m.payloads(ack), n_generated // 2) if is_bad_ack(p)]
        return out

    return make


def store_week(case: str, days: float, without_days: float) -> FaultResult:
    """The `store_week` row: bench/store_growth.py's store driven for `days` simulated days with the
    controller's default retention. Goal: the file (database + WAL) never above the retention bound
    (`retention.max_mb`); printed beside it, the week without retention (extrapolated from
    `without_days`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import store_growth

    from fleetplan.controller.settings import RetentionSettings
    from fleetplan.controller.state_retention import DAY_S, RetentionRules

    d = RetentionSettings()
    rules = RetentionRules(keep_s=d.keep_days * DAY_S, keep_documents_s=d.keep_plans_days * DAY_S,
                           max_bytes=int(d.max_mb * 2**20), rows_per_cycle=d.rows_per_cycle)
    cycle_s, models = float(case.split(":")[0]), int(case.split(":")[1])
    res = FaultResult("store_week", lab=False)
    t = time.monotonic()
    without = store_growth.run(cycle_s, models, without_days, None)
    week = without["final_mb"] / without_days * 7
    got = store_growth.run(cycle_s, models, days, rules)
    res.notes.append(f"{cycle_s:g} s cycles, {models} model(s), {days:g} simulated days: {got['final_mb']:.1f} MiB "
                     f"at the end, peak {got['peak_mb']:.1f} MiB (bound {d.max_mb:g} MiB), {got['pruned']:.0f} rows "
                     f"pruned, longest prune transaction {got['longest_s'] * 1000:.0f} ms; without retention "
                     f"{week:.0f} MiB a week; {time.monotonic() - t:.0f} s")
    if got["peak_mb"] > d.max_mb:
        res.missed.append(f"the store reached {got['peak_mb']:.1f} MiB (goal <= {d.max_mb:g} MiB)")
    return res


async def own_rows(args: argparse.Namespace, work: Path, names: Sequence[str]) -> list[FaultResult]:
    """The rows measured off the shared lab (fault_core.OWN_ROWS), in the order asked."""
    out = []
    for name in names:
        if name == "cold_starts":
            res = await cold_starts(work / "cold", count=args.cold_starts, hosts=args.hosts,
                                    rps=args.cold_rps if args.cold_rps is not None else args.rps,
                                    seconds=args.cold_seconds, seed=args.seed, log=lambda s: print(s, flush=True))
        else:
            res = await asyncio.to_thread(store_week, args.store_case, args.store_days, args.store_without_days)
        print(res.line() + ("  " + "; ".join(res.notes) if res.notes else "")
              + ("  MISSED: " + "; ".join(res.missed) if res.missed else ""), flush=True)
        out.append(res)
    return out


async def run(args: argparse.Namespace, work: Path, names: Sequence[str]) -> int:
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]  # the figures depend on it: a busy machine stretches every cycle
    on_lab = [n for n in names if n in LAB_FAULTS]
    results = await run_lab(args, work, on_lab) if on_lab else []
    results += await own_rows(args, work, [n for n in names if n not in LAB_FAULTS])
    print("", flush=True)
    print(f"== summary ({len(results)} faults, --seconds {args.seconds:g}, --rps {args.rps:g}, "
          f"seed {args.seed}; wall time {time.monotonic() - t_start:.0f} s; load average {load_start:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end)")
    print(summary(results))
    for r in results:
        if r.notes:
            print(f"  {r.name}: " + "; ".join(r.notes))
        if r.missed:
            print(f"  {r.name} MISSED: " + "; ".join(r.missed))
    missed = [r for r in results if not r.goals_met]
    for r in missed:
        lines = log_excerpt(r.log_lines)
        if lines:
            print(f"\n== controller log during {r.name} ({len(lines)} lines of interest of {len(r.log_lines)}):")
        for ln in lines[:60]:
            print("  " + ln)
    return 1 if missed else 0


async def run_lab(args: argparse.Namespace, work: Path, names: Sequence[str]) -> list[FaultResult]:
    """The faults on the shared lab, one after the other; their results."""
    t_start = time.monotonic()
    rig = Rig(work / "rig", hosts=args.hosts, gpus_per_host=8,
              engine=EngineOptions(time_scale=K, startup_s=40.0, build_s=200.0, max_num_seqs=MAX_NUM_SEQS))
    over: dict[str, Any] = {"min_replicas": 1, "max_replicas": 2 * args.hosts}  # room for the scale-up
    ctrl_dir = work / "controller"
    ctrl_dir.mkdir(parents=True, exist_ok=True)
    state_mount = mount_state_fs(ctrl_dir / "state", args.state_fs_mb) if "store_disk_full" in names else None
    load: Load | None = None
    suite: FaultSuite | None = None
    ctrl: ControllerProc | None = None
    proxy: PromProxy | None = None
    # the clock faults: the controller under libfaketime, its wall clock offset by what this file says
    clock_file = ctrl_dir / "faketime-offset"
    env = faketime_env(clock_file) if any(n.startswith("clock_step") for n in names) else None
    if env is None and any(n.startswith("clock_step") for n in names):
        print("== libfaketime is not installed (apt-get install libfaketime): the clock faults will report "
              "a harness error", flush=True)
    try:
        print(f"== lab in {work}: {args.hosts} hosts x 8 H100, simulated engines at {K:g}x", flush=True)
        await asyncio.to_thread(rig.start)
        over["hosts"] = [(h.name, 8) for h in rig.lab.hosts]  # the policy's inventory (lying_status)
        settings: dict[str, Any] = {}
        if any(n.startswith("prometheus_") and n != "prometheus_empty" for n in names):
            # the controller's Prometheus is a proxy that passes everything through until a fault
            proxy = await asyncio.to_thread(PromProxy(work / "prom-proxy", rig.lab.prometheus.url).start)
            settings["prometheus_url"] = proxy.url
        ctrl = ControllerProc(rig, ctrl_dir, policy_doc(**over), env=env, **settings)
        if state_mount is not None:
            ctrl.state_db = state_mount / "state.db"
        await asyncio.to_thread(ctrl.start)
        print(f"== controller up (log {ctrl.log_path}); load {args.rps:g} simulated rps of {MODEL}", flush=True)
        await wait_until(lambda: ready_replicas(ctrl.report()), 60, "the first replica ready")
        load = Load(rig.lab.nginx_url, MODEL, speed=K, isl=ISL, osl=OSL, seed=args.seed)
        load.start(args.rps)
        suite = FaultSuite(rig, ctrl, load, seconds=args.seconds, seed=args.seed, policy_over=over,
                           bad_payloads=bad_payloads(args.generated) if "bad_messages" in names else None,
                           log=lambda s: print(s, flush=True), state_mount=state_mount, hold_s=args.hold,
                           router_hold_s=args.router_hold, prom_proxy=proxy,
                           clock_file=clock_file if env is not None else None, sick_s=args.sick,
                           readers=args.readers)
        await suite.start()
        # warm-up: the load observed, the fleet sized for it and unchanged past the scale-down delay
        why = await suite.settle(timeout_s=120, stable_s=8.0)
        print(f"== warmed up in {time.monotonic() - t_start:.0f} s: {suite.fleet_size()} replicas"
              + ("" if why is None else f" (not settled: {why})"), flush=True)
        print(HEADER, flush=True)
        return await suite.run(names)
    finally:
        if suite is not None:
            await suite.close()
        if load is not None:
            await load.stop()
        if ctrl is not None:
            await asyncio.to_thread(ctrl.stop)
        if proxy is not None:
            await asyncio.to_thread(proxy.stop)
        await asyncio.to_thread(rig.stop)
        if state_mount is not None:
            await asyncio.to_thread(subprocess.run, ["umount", str(state_mount)], check=False, capture_output=True)
        print(f"== lab stopped; its wall time {time.monotonic() - t_start:.0f} s", flush=True)


def mount_state_fs(path: Path, size_mb: int) -> Path | None:
    """A tmpfs of `size_mb` for the controller's state database (store_disk_full fills it); None
    (the fault then reports a harness error) when this user may not mount."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"== cannot mount a tmpfs for the state database ({done.stderr.strip()}): store_disk_full "
              "will report a harness error", flush=True)
        return None
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(ALL_FAULTS), help=f"comma-separated, of: {', '.join(ALL_FAULTS)}")
    ap.add_argument("--seconds", type=float, default=20.0, help="wall seconds of load after each fault (at least)")
    ap.add_argument("--rps", type=float, default=0.8, help="simulated requests/s (x20 in wall time)")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="load arrivals and the random controller kills")
    ap.add_argument("--generated", type=int, default=200, help="generated bad statuses (half as many acks)")
    ap.add_argument("--dir", help="work directory (kept); default a temporary one, removed")
    ap.add_argument("--hold", type=float, default=8.0,
                    help="wall seconds the disk stays full and the status lies (default 8)")
    ap.add_argument("--router-hold", type=float, default=4.0,
                    help="wall seconds nginx stays down (default 4: under the policy's 6 s scale-down delay)")
    ap.add_argument("--sick", type=float, default=30.0,
                    help="wall seconds Prometheus stays sick and the report readers read (default 30)")
    ap.add_argument("--readers", type=int, default=200, help="concurrent report readers (default 200)")
    ap.add_argument("--state-fs-mb", type=int, default=128, help="size of the tmpfs of the state database")
    ap.add_argument("--cold-starts", type=int, default=10, help="cold starts of the cold_starts row (default 10)")
    ap.add_argument("--cold-seconds", type=float, default=75.0,
                    help="wall seconds each cold start is watched after its first replica serves (default 75)")
    ap.add_argument("--cold-rps", type=float, help="simulated requests/s of the cold starts (default --rps)")
    ap.add_argument("--store-case", default="60:10",
                    help="cycle_s:models of the store_week row (default 60:10: over the bound in a week without retention)")
    ap.add_argument("--store-days", type=float, default=7.0, help="simulated days of the store_week row")
    ap.add_argument("--store-without-days", type=float, default=1.0,
                    help="simulated days without retention, extrapolated to the week (default 1)")
    args = ap.parse_args()
    names = [n for n in args.faults.split(",") if n]
    unknown = [n for n in names if n not in ALL_FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; known: {', '.join(ALL_FAULTS)}")
    work = Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="fleetplan-faults-"))
    try:
        return asyncio.run(run(args, work, names))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
