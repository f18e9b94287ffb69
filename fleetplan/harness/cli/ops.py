"""Commands for on-call: pause, resume (actuation, through the report API) and history (the audit
trail, read from the state store).

register() stays light: httpx and the store are imported in handlers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

DEFAULT_REPORT = "http://127.0.0.1:9470"  # the report API of a controller on this machine


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

    p = sub.add_parser("history", help="what the controller decided and did, and why (from its state store)")
    p.add_argument("--state-db", default="/var/lib/fleetplan/state.db", help="the controller's SQLite state file")
    p.add_argument("--since", default="24h", help="how far back (wall clock): 90s, 30m, 2h, 7d (default 24h)")
    p.add_argument("--model", default=None, help="only this model")
    p.add_argument("--all", action="store_true", help="also cycles that changed nothing")
    p.add_argument("--json", action="store_true", help="the decision records, one JSON object per line")
    p.set_defaults(handler=_history)


def _pause(args: argparse.Namespace) -> int:
    from fleetplan.controller.report import post

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


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")


def parse_duration_s(text: str) -> float:
    """"90s", "30m", "2h", "7d", "120" (seconds) -> seconds; ValueError names the value."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"--since {text!r}: expected a duration like 90s, 30m, 2h or 7d")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_history(decisions: Sequence[Mapping[str, Any]], actions: Sequence[Mapping[str, Any]], *,
                   model: str | None = None, changes_only: bool = True) -> str:
    """A readable timeline: per decision, what changed per model, the actions (with their final
    status), what was held back and why; housekeeping actions (no decision) in time order."""
    from fleetplan.planner.audit import timeline

    entries: list[tuple[float, int, list[str]]] = []
    for rec in timeline(decisions, actions, model=model, changes_only=changes_only):
        flags = [] if rec.get("mode") in (None, "active") else [f"mode {rec['mode']}"]
        if rec.get("paused"):
            flags.append("PAUSED")
        head = f"{_when(rec['created_s'])}  decision {rec['decision_id']}" + (f"  ({', '.join(flags)})" if flags else "")
        lines = [head]
        for name, mm in sorted((rec.get("models") or {}).items()):
            was, now = (rec.get("changed") or {}).get(name, (None, None))
            change = f"replicas {was if was is not None else '?'} -> {now}" if name in (rec.get("changed") or {}) \
                else f"replicas {mm.get('replicas')}"
            lines.append(f"  {name}: {change}; demand {_f(mm.get('demand_rps'))} rps (observed "
                         f"{_f(mm.get('observed_rps'))}, forecast {_f(mm.get('forecast_rps'))}), required "
                         f"{_f(mm.get('required_rps'))}, capacity {_f(mm.get('capacity_rps'))} rps, "
                         f"${_f(mm.get('usd_h'))}/h")
        for a in rec.get("action_rows", []):
            detail = f" [{a['detail']}]" if a.get("detail") else ""
            lines.append(f"  {a['kind']:<6} {a.get('replica_id') or '-':<10} {a.get('host') or '-':<10} "
                         f"{a['status']:<9} {a.get('reason') or ''}{detail}")
        for h in rec.get("held", []):
            lines.append(f"  held   {h.get('replica_id') or '-':<10} {h.get('kind')}: held back by {h.get('limit')}: "
                         f"{h.get('detail')}")
        why = [w for w in rec.get("why", []) if model is None or model in w]
        for w in why[:4]:
            lines.append(f"  why: {w}")
        entries.append((float(rec["created_s"]), 0, lines))
    for a in actions:
        if a.get("cycle_id") is not None or (model is not None and a.get("model") != model):
            continue
        entries.append((float(a["created_s"]), 1, [
            f"{_when(a['created_s'])}  {a['kind']} {a.get('replica_id') or '-'} on {a.get('host') or '-'} "
            f"{a['status']} (no decision: {a.get('reason') or 'housekeeping'})"]))
    if not entries:
        return "no decisions recorded in this period" + (f" for {model}" if model else "")
    entries.sort(key=lambda e: (e[0], e[1]))
    return "\n".join(line for _, _, lines in entries for line in lines)


def _history(args: argparse.Namespace) -> int:
    from fleetplan.controller.state import read_history

    try:
        since = time.time() - parse_duration_s(args.since)
        decisions, actions = read_history(args.state_db, since)
    except (ValueError, OSError) as exc:
        print(f"fleetplan history: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # sqlite3.DatabaseError: not a state database
        print(f"fleetplan history: {args.state_db}: cannot read: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for d in decisions:
            if args.model is None or args.model in (d.get("models") or {}):
                print(json.dumps(d, sort_keys=True))
        return 0
    print(render_history(decisions, actions, model=args.model, changes_only=not args.all))
    return 0
