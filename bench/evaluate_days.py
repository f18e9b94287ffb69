"""Days and weeks: fleetplan against the yardsticks found with hindsight, over the users' horizon.

    .venv/bin/python bench/evaluate_days.py [--scenarios azure,mooncake] [--per-day 100000,400000]
        [--shape day|week] [--day 2] [--swing X] [--window-floor F] [--profiles benchmarks|ground-truth|FILE] [--seed 1]
        [--policies fleetplan,best-fixed,hpa-tuned,clairvoyant] [--workers 2 | --ray ADDRESS]
        [--json-out FILE]

Each run builds a day (24 h) or a week of one model's traffic on the Azure conversation service's
real week shape (data/traces/azure_llm_conv_2024_week_rate.csv; `fleetplan trace build`,
fleetplan/sim/trace_build.py: the source log's burstiness inside a minute, lengths, sessions and
prefix blocks, the week's envelope) at each requested number of requests per day, and replays it
with `fleetplan.sim.evaluate.evaluate` under the scenario's policy (bench/evaluate_traces.py: azure =
Llama-3-70B on 8 x 8 H100, mooncake = Llama-3-8B on 4 x 8 H100, coding = the bursty coding-like hour
under config/example-policy.yaml's Llama-3-8B, TensorRT-LLM builds paid at their lead time where not
cached; `--swing X` deepens the span's nights until its hourly peak-to-trough is X, as a coding
service's, `trace_build.deepened`; `--window-floor F` lets fleetplan spend the SLO's error budget
down to a good share of F in a window while the period has budget left, the policy's
`slo.window_floor`: every policy is still judged by the objective over the period) and profiles
fitted from data/benchmarks (the user's workflow). It prints
per run: GPU-hours, SLO attainment (the day's share) and the worst rolling period's share (the
SLO the policy writes, every policy and yardstick judged by it: sim/slo_periods.py) per policy,
fleetplan over best-fixed, tuned hpa and the
clairvoyant next to the goals (<= 0.7, <= 0.85, <= 1.2), the share of fleetplan's serving GPU-hours
on TensorRT-LLM, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from evaluate_traces import DATA, _scenario  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from replay_day import profiles_for  # noqa: E402

from fleetplan.planner.policy import Policy, Slo  # noqa: E402
from fleetplan.sim import trace_build as tb  # noqa: E402
from fleetplan.sim.evaluate import EvaluateOptions, evaluate, prepare_trace  # noqa: E402

GOALS = {"best-fixed": 0.70, "hpa-tuned": 0.85, "clairvoyant": 1.20}
DAY_S = 86_400.0


def build(scenario: str, per_day: float, shape: tb.Shape, day: int, seed: int,
          swing: float | None = None) -> Any:
    """The scenario's source log on the week's shape at `per_day` requests a day: (trace, policy, model).
    `swing`: the span's peak-to-trough of hourly means made this (`trace_build.deepened`); None: the week's."""
    raw, _hour, policy, model, _scale = _scenario(scenario, DATA)
    week = tb.read_week_rate(DATA / "traces" / "azure_llm_conv_2024_week_rate.csv")
    env = tb.envelope(week, shape, day)
    if swing is not None:
        env = tb.deepened(env, swing)
    built = tb.build_on_shape(tb.source_log(raw), env, per_day / DAY_S, seed)
    name = f"{scenario}-{shape.value}-{per_day:g}/day" + (f"-swing{swing:g}" if swing is not None else "")
    trace = prepare_trace(built.to_trace(name, model), policy, model)
    return trace, policy, model


def with_window_floor(policy: Policy, floor: float) -> Policy:
    """The policy with every model's per-window floor at `floor` (`slo.window_floor`), validated as a
    policy file's would be (a floor above the objective is refused)."""
    models = tuple(m.model_copy(update={"slo": Slo.model_validate({**m.slo.model_dump(), "window_floor": floor})})
                   for m in policy.models)
    return policy.model_copy(update={"models": models})


