"""Calibrate the simulator's ground truth against the TensorRT-LLM v0.14 online-serving table.

Replays the table's QPS sweep (ISL 467, OSL 256 and 16, 500 Poisson requests per point) on the
simulated clock with the trtllm persona (Llama 3.1 8B / H100 / TP1 and 70B / TP4) and prints mean
TTFT and mean ITL, simulator vs table, per point. Points at or past saturation (QPS INF, achieved
req/s < 85% of the offered QPS, or a table TTFT > 5x the sweep's lowest: queueing) are marked and excluded from the error summary.

    .venv/bin/python bench/calibrate_sim.py [--gpu h100] [--persona trtllm] [--seeds 3]
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from models.names import parse_engine, parse_gpu, parse_precision
from sim.groundtruth import build_params, poisson_arrivals, simulate

TABLE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "benchmarks" / (
    "trtllm_v0.14_online_serving_triton_bf16.csv"
)
MODELS = {"LLaMA 3.1 8B": ("llama-3.1-8b", 1), "LLaMA 3.1 70B": ("llama-3.1-70b", 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--persona", default="trtllm")
    ap.add_argument("--seeds", type=int, default=3, help="runs per point (mean of the means)")
    ap.add_argument("--requests", type=int, default=500)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
