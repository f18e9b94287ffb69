"""Which requests miss the SLO on a length mix, by the engine's ground truth and by the planner's model.

For one configuration and a trace's lengths (default: the coding-like process, `fleetplan trace coding
--seed S`), Poisson arrivals at each rate are replayed on the simulator's engine
(`fleetplan.sim.core.replay_on_core`: the same scheduler as every replay, chunked prefill in a token
budget per step) and the requests that miss are counted by cause (TTFT over its target, per-request
ITL over its target) and by output length: a request's ITL is the mean of its output - 1 token gaps,
so an output of two tokens is one gap, and one step that also computes another prompt's prefill is
all of it. Beside the truth, the planner's model on the same mix (`fleetplan.models.mix`: the
profile fitted from `--profiles`, else the roofline prior): its ITL p99 and its share of requests
within both targets, with the profile's prefill-stall weight as fitted and as `--stall-weight`.

    .venv/bin/python bench/short_outputs.py [--seed 4] [--engine trtllm] [--tp 1] [--rates 1,2,3,5,8]
        [--ttft-ms 500] [--itl-ms 50] [--stall-weight 1.0] [--profiles FILE] [--requests 3000]

docs/decisions/0028-short-outputs-behind-prefill-steps.md holds what it printed.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

import numpy as np

from fleetplan.models.mix import attainment_mix, capacity_mix, predict_mix
from fleetplan.models.names import GpuType, Precision, parse_engine
from fleetplan.models.profile import ConfigKey, PerfProfile, roofline_profile
from fleetplan.shared.benchfiles import load_profiles
from fleetplan.sim.core import replay_on_core
from fleetplan.sim.evaluate import trace_workload
from fleetplan.sim.groundtruth import build_params
from fleetplan.sim.trace_build import CodingHour, coding_hour

MODEL = "llama-3-8b"
OUTPUT_CLASSES = ((2, 2), (3, 5), (6, 20), (21, None))  # output tokens; one token has no gap


def _profile(key: ConfigKey, path: str | None) -> PerfProfile:
    prof = load_profiles(path).get(key.model, key.engine, key.gpu, key.tp) if path else None
    prof = prof or roofline_profile(key)
    if prof is None:
        raise SystemExit(f"no profile and no roofline prior for {key.label()}")
    return prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=4, help="the coding-like process' seed (its lengths)")
    ap.add_argument("--engine", default="trtllm")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rates", default="1,2,3,5,8", help="rps per replica")
    ap.add_argument("--ttft-ms", type=float, default=500.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    ap.add_argument("--stall-weight", type=float, default=1.0)
    ap.add_argument("--profiles", default=None, help="PROFILES.json (default: the roofline prior)")
    ap.add_argument("--requests", type=int, default=3000, help="requests per rate (the first tenth warms up)")
    args = ap.parse_args(argv)
    engine = parse_engine(args.engine)
    key = ConfigKey(MODEL, engine, GpuType.H100, args.tp, Precision.BF16)
    trace = coding_hour(CodingHour(duration_s=3600.0), args.seed).as_single_model(MODEL)
    lengths = [(r.prompt_tokens, r.output_tokens) for r in trace.requests]
    rng = random.Random(0)
    sample = [lengths[rng.randrange(len(lengths))] for _ in range(args.requests)]
    gaps = [rng.expovariate(1.0) for _ in range(args.requests)]
    warm = args.requests // 10
    params = build_params(engine, MODEL, GpuType.H100, args.tp)
    workload = trace_workload(trace, MODEL)  # the mix as the controller reads it from histograms
    mix = workload.mix
    assert mix is not None
    osl = np.array([o for _, o in lengths], dtype=float)
    fitted = _profile(key, args.profiles)
    stalled = replace(fitted, params=replace(fitted.params, itl_stall_weight=args.stall_weight))
    print(f"{key.label()}, coding-like seed {args.seed} lengths (prompts mean {workload.isl:.0f}, outputs "
          f"mean {workload.osl:.0f}, {np.mean(osl <= 5):.0%} of outputs 5 tokens or fewer); SLO "
          f"{args.ttft_ms:g} / {args.itl_ms:g} ms; model: {fitted.source} profile, stall weight "
          f"{fitted.params.itl_stall_weight:g} as fitted, {args.stall_weight:g} set")
    for w, prof in ((fitted.params.itl_stall_weight, fitted), (args.stall_weight, stalled)):
        cap = capacity_mix(prof, mix, ttft_p99_ms=args.ttft_ms, itl_p99_ms=args.itl_ms)
        print(f"  model, stall weight {w:g}: capacity {cap.max_rps:.2f} rps per replica ({cap.binding} binds)")
    for rate in (float(r) for r in args.rates.split(",")):
        t, arrivals = 0.0, []
        for g, (p, o) in zip(gaps, sample, strict=True):
            t += g / rate
            arrivals.append((t, p, o))
        ttft, tpot = replay_on_core(params, arrivals, seed=0)
        ttft, tpot = ttft[warm:], tpot[warm:]
        out = np.array([o for _, _, o in arrivals])[warm:]
        t_miss = ttft * 1000.0 > args.ttft_ms
        i_miss = ~np.isnan(tpot) & (tpot * 1000.0 > args.itl_ms)
        by = []
        for lo, hi in OUTPUT_CLASSES:
            sel = (out >= lo) & (out <= (hi if hi is not None else np.inf))
            by.append(f"{lo}-{hi if hi is not None else ''} tokens {sel.mean():.0%} of requests, "
                      f"{i_miss[sel].mean():.1%} miss, {i_miss[sel].sum() / max(i_miss.sum(), 1):.0%} of ITL misses")
        print(f"{rate:g} rps: truth TTFT misses {t_miss.mean():.2%}, ITL misses {i_miss.mean():.2%}, ITL p99 "
              f"{np.nanquantile(tpot, 0.99) * 1000:.0f} ms | " + "; ".join(by))
        for w, prof in ((fitted.params.itl_stall_weight, fitted), (args.stall_weight, stalled)):
            a = attainment_mix(prof, mix, rate, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms)
            pr = predict_mix(prof, mix, rate)
            print(f"    model, stall weight {w:g}: ITL p99 {pr.itl_p99_ms:.0f} ms, within both {a.share:.2%} "
                  f"(TTFT {a.ttft_share:.2%}, ITL {a.itl_share:.2%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
