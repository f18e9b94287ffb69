"""`fleetplan policy check FILE` and `fleetplan plan ...`: the planner from the command line.

File reading happens here; the planner core (planner/) is pure and gets text/dicts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from fleetplan.controller.plan_text import render_plan
from fleetplan.harness.cli.files import load_yaml_or_json, read_text


def register(subparsers: Any) -> None:
    policy = subparsers.add_parser("policy", help="policy file tools")
    psub = policy.add_subparsers(dest="policy_command", metavar="SUBCOMMAND")
    check = psub.add_parser("check", help="validate a policy file and print a summary (exit 2 on errors)")
    check.add_argument("file", help="policy YAML file")
    check.add_argument("--controller", help="also run `what-if` of FILE against the running controller's policy, "
                       "fleet and last observation (exit 0 no change, 1 change, 2 bad file)")
    check.add_argument("--token", default=None, help="report API bearer token (default $FLEETPLAN_REPORT_TOKEN)")
    check.set_defaults(handler=cmd_policy_check)
    policy.set_defaults(handler=lambda args: (policy.print_help(), 2)[1])

    p = subparsers.add_parser("plan", help="plan the fleet for a demand: counts, engines, TP, placement, actions")
    p.add_argument("--policy", required=True, help="policy YAML (see config/example-policy.yaml)")
    p.add_argument("--profiles", required=True, help="PROFILES.json from `fleetplan models fit`")
    p.add_argument("--demand", required=True, help="DEMAND.yaml: request rate and ISL/OSL per model")
    p.add_argument("--fleet", help="CURRENT.json: hosts, running replicas, engine builds, planner state")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--now", type=float, help="plan for this epoch time (default: DEMAND's time_s, else now)")
    p.set_defaults(handler=cmd_plan)


def cmd_policy_check(args: argparse.Namespace) -> int:
    from fleetplan.planner.policy import PolicyError, effective, load_policy_text

    text = read_text(args.file, "policy")
    if text is None:
        return 2
    try:
        policy = load_policy_text(text, args.file)
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(f"{args.file}: OK")
    print(f"  models ({len(policy.models)}):")
    for m in policy.models:
        engines = ",".join(e.value for e in m.allowed.engines)
        gpus = ",".join(g.value for g in m.allowed.gpus) if m.allowed.gpus else "any"
        mx = "-" if m.max_replicas is None else str(m.max_replicas)
        print(f"    {m.name:<24} SLO ttft_p99={m.slo.ttft_p99_ms:g} ms itl_p99={m.slo.itl_p99_ms:g} ms  "
              f"priority={m.priority} replicas={m.min_replicas}..{mx} engines={engines} "
              f"tp={','.join(str(t) for t in m.allowed.tp)} gpus={gpus} headroom={m.headroom:g}")
    print("  gpu types: " + ", ".join(f"{g.value} ${p.price_usd_h:g}/h" for g, p in policy.gpu_types.items()))
    total = sum(h.gpu_count for h in policy.hosts)
    print(f"  hosts: {len(policy.hosts)} ({total} GPUs)")
    print("  engines: " + ", ".join(
        f"{e.value} (startup {p.startup.default_s:g} s"
        + (f", build {p.build.default_s:g} s, {len(p.cached_builds)} cached builds" if p.build else "") + ")"
        for e, p in policy.engines.items()))
    b = policy.budget
    print(f"  budget: max_gpus={b.max_gpus if b.max_gpus is not None else '-'} "
          f"max_usd_h={b.max_usd_h if b.max_usd_h is not None else '-'}")
    s = policy.scaling
    print(f"  scaling: cycle {s.cycle_s:g} s, scale-down delay {s.scale_down_delay_s:g} s, "
          f"scale-down band {s.scale_down_band:.0%}, {s.max_actions_per_cycle} actions/cycle, "
          f"churn ${s.churn_cost_usd_h:g}/h")
    print(f"  schedules ({len(policy.schedules)}): " + ", ".join(f"{x.name} [{x.cron}]" for x in policy.schedules))
    active = effective(policy, time.time()).active_schedules
    print("  active now: " + (", ".join(active) if active else "none"))
    if getattr(args, "controller", None):
        from fleetplan.harness.cli.whatif import run_whatif

        print("")
        sys.stdout.flush()
        return run_whatif(args.file, controller=args.controller, token=args.token)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from fleetplan.models.profile import ProfileSet
    from fleetplan.planner.core import plan, plan_to_dict
    from fleetplan.planner.policy import PolicyError, load_policy_text
    from fleetplan.planner.serde import fleet_from_dict, observation_from_dict
    from fleetplan.planner.types import Fleet, PlannerState
    from fleetplan.shared.benchfiles import load_profiles

    ptext = read_text(args.policy, "policy")
    dtext = read_text(args.demand, "demand")
    if ptext is None or dtext is None:
        return 2
    try:
        policy = load_policy_text(ptext, args.policy)
        observation, time_s = observation_from_dict(load_yaml_or_json(dtext, args.demand), args.demand)
        fleet, state = Fleet(), PlannerState.initial()
        if args.fleet:
            ftext = read_text(args.fleet, "fleet")
            if ftext is None:
                return 2
            fleet, state = fleet_from_dict(load_yaml_or_json(ftext, args.fleet), args.fleet)
        profiles: ProfileSet = load_profiles(args.profiles)
    except (PolicyError, ValueError) as exc:  # ProfilesFileError is a ValueError
        print(str(exc), file=sys.stderr)
        return 2
    now_s = args.now if args.now is not None else time_s if time_s is not None else time.time()
    result = plan(observation, fleet, policy, profiles, state, now_s)
    doc = plan_to_dict(result)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_plan(doc))
    return 0


