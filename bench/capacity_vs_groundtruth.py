"""Predicted vs ground-truth capacity at a p99 SLO, for a few configurations on the simulator.

What the planner uses is `fleetplan.models.profile.capacity()` of a fitted profile. This bench does what a
team would do on the simulator's ground truth (fleetplan.sim.groundtruth): a Poisson rate sweep at the
workload's lengths (the `vllm bench serve` points: TTFT mean/p50/p99, per-request TPOT mean/p50/p99,
ITL p99 over all token gaps), fitted with fleetplan.models.fit.fit_profile, then compares
`capacity(profile, ttft_p99, itl_p99).max_rps` with the truth:

- fixed: fixed-length requests, truth = fleetplan.sim.capacity_truth.max_rate_at_slo (p99 TTFT and p99 of all
  inter-token gaps);
- azure (--mix): the Azure conversation trace's length mix (Llama-3-70B, SLO 1 s / 80 ms, as
  bench/evaluate_traces.py), profile built by fleetplan.sim.evaluate.profiles_from_ground_truth, truth =
  fleetplan.sim.des.capacity_at_slo (p99 TTFT and p99 per-request TPOT; median of 3 draws).

The sweep spans 15%..115% of the true capacity (like fleetplan.sim.evaluate), so the fit sees the region that
matters. Prints one line per config: predicted and true max rps, the error, the predicted binding.

    .venv/bin/python bench/capacity_vs_groundtruth.py [--only fixed|mix] [--configs 0,2]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from fleetplan.models.bench import BenchmarkPoint, LoadKind  # noqa: E402
from fleetplan.models.fit import fit_profile  # noqa: E402
from fleetplan.models.names import Engine, GpuType, Precision  # noqa: E402
from fleetplan.models.profile import ConfigKey, Workload, capacity, predict  # noqa: E402
from fleetplan.sim.capacity_truth import max_rate_at_slo, simulate  # noqa: E402
from fleetplan.sim.groundtruth import EngineParams, build_params  # noqa: E402


@dataclass(frozen=True)
class Case:
    engine: Engine
    model: str
    gpu: GpuType
    tp: int
    precision: Precision
    isl: int
    osl: int
    ttft_ms: float
    itl_ms: float

    def label(self) -> str:
        return (f"{self.model}/{self.engine.value}/{self.gpu.value}/tp{self.tp} isl {self.isl} osl {self.osl} "
                f"SLO {self.ttft_ms:g}/{self.itl_ms:g} ms")


CASES = (
    Case(Engine.TRTLLM, "llama-3-70b", GpuType.H100, 4, Precision.BF16, 1155, 211, 1000.0, 80.0),
    Case(Engine.VLLM, "llama-3-70b", GpuType.H100, 4, Precision.BF16, 1155, 211, 1000.0, 80.0),
    Case(Engine.VLLM, "llama-3.1-8b", GpuType.H100, 1, Precision.BF16, 467, 128, 500.0, 30.0),
    Case(Engine.TRTLLM, "llama-3.1-8b", GpuType.H100, 1, Precision.BF16, 2048, 256, 400.0, 25.0),
    Case(Engine.VLLM, "llama-3-8b", GpuType.H100, 1, Precision.BF16, 8000, 300, 5000.0, 60.0),
)
FRACTIONS = (0.15, 0.3, 0.5, 0.7, 0.85, 1.0, 1.15)


def sweep_point(params: EngineParams, case: Case, rate: float, n: int, seed: int) -> BenchmarkPoint:
    rng = random.Random(seed)
    t = 0.0
    arr = []
    for _ in range(n):
        t += rng.expovariate(rate)
        arr.append((t, case.isl, case.osl))
    stats = simulate(params, arr, seed=seed, warmup=n // 10, max_sim_s=arr[-1][0] * 3 + 60.0)
    tt = np.array(stats.ttft_s) * 1000.0
    tp = np.array(stats.tpot_s) * 1000.0
    return BenchmarkPoint(
        source=f"gt sweep {case.label()} @ {rate:.3f}", model=case.model, engine=case.engine, gpu=case.gpu,
        tp=case.tp, precision=case.precision, isl=case.isl, osl=case.osl, load=LoadKind.RATE, rate_rps=rate,
        request_rps=stats.completed / max(stats.duration_s - arr[0][0], 1e-9),
        output_tok_s=stats.output_tokens / max(stats.duration_s, 1e-9),
        ttft_mean_ms=float(tt.mean()), ttft_p50_ms=float(np.quantile(tt, 0.5)), ttft_p99_ms=float(np.quantile(tt, 0.99)),
        itl_mean_ms=float(tp.mean()), itl_p50_ms=float(np.quantile(tp, 0.5)), itl_p99_ms=stats.itl_p99_s * 1000.0,
        tpot_mean_ms=float(tp.mean()), tpot_p50_ms=float(np.quantile(tp, 0.5)), tpot_p99_ms=float(np.quantile(tp, 0.99)),
        series="gt-sweep",
    )


def run_fixed(cases: Sequence[Case], n: int) -> list[float]:
    errs = []
    for case in cases:
        t0 = time.perf_counter()
        params = build_params(case.engine, case.model, case.gpu, case.tp, case.precision)
        true = max_rate_at_slo(params, case.isl, case.osl, case.ttft_ms, case.itl_ms)
        points = [sweep_point(params, case, true * f, n, seed=7 + i) for i, f in enumerate(FRACTIONS)]
        key = ConfigKey(case.model, case.engine, case.gpu, case.tp, case.precision)
        prof = fit_profile(key, points, loo=False).profile
        w = Workload(case.isl, case.osl)
        cap = capacity(prof, w, ttft_p99_ms=case.ttft_ms, itl_p99_ms=case.itl_ms)
        err = cap.max_rps / true - 1.0 if true > 0 else math.nan
        errs.append(abs(err) * 100.0)
        at_true = predict(prof, w, rate_rps=true * 0.999) if true < cap.max_rps * 10 else None
        obs = min(points, key=lambda p: abs((p.rate_rps or 0.0) - true))
        detail = ""
        if at_true is not None and not at_true.saturated:
            detail = (f"  @true: TTFT p99 pred {at_true.ttft.p99_ms:.0f} obs {obs.ttft_p99_ms:.0f} ms, "
                      f"ITL p99 pred {at_true.itl.p99_ms:.1f} obs {obs.itl_p99_ms:.1f} ms")
        print(f"fixed {case.label():70} pred {cap.max_rps:7.2f} true {true:7.2f} rps  {err:+6.1%} "
              f"binding {cap.binding.value:6}{detail}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return errs


def run_mix(n_sweep: int) -> list[float]:
    from fleetplan.planner.types import ConfigKey
    from fleetplan.sim.evaluate import ground_truth_capacity, profiles_from_ground_truth, trace_lengths
    from fleetplan.sim.traces import read_trace

    trace = read_trace(ROOT / "data" / "traces" / "azure_llm_conv_2023.csv", model="llama-3-70b")
    lengths = trace_lengths(trace, "llama-3-70b")
    isl = sum(p for p, _ in lengths) / len(lengths)
    osl = sum(o for _, o in lengths) / len(lengths)
    ttft_ms, itl_ms = 1000.0, 80.0
    errs = []
    for engine in (Engine.TRTLLM, Engine.VLLM):
        t0 = time.perf_counter()
        c = ConfigKey("llama-3-70b", engine, GpuType.H100, 4, Precision.BF16)
        true = ground_truth_capacity(c, lengths, ttft_ms, itl_ms)
        profs = profiles_from_ground_truth([c], lengths, ttft_ms, itl_ms, n=n_sweep, capacities={c: true})
        prof = profs.get(c.model, c.engine, c.gpu, c.tp, c.precision)
        assert prof is not None
        cap = capacity(prof, Workload(isl, osl), ttft_p99_ms=ttft_ms, itl_p99_ms=itl_ms)
        err = cap.max_rps / true - 1.0
        errs.append(abs(err) * 100.0)
        print(f"azure {c.model}/{engine.value}/h100/tp4 mix isl {isl:.0f} osl {osl:.0f} SLO 1000/80 ms"
              f"{'':14} pred {cap.max_rps:7.2f} true {true:7.2f} rps  {err:+6.1%} binding {cap.binding.value}"
              f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return errs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("fixed", "mix"), default=None)
    ap.add_argument("--configs", default=None, help="comma-separated indexes into the fixed cases")
    ap.add_argument("--n", type=int, default=600, help="requests per sweep point")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    errs: list[float] = []
    if args.only in (None, "fixed"):
        cases = CASES if args.configs is None else tuple(CASES[int(i)] for i in args.configs.split(","))
        errs += run_fixed(cases, args.n)
    if args.only in (None, "mix"):
        errs += run_mix(1200)
    if errs:
        print(f"mean |error| {sum(errs) / len(errs):.1f}% over {len(errs)} configs")
    print(f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
