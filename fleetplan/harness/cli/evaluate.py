"""`fleetplan evaluate`: replay a trace through a simulated fleet under every policy.

    fleetplan evaluate --trace FILE --policy P.yaml --profiles PROFILES.json [--json] [--out DIR]
                       [--day-s S] [--rate-scale R] [--model M] [--policies a,b,...] [--workers N | --ray ADDRESS]
                       [--controller-config controller.yaml [--time-scale K]] [--scrape-interval-s S]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="replay a trace through a simulated fleet: fleetplan vs baselines vs the oracle",
        description="Discrete-event replay of a trace (Azure CSV, Mooncake JSONL, BurstGPT CSV) on the "
        "simulator's ground truth, under fleetplan, its single-engine variants, static-peak, static-mean, "
        "hpa and the oracle bound. Prints a table (or --json) and writes charts to --out.",
    )
    p.add_argument("--trace", required=True, type=Path, help="trace file")
    p.add_argument("--policy", required=True, type=Path, help="policy YAML")
    p.add_argument("--profiles", required=True, type=Path, help="PROFILES.json (fleetplan models fit)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--out", type=Path, default=None, help="directory for evaluation.png/.html/.json")
    p.add_argument("--day-s", type=float, default=None,
                   help="shape the trace into a day of this many seconds (tile + diurnal time warp)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the arrival rate (tiles the trace; lengths kept)")
    p.add_argument("--model", default=None,
                   help="serve the whole trace as this policy model (default: the trace's model column, "
                   "else the policy's first model)")
    p.add_argument("--policies", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--workers", type=int, default=2, help="worker processes of this machine (default 2)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run the replays as tasks on the Ray cluster at ADDRESS instead (auto, ray://HOST:10001, "
                        "or local; needs the ray extra: pip install 'fleetplan[ray]'); the figures are the same")
    p.add_argument("--routing", choices=("least-loaded", "round-robin", "affinity"), default="least-loaded",
                   help="how the simulated router spreads requests: fewest in flight (default), round-robin, or "
                        "prefix/session affinity with a bound on imbalance (consistent hashing)")
    p.add_argument("--shared-engine-cache", action="store_true",
                   help="the hosts share one engine cache directory: a TensorRT-LLM engine built on one host "
                   "serves on every host of its GPU type (default: only where it was built)")
    p.add_argument("--controller-config", type=Path, default=None,
                   help="the daemon's controller config (YAML, as `fleetplan daemon --config`): the replay "
                        "reads its observation windows and waits its timeouts (default: the daemon's defaults)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="with --controller-config: its wall seconds are this many simulated seconds (a lab whose "
                        "engines run K x faster, as the demo's; default 1)")
    p.add_argument("--scrape-interval-s", type=float, default=None,
                   help="your Prometheus' scrape_interval for the engines, in the config's wall seconds "
                        "(default 15); a controller config whose peak_window_s is shorter than two of them is refused")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="engines compute every prompt in full (default: their prefix caches hold the trace's "
                        "shared prompt blocks, where the trace has them)")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from fleetplan.harness.replay_settings import replay_settings
    from fleetplan.planner.policy import PolicyError, load_policy_text
    from fleetplan.shared.atomic import atomic_write_text
    from fleetplan.shared.benchfiles import load_profiles
    from fleetplan.sim.evaluate import (
        EvaluateError,
        EvaluateOptions,
        evaluate,
        parse_policy_list,
        render_table,
        write_charts,
    )
    from fleetplan.sim.jobs import JobsError
    from fleetplan.sim.traces import TraceError, block_reuse_share, read_trace, reshape, shape_day

    try:
        policies = parse_policy_list(args.policies)
        if args.rate_scale <= 0:
            raise EvaluateError(f"--rate-scale must be > 0, got {args.rate_scale}")
        if not args.time_scale > 0:
            raise EvaluateError(f"--time-scale must be > 0, got {args.time_scale}")
        if args.time_scale != 1.0 and args.controller_config is None:
            raise EvaluateError("--time-scale scales the wall seconds of --controller-config; give both")
        if args.day_s is not None and args.day_s <= 0:
            raise EvaluateError(f"--day-s must be > 0, got {args.day_s}")
        try:
            policy_text = args.policy.read_text(encoding="utf-8")
        except OSError as exc:
            raise EvaluateError(f"{args.policy}: cannot read policy ({exc.strerror or exc})") from None
        policy = load_policy_text(policy_text, str(args.policy))
        profiles = load_profiles(args.profiles)
        trace = read_trace(args.trace)
        info: dict[str, Any] = {"file": str(args.trace), "requests_in_file": len(trace.requests),
                                "skipped_rows": trace.skipped, "rate_scale": args.rate_scale,
                                # the prefix-cache hit-rate bound: one replica, unlimited cache (in blocks)
                                "block_reuse_share": _round4(block_reuse_share(trace.requests)),
                                "day_s": args.day_s,
                                "controller_config": None if args.controller_config is None else str(args.controller_config),
                                "time_scale": args.time_scale}
        if args.day_s is not None:
            trace = shape_day(trace, args.day_s, args.rate_scale)
        elif args.rate_scale != 1.0:
            trace = reshape(trace, duration_s=trace.duration_s, rate_scale=args.rate_scale)
        from fleetplan.sim.router import RouteMode

        replay = replay_settings(_controller_settings(args.controller_config), time_scale=args.time_scale,
                                 scrape_interval_s=args.scrape_interval_s, routing=RouteMode(args.routing), prefix_cache=not args.no_prefix_cache,
                                 shared_engine_cache=args.shared_engine_cache)
        ev = evaluate(trace, policy, profiles,
                      EvaluateOptions(policies=policies, model=args.model, workers=max(1, args.workers),
                                      ray_address=args.ray, settings=replay.sim, control=replay.control),
                      trace_info=info,
                      progress=lambda line: print(f"fleetplan evaluate: {line}", file=sys.stderr, flush=True))
    except (EvaluateError, TraceError, PolicyError, JobsError, ValueError) as exc:
        print(f"fleetplan evaluate: {exc}", file=sys.stderr)
        return 2
    doc = ev.to_json()
    if args.out is not None:
        png, html = write_charts(ev, args.out)
        atomic_write_text(args.out / "evaluation.json", json.dumps(doc, indent=2) + "\n")
        doc["trace"]["charts"] = {"png": str(png), "html": str(html)}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(ev))
        if args.out is not None:
            print(f"charts: {args.out / 'evaluation.png'} {args.out / 'evaluation.html'}")
    return 0


def _round4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _controller_settings(path: Path | None) -> Any:
    """The daemon's controller config at `path` (its defaults when None), read as the daemon reads it."""
    from fleetplan.controller.settings import ControllerSettings, SettingsError, load_settings
    from fleetplan.sim.evaluate import EvaluateError

    if path is None:
        return ControllerSettings()
    try:
        return load_settings(path)
    except SettingsError as exc:  # its message names the file, the field and the value
        raise EvaluateError(f"--controller-config {exc}") from None
