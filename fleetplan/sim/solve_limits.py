"""The replay's solver limits: work, not wall-clock time.

The daemon's plan must arrive on time, so its solve stops at the policy's `solver.time_limit_s` of
wall-clock time. A replay must be a function of its inputs: where a solve stops at a wall-clock
limit, it stops at a different point on a busy machine than on an idle one, and the plan (so the
GPU-hours) would follow the machine's load. The replay gives the planner a limit on the solver's
work instead (planner/counts.py `work_limit`: CP-SAT's deterministic time, SCIP's nodes), of as
many work units (about a second of one core each) as the policy gives it seconds, or the policy's
own `solver.work_limit` when it sets one.
"""

from __future__ import annotations

from fleetplan.planner.policy import Policy


def replay_policy(policy: Policy) -> Policy:
    """`policy` with its solve limited by work (the policy's work_limit, else time_limit_s units)."""
    solver = policy.solver
    if solver.work_limit is not None:
        return policy
    return policy.model_copy(update={"solver": solver.model_copy(update={"work_limit": solver.time_limit_s})})
