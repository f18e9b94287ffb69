"""Ground truth for disaggregated serving: the cheapest fixed fleet at the SLO, aggregated vs pools.

    .venv/bin/python bench/disagg_fleets.py [--scenarios coding,mooncake-long,azure] [--itl-ms 25]
        [--layouts vllm:1,trtllm:1] [--workers 2]

Per scenario, every fleet is held fixed for the whole trace in the replay (bench/static_fleets.py,
warm at t = 0, the scenario's engines and routing), and the replay's attainment (the share of
requests within both the TTFT and the ITL target) is compared with the objective (0.99):

- aggregated: per layout (engine:TP), the fewest replicas that reach it;
- disaggregated: per layout and decode count d = 1, 2, ..., the fewest prefill replicas that
  reach it with d decode replicas (same engine and TP in both pools; the replay places them on the
  first free GPUs, so a small fleet's pools share a host: the KV moves over NVLink).

It prints each layout's cheapest fleet and, per scenario, the cheapest of each kind. Scenarios:
coding (data/traces/coding_like_hour.jsonl, config/example-policy.yaml's llama-3-8b: TTFT 500 ms,
ITL 50 ms), mooncake-long and azure (bench/evaluate_traces.py's). `--itl-ms` replaces every ITL
target (a tighter target is where pools pay); `--ttft-ms` every TTFT target.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from evaluate_traces import DATA, scenario_hour  # noqa: E402
from static_fleets import row  # noqa: E402

from fleetplan.models.config_key import Role  # noqa: E402
from fleetplan.models.names import parse_engine  # noqa: E402
from fleetplan.planner.policy import Policy, load_policy_text  # noqa: E402
from fleetplan.planner.types import ConfigKey  # noqa: E402
from fleetplan.sim.baselines import StaticController  # noqa: E402
from fleetplan.sim.des import FleetSim, SimResult, SimSettings  # noqa: E402
from fleetplan.sim.evaluate import make_environment, policy_for_models, prepare_trace  # noqa: E402
from fleetplan.sim.search import smallest_count  # noqa: E402
from fleetplan.sim.traces import Trace, read_trace  # noqa: E402

OBJECTIVE = 0.99
MAX_REPLICAS = 16  # per pool
MAX_DECODE = 8  # decode replicas tried

DEFAULT_LAYOUTS = {"coding": "vllm:1,trtllm:1", "mooncake-long": "vllm:1,trtllm:1", "azure": "vllm:4,trtllm:4"}


def scenario(key: str, data: Path) -> tuple[Trace, Policy, str]:
    if key == "coding":
        policy = load_policy_text((ROOT / "config" / "example-policy.yaml").read_text(), "config/example-policy.yaml")
        model = "llama-3-8b"
        trace = prepare_trace(read_trace(data / "traces" / "coding_like_hour.jsonl"), policy, model)
        return trace, policy_for_models(policy, [model]), model
    return scenario_hour(key, data)


class Search:
    """One scenario's replays (fixed fleets), with the SLO targets possibly overridden."""

    def __init__(self, key: str, data: Path, itl_ms: float | None, ttft_ms: float | None) -> None:
        self.trace, self.policy, self.model = scenario(key, data)
        env = make_environment(self.policy)
        if itl_ms is not None:
            env = replace(env, itl_slo_ms={m: itl_ms for m in env.itl_slo_ms})
        if ttft_ms is not None:
            env = replace(env, ttft_slo_ms={m: ttft_ms for m in env.ttft_slo_ms})
        self.env = env
        mp = self.policy.model(self.model)
        assert mp is not None
        self.gpu = mp.allowed.gpus[0] if mp.allowed.gpus else self.policy.hosts[0].gpu
        self.precision = mp.precision
        self.cache: dict[tuple[tuple[ConfigKey, int], ...], SimResult] = {}

    def key(self, layout: str, role: Role = Role.AGGREGATED) -> ConfigKey:
        eng, tp = layout.split(":")
        return ConfigKey(self.model, parse_engine(eng), self.gpu, int(tp), self.precision, role)

    def run(self, counts: dict[ConfigKey, int]) -> SimResult:
        k = tuple(sorted(counts.items()))
        res = self.cache.get(k)
        if res is None:
            res = FleetSim(self.trace, StaticController("fixed", counts), self.env, SimSettings()).run()
            self.cache[k] = res
        return res

    def ok(self, counts: dict[ConfigKey, int]) -> bool:
        res = self.run(counts)
        return res.slo_attainment >= OBJECTIVE and res.rejected + res.unfinished == 0


