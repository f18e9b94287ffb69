"""Aggregated or disaggregated serving on a trace's length mix: GPUs of each fleet by rate, ITL target and link.

The mix is read from a trace's request lengths (default: data/traces/coding_like_hour.jsonl, prompts
mean ~2,200 tokens, outputs mean ~28) at the quantile levels the planner reads from histograms
(models.mix.QUANTILE_LEVELS); the profile is the roofline prior of the configuration (or a fitted one
from --profiles). Each row: one replica's capacity aggregated, in a prefill and in a decode pool,
the GPUs of both fleets at the rate (with the headroom), the cheaper one, and what would flip it.
`--stall-weight W` also prints every row with the profile's prefill-stall weight set to W (the fit's
prior is 1.0; a roofline prior has 0: the per-request ITL then sees prefill only through the step time).

`--fit-sim`: the profile is instead fitted on the simulator's ground truth for the trace's lengths
(`fleetplan.sim.evaluate.profiles_from_ground_truth`, what `fleetplan evaluate` plans with; ~20 s).
`--truth`: also the simulator's own capacities (`fleetplan.sim.core.capacity_at_slo`, median of 3):
an aggregated replica at both targets, and a prefill-only replica (one output token) at the TTFT
target less the NVLink transfer and the decode side's join, and the GPUs of each fleet with the
model's decode pool (the simulator has no decode-only engine; ~1 min).

    .venv/bin/python bench/disagg_choice.py [--trace FILE] [--model llama-3-8b] [--gpu h100] [--tp 1]
        [--engine vllm] [--profiles P | --fit-sim] [--rates 5,20] [--ttft-ms 500] [--itl-ms 50,20]
        [--links host,ib400,eth25] [--headroom 0.2] [--price 3.0] [--stall-weight 1.0] [--truth] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from fleetplan.models import disagg
from fleetplan.models.mix import LengthMix
from fleetplan.models.names import Precision, parse_engine, parse_gpu
from fleetplan.models.profile import ConfigKey, PerfProfile, roofline_profile
from fleetplan.planner.disagg_choice import choose_serving
from fleetplan.shared.benchfiles import load_profiles
from fleetplan.sim.evaluate import trace_workload
from fleetplan.sim.traces import read_trace

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "data" / "traces" / "coding_like_hour.jsonl"


def trace_mix(path: Path) -> LengthMix:
    """The trace's length mix as the controller reads it (`fleetplan.sim.evaluate.trace_workload`)."""
    mix = trace_workload(read_trace(path).as_single_model("m"), "m").mix
    assert mix is not None
    return mix


