"""Bursty coding-like traffic over several seeds: fleetplan against the fleet fixed with hindsight.

    .venv/bin/python bench/coding_hours.py [--seeds 0-15] [--hours 1] [--policies fleetplan,best-fixed]
        [--profiles benchmarks|FILE] [--policy config/example-policy.yaml] [--workers 2] [--scrape-offsets K]

One trace is one draw of a process (`fleetplan trace coding`: edit bursts, burst episodes with
Pareto amplitudes, IDE prompts; fleetplan/sim/trace_build.py `CodingHour`), so a rule judged on
one hour is judged on its bursts; this replays `--hours` hours of the process per seed (seed s
is `fleetplan trace coding --seed s --duration-s 3600 x hours`), deterministically, and prints
per seed and policy the GPU-hours, the share of requests within the SLO, the worst rolling
hour's share (the SLO the policy writes), the share of the misses in the 3 worst minutes (a burst
the standing fleet did not serve, or misses spread over the hour: sim/slo_periods.py miss_minutes)
and fleetplan over best-fixed; then the totals. The
profiles are fitted from data/benchmarks by default (the user's workflow: the roofline prior
for Llama-3-8B, which has no benchmark rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # evaluate_traces, a sibling script (fleetplan itself is installed)

from evaluate_traces import DATA, _benchmark_profiles  # noqa: E402

from fleetplan.models.profile import ProfileSet  # noqa: E402
from fleetplan.planner.policy import load_policy_text  # noqa: E402
from fleetplan.shared.benchfiles import load_profiles  # noqa: E402
from fleetplan.sim.des import SimSettings  # noqa: E402
from fleetplan.sim.evaluate import EvaluateOptions, evaluate  # noqa: E402
from fleetplan.sim.trace_build import CodingHour, coding_hour  # noqa: E402


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _one(seed: int, hours: float, policy_path: str, profiles: ProfileSet, policies: tuple[str, ...],
         model: str, scrape_offsets: int = 1) -> tuple[int, dict[str, tuple[float, float, float, float]], float]:
    t0 = time.perf_counter()
    trace = coding_hour(CodingHour(duration_s=3600.0 * hours), seed)
    policy = load_policy_text(Path(policy_path).read_text(encoding="utf-8"), policy_path)
    ev = evaluate(trace, policy, profiles, EvaluateOptions(policies=policies, model=model, workers=1,
                                                           settings=SimSettings(scrape_offsets=scrape_offsets)))
    out: dict[str, tuple[float, float, float, float]] = {}
    for name, f in ev.policies.items():
        if f.slo_attainment is None:  # the oracle: a bound, not a run
            continue
        worst = f.slo_periods.worst_share if f.slo_periods is not None else f.slo_attainment
        burst = f.miss_minutes.worst_share if f.miss_minutes is not None else 0.0
        out[name] = (f.gpu_hours, f.slo_attainment, worst, burst)
    return seed, out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0-15", help="e.g. 0-15 or 1,3,5")
    ap.add_argument("--hours", type=float, default=1.0, help="hours of the process per seed")
    ap.add_argument("--policies", default="fleetplan,best-fixed")
    ap.add_argument("--policy", default=str(ROOT / "config" / "example-policy.yaml"))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--profiles", default="benchmarks", help="benchmarks (fleetplan models fit on "
                    "DATA/benchmarks, cached in --profiles-cache) or a PROFILES.json path")
    ap.add_argument("--profiles-cache", type=Path, default=Path("/tmp/fleetplan-benchmark-profiles.json"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scrape-offsets", type=int, default=1,
                    help="scrape each target at one of K offsets in the interval, as Prometheus does (1: all at once)")
    args = ap.parse_args(argv)
    profiles = (_benchmark_profiles(DATA / "benchmarks", args.profiles_cache) if args.profiles == "benchmarks"
                else load_profiles(args.profiles))
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    seeds = _seeds(args.seeds)
    t0 = time.perf_counter()
    rows: dict[int, dict[str, tuple[float, float, float, float]]] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futs = [pool.submit(_one, s, args.hours, args.policy, profiles, policies, args.model, args.scrape_offsets)
                for s in seeds]
        for fut in futs:
            seed, out, wall = fut.result()
            rows[seed] = out
            print(f"seed {seed}: replayed in {wall:.0f} s", file=sys.stderr, flush=True)
    print(f"{args.hours:g} h of coding-like traffic per seed, policy {args.policy}, profiles {args.profiles}")
    print(f"{'seed':>4}  " + "  ".join(f"{p:>34}" for p in policies) + "  fleetplan/best-fixed")
    totals = {p: [0.0, 0, 0] for p in policies}
    for seed in seeds:
        cells = []
        for p in policies:
            if p not in rows[seed]:
                cells.append(f"{'-':>34}")
                continue
            g, a, w, b = rows[seed][p]
            cells.append(f"{g:7.2f} GPU-h {100 * a:6.2f}% w{100 * w:6.2f}% 3m{100 * b:4.0f}%")
            totals[p][0] += g
            totals[p][1] += a >= 0.99
            totals[p][2] += w >= 0.99
        ratio = ""
        if "fleetplan" in rows[seed] and "best-fixed" in rows[seed] and rows[seed]["best-fixed"][0] > 0:
            ratio = f"{rows[seed]['fleetplan'][0] / rows[seed]['best-fixed'][0]:6.2f}"
        print(f"{seed:>4}  " + "  ".join(cells) + f"  {ratio}")
    for p in policies:
        g, n_all, n_worst = totals[p]
        print(f"{p}: {g:.2f} GPU-h over {len(seeds)} seeds; >= 99% of requests on {n_all}, "
              f"every rolling hour >= 99% on {n_worst}")
    print("w: the worst rolling hour's share; 3m: the share of the misses in the 3 worst minutes")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