def label(counts: dict[ConfigKey, int]) -> str:
    return ",".join(f"{c.engine.value}:{c.tp}{'' if c.role is Role.AGGREGATED else ':' + c.role.value}={n}"
                    for c, n in counts.items())


def best_of_layout(args: tuple[str, str, Path, float | None, float | None]) -> list[tuple[str, int, str]]:
    """(kind, GPUs, table row) of the cheapest aggregated fleet and the cheapest pools of one layout."""
    key, layout, data, itl_ms, ttft_ms = args
    s = Search(key, data, itl_ms, ttft_ms)
    out: list[tuple[str, int, str]] = []
    agg = s.key(layout)
    n = smallest_count(lambda k: s.ok({agg: k}), MAX_REPLICAS, start=2)
    if n is not None:
        counts = {agg: n}
        out.append(("aggregated", n * agg.tp, row(label(counts), s.run(counts))))
    pre, dec = s.key(layout, Role.PREFILL), s.key(layout, Role.DECODE)
    best: tuple[int, dict[ConfigKey, int]] | None = None
    for d in range(1, MAX_DECODE + 1):
        if best is not None and (d + 1) * agg.tp > best[0]:
            break  # d decode replicas and one prefill replica already cost more than the best pools
        def reaches(k: int, d: int = d) -> bool:
            return s.ok({pre: k, dec: d})

        p = smallest_count(reaches, MAX_REPLICAS, start=max(1, (n or 2) - d))
        if p is not None and (best is None or (p + d) * agg.tp < best[0]):
            best = ((p + d) * agg.tp, {pre: p, dec: d})
    if best is not None:
        out.append(("disaggregated", best[0], row(label(best[1]), s.run(best[1]))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="coding,mooncake-long,azure")
    ap.add_argument("--layouts", default=None, help="engine:tp,... (default per scenario)")
    ap.add_argument("--itl-ms", type=float, default=None, help="replace every ITL target")
    ap.add_argument("--ttft-ms", type=float, default=None, help="replace every TTFT target")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    for key in (k.strip() for k in args.scenarios.split(",") if k.strip()):
        layouts = [x.strip() for x in (args.layouts or DEFAULT_LAYOUTS[key]).split(",") if x.strip()]
        slo = "" if args.itl_ms is None else f", ITL target {args.itl_ms:g} ms"
        slo += "" if args.ttft_ms is None else f", TTFT target {args.ttft_ms:g} ms"
        print(f"\n{key}{slo}: cheapest fixed fleets at {100 * OBJECTIVE:g}% (layouts {', '.join(layouts)})",
              flush=True)
        print(f"{'kind':14s} {'GPUs':>4} {'fleet':40s} {'GPU-h':>7} {'SLO att.':>9} {'TTFT p99':>9} "
              f"{'ITL p99':>8} {'unmet':>7}", flush=True)
        with ProcessPoolExecutor(max(1, args.workers)) as pool:
            found = [x for part in pool.map(best_of_layout, [(key, lay, args.data, args.itl_ms, args.ttft_ms)
                                                              for lay in layouts]) for x in part]
        for kind in ("aggregated", "disaggregated"):
            rows = sorted((g, r) for k, g, r in found if k == kind)
            for g, r in rows:
                print(f"{kind:14s} {g:4d} {r}", flush=True)
            if not rows:
                print(f"{kind:14s}    - none within {MAX_REPLICAS} replicas per pool", flush=True)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
