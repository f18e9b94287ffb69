"""What fixed fleets reach on a trace: the replay's attainment per GPU-hour, as a yardstick for the oracle.

    .venv/bin/python bench/static_fleets.py --trace mooncake-long \
        --fleets "trtllm:4=1; trtllm:4=2; trtllm:4=1,trtllm:1=1; vllm:4=2"

The oracle of `fleetplan evaluate` is a bound, not a run: ceil(rate / capacity) replicas per window,
where capacity is one replica's rate at the SLO under Poisson arrivals with the trace's length mix.
Whether a fleet that size reaches the attainment target on the trace itself (its bursts, its
conversations, its longest prompts meeting each other on one replica) is what this prints: each
fleet held fixed for the whole trace in the same replay (bench/evaluate_traces.py's scenarios,
policies, routing and engines), its GPU-hours, SLO attainment and latency p99s. The cheapest fleet
at or above the target is the least any policy spends on this trace; a goal below it cannot be met.

A fleet is `engine:tp=replicas` terms joined by commas (the scenario's model and its policy's GPU);
fleets are separated by semicolons. A term `engine:tp:prefill=n` or `engine:tp:decode=n` is a pool of
a disaggregated deployment (fleetplan/sim/disagg_proxy.py), e.g. "vllm:1:prefill=3,vllm:1:decode=1";
pools and aggregated replicas of one model may be mixed. The GPU-hours are printed per role too.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # evaluate_traces, a sibling script (fleetplan itself is installed)

from evaluate_traces import DATA, SCENARIOS, scenario_hour  # noqa: E402

from fleetplan.models.config_key import Role  # noqa: E402
from fleetplan.models.names import Engine, parse_engine  # noqa: E402
from fleetplan.planner.policy import Policy  # noqa: E402
from fleetplan.planner.types import ConfigKey  # noqa: E402
from fleetplan.sim.baselines import StaticController  # noqa: E402
from fleetplan.sim.des import FleetSim, SimResult, SimSettings  # noqa: E402
from fleetplan.sim.evaluate import make_environment  # noqa: E402
from fleetplan.sim.traces import Trace  # noqa: E402


def parse_fleets(text: str, policy: Policy, model: str) -> list[tuple[str, dict[ConfigKey, int]]]:
    """'trtllm:4=1,vllm:1=2; vllm:4=2' -> [(label, {config: replicas}), ...] on the policy's GPU."""
    mp = policy.model(model)
    if mp is None:
        raise SystemExit(f"model {model!r} is not in the scenario's policy")
    gpu, precision = (mp.allowed.gpus[0] if mp.allowed.gpus else policy.hosts[0].gpu), mp.precision
    out = []
    for fleet in (f.strip() for f in text.split(";")):
        if not fleet:
            continue
        counts: dict[ConfigKey, int] = {}
        for term in (t.strip() for t in fleet.split(",")):
            try:
                cfg, n = term.split("=")
                eng, tp, *role = cfg.split(":")
                engine: Engine = parse_engine(eng.strip())
                if len(role) > 1:
                    raise ValueError("one role at most")
                counts[ConfigKey(model, engine, gpu, int(tp), precision,
                                 Role(role[0].strip()) if role else Role.AGGREGATED)] = int(n)
            except ValueError as exc:
                raise SystemExit(f"--fleets: cannot read {term!r} (engine:tp[:prefill|decode]=replicas): "
                                 f"{exc}") from None
        out.append((fleet, counts))
    return out


def run_fleet(trace: Trace, policy: Policy, label: str, counts: dict[ConfigKey, int]) -> SimResult:
    """The fleet held fixed for the whole trace (warm at t = 0), in the scenario's replay."""
    return FleetSim(trace, StaticController(label, counts), make_environment(policy), SimSettings()).run()


def row(label: str, res: SimResult) -> str:
    """One line of the table: GPU-hours (per role when pools serve), attainment, p99s, unmet requests."""
    ttft = float(np.percentile(res.ttft_ms, 99)) if len(res.ttft_ms) else float("nan")
    itl = float(np.percentile(res.itl_ms, 99)) if len(res.itl_ms) else float("nan")
    roles = dict(res.gpu_hours_by_role)
    pools = "" if set(roles) <= {Role.AGGREGATED} else "  (" + ", ".join(
        f"{r.value} {h:.2f}" for r, h in res.gpu_hours_by_role) + ")"
    return (f"{label:40s} {res.gpu_hours:7.2f} {100 * res.slo_attainment:8.2f}% {ttft:9.0f} {itl:8.1f} "
            f"{res.rejected + res.unfinished:7d}{pools}")


def run_one(trace: Trace, policy: Policy, label: str, counts: dict[ConfigKey, int]) -> str:
    return row(label, run_fleet(trace, policy, label, counts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="mooncake-long", choices=sorted(SCENARIOS))
    ap.add_argument("--fleets", required=True, help="'engine:tp=n,...; ...' (see the module docstring)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args(argv)
    trace, policy, model = scenario_hour(args.trace, args.data)
    fleets = parse_fleets(args.fleets, policy, model)
    print(f"{args.trace}: {len(trace.requests)} requests over {trace.duration_s:.0f} s, {len(fleets)} fleets "
          f"on {args.workers} workers", flush=True)
    print(f"{'fleet (engine:tp=replicas)':40s} {'GPU-h':>7} {'SLO att.':>9} {'TTFT p99':>9} {'ITL p99':>8} "
          f"{'unmet':>7}", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        futures = [pool.submit(run_one, trace, policy, label, counts) for label, counts in fleets]
        for f in futures:
            print(f.result(), flush=True)
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
