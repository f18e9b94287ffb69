"""Commands: controller, report, explain, observe, demo.

register() stays light: the daemon, aiohttp, httpx and the planner are imported in handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from fleetplan.harness.cli.ops import DEFAULT_REPORT
from fleetplan.harness.cli.sim import _positive_float


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("controller", help="run the controller daemon (observe -> plan -> act)")
    p.add_argument("--policy", required=True, help="policy YAML (reloaded on SIGHUP)")
    p.add_argument("--profiles", default=None, help="PROFILES.json from `fleetplan models fit`")
    p.add_argument("--state-db", default="/var/lib/fleetplan/state.db", help="SQLite state file")
    p.add_argument("--report-listen", default="127.0.0.1:9470", help="HOST:PORT of the report API")
    p.add_argument("--report-token-file", default=None,
                   help="file holding the bearer token (required when --report-listen is not loopback)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated clock runs K x wall time (lab/demo); cycle and delays shrink by K")
    p.add_argument("--config", default=None,
                   help="controller YAML (prometheus_url, mqtt, routing paths; default "
                   "/etc/fleetplan/controller.yaml when it exists); see docs/controller.md")
    p.add_argument("--once", action="store_true", help="run one cycle and exit")
    p.set_defaults(handler=_controller)

    p = sub.add_parser("report", help="what the controller did and why (from its report API)")
    p.add_argument("--url", default=None,
                   help=f"report API (default $FLEETPLAN_REPORT_URL, else {DEFAULT_REPORT})")
    p.add_argument("--token", default=None, help="bearer token (default $FLEETPLAN_REPORT_TOKEN)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_report)

    p = sub.add_parser("explain", help="why MODEL has the replicas it has")
    p.add_argument("model")
    p.add_argument("--url", default=None,
                   help=f"report API (default $FLEETPLAN_REPORT_URL, else {DEFAULT_REPORT})")
    p.add_argument("--token", default=None, help="bearer token (default $FLEETPLAN_REPORT_TOKEN)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_explain)

    p = sub.add_parser("observe", help="what the controller sees in Prometheus per model right now")
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--window", type=float, default=60.0, help="rate window, seconds (default 60)")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide rates by K (lab)")
    p.add_argument("--model", action="append", default=[], help="also list this model when absent")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_observe)

    p = sub.add_parser("demo", help="the whole loop on a simulated lab (needs nothing outside the repo)")
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--trace", default=None, help="replay this trace instead of a generated day")
    p.add_argument("--minutes", type=float, default=3.0, help="wall minutes of replay (default 3)")
    p.add_argument("--speed", type=float, default=20.0, help="time compression (default 20x)")
    p.add_argument("--peak-rps", type=_positive_float, default=2.0,
                   help="the generated day's afternoon peak, simulated requests/s (default 2)")
    p.add_argument("--base-rps", type=_positive_float, default=0.1,
                   help="the generated day's night trough, simulated requests/s (default 0.1)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--keep", action="store_true", help="leave the working directory in place")
    p.add_argument("--no-real-day", dest="real_day", action="store_false",
                   help="skip the replay of the generated day at its real length (24 h; a few minutes)")
    p.set_defaults(handler=_demo)


def _observe(args: argparse.Namespace) -> int:
    from fleetplan.controller.observe import Observer, ObserverConfig, PromClient, render_snapshot

    async def run() -> int:
        async with PromClient(args.prometheus) as client:
            cfg = ObserverConfig(window_s=args.window, time_scale=args.time_scale, history_s=600.0)
            snap = await Observer(client, cfg).snapshot(args.model, with_history=False)
        if args.json:
            print(json.dumps(snap.to_json(), indent=2))
        else:
            print(render_snapshot(snap))
        return 0 if snap.prometheus_ok else 1

    return asyncio.run(run())


def _controller(args: argparse.Namespace) -> int:
    from fleetplan.controller.runner import run_from_args
    from fleetplan.harness.lab import settings_from_lab

    return int(run_from_args(args, prepare=settings_from_lab))


def _fetch_report(args: argparse.Namespace, command: str) -> dict[str, Any] | None:
    """The report API's document (flags first, then the environment, then the default URL), or None
    after printing why it could not be fetched."""
    from fleetplan.controller.report import fetch

    url = args.url or os.environ.get("FLEETPLAN_REPORT_URL") or DEFAULT_REPORT
    token = args.token or os.environ.get("FLEETPLAN_REPORT_TOKEN")
    try:
        return fetch(url, "/api/report", token)
    except RuntimeError as exc:
        print(f"fleetplan {command}: {exc}", file=sys.stderr)
        return None


def _report(args: argparse.Namespace) -> int:
    from fleetplan.controller.report import render_report

    data = _fetch_report(args, "report")
    if data is None:
        return 1
    print(json.dumps(data, indent=2) if args.json else render_report(data))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from fleetplan.controller.report import render_explain

    data = _fetch_report(args, "explain")
    if data is None:
        return 1
    text = render_explain(data, args.model)
    if text is None:
        print(f"fleetplan explain: model {args.model!r} is not in the current plan", file=sys.stderr)
        return 1
    print(json.dumps(data.get("plan", {}), indent=2) if args.json else text)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from fleetplan.harness.demo import run_demo

    return int(run_demo(args))
