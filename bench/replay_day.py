"""How fast fleetplan's replay runs a day (or a week) of traffic: the daemon's decision path, cycle by cycle.

    .venv/bin/python bench/replay_day.py [--scenario azure] [--requests 1000000] [--days 1] [--hours H]
        [--policy fleetplan] [--profiles ground-truth|benchmarks|PROFILES.json] [--json-out FILE]
        [--cprofile FILE] [--data DIR]

The day: the scenario's hour (bench/evaluate_traces.py: azure = the Azure LLM conversation trace served
as Llama-3-70B on 8 x 8 H100; mooncake = the Mooncake conversation trace as Llama-3-8B on 4 x 8 H100)
shaped into 24 h by `fleetplan.sim.traces.shape_day` (tiled and time-warped: trough at midnight, peak
at noon, peak/trough 3; the hour's burstiness and length mix kept), at the rate scale that gives
`--requests` requests a day. `--days 7` lays seven such days back to back (a week); `--hours H` replays
only the first H hours of the first day (a short run to profile). Profiles: the simulator's ground truth
swept with the trace's own length mix and fitted (as bench/evaluate_traces.py), cached in /tmp.

It runs one policy (default fleetplan: sim/control.py ReplayControl, the daemon's own observe / decide /
act every cycle) in this process and prints the wall time, CPU time, control cycles per second,
requests per second and the peak RSS (resource.getrusage). `--json-out` writes the run's figures and a
digest of every cycle's decision (actions, allowed actions, plan counts), to compare two trees on the
same inputs: a replay that is only faster writes the same file. `--cprofile` writes a cProfile dump
(read it with `python -m pstats FILE` or the top items this script prints).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from evaluate_traces import DATA, _benchmark_profiles, _scenario  # noqa: E402

from fleetplan.models.profile import ProfileSet  # noqa: E402
from fleetplan.sim.des import FleetSim, SimResult, SimSettings  # noqa: E402
from fleetplan.sim.evaluate import (  # noqa: E402
    _figures,
    candidates_for,
    make_controller,
    make_environment,
    policy_for_models,
    prepare_trace,
    profiles_from_ground_truth,
    trace_lengths,
)
from fleetplan.sim.traces import Trace, repeat_days, shape_day  # noqa: E402

DAY_S = 86_400.0


def build_trace(raw: Trace, requests: int, days: int, hours: float | None) -> tuple[Trace, float]:
    """`days` shaped days of about `requests` requests each, back to back (cut at `hours`); the rate scale."""
    period = raw.duration_s + raw.duration_s / max(1, len(raw.requests) - 1)
    scale = requests * period / (len(raw.requests) * DAY_S)
    day = shape_day(raw, DAY_S, scale)
    return repeat_days(day, days, DAY_S, end_s=None if hours is None else hours * 3600.0), scale


def profiles_for(kind: str, key: str, trace: Trace, policy: Any, model: str, data: Path) -> ProfileSet:
    if kind == "benchmarks":
        return _benchmark_profiles(data / "benchmarks", Path("/tmp/fleetplan-benchmark-profiles.json"))
    if kind != "ground-truth":
        return ProfileSet.from_json_dict(json.loads(Path(kind).read_text()))
    cache = Path(f"/tmp/fleetplan-replay-day-profiles-{key}.json")
    if cache.exists():
        return ProfileSet.from_json_dict(json.loads(cache.read_text()))
    m = policy.models[0]
    prof = profiles_from_ground_truth(candidates_for(policy, model), trace_lengths(trace, model),
                                      m.slo.ttft_p99_ms, m.slo.itl_p99_ms)
    cache.write_text(json.dumps(prof.to_json_dict()))
    return prof


def decision_digest(sim: FleetSim) -> tuple[str, int]:
    """A hash of every cycle's decision (time, deferral, actions, allowed actions, target counts)."""
    h = hashlib.sha256()
    n = 0
    if sim.control is None:
        return "", 0
    for t, d in sim.control.decisions:
        n += 1
        parts: list[str] = [f"{t:.3f}", str(d.deferred)]
        r = d.result
        if r is not None:
            parts += [repr(r.plan), repr(r.target), repr(r.actions), repr(r.deferred_actions), repr(r.next_state)]
        parts.append(repr(d.allowed))
        h.update("|".join(parts).encode())
    return h.hexdigest(), n


def _solves(sim: FleetSim) -> tuple[int, int]:
    """(stage-1 problems over the run, those that reused an earlier solution instead of solving)."""
    n = k = 0
    for _t, d in sim.control.decisions if sim.control is not None else ():
        for r in d.result.explanation.solver if d.result is not None else ():
            if r.stage == "counts":
                n += 1
                k += r.backend.endswith("(reused)")
    return n, k


