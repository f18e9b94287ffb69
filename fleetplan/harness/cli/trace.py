"""`fleetplan trace`: build traces that `fleetplan evaluate --trace` replays.

    fleetplan trace build --shape week|day [--day D] [--rate-scale X | --requests-per-day N]
                          [--source azure|mooncake|FILE] [--week-rate FILE] --seed N --out FILE
    fleetplan trace coding [--mean-rps R] [--peak-to-mean X] [--duration-s S] --seed N --out FILE
    fleetplan trace from-prometheus --prometheus URL --start T --end T --model M --out FILE
                          [--step S] [--length-window-s S] [--seed N]   (cli/trace_prom.py)

Every trace is Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids where known),
written atomically; what it was built from is printed and written next to it as FILE.info.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# the repository's data/ (data/SOURCES.md), where the public logs and the week's rate travel
DATA = Path(__file__).resolve().parents[3] / "data"
SOURCES = {"azure": "azure_llm_conv_2023.csv", "mooncake": "mooncake_conversation.jsonl"}
WEEK_RATE = "azure_llm_conv_2024_week_rate.csv"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="build traces: a real week's shape, a coding-like hour, your Prometheus",
                              description="Build request traces for `fleetplan evaluate --trace`.")
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    b = sub.add_parser("build", help="a day or a week on the Azure conversation service's week (2024) from a "
                                     "public request log's bursts, lengths and conversations")
    b.add_argument("--shape", choices=("week", "day"), required=True)
    b.add_argument("--day", type=int, default=2, help="with --shape day: 0 = Sunday 2024-05-12 .. 6 (default 2, Tuesday)")
    rate = b.add_mutually_exclusive_group()
    rate.add_argument("--rate-scale", type=float, default=None,
                      help="mean rate over the span = X x the source log's mean rate (default 1)")
    rate.add_argument("--requests-per-day", type=float, default=None, help="mean rate as requests per day")
    b.add_argument("--source", default="azure",
                   help="the request log: azure (Azure conversation 2023, 1 h) or mooncake (Kimi conversations "
                        "with prefix blocks, 1 h) from data/traces, or a trace FILE (Azure CSV, Mooncake JSONL, BurstGPT)")
    b.add_argument("--week-rate", type=Path, default=None, help=f"the week's rate CSV (default data/traces/{WEEK_RATE})")
    b.add_argument("--swing", type=float, default=None,
                   help="make the span's peak-to-trough of hourly means X (the week: 3.5; a coding service's: ~31): "
                        "the same hours, deeper nights (default: the week's own)")
    b.add_argument("--seed", type=int, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.set_defaults(handler=_build)
    c = sub.add_parser("coding", help="a bursty coding-assistant-like hour from mechanisms (edit bursts, burst "
                                      "episodes, IDE prompt budgets, short completions)")
    c.add_argument("--mean-rps", type=float, default=8.0)
    c.add_argument("--peak-to-mean", type=float, default=4.1, help="the highest aligned 60 s rate over the mean")
    c.add_argument("--duration-s", type=float, default=3600.0)
    c.add_argument("--seed", type=int, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.set_defaults(handler=_coding)
    from fleetplan.harness.cli import trace_prom  # light: its heavy imports live in its handler

    trace_prom.register(sub)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def write_stream(path: Path, chunks: Iterable[str]) -> int:
    """Write text chunks to `path` atomically (a temp file beside it, fsync, rename); returns bytes
    written. A trace of millions of requests is never held whole in memory."""
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    size = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for chunk in chunks:
                fh.write(chunk)
                size += len(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def write_info(out: Path, info: Mapping[str, Any]) -> Path:
    from fleetplan.shared.atomic import atomic_write_text

    side = out.with_name(out.name + ".info.json")
    atomic_write_text(side, json.dumps(info, indent=2, sort_keys=True) + "\n")
    return side


def _source_path(name: str) -> Path:
    return DATA / "traces" / SOURCES[name] if name in SOURCES else Path(name)


def _build(args: argparse.Namespace) -> int:
    import numpy as np

    from fleetplan.sim import trace_build as tb
    from fleetplan.sim.traces import TraceError, read_trace

    try:
        week = tb.read_week_rate(args.week_rate or DATA / "traces" / WEEK_RATE)
        shape = tb.Shape(args.shape)
        env = tb.envelope(week, shape, args.day)
        if args.swing is not None:
            if not args.swing >= 1.0:
                raise ValueError(f"--swing must be >= 1 (a peak-to-trough ratio of hourly means), got {args.swing}")
            env = tb.deepened(env, args.swing)
        src_path = _source_path(args.source)
        src = tb.source_log(read_trace(src_path))
        src_rps = len(src.offset_s) / (src.minutes * tb.MINUTE_S)
        if args.requests_per_day is not None:
            if not args.requests_per_day > 0:
                raise ValueError(f"--requests-per-day must be > 0, got {args.requests_per_day}")
            mean_rps = args.requests_per_day / 86400.0
        else:
            scale = 1.0 if args.rate_scale is None else args.rate_scale
            if not scale > 0:
                raise ValueError(f"--rate-scale must be > 0, got {scale}")
            mean_rps = scale * src_rps
        built = tb.build_on_shape(src, env, mean_rps, args.seed)
    except (TraceError, ValueError) as exc:
        print(f"fleetplan trace build: {exc}", file=sys.stderr)
        return 2
    write_stream(args.out, tb.jsonl_chunks(built))
    days = len(env) / tb.DAY_MINUTES
    info = {
        "kind": "shape", "shape": shape.value, "day": args.day if shape is tb.Shape.DAY else None, "seed": args.seed,
        "week_rate": week.source, "swing": round(tb.hourly_swing(env), 3), "source": str(src_path), "source_mean_rps": round(src_rps, 4),
        "mean_rps": round(mean_rps, 4), "requests_per_day": round(len(built) / days),
        "peak_to_mean_60s": round(tb.peak_to_mean(built.t_s, tb.MINUTE_S, len(env) * tb.MINUTE_S), 3),
        "source_minute_cv": {"raw": round(src.raw_cv, 4), "poisson": round(src.poisson_cv, 4),
                             "modulation": round(src.modulation_cv, 4)},
        "prefix_blocks": bool(src.block_span), **dict(built.info),
        "real": ["the week's rate (its 7.2-minute columns' medians)", "each request's second within its minute, "
                 "prompt and output lengths, conversations and prefix blocks (the source log's rows)",
                 "the minute-to-minute modulation (the source's, resampled in 15-minute blocks)"],
        "synthetic": ["which source rows fill which minute (lanes from random starts, thinned per conversation)",
                      "the joint of the week's shape with another service's bursts and lengths"],
    }
    side = write_info(args.out, info)
    hourly = np.bincount((built.t_s // 3600).astype(int), minlength=int(len(env) / 60))
    print(f"{args.out}: {len(built)} requests over {days:g} day(s), {info['requests_per_day']} a day, mean "
          f"{len(built) / (len(env) * 60):.2f} rps, busiest hour {hourly.max() / 3600:.2f} rps, quietest "
          f"{hourly.min() / 3600:.2f} rps, 60 s peak/mean {info['peak_to_mean_60s']}; {side}")
    return 0


def _coding(args: argparse.Namespace) -> int:
    import numpy as np

    from fleetplan.sim import trace_build as tb

    params = tb.CodingHour(duration_s=args.duration_s, mean_rps=args.mean_rps, peak_to_mean_60s=args.peak_to_mean)
    try:
        trace = tb.coding_hour(params, args.seed)
    except ValueError as exc:
        print(f"fleetplan trace coding: {exc}", file=sys.stderr)
        return 2
    write_stream(args.out, tb.jsonl_requests(trace.requests))
    t = np.array([r.t_s for r in trace.requests])
    p = np.array([r.prompt_tokens for r in trace.requests])
    o = np.array([r.output_tokens for r in trace.requests])
    info = {"kind": "coding", "seed": args.seed, "params": {k: getattr(params, k) for k in params.__dataclass_fields__},
            "requests": len(t), "mean_rps": round(len(t) / params.duration_s, 3),
            "peak_to_mean_60s": round(tb.peak_to_mean(t, tb.MINUTE_S, params.duration_s), 3),
            "prompt_mean": round(float(p.mean()), 1), "prompt_p99": float(np.percentile(p, 99)),
            "output_mean": round(float(o.mean()), 2), "output_p99": float(np.percentile(o, 99))}
    side = write_info(args.out, info)
    print(f"{args.out}: {len(t)} requests, {info['mean_rps']} rps, 60 s peak/mean {info['peak_to_mean_60s']}, prompts "
          f"mean {info['prompt_mean']} / p99 {info['prompt_p99']:.0f}, outputs mean {info['output_mean']}; {side}")
    return 0

