"""`fleetplan models fit | predict | capacity`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any


def register(subparsers: Any) -> None:
    models = subparsers.add_parser("models", help="fit and query engine performance models")
    sub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)

    fit = sub.add_parser("fit", help="fit performance profiles to benchmark files",
                         description="Fit one profile per (model, engine, GPU, TP, precision) found in the "
                                     "benchmark files; bad files are listed and skipped.")
    fit.add_argument("paths", nargs="+", metavar="PATH", help="benchmark files or directories")
    _meta_args(fit)
    fit.add_argument("--aliases", metavar="FILE", help="YAML mapping canonical model name -> [spellings]")
    fit.add_argument("--out", required=True, metavar="PROFILES.json", help="where to write the profiles")
    fit.add_argument("--no-loo", action="store_true", help="skip the leave-one-out error (faster)")
    fit.set_defaults(handler=_fit)

    predict = sub.add_parser("predict", help="TTFT/ITL/throughput at a rate or a concurrency")
    _query_args(predict)
    load = predict.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, metavar="RPS", help="open-loop request rate (req/s)")
    load.add_argument("--concurrency", type=float, metavar="C", help="closed-loop concurrent requests")
    predict.set_defaults(handler=_predict)

    cap = sub.add_parser("capacity", help="largest request rate of one replica under TTFT/ITL p99 targets")
    _query_args(cap)
    cap.add_argument("--ttft-p99-ms", type=float, required=True, metavar="X")
    cap.add_argument("--itl-p99-ms", type=float, required=True, metavar="Y")
    cap.set_defaults(handler=_capacity)
    from fleetplan.harness.cli.models_disagg import disagg_args

    disagg_args(cap)


def _meta_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", help="engine of files that do not say (vllm, trtllm)")
    p.add_argument("--gpu", help="GPU type of files that do not say (h100, h200, ...)")
    p.add_argument("--tp", type=int, help="tensor-parallel size of files that do not say")
    p.add_argument("--precision", help="precision of files that do not say (bf16, fp8, ...)")
    p.add_argument("--model", help="model of files that do not say")


def _query_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profiles", required=True, metavar="F", help="PROFILES.json from `models fit`")
    p.add_argument("--model", required=True)
    p.add_argument("--engine", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--precision")
    p.add_argument("--isl", type=float, required=True, metavar="N", help="mean prompt tokens")
    p.add_argument("--osl", type=float, required=True, metavar="N", help="mean output tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _err(msg: str) -> int:
    print(f"fleetplan models: {msg}", file=sys.stderr)
    return 2


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _fit(args: argparse.Namespace) -> int:
    from fleetplan.models.bench import Metadata
    from fleetplan.models.fit import FitFailure, fit_profile, group_points
    from fleetplan.models.names import (
        ModelAliases,
        UnknownNameError,
        parse_engine,
        parse_gpu,
        parse_precision,
    )
    from fleetplan.models.profile import ProfileSet
    from fleetplan.shared.benchfiles import load_aliases, read_benchmark_paths, save_profiles

    try:
        meta = Metadata(
            model=args.model,
            engine=parse_engine(args.engine) if args.engine else None,
            gpu=parse_gpu(args.gpu) if args.gpu else None,
            tp=args.tp,
            precision=parse_precision(args.precision) if args.precision else None,
        )
        aliases = load_aliases(args.aliases) if args.aliases else ModelAliases()
    except (UnknownNameError, ValueError) as exc:
        return _err(str(exc))
    if args.tp is not None and args.tp < 1:
        return _err(f"--tp must be >= 1, got {args.tp}")
    outcome = read_benchmark_paths(args.paths, meta, aliases)
    for line in outcome.bad:
        print(f"skipped: {line}")
    for line in outcome.row_problems:
        print(f"skipped row: {line}")
    profiles = []
    header = f"{'profile':58} {'points':>6} {'sat':>4} {'TTFT':>7} {'ITL':>7} {'tput':>7}"
    rows: list[str] = []
    for key, points in sorted(group_points(outcome.points).items(), key=lambda kv: kv[0].label()):
        try:
            report = fit_profile(key, points, loo=not args.no_loo)
        except FitFailure as exc:
            print(f"not fitted: {exc}")
            continue
        profiles.append(report.profile)
        e = report.profile.fit_error
        rows.append(f"{key.label():58} {report.points_used:>6} {report.saturated_points:>4} "
                    f"{_fmt_pct(e.ttft_mape if e else None):>7} {_fmt_pct(e.itl_mape if e else None):>7} "
                    f"{_fmt_pct(e.throughput_mape if e else None):>7}")
    print(f"read {outcome.files_read} files, {len(outcome.points)} points; skipped {len(outcome.bad)} files")
    if not profiles:
        print("nothing could be fitted", file=sys.stderr)
        return 1
    print("leave-one-out MAPE (sat: saturated points, used for throughput only):")
    print(header)
    print("\n".join(rows))
    try:
        save_profiles(args.out, ProfileSet(tuple(profiles)))
    except OSError as exc:
        return _err(f"{args.out}: cannot write profiles: {exc.strerror or exc}")
    print(f"wrote {len(profiles)} profiles to {args.out}")
    return 0


def _lookup(args: argparse.Namespace) -> tuple[Any, int]:
    from fleetplan.models.names import UnknownNameError, parse_engine, parse_gpu, parse_precision
    from fleetplan.models.profile import ConfigKey, Workload, roofline_profile
    from fleetplan.shared.benchfiles import ProfilesFileError, load_profiles

    try:
        engine, gpu = parse_engine(args.engine), parse_gpu(args.gpu)
        precision = parse_precision(args.precision) if args.precision else None
    except UnknownNameError as exc:
        return None, _err(str(exc))
    if args.tp < 1:
        return None, _err(f"--tp must be >= 1, got {args.tp}")
    if not (args.isl >= 0 and args.osl >= 1 and math.isfinite(args.isl + args.osl)):
        return None, _err(f"--isl {args.isl} --osl {args.osl}: need isl >= 0 and osl >= 1")
    try:
        profiles = load_profiles(args.profiles)
    except ProfilesFileError as exc:
        return None, _err(str(exc))
    profile = profiles.get(args.model, engine, gpu, args.tp, precision)
    extra: list[str] = []
    if profile is None:
        prior = roofline_profile(ConfigKey(args.model, engine, gpu, args.tp, precision or _default_precision(gpu)))
        if prior is None:
            known = ", ".join(k.label() for k in profiles.keys()) or "none"
            return None, _err(f"{args.profiles}: no profile for {args.model}/{engine.value}/{gpu.value}x{args.tp}"
                              f"{'/' + precision.value if precision else ''} and no roofline prior "
                              f"(unknown architecture); profiles: {known}")
        profile = prior
        extra.append(f"no fitted profile in {args.profiles}; using the roofline prior")
    return (profile, Workload(args.isl, args.osl), extra), 0


def _default_precision(gpu: Any) -> Any:
    from fleetplan.models.names import GpuType, Precision

    return Precision.BF16 if gpu in (GpuType.A100, GpuType.RTX4090) else Precision.FP8


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _predict(args: argparse.Namespace) -> int:
    from fleetplan.models.profile import predict

    found, code = _lookup(args)
    if found is None:
        return code
    profile, workload, extra = found
    if args.rate is not None and not args.rate >= 0:
        return _err(f"--rate must be >= 0, got {args.rate}")
    if args.concurrency is not None and not args.concurrency > 0:
        return _err(f"--concurrency must be > 0, got {args.concurrency}")
    pred = predict(profile, workload, rate_rps=args.rate, concurrency=args.concurrency)
    warnings = [*extra, *pred.warnings]
    doc = {
        "profile": profile.key.label(),
        "ttft_ms": {"mean": _num(pred.ttft.mean_ms), "p50": _num(pred.ttft.p50_ms), "p99": _num(pred.ttft.p99_ms)},
        "itl_ms": {"mean": _num(pred.itl.mean_ms), "p50": _num(pred.itl.p50_ms), "p99": _num(pred.itl.p99_ms)},
        "output_tok_s": _num(pred.output_tok_s),
        "request_rps": _num(pred.request_rps),
        "concurrency": _num(pred.concurrency),
        "saturated": pred.saturated,
        "warnings": warnings,
    }
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"profile {doc['profile']}  isl={workload.isl:g} osl={workload.osl:g}")
    for name in ("ttft_ms", "itl_ms"):
        stats = doc[name]
        assert isinstance(stats, dict)
        print(f"  {name:8} " + "  ".join(f"{k}={'inf' if v is None else f'{v:.1f}'}" for k, v in stats.items()))
    print(f"  output_tok_s={pred.output_tok_s:.1f} request_rps={pred.request_rps:.3f}")
    for w in warnings:
        print(f"  warning: {w}")
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from fleetplan.models.profile import capacity

    if not (args.ttft_p99_ms > 0 and args.itl_p99_ms > 0):
        return _err(f"--ttft-p99-ms and --itl-p99-ms must be > 0, got {args.ttft_p99_ms}, {args.itl_p99_ms}")
    found, code = _lookup(args)
    if found is None:
        return code
    profile, workload, extra = found
    if args.disagg:
        from fleetplan.harness.cli.models_disagg import capacity_disagg

        return capacity_disagg(args, profile, workload, extra, _err)
    cap = capacity(profile, workload, ttft_p99_ms=args.ttft_p99_ms, itl_p99_ms=args.itl_p99_ms)
    doc = {"max_rps": cap.max_rps, "binding": cap.binding.value, "profile": profile.key.label(),
           "warnings": [*extra, *cap.warnings]}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"profile {doc['profile']}: max {cap.max_rps:.3f} req/s per replica (binding: {cap.binding.value})")
        for w in doc["warnings"]:
            print(f"  warning: {w}")
    return 0