def run(scenario: str, per_day: float, args: argparse.Namespace) -> dict[str, Any]:
    shape = tb.Shape(args.shape)
    t0 = time.perf_counter()
    trace, policy, model = build(scenario, per_day, shape, args.day, args.seed, args.swing)
    if args.window_floor is not None:
        try:
            policy = with_window_floor(policy, args.window_floor)
        except ValidationError as e:
            raise SystemExit(f"--window-floor {args.window_floor:g}: {e.errors()[0]['msg']}") from None
    profiles = profiles_for(args.profiles, f"days-{scenario}-{shape.value}-{per_day:g}-{args.seed}-{args.swing}", trace, policy,
                            model, DATA)
    floor = "" if args.window_floor is None else f", window floor {args.window_floor:g}"
    print(f"== {trace.source}: {len(trace.requests):,} requests over {trace.duration_s / 3600:.1f} h{floor} "
          f"(built in {time.perf_counter() - t0:.0f} s)", flush=True)
    t1 = time.perf_counter()
    ev = evaluate(trace, policy, profiles,
                  EvaluateOptions(policies=tuple(args.policies.split(",")), workers=args.workers,
                                  ray_address=args.ray),
                  progress=lambda line: print(f"   {line}", flush=True))
    doc = ev.to_json()
    pols = doc["policies"]
    row: dict[str, Any] = {"scenario": scenario, "shape": shape.value, "requests_per_day": per_day,
                           "window_floor": args.window_floor,
                           "requests": len(trace.requests), "wall_s": round(time.perf_counter() - t1, 1),
                           "policies": {n: {k: p.get(k) for k in ("gpu_hours", "slo_attainment", "slo_periods",
                                                                  "gpu_hours_by_engine", "found_at")}
                                        for n, p in pols.items()}}
    fp = pols.get("fleetplan")
    if fp:
        by_engine = fp.get("gpu_hours_by_engine") or {}
        serving = sum(v for k, v in by_engine.items() if k != "build")
        row["trtllm_share"] = round(by_engine.get("trtllm", 0.0) / serving, 3) if serving else None
        row["over"] = {n: round(fp["gpu_hours"] / pols[n]["gpu_hours"], 3)
                       for n in GOALS if n in pols and pols[n].get("gpu_hours")}
    print(f"   {'policy':<14} {'GPU-h':>9} {'SLO':>8} {'worst period':>13}", flush=True)
    for n, p in pols.items():
        att = p.get("slo_attainment")
        per = p.get("slo_periods") or {}
        worst = "" if not per else f"{100 * per['worst_share']:.2f}%{'' if per.get('met') else ' MISSED'}"
        print(f"   {n:<14} {p['gpu_hours']:>9.2f} {'' if att is None else f'{100 * att:.2f}%':>8} {worst:>13}",
              flush=True)
    for n, ratio in (row.get("over") or {}).items():
        print(f"   fleetplan / {n}: {ratio:.3f} (goal <= {GOALS[n]:g}: {'met' if ratio <= GOALS[n] else 'MISSED'})",
              flush=True)
    if row.get("trtllm_share") is not None:
        print(f"   TensorRT-LLM share of fleetplan's serving GPU-hours: {100 * row['trtllm_share']:.0f}%", flush=True)
    print(f"   evaluated in {row['wall_s']:.0f} s", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="azure,mooncake")
    ap.add_argument("--per-day", default="100000,400000", help="requests per day, comma-separated")
    ap.add_argument("--shape", choices=[s.value for s in tb.Shape], default="day")
    ap.add_argument("--day", type=int, default=tb.DEFAULT_DAY, help="with --shape day: 0 = Sunday .. 6")
    ap.add_argument("--swing", type=float, default=None,
                    help="the span's peak-to-trough of hourly means (default: the week's own; a coding service's ~31)")
    ap.add_argument("--window-floor", type=float, default=None, metavar="F",
                    help="fleetplan may size a window for a good share of F (< the objective) while the period "
                         "has error budget left (slo.window_floor); default: every window at the objective")
    ap.add_argument("--profiles", default="benchmarks")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default="fleetplan,best-fixed,hpa-tuned,clairvoyant")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ray", default=None, metavar="ADDRESS")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    rows = [run(s, float(n), args) for s in args.scenarios.split(",") for n in args.per_day.split(",")]
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
