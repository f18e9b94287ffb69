"""Planner scale benchmark: a synthetic fleet, one full plan (counts + placement), timed.

    .venv/bin/python bench/solve_scale.py --hosts 1000 --models 50

Synthetic inventory: 3 GPU types (H100, A100, L40S) in equal thirds, 8 GPUs per host (H100/A100:
one NVLink group of 8; L40S: PCIe, the host is one group), models x 2 engines x TP {1, 2, 4} on
every GPU type, capacities from a deterministic formula (bigger models are slower, TRT-LLM ~1.25x
vLLM, TP scales sub-linearly), demand sized to fill ~70% of the fleet. The last line is
`solve_s=<s> gap=<fraction> status=<s>` where solve_s is the wall time of the whole plan()
(both stages, as the caller sees it) and gap/status are stage 1's.

--breakdown prints where that time goes (CPU seconds, a loaded machine inflates wall time but not
these): stage 1 (the count solves), stage 2 (placement), the counterfactuals, the explanation and
the rest of plan(). At 10,000 hosts / 500 models the solve and placement are most of it; work per
model or per alternative that grows with the whole table (a lookup rebuilt inside a per-model loop)
shows up here first (tests/unit/planner/test_counts_scale.py guards the counterfactuals).
--max-s S exits 1 when solve_s exceeds S.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import fleetplan.planner.core as core
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.policy import load_policy_dict
from fleetplan.planner.types import (
    ConfigKey,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    PlannerState,
    ReplicaState,
)

GPUS = (GpuType.H100, GpuType.A100, GpuType.L40S)
PRICE = {GpuType.H100: 3.0, GpuType.A100: 1.8, GpuType.L40S: 1.1}
SPEED = {GpuType.H100: 1.0, GpuType.A100: 0.55, GpuType.L40S: 0.4}
TPS = (1, 2, 4)


def synthetic(hosts: int, models: int, load: float = 0.7, workers: int = 1,
              time_limit_s: float = 10.0, gap: float = 0.005, backend: str = "SCIP") -> tuple[Fleet, Observation, object, dict[ConfigKey, CapacityInfo]]:
    inv = []
    for i in range(hosts):
        g = GPUS[i % 3]
        groups = ((0, 1, 2, 3, 4, 5, 6, 7),) if g != GpuType.L40S else ()
        inv.append(HostInventory(f"host-{i:05d}", g, 8, groups, True))
    names = [f"model-{j:03d}" for j in range(models)]
    caps: dict[ConfigKey, CapacityInfo] = {}
    size = {}
    for j, m in enumerate(names):
        size[m] = 1.0 + (j * 7919 % 13)  # relative model "size" 1..13
        for g in GPUS:
            for e, ef in ((Engine.VLLM, 1.0), (Engine.TRTLLM, 1.25 + 0.05 * (j % 3))):
                for tp in TPS:
                    if g == GpuType.L40S and size[m] > 9 and tp == 1:
                        continue  # does not fit
                    rps = 40.0 * SPEED[g] * ef * (tp ** (0.85 + 0.02 * (j % 5))) / size[m]
                    caps[ConfigKey(m, e, g, tp, Precision.BF16)] = CapacityInfo(rps, "itl")
    # demand: ~load of the fleet's GPUs when served on the best $/rps config
    total_gpus = hosts * 8
    per_model_gpus = load * total_gpus / models
    obs = {}
    for j, m in enumerate(names):
        # rps per GPU of the best config, averaged over the GPU types (the fleet is a third of each)
        best = sum(max(c.max_rps / k.tp for k, c in caps.items() if k.model == m and k.gpu == g)
                   for g in GPUS) / len(GPUS)
        rate = per_model_gpus * best * (0.6 + 0.8 * ((j * 31) % 17) / 16) / 1.2
        obs[m] = ModelObservation(m, rate, 500.0, 200.0)
    policy = load_policy_dict({
        "gpu_types": {g.value: {"price_usd_h": PRICE[g]} for g in GPUS},
        "models": [{"name": m, "slo": {"ttft_p99_ms": 1000, "itl_p99_ms": 80}, "priority": j % 4,
                    "min_replicas": 1, "allowed": {"engines": ["vllm", "trtllm"], "tp": list(TPS)},
                    "headroom": 0.2, "workload": {"isl": 500, "osl": 200}} for j, m in enumerate(names)],
        "engines": {"vllm": {"launch": {"command": "vllm"}, "startup": {"default_s": 60}},
                    "trtllm": {"launch": {"command": "trtllm-serve"}, "startup": {"default_s": 45},
                               "build": {"default_s": 900},
                               "cached_builds": [{"model": m, "gpu": g.value, "tp": tp}
                                                 for m in names for g in GPUS for tp in TPS]}},
        "scaling": {"churn_cost_usd_h": 0.5, "lead_time_cost_usd_h_per_min": 0.02},
        "solver": {"time_limit_s": time_limit_s, "relative_gap": gap, "workers": workers,
                   "backend": backend},
    }, "synthetic")
    return Fleet(tuple(inv)), Observation(obs), policy, caps


_PHASES = {"solve_counts": "stage1", "place": "stage2", "add_counterfactuals": "counterfactuals",
           "_explain": "explain"}


def _timed(spent: dict[str, float]) -> Callable[[], None]:
    """Wrap plan()'s phases (as core calls them) to add up their CPU seconds in `spent`; returns the undo."""
    originals = {name: getattr(core, name) for name in _PHASES}

    def wrap(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t = time.process_time()
            try:
                return f(*a, **kw)
            finally:
                spent[_PHASES[name]] = spent.get(_PHASES[name], 0.0) + time.process_time() - t
        return timed

    for name, f in originals.items():
        setattr(core, name, wrap(name, f))

    def undo() -> None:
        for n, f in originals.items():
            setattr(core, n, f)
    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the fleet the demand fills")
    ap.add_argument("--workers", type=int, default=1, help="CP-SAT workers (1: deterministic)")
    ap.add_argument("--gap", type=float, default=0.005, help="relative gap limit")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--backend", default="SCIP", choices=["SCIP", "cp-sat"])
    ap.add_argument("--replan", action="store_true", help="also time the next cycle with the plan running")
    ap.add_argument("--breakdown", action="store_true", help="CPU seconds per phase of plan()")
    ap.add_argument("--max-s", type=float, default=None, help="exit 1 when solve_s exceeds this")
    args = ap.parse_args()
    fleet, obs, policy, caps = synthetic(args.hosts, args.models, args.load, args.workers, args.time_limit, args.gap,
                                         args.backend)
    spent: dict[str, float] = {}
    undo = _timed(spent) if args.breakdown else None
    t0, c0 = time.perf_counter(), time.process_time()
    result = plan_with_capacities(obs, fleet, policy, caps, PlannerState.initial(), 1.7e9)  # type: ignore[arg-type]
    solve_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if undo is not None:
        undo()
    e = result.explanation
    counts = [r for r in e.solver if r.stage == "counts"]
    placement = [r for r in e.solver if r.stage == "placement"]
    unmet = sum(m.unmet_rps for m in e.models)
    print(f"hosts={args.hosts} models={args.models} gpus={args.hosts * 8} candidates={len(caps)}")
    print(f"planned replicas={len(result.plan.replicas)} gpus={result.plan.gpus} usd_h={result.plan.usd_h:.2f} "
          f"unmet_rps={unmet:.2f}")
    for r in counts:
        print(f"stage1 {r.backend} status={r.status} objective={r.objective} bound={r.best_bound} "
              f"gap={r.gap} solver_wall_s={r.wall_s:.3f}")
    for r in placement:
        print(f"stage2 {r.backend} status={r.status}")
    if args.replan:
        # the next cycle: the plan is running, demand moved by -10%..+10% per model
        running = tuple(replace(r, state=ReplicaState.READY, since_s=1.7e9) for r in result.plan.replicas)
        moved = {name: replace(o, rate_rps=(o.rate_rps or 0.0) * (0.9 + 0.2 * ((i * 37) % 11) / 10))
                 for i, (name, o) in enumerate(sorted(obs.models.items()))}
        t1 = time.perf_counter()
        again = plan_with_capacities(Observation(moved), replace(fleet, replicas=running), policy, caps,  # type: ignore[arg-type]
                                     result.next_state, 1.7e9 + 60)
        replan_s = time.perf_counter() - t1
        rc = [r for r in again.explanation.solver if r.stage == "counts"]
        kinds: dict[str, int] = {}
        for a in (*again.actions, *again.deferred_actions):
            kinds[a.kind.value] = kinds.get(a.kind.value, 0) + 1
        print(f"replan (fleet running, demand -10..+10%): wall_s={replan_s:.3f} solves={len(rc)} "
              f"status={rc[-1].status} gap={rc[-1].gap:.5f} actions={kinds}")
    if args.breakdown:
        rest = cpu_s - sum(spent.values())
        print("breakdown cpu_s: " + " ".join(f"{k}={v:.3f}" for k, v in spent.items())
              + f" rest={rest:.3f} total={cpu_s:.3f}")
    main_r = counts[-1]
    gap = main_r.gap if main_r.gap is not None else float("nan")
    print(f"solve_s={solve_s:.3f} gap={gap:.5f} status={main_r.status}")
    if args.max_s is not None and solve_s > args.max_s:
        print(f"solve_s {solve_s:.3f} > --max-s {args.max_s:g}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
