"""Replay evaluation on the real traces in data/traces: every policy side by side.

    .venv/bin/python bench/evaluate_traces.py [--traces azure,mooncake] [--day] [--workers 2] [--out DIR]
        [--data DIR]     (default: the repository's data/, or $FLEETPLAN_DATA; data/SOURCES.md)
        [--rotations N]  (each hour also at N phases of the control cycle: the spread of a chaotic path)
        [--scrape-offsets K]  (each target scraped at one of K offsets in the interval, as Prometheus does)

Per trace it builds profiles the way a team would (a rate sweep per config on the simulator's ground
truth with the trace's own length mix, fitted with fleetplan.models.fit), runs `fleetplan.sim.evaluate.evaluate` for
all policies, prints the table, the issue's goals and the evaluation wall time (the simulations of
all policies plus the ground-truth capacities; profile generation is reported separately).

Scenarios (policies are written below; the traces are the repository's data/traces):
- azure: Azure LLM conversation trace, 1 h, 19,366 requests, rate x4 (tiled: 4 copies of the hour
  time-compressed into the hour, fleetplan.sim.traces.reshape), served as Llama-3-70B on 8 hosts x 8 H100,
  SLO TTFT p99 1 s / ITL p99 80 ms; vLLM and TensorRT-LLM at TP 4 or 8 (TRT-LLM engines cached).
- mooncake: Mooncake conversation trace, 59 min, 12,031 requests with 12k-token mean prompts, rate
  x1, served as Llama-3-8B on 4 hosts x 8 H100, long-context SLO TTFT p99 20 s / ITL p99 150 ms,
  TP 1 or 2 (TRT-LLM engines cached). Both: headroom 0.2 (the example policy's), 60 s cycle, 300 s
  scale-down delay.
With --day the hour is also shaped into a compressed day (fleetplan.sim.traces.shape_day, day_s = 3600 s:
trough at the start, peak at 30 min, peak/trough 3); with --day-s S [--day-scale R] into a day of S
seconds (e.g. --traces azure --day-s 21600 --day-scale 2: a 6 h day, 238k requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from fleetplan.models.profile import ProfileSet  # noqa: E402
from fleetplan.planner.policy import Policy, load_policy_text  # noqa: E402
from fleetplan.sim.baselines import POLICY_NAMES  # noqa: E402
from fleetplan.sim.des import SimSettings  # noqa: E402
from fleetplan.sim.evaluate import (  # noqa: E402
    EvaluateOptions,
    Evaluation,
    candidates_for,
    evaluate,
    goals,
    policy_for_models,
    prepare_trace,
    profiles_from_ground_truth,
    render_table,
    trace_lengths,
    write_charts,
)
from fleetplan.sim.router import RouteMode  # noqa: E402
from fleetplan.sim.traces import Trace, read_trace, reshape, rotated, shape_day  # noqa: E402

# the public data travels with the repository (data/SOURCES.md); --data or $FLEETPLAN_DATA for other data
DATA = Path(os.environ.get("FLEETPLAN_DATA") or ROOT / "data")

_COMMON = """
version: 1
gpu_types:
  h100: {price_usd_h: 3.0}
engines:
  vllm:
    launch: {command: vllm, args: [serve, "{hf_model}", --tensor-parallel-size, "{tp}", --port, "{port}"]}
    startup: {default_s: 60, overrides: [{model: llama-3-70b, seconds: 90}]}
  trtllm:
    launch: {command: trtllm-serve, args: ["{engine_dir}", --tp_size, "{tp}", --port, "{port}"]}
    startup: {default_s: 45, overrides: [{model: llama-3-70b, seconds: 75}]}
    build: {default_s: 900, overrides: [{model: llama-3-70b, seconds: 1500}]}
    cached_builds: [CACHED]
scaling:
  cycle_s: 60
  scale_down_delay_s: 300
  max_actions_per_cycle: 8
  forecast_quantile: 0.9
"""


def _hosts(n: int) -> str:
    return "hosts:\n" + "".join(
        f"  - {{name: gpu-{i:02d}, gpu: h100, gpu_count: 8, nvlink_groups: [[0, 1, 2, 3, 4, 5, 6, 7]]}}\n"
        for i in range(1, n + 1)
    )


AZURE_POLICY = _COMMON.replace("CACHED", "{model: llama-3-70b, gpu: h100, tp: 4}, {model: llama-3-70b, gpu: h100, tp: 8}") + _hosts(8) + """
models:
  - name: llama-3-70b
    slo: {ttft_p99_ms: 1000, itl_p99_ms: 80}
    min_replicas: 1
    allowed: {engines: [vllm, trtllm], tp: [4, 8], gpus: [h100]}
    headroom: 0.2
    workload: {isl: 1155, osl: 211}
"""

MOONCAKE_POLICY = _COMMON.replace("CACHED", "{model: llama-3-8b, gpu: h100, tp: 1}, {model: llama-3-8b, gpu: h100, tp: 2}") + _hosts(4) + """
models:
  - name: llama-3-8b
    slo: {ttft_p99_ms: 20000, itl_p99_ms: 150}
    min_replicas: 1
    allowed: {engines: [vllm, trtllm], tp: [1, 2], gpus: [h100]}
    headroom: 0.2
    workload: {isl: 12035, osl: 343}
