"""`fleetplan what-if`: the plan diff a policy edit would cause, before the SIGHUP.

    fleetplan what-if --policy NEW.yaml (--against OLD.yaml | --controller URL)
                      [--profiles P] [--demand D] [--fleet CURRENT] [--now T] [--json]

Plans the same demand, fleet and planner state under the old and the new policy and prints what
changes: replicas started/stopped per model and config, $/h before and after, SLO risk (models
whose planned capacity falls below their demand or required rate) and the actions the new policy
would issue. With --controller the old policy, the fleet, the last observation and the profiles
come from the running controller (GET /api/state, same bearer token as the report API); files
given on the command line win. Exit 0: no change; 1: a change; 2: a bad file (the message names
the file, the field and the value) or the controller unreachable.

The diff itself is fleetplan.planner.whatif.plan_diff (pure); this module reads files and renders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

EXIT_SAME, EXIT_CHANGED, EXIT_ERROR = 0, 1, 2


def register(sub: Any) -> None:
    p = sub.add_parser("what-if", help="the plan diff a policy edit would cause (exit 0 same, 1 changed, 2 bad file)")
    p.add_argument("--policy", required=True, help="the edited policy YAML")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--against", help="the current policy YAML to compare with")
    src.add_argument("--controller", help="report API URL of the running controller: compare with its policy, "
                     "fleet, last observation and profiles")
    p.add_argument("--token", default=None, help="bearer token (default $FLEETPLAN_REPORT_TOKEN)")
    p.add_argument("--profiles", help="PROFILES.json (default with --controller: the controller's)")
    p.add_argument("--demand", help="DEMAND.yaml (default with --controller: its last observation)")
    p.add_argument("--fleet", help="CURRENT.json (default with --controller: its fleet; else an empty fleet)")
    p.add_argument("--now", type=float, help="plan for this epoch time (default: DEMAND's time_s, else now)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=cmd_whatif)


def cmd_whatif(args: argparse.Namespace) -> int:
    return run_whatif(args.policy, against=args.against, controller=args.controller, token=args.token,
                      profiles=args.profiles, demand=args.demand, fleet=args.fleet, now=args.now,
                      as_json=args.json)


class _Stop(Exception):
    """An input is missing or unreadable; the message is printed, the command exits EXIT_ERROR."""


def _from_file_or_controller(path: str | None, kind: str, state_doc: dict[str, Any], key: str,
                             controller: str | None, parse: Any) -> Any:
    """`parse(doc, where)` of the file at `path`, else of the controller's copy (`state_doc[key]`),
    else None. The one rule for every input `what-if` takes from a file or a running controller."""
    from fleetplan.harness.cli.files import load_yaml_or_json, read_text

    if path is not None:
        text = read_text(path, kind)
        if text is None:
            raise _Stop("")
        return parse(load_yaml_or_json(text, path), path)
    if state_doc.get(key) is not None:
        return parse(state_doc[key], f"{controller} ({key})")
    return None


def _inputs(policy: str, against: str | None, controller: str | None, token: str | None,
            profiles: str | None, demand: str | None, fleet: str | None) -> dict[str, Any]:
    from fleetplan.harness.cli.files import read_text
    from fleetplan.models.profile import ProfileError, ProfileSet
    from fleetplan.planner.policy import load_policy_dict, load_policy_text
    from fleetplan.planner.serde import fleet_from_dict, observation_from_dict
    from fleetplan.planner.types import Fleet, PlannerState
    from fleetplan.shared.benchfiles import load_profiles

    state_doc: dict[str, Any] = {}
    if controller is not None:
        from fleetplan.controller.report import fetch

        try:
            state_doc = fetch(controller, "/api/state", token or os.environ.get("FLEETPLAN_REPORT_TOKEN"))
        except RuntimeError as exc:
            raise _Stop(f"fleetplan what-if: {exc}") from None
    ptext = read_text(policy, "policy")
    if ptext is None:
        raise _Stop("")
    new = load_policy_text(ptext, policy)
    if against is not None:
        otext = read_text(against, "policy")
        if otext is None:
            raise _Stop("")
        old, old_name = load_policy_text(otext, against), against
    elif not state_doc.get("policy"):
        raise _Stop(f"fleetplan what-if: {controller}: the controller has no policy loaded")
    else:
        old_name = f"{controller} (policy {state_doc.get('policy_path')})"
        old = load_policy_dict(state_doc["policy"], old_name)
    obs = _from_file_or_controller(demand, "demand", state_doc, "demand", controller, observation_from_dict)
    if obs is None:
        raise _Stop("fleetplan what-if: --demand is required"
                    + (f" ({controller} has no observation yet)" if controller else ""))
    fl = _from_file_or_controller(fleet, "fleet", state_doc, "fleet", controller, fleet_from_dict)

    def parse_profiles(doc: Any, where: str) -> ProfileSet:
        try:
            return ProfileSet.from_json_dict(doc)
        except ProfileError as exc:
            raise ValueError(f"{where}: {exc}") from None

    profs = load_profiles(profiles) if profiles is not None else \
        _from_file_or_controller(None, "profiles", state_doc, "profiles", controller, parse_profiles)
    if profs is None:
        raise _Stop("fleetplan what-if: --profiles is required")
    return {"old": old, "old_name": old_name, "new": new, "observation": obs[0], "time_s": obs[1],
            "fleet": fl or (Fleet(), PlannerState.initial()), "profiles": profs, "state_doc": state_doc}


def run_whatif(
    policy: str,
    *,
    against: str | None = None,
    controller: str | None = None,
    token: str | None = None,
    profiles: str | None = None,
    demand: str | None = None,
    fleet: str | None = None,
    now: float | None = None,
    as_json: bool = False,
) -> int:
    from fleetplan.planner.core import plan
    from fleetplan.planner.policy import PolicyError
    from fleetplan.planner.whatif import diff_to_dict, plan_diff

    try:
        i = _inputs(policy, against, controller, token, profiles, demand, fleet)
    except _Stop as exc:
        if str(exc):
            print(str(exc), file=sys.stderr)
        return EXIT_ERROR
    except (PolicyError, ValueError) as exc:  # ProfilesFileError is a ValueError
        print(str(exc), file=sys.stderr)
        return EXIT_ERROR
    old, new, (fl, pstate) = i["old"], i["new"], i["fleet"]
    now_s = now if now is not None else i["time_s"] if i["time_s"] is not None else \
        float(i["state_doc"].get("now_s") or time.time())
    before = plan(i["observation"], fl, old, i["profiles"], pstate, now_s, counterfactuals=False)
    after = plan(i["observation"], fl, new, i["profiles"], pstate, now_s, counterfactuals=False)
    d = plan_diff(before, after)
    doc = diff_to_dict(d)
    doc.update(policy=policy, against=i["old_name"], now_s=now_s)
    notes = []
    if fl.hosts and {h.name for h in old.hosts} != {h.name for h in new.hosts}:
        notes.append(f"the fleet reports its own hosts ({len(fl.hosts)}); the policy's `hosts` list is used only "
                     "when agents report none, so the host edit does not change this fleet's plan")
    doc["notes"] = notes
    if as_json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_diff(doc))
    return EXIT_CHANGED if d.changed else EXIT_SAME


def _cfg(c: dict[str, Any]) -> str:
    return f"{c['model']:<22} {c['engine']:<7} {c['gpu']}x{c['tp']:<3}"


def render_diff(doc: dict[str, Any]) -> str:
    """Readable text of a diff_to_dict() document (never recomputes)."""
    out = [f"what-if: {doc['policy']} against {doc['against']}"]

    def money(before: float, after: float) -> str:
        return f"${before:.2f}/h -> ${after:.2f}/h ({after - before:+.2f})"

    out.append(f"$/h now:    {money(doc['usd_h_before'], doc['usd_h_after'])}")
    out.append(f"$/h target: {money(doc['target_usd_h_before'], doc['target_usd_h_after'])} (after engine builds)")
    for title, key in (("REPLICAS (plan for now)", "changes"), ("REPLICAS (target, after builds)", "target_changes")):
        out.append("")
        rows = doc[key]
        out.append(f"{title}: " + ("no change" if not rows else
                                   f"+{sum(c['started'] for c in rows)} started, "
                                   f"-{sum(c['stopped'] for c in rows)} stopped"))
        for c in rows:
            delta = ", ".join(x for x in (f"+{c['started']} start" if c["started"] else "",
                                          f"-{c['stopped']} stop" if c["stopped"] else "") if x)
            if c["started"] and c["stopped"] and c["before"] == c["after"]:
                delta += " (moved)"
            out.append(f"  {_cfg(c)} {c['before']:>3} -> {c['after']:<3} {delta}")
    out.append("")
    risk = doc["slo_risk"]
    out.append(f"SLO RISK ({len(risk)})" if risk else "SLO risk: none (every model's capacity covers its required rate)")
    for r in risk:
        what = "below DEMAND" if r["below_demand"] else "below demand x (1 + headroom)"
        out.append(f"  {r['model']}: capacity {r['capacity_after_rps']:.1f} rps {what} ({r['demand_rps']:.1f} rps "
                   f"demand, {r['required_rps']:.1f} rps required); was {r['capacity_before_rps']:.1f} rps")
    if doc["slo_risk_before"]:
        out.append("  at risk under the current policy too: " + ", ".join(doc["slo_risk_before"]))
    out.append("")
    acts = doc["actions"]
    out.append(f"ACTIONS the new policy would issue ({len(acts)} this cycle, {doc['deferred_actions']} deferred)"
               + ("" if doc["actions_changed"] else ": the same as the current policy's"))
    for i, a in enumerate(acts, 1):
        out.append(f"  {i:>2}. {a['kind'].upper():<5} {a['replica_id']}  ({a['reason']})")
    for n in doc.get("notes", []):
        out.append("NOTE: " + n)
    out.append("")
    out.append("RESULT: " + ("CHANGE (exit 1)" if doc["changed"] else "no change (exit 0)"))
    return "\n".join(out) + "\n"