def _link(name: str, key: ConfigKey) -> disagg.KvLink:
    if name == "host":
        return disagg.host_link(key.gpu)
    return {"ib400": disagg.IB_NDR_400G, "eth100": disagg.ETH_100G, "eth25": disagg.ETH_25G}[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--profiles", type=Path, help="PROFILES.json (default: the roofline prior)")
    ap.add_argument("--rates", default="5,20")
    ap.add_argument("--ttft-ms", type=float, default=500.0)
    ap.add_argument("--itl-ms", default="50,20")
    ap.add_argument("--links", default="host,ib400,eth25")
    ap.add_argument("--headroom", type=float, default=0.2)
    ap.add_argument("--price", type=float, default=3.0)
    ap.add_argument("--stall-weight", type=float)
    ap.add_argument("--fit-sim", action="store_true")
    ap.add_argument("--truth", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    key = ConfigKey(args.model, parse_engine(args.engine), parse_gpu(args.gpu), args.tp, Precision.BF16)
    prof: PerfProfile | None = None
    if args.profiles is not None:
        prof = load_profiles(args.profiles).get(args.model, key.engine, key.gpu, key.tp)
    lengths = [(r.prompt_tokens, r.output_tokens) for r in read_trace(args.trace).requests]
    if args.fit_sim:
        from fleetplan.sim.evaluate import profiles_from_ground_truth

        itl0 = float(args.itl_ms.split(",")[0])
        prof = profiles_from_ground_truth([key], lengths, args.ttft_ms, itl0).get(args.model, key.engine, key.gpu,
                                                                                 key.tp)
    prof = prof or roofline_profile(key)
    if prof is None:
        print(f"no profile for {key.label()}", file=sys.stderr)
        return 2
    mix = trace_mix(args.trace)
    isl_p99 = None
    if prof.data_range is not None and prof.data_range.length_spread:  # as the planner does (capacity.mix_for)
        isl_p99 = mix.isl_quantile(0.99)
        mix = LengthMix.single(mix.mean().isl, mix.mean().osl)
    variants = [("profile", prof)]
    if args.stall_weight is not None:
        variants.append((f"stall {args.stall_weight:g}",
                         replace(prof, params=replace(prof.params, itl_stall_weight=args.stall_weight))))
    rows = []
    for label, p in variants:
        for itl in (float(v) for v in args.itl_ms.split(",")):
            for link_name in args.links.split(","):
                link = _link(link_name, key)
                for rate in (float(v) for v in args.rates.split(",")):
                    c = choose_serving(p, mix, rate, ttft_p99_ms=args.ttft_ms, itl_p99_ms=itl, link=link,
                                       price_usd_h=args.price, headroom=args.headroom, transfer_isl_p99=isl_p99)
                    d = c.disaggregated
                    assert d is not None and c.flips is not None
                    rows.append({"variant": label, "itl_ms": itl, "link": link_name, "rate_rps": rate,
                                 "agg_rps": c.aggregated.capacity_rps, "agg_binding": c.aggregated.binding,
                                 "prefill_rps": d.prefill.capacity_rps, "decode_rps": d.decode.capacity_rps,
                                 "prefill_reachable": d.prefill.reachable,
                                 "agg_gpus": c.aggregated.gpus, "disagg_gpus": d.gpus, "ratio": d.ratio(),
                                 "transfer_p99_ms": d.transfer_p99_ms, "chosen": c.chosen.value,
                                 "flip_rate_rps": c.flips.rate_rps, "flip_isl_scale": c.flips.isl_scale,
                                 "flip_link_gb_s": c.flips.link_gb_s})
    truth = _truth(args, key, lengths, prof, mix, isl_p99) if args.truth else []
    if args.json:
        print(json.dumps({"profile": prof.key.label(), "source": prof.source, "mix": mix.describe(), "rows": rows,
                          "truth": truth}))
        return 0
    print(f"{prof.key.label()} ({prof.source}); mix {mix.describe()}; TTFT p99 {args.ttft_ms:g} ms, "
          f"headroom {args.headroom:g}")
    print(f"{'variant':10} {'ITL':>4} {'link':6} {'rps':>4} {'agg/rep':>12} {'pre/rep':>7} {'dec/rep':>7} "
          f"{'xfer99':>7} {'aggGPU':>6} {'disGPU':>6} {'P:D':>5} {'chosen':>13}  flips (rate, isl x, link GB/s)")
    for r in rows:
        f = [("-" if r[k] is None else f"{r[k]:.3g}") for k in ("flip_rate_rps", "flip_isl_scale", "flip_link_gb_s")]
        print(f"{r['variant']:10} {r['itl_ms']:>4g} {r['link']:6} {r['rate_rps']:>4g} "
              f"{r['agg_rps']:>6.2f} {r['agg_binding']:>5} {r['prefill_rps']:>6.2f}{' ' if r['prefill_reachable'] else '*'}"
              f" {r['decode_rps']:>7.1f} "
              f"{r['transfer_p99_ms']:>7.1f} {r['agg_gpus']:>6} {r['disagg_gpus']:>6} {r['ratio']:>5} "
              f"{r['chosen']:>13}  {', '.join(f)}")
    print("* the TTFT target is out of the prefill pool's reach for this mix (sized from its floor share)")
    for t in truth:
        print(f"truth: ITL {t['itl_ms']:g} ms: aggregated {t['agg_rps']:.2f} rps a replica, prefill-only "
              f"{t['prefill_rps']:.2f}, decode (model) {t['decode_rps']:.1f}; GPUs aggregated / disaggregated: "
              + ", ".join(f"{g['rate_rps']:g} rps {g['agg_gpus']} / {g['disagg_gpus']}" for g in t["gpus"]))
    return 0


def _truth(args: argparse.Namespace, key: ConfigKey, lengths: list[tuple[int, int]], prof: PerfProfile,
           mix: LengthMix, isl_p99: float | None) -> list[dict[str, object]]:
    from fleetplan.sim.core import capacity_at_slo
    from fleetplan.sim.groundtruth import build_params

    params = build_params(key.engine, key.model, key.gpu, key.tp, key.precision)
    link = disagg.host_link(key.gpu)
    bytes_per_token = disagg.kv_bytes_per_token(key) or 0.0
    transfer = disagg.kv_transfer_ms(bytes_per_token, float(np.quantile([p for p, _ in lengths], 0.99)), link, key.tp)
    out: list[dict[str, object]] = []
    for itl in (float(v) for v in args.itl_ms.split(",")):
        agg = capacity_at_slo(params, lengths, args.ttft_ms, itl, repeats=3)
        join = prof.params.ttft_fixed_ms + itl / prof.params.itl_p99_factor
        pre = capacity_at_slo(params, [(p, 1) for p, _ in lengths], args.ttft_ms - transfer - join, 1e9, repeats=3)
        dec = disagg.disagg_capacity(disagg.pool_profiles(prof), mix, ttft_p99_ms=args.ttft_ms, itl_p99_ms=itl,
                                     link=link, transfer_isl_p99=isl_p99)
        dec_rps = dec.decode.max_rps if dec is not None else float("inf")
        gpus = []
        for rate in (float(v) for v in args.rates.split(",")):
            need = rate * (1.0 + args.headroom)
            gpus.append({"rate_rps": rate, "agg_gpus": disagg.replicas_for(need, agg) * key.tp,
                         "disagg_gpus": (disagg.replicas_for(need, pre) + disagg.replicas_for(need, dec_rps)) * key.tp})
        out.append({"itl_ms": itl, "agg_rps": agg, "prefill_rps": pre, "decode_rps": dec_rps, "gpus": gpus})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
