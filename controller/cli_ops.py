"""Commands for on-call: pause, resume (actuation, through the report API) and history (the audit
trail, read from the state store).

register() stays light: httpx and the store are imported in handlers.
"""

from __future__ import annotations

import argparse
import os
import sys

from controller.cli_daemon import DEFAULT_REPORT


def _api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"report API (default $FLEETPLAN_REPORT_URL, else {DEFAULT_REPORT})")
    p.add_argument("--token", default=None, help="bearer token (default $FLEETPLAN_REPORT_TOKEN)")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pause", help="stop the controller acting (from its next cycle; survives restarts)")
    _api_args(p)
    p.add_argument("--reason", default="", help="why (shown in reports)")
    p.set_defaults(handler=_pause, paused=True)

    p = sub.add_parser("resume", help="let a paused controller act again (from its next cycle)")
    _api_args(p)
    p.set_defaults(handler=_pause, paused=False, reason="")


def _pause(args: argparse.Namespace) -> int:
    from controller.report import post

    url = args.url or os.environ.get("FLEETPLAN_REPORT_URL") or DEFAULT_REPORT
    token = args.token or os.environ.get("FLEETPLAN_REPORT_TOKEN")
    path = "/api/pause" if args.paused else "/api/resume"
    try:
        state = post(url, path, {"reason": args.reason} if args.reason else {}, token)
    except RuntimeError as exc:
        print(f"fleetplan {'pause' if args.paused else 'resume'}: {exc}", file=sys.stderr)
        return 1
    if state.get("paused"):
        print("actuation paused (from the next cycle on; `fleetplan resume` to act again)"
              + (f": {state['reason']}" if state.get("reason") else ""))
    else:
        print("actuation resumed (from the next cycle on)")
    if state.get("mode") == "advisory":
        print("note: the policy's mode is advisory: the controller acts on nothing until it is `active`")
    return 0
