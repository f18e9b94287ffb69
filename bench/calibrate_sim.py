"""Calibrate the simulator's ground truth against the TensorRT-LLM v0.14 online-serving table.

Replays the table's QPS sweep (ISL 467, OSL 256 and 16, 500 Poisson requests per point) on the
simulated clock with the trtllm persona (Llama 3.1 8B / H100 / TP1 and 70B / TP4) and prints mean
TTFT and mean ITL, simulator vs table, per point. Points at or past saturation (QPS INF, achieved
req/s < 85% of the offered QPS, or a table TTFT > 5x the sweep's lowest: queueing) are marked and excluded from the error summary.

    .venv/bin/python bench/calibrate_sim.py [--gpu h100] [--persona trtllm] [--seeds 3] [--offline]

--offline adds an out-of-sample check against the TensorRT-LLM v0.17 offline max-throughput table
(FP8, Llama 3.1 8B and 70B, TP 1-8; not used for tuning): simulated saturated output tok/s.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from fleetplan.models.names import Engine, GpuType, parse_engine, parse_gpu, parse_precision
from fleetplan.sim.capacity_truth import poisson_arrivals, simulate
from fleetplan.sim.groundtruth import build_params

BENCH_DIR = Path(__file__).resolve().parents[1] / "data" / "benchmarks"  # the repository's copy (data/SOURCES.md)
TABLE = BENCH_DIR / "trtllm_v0.14_online_serving_triton_bf16.csv"
OFFLINE_TABLE = BENCH_DIR / "trtllm_v0.17_perf_overview_throughput.csv"
MODELS = {"LLaMA 3.1 8B": ("llama-3.1-8b", 1), "LLaMA 3.1 70B": ("llama-3.1-70b", 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--persona", default="trtllm")
    ap.add_argument("--seeds", type=int, default=3, help="runs per point (mean of the means)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--offline", action="store_true", help="also compare with the v0.17 offline throughput table")
    args = ap.parse_args(argv)
    gpu = parse_gpu(args.gpu)
    persona = parse_engine(args.persona)
    if not args.table.is_file():
        print(f"table not found: {args.table}", file=sys.stderr)
        return 2
    rows = list(csv.DictReader(args.table.open()))
    errs: dict[str, list[float]] = {"ttft": [], "itl": []}
    print(f"persona={persona.value} gpu={gpu.value}  (sim vs table; err = sim/table - 1)")
    print(f"{'model':14} {'tp':>2} {'osl':>4} {'qps':>4} | {'rps sim':>7} {'table':>5} | "
          f"{'TTFT sim':>8} {'table':>6} {'err':>6} | {'ITL sim':>7} {'table':>5} {'err':>6}")
    for row in rows:
        if parse_gpu(row["gpu"]) != gpu or row["model"] not in MODELS:
            continue
        model, tp = MODELS[row["model"]]
        if int(row["tp"]) != tp:
            continue
        params = build_params(persona, model, gpu, tp, parse_precision(row["precision"]))
        isl, osl = int(row["isl"]), int(row["osl"])
        qps = math.inf if row["qps"].upper() == "INF" else float(row["qps"])
        ttft, itl, rps = [], [], []
        for seed in range(args.seeds):
            if math.isinf(qps):
                arr = [(0.0, isl, osl)] * args.requests
            else:
                arr = poisson_arrivals(qps, args.requests, isl, osl, seed=seed)
            st = simulate(params, arr, seed=seed)
            ttft.append(st.mean_ttft_s() * 1000)
            itl.append(st.mean_itl_s() * 1000)
            rps.append(len(st.ttft_s) / st.duration_s)
        t_sim, i_sim, r_sim = (sum(x) / len(x) for x in (ttft, itl, rps))
        t_tab, i_tab, r_tab = float(row["mean_ttft_ms"]), float(row["mean_itl_ms"]), float(row["req_throughput_rps"])
        low = min(float(r["mean_ttft_ms"]) for r in rows if (r["model"], r["gpu"], r["tp"], r["osl"]) ==
                  (row["model"], row["gpu"], row["tp"], row["osl"]))
        saturated = math.isinf(qps) or r_tab < 0.85 * qps or t_tab > 5 * low
        et, ei = t_sim / t_tab - 1, i_sim / i_tab - 1
        if not saturated:
            errs["ttft"].append(et)
            errs["itl"].append(ei)
        print(f"{row['model']:14} {tp:>2} {osl:>4} {row['qps']:>4} | {r_sim:7.1f} {r_tab:5.0f} | "
              f"{t_sim:8.1f} {t_tab:6.0f} {et:+6.0%} | {i_sim:7.1f} {i_tab:5.0f} {ei:+6.0%}"
              f"{'  (saturated)' if saturated else ''}")
    for k, v in errs.items():
        if v:
            print(f"{k.upper()} below saturation: n={len(v)} mean |err| {sum(map(abs, v)) / len(v):.1%}, "
                  f"max |err| {max(map(abs, v)):.1%}")
    if args.offline:
        offline(gpu, persona)
    return 0


def offline(gpu: GpuType, persona: Engine) -> None:
    """Saturated output tok/s vs the v0.17 offline table (trtllm-bench throughput)."""
    if not OFFLINE_TABLE.is_file():
        print(f"table not found: {OFFLINE_TABLE}", file=sys.stderr)
        return
    names = {"LLaMA v3.1 8B": "llama-3.1-8b", "LLaMA v3.1 70B": "llama-3.1-70b"}
    seen = set()
    errs = []
    print(f"\noffline max throughput, output tok/s ({OFFLINE_TABLE.name}; sim: saturated Poisson overload)")
    for row in csv.DictReader(OFFLINE_TABLE.open()):
        if row["model"] not in names or parse_gpu(row["gpu"]) != gpu:
            continue
        tp, isl, osl = int(row["tp"]), int(row["isl"]), int(row["osl"])
        key = (row["model"], row["precision"], tp, isl, osl)
        if key in seen:
            continue
        seen.add(key)
        table = float(row["token_throughput_tok_s_as_reported"])
        try:
            params = build_params(persona, names[row["model"]], gpu, tp, parse_precision(row["precision"]),
                                  noise_sigma=0.0)
        except ValueError as exc:
            print(f"{row['model']:15} {row['precision']:4} tp{tp} {isl:>5}/{osl:<5}: {exc}")
            continue
        n = min(3000, max(600, 400_000 // (isl + osl)))
        st = simulate(params, [(0.0, isl, osl)] * n, seed=0)
        sim = st.output_tokens / st.duration_s
        err = sim / table - 1
        errs.append(err)
        print(f"{row['model']:15} {row['precision']:4} tp{tp} {isl:>5}/{osl:<5}: table {table:8.0f}  sim {sim:8.0f}  "
              f"{err:+6.0%}")
    if errs:
        print(f"offline: n={len(errs)} mean |err| {sum(map(abs, errs)) / len(errs):.1%}, "
              f"max |err| {max(map(abs, errs)):.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