"""

LONG_CONTEXT_POLICY = (ROOT / "config" / "example-policy-long-context.yaml").read_text()
# the example policy without its schedules (a business-hours floor of two replicas, a maintenance
# window): a day's replay starts on a Monday, and the yardsticks know no floors
EXAMPLE_POLICY = (ROOT / "config" / "example-policy.yaml").read_text().split("\nschedules:")[0] + "\n"

SCENARIOS = {
    "azure": ("azure_llm_conv_2023.csv", AZURE_POLICY, "llama-3-70b", 4.0),
    "mooncake": ("mooncake_conversation.jsonl", MOONCAKE_POLICY, "llama-3-8b", 1.0),
    # the long-context case: config/example-policy-long-context.yaml (TTFT 15 s / ITL 120 ms,
    # TP 1/2/4, TRT-LLM TP1/TP2 cached); meant to be run with --profiles benchmarks
    "mooncake-long": ("mooncake_conversation.jsonl", LONG_CONTEXT_POLICY, "llama-3-8b", 1.0),
    # the bursty coding-like hour (`fleetplan trace coding`, seed 1: 60 s peak 4x the mean, 2.2k-token
    # prompts, 28-token outputs) under config/example-policy.yaml's Llama-3-8B (TTFT 500 ms / ITL 50 ms),
    # its schedules left out
    "coding": ("coding_like_hour.jsonl", EXAMPLE_POLICY, "llama-3-8b", 1.0),
}


def _scenario(key: str, data: Path) -> tuple[Trace, Trace, Policy, str, float]:
    """(the raw trace, its hour at the scenario's rate scale, the policy, the model, the scale)."""
    fname, policy_text, model, scale = SCENARIOS[key]
    policy = load_policy_text(policy_text, f"bench:{key}")
    if len(policy.models) > 1:
        policy = policy_for_models(policy, [model])
    raw = read_trace(data / "traces" / fname, model=model)
    hour = raw if scale == 1.0 else reshape(raw, duration_s=raw.duration_s, rate_scale=scale)
    return raw, hour, policy, model, scale


def scenario_hour(key: str, data: Path = DATA) -> tuple[Trace, Policy, str]:
    """A scenario's hour as the other bench scripts replay it: (the trace prepared for the policy's
    model, the policy restricted to that model, the model)."""
    _, hour, policy, model, _ = _scenario(key, data)
    return prepare_trace(hour, policy, model), policy_for_models(policy, [model]), model


def _benchmark_profiles(benchmarks: Path, cache: Path) -> ProfileSet:
    """The user's workflow: `fleetplan models fit` on the public benchmark files (cached)."""
    if not cache.exists():
        print(f"fitting profiles from {benchmarks} (fleetplan models fit; a few minutes) -> {cache}", flush=True)
        subprocess.run([sys.executable, "-m", "fleetplan", "models", "fit", str(benchmarks), "--out",
                        str(cache)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return ProfileSet.from_json_dict(json.loads(cache.read_text()))


def _rotations(tr: Trace, pol: Policy, profiles: ProfileSet, opts: EvaluateOptions, ev0: Evaluation, n: int) -> None:
    """The hour replayed at `n` phases of the control cycle (`rotated`): one figure per phase and
    their spread, for the policies that run a control loop (the fixed fleets do not depend on it).
    Why: a replay is deterministic, but a path of decisions is chaotic: arrivals 20 s later moved
    benchmark-fitted mooncake from 9.22 to 10.29 GPU-hours. A rule is judged over the phases."""
    cycle_s = pol.scaling.cycle_s
    looped = tuple(p for p in opts.policies if p.startswith("fleetplan") or p == "hpa")
    if not looped:
        return
    runs: dict[str, list[tuple[float, float, int]]] = {p: [] for p in looped}
    offsets = [k * cycle_s / n for k in range(n)]
    for k, off in enumerate(offsets):
        ev = ev0 if k == 0 else evaluate(rotated(tr, off), pol, profiles, dataclasses.replace(opts, policies=looped))
        for p in looped:
            f = ev.policies[p]
            runs[p].append((f.gpu_hours, f.slo_attainment or 0.0, f.replica_starts))
        print(f"rotation {off:5.1f} s: " + "; ".join(
            f"{p} {runs[p][-1][0]:.2f} GPU-h / {100 * runs[p][-1][1]:.2f}% / {runs[p][-1][2]} starts" for p in looped))
        sys.stdout.flush()
    fixed = ev0.policies.get("best-fixed")
    for p, rs in runs.items():
        g = [r[0] for r in rs]
        mean = sum(g) / len(g)
        over = f", mean / best-fixed {mean / fixed.gpu_hours:.2f}" if fixed is not None and fixed.gpu_hours > 0 else ""
        print(f"rotations ({n}, every {cycle_s / n:g} s): {p} GPU-h mean {mean:.2f} [{min(g):.2f}, {max(g):.2f}], "
              f"SLO attainment lowest {100 * min(r[1] for r in rs):.2f}%, "
              f"{sum(1 for r in rs if r[1] >= 0.99)} of {n} at 99% or more, starts mean "
              f"{sum(r[2] for r in rs) / n:.1f}{over}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="azure,mooncake")
    ap.add_argument("--day", action="store_true", help="also evaluate the compressed-day shape")
    ap.add_argument("--day-s", type=float, default=None,
                    help="also evaluate a day of this many seconds (shape_day), e.g. 21600")
    ap.add_argument("--day-scale", type=float, default=None,
                    help="rate scale of that day (default: the scenario's)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--out", type=Path, default=None, help="write charts per scenario here")
    ap.add_argument("--profiles", default="ground-truth",
                    help="ground-truth (rate sweeps on the simulator with the trace's mix, fitted), "
                         "benchmarks (fleetplan models fit on DATA/benchmarks: the user's "
                         "workflow; cached in --profiles-cache), or a PROFILES.json path")
    ap.add_argument("--profiles-cache", type=Path, default=Path("/tmp/fleetplan-benchmark-profiles.json"))
    ap.add_argument("--routing", default="least-loaded", choices=("least-loaded", "round-robin", "affinity"))
    ap.add_argument("--no-prefix-cache", action="store_true", help="engines compute every prompt in full")
    ap.add_argument("--rotations", type=int, default=1,
                    help="replay each hour N times, its arrivals rotated by k x cycle_s / N seconds (k < N): "
                         "the same requests meeting the control cycles at N phases; prints each run and the spread")
    ap.add_argument("--scrape-offsets", type=int, default=1,
                    help="scrape each target at one of K offsets in the scrape interval (a hash of its id, as "
                         "Prometheus offsets targets); 1 (default): every target at once, on the cycles' grid")
    ap.add_argument("--data", type=Path, default=DATA,
                    help="the data folder with traces/ and benchmarks/ (default: the repository's data/, "
                         "or $FLEETPLAN_DATA)")
    args = ap.parse_args(argv)
    traces = args.data / "traces"
    if not traces.is_dir():
        print(f"traces not found at {traces}", file=sys.stderr)
        return 2
    for key in [k.strip() for k in args.traces.split(",") if k.strip()]:
        fname = SCENARIOS[key][0]
        raw, hour, policy, model, scale = _scenario(key, args.data)
        shapes = [("hour", hour, scale)]
        if args.day:
            shapes.append(("compressed-day", shape_day(raw, raw.duration_s, scale), scale))
        if args.day_s is not None:
            ds = args.day_scale or scale
            shapes.append((f"day-{args.day_s:g}s", shape_day(raw, args.day_s, ds), ds))
        for shape_name, tr, tr_scale in shapes:
            tr = prepare_trace(tr, policy, model)
            pol = policy_for_models(policy, [model])
            m = pol.models[0]
            t0 = time.perf_counter()
            configs = candidates_for(pol, model)
            if args.profiles == "ground-truth":
                profiles = profiles_from_ground_truth(configs, trace_lengths(tr, model), m.slo.ttft_p99_ms,
                                                      m.slo.itl_p99_ms)
            elif args.profiles == "benchmarks":
                profiles = _benchmark_profiles(args.data / "benchmarks", args.profiles_cache)
            else:
                profiles = ProfileSet.from_json_dict(json.loads(Path(args.profiles).read_text()))
            t_prof = time.perf_counter() - t0
            settings = SimSettings(routing=RouteMode(args.routing), prefix_cache=not args.no_prefix_cache,
                                   scrape_offsets=args.scrape_offsets)
            opts = EvaluateOptions(policies=tuple(args.policies.split(",")), settings=settings,
                                   workers=args.workers)
            ev = evaluate(tr, pol, profiles, opts, trace_info={"scenario": key, "shape": shape_name,
                                                                "rate_scale": tr_scale})
            print(f"\n=== {key} ({fname}), {shape_name}, rate x{tr_scale:g}, model {model}, "
                  f"profiles: {args.profiles} ===")
            print(render_table(ev))
            print("diagnostics: " + "; ".join(
                f"{n}: swap_cycles={f.swap_cycles} builds={f.builds} mean_gpus={f.mean_gpus:.1f}"
                for n, f in ev.policies.items() if n.startswith("fleetplan") or n == "hpa"))
            for goal, ok, fig in goals(ev):
                print(f"goal: {goal}: {'MET' if ok else 'NOT MET'} ({fig})")
            print(f"profiles ({args.profiles}): {t_prof:.1f} s; evaluation wall time: {ev.wall_s:.1f} s "
                  f"for {len(ev.policies)} policies on {ev.trace['requests']} requests")
            if args.rotations > 1 and shape_name == "hour":
                _rotations(tr, pol, profiles, opts, ev, args.rotations)
            if args.out is not None:
                png, html = write_charts(ev, args.out / f"{key}-{shape_name}")
                print(f"charts: {png} {html}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