def _cpu_s(ru0: resource.struct_rusage) -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime - ru0.ru_utime) + (ru.ru_stime - ru0.ru_stime)


def _progress(sim: FleetSim, every_s: float, end_s: float, ru0: resource.struct_rusage, w0: float) -> None:
    """A line every `every_s` simulated seconds: control cycles, requests, CPU and wall so far
    (an event of the replay's clock that only prints: the replay's decisions are the same)."""
    def report(t: float) -> None:
        arrived = int(np.searchsorted(sim.arr_t, t, side="right"))
        print(f"  sim {t / 3600.0:6.1f} h: {sim.decisions} cycles, {arrived:,} requests, cpu {_cpu_s(ru0):.1f} s, "
              f"wall {time.perf_counter() - w0:.1f} s, RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB",
              flush=True)

    k = 1
    while k * every_s <= end_s:
        sim.later(k * every_s, report)
        k += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="azure", choices=("azure", "mooncake", "mooncake-long"))
    ap.add_argument("--requests", type=float, default=1_000_000, help="requests per day (default 1M)")
    ap.add_argument("--days", type=int, default=1, help="days back to back (7: a week)")
    ap.add_argument("--hours", type=float, default=None, help="replay only the first H hours")
    ap.add_argument("--policy", default="fleetplan")
    ap.add_argument("--profiles", default="ground-truth")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--cprofile", type=Path, default=None)
    ap.add_argument("--top", type=int, default=30, help="cProfile: print this many top items")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--progress-h", type=float, default=1.0,
                    help="print progress every this many simulated hours (0: never)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    raw, _hour, policy, model, _scale = _scenario(args.scenario, args.data)
    trace, scale = build_trace(raw, int(args.requests), args.days, args.hours)
    trace = prepare_trace(trace, policy, model)
    policy = policy_for_models(policy, [model])
    profiles = profiles_for(args.profiles, args.scenario, prepare_trace(raw, policy, model), policy, model, args.data)
    t_prep = time.perf_counter() - t0
    print(f"trace: {args.scenario} x{scale:.3f}, {args.days} day(s){'' if args.hours is None else f', first {args.hours:g} h'}: "
          f"{len(trace.requests):,} requests over {trace.duration_s / 3600.0:.2f} h (prepared in {t_prep:.1f} s)",
          flush=True)

    settings = SimSettings()
    ctl = make_controller(args.policy, trace, policy, profiles)
    sim = FleetSim(trace, ctl, make_environment(policy), settings)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.perf_counter()
    if args.progress_h > 0:
        _progress(sim, args.progress_h * 3600.0, trace.duration_s, ru0, w0)
    # process time: on a shared machine wall time charges other jobs' CPU to whatever was on the stack
    prof = cProfile.Profile(time.process_time) if args.cprofile is not None else None
    if prof is not None:
        prof.enable()
    res: SimResult = sim.run()
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - w0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    rss_mb = ru1.ru_maxrss / 1024.0
    cycles = res.decisions
    solve_s = getattr(ctl, "solve_s", 0.0)
    print(f"replay ({args.policy}): wall {wall:.1f} s, cpu {cpu:.1f} s; {cycles} control cycles = "
          f"{cycles / cpu:.2f} cycles/cpu-s ({cycles / wall:.2f}/wall-s); {res.arrived:,} requests = "
          f"{res.arrived / cpu:,.0f} req/cpu-s ({res.arrived / wall:,.0f}/wall-s); peak RSS {rss_mb:.0f} MB; "
          f"OR-Tools solve {solve_s:.1f} s")
    solves, reused = _solves(sim)
    if solves:
        print(f"stage-1 problems: {solves}, of which {reused} reused the last solution (planner/solve_memo.py)")
    fig = _figures(res, wall, {})
    doc = fig.to_json()
    print(f"figures: GPU-h {res.gpu_hours:.3f}, SLO attainment {100 * res.slo_attainment:.3f}%, starts "
          f"{res.replica_starts}, builds {res.builds}, swaps {res.swap_cycles}, by engine "
          f"{ {k: round(v, 2) for k, v in fig.gpu_hours_by_engine().items()} }")
    digest, n = decision_digest(sim)
    per_request = hashlib.sha256(res.ttft_ms.tobytes() + res.itl_ms.tobytes()
                                 + (res.met.tobytes() if res.met is not None else b"")).hexdigest()
    if args.json_out is not None:
        doc.pop("wall_s", None)
        out = {"figures": doc, "decisions": n, "decision_digest": digest, "per_request_digest": per_request, "requests": res.arrived,
               "bench": {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss_mb, "cycles": cycles}}
        args.json_out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json_out} (decision digest {digest[:16]})")
    if prof is not None:
        prof.dump_stats(str(args.cprofile))
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(args.top)
        st.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
