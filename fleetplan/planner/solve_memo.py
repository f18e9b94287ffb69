"""A cycle whose solver inputs did not move reuses the last solution instead of solving again. Pure.

Stage 1 (planner/counts.py) is solved several times a cycle (the target, the plan for now, the
scale-down hold's re-solves), every cycle, on inputs that at steady traffic move only by the rate's
counting noise and the corrections' small steps. A problem reuses a solution solved in an earlier
cycle (the anchor) when:

1. everything discrete is the same: the candidates (config, price, lead time, build, cap), the
   slots, the current fleet, the floors and young floors, the budgets, the cost and solver settings,
   each model's priority and min/max replicas;
2. the anchor's counts still meet every model's required rate at the new capacities, and the
   anchor left no demand unmet;
3. per model and config, the demand counted in that config's replicas (required rate / capacity per
   replica) has not fallen below the anchor's by more than `tolerance` (relative, per model).

With no tolerance (the planner's: planner/core.py) the anchor is the optimum of the new problem:
with the demand in replicas no lower, every fleet that meets the new problem met the anchor's too,
at the same price, and the anchor's fleet meets both; decisions are the solver's (up to its ties).
Any fall (or any discrete change) solves again, and the anchor stays the problem last SOLVED. A
tolerance of the rate's Poisson half-width (planner/scale_down.py `noise_band` / 2) was measured and
not kept: over 8 h of the 1M/day day 9 of 192 reuses differed from a fresh solve (3 x TP4 + 1 x TP8
held where 2 x TP8 served) and the 24 h day spent 0.36% more GPU-hours (docs/evaluate.md).

The memo is carried in PlannerState (`solves`, not persisted: after a restart the first cycle
solves), so the daemon and the replay take the same decisions.

Worked example (tests/unit/planner/test_solve_memo.py): anchor 10 rps on replicas of 4 rps, 3
solved; the next cycle reads 9.8 rps with a tolerance of 5%: 9.8 >= 10 x 0.95 and 3 x 4 >= 9.8,
so 3 is reused; at 9.0 rps (a 10% fall) the problem is solved again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fleetplan.models.names import GpuType
from fleetplan.planner.counts import UNMET_TOL_RPS, CountProblem, CountSolution
from fleetplan.planner.disagg_counts import served_rps
from fleetplan.planner.types import ConfigKey

__all__ = ["Solved", "reusable", "reused"]


@dataclass(frozen=True)
class Solved:
    """A problem stage 1 solved and its solution (the anchor a later problem may reuse)."""

    problem: CountProblem
    solution: CountSolution


def _same_discrete(a: CountProblem, b: CountProblem) -> bool:
    if len(a.candidates) != len(b.candidates) or len(a.demands) != len(b.demands):
        return False
    for x, y in zip(a.candidates, b.candidates, strict=True):
        if (x.config, x.usd_h, x.lead_s, x.build_s, x.max_count, x.binding) != \
                (y.config, y.usd_h, y.lead_s, y.build_s, y.max_count, y.binding):
            return False
    for d, e in zip(a.demands, b.demands, strict=True):
        if (d.model, d.priority, d.min_replicas, d.max_replicas) != (e.model, e.priority, e.min_replicas,
                                                                      e.max_replicas):
            return False
    return (_plain(a.slots) == _plain(b.slots) and dict(a.current) == dict(b.current)
            and dict(a.floors) == dict(b.floors) and dict(a.young) == dict(b.young)
            and (a.max_gpus, a.max_usd_h, a.churn_cost_usd_h, a.lead_time_cost_usd_h_per_min, a.time_limit_s,
                 a.relative_gap, a.workers, a.backend, a.work_limit)
            == (b.max_gpus, b.max_usd_h, b.churn_cost_usd_h, b.lead_time_cost_usd_h_per_min, b.time_limit_s,
                b.relative_gap, b.workers, b.backend, b.work_limit))


def _plain(slots: Mapping[GpuType, Mapping[int, int]]) -> dict[GpuType, dict[int, int]]:
    return {g: dict(v) for g, v in slots.items()}


def _holds(anchor: Solved, problem: CountProblem, tolerance: Mapping[str, float]) -> bool:
    """Conditions 2 and 3 of the module docstring (the discrete parts are the same)."""
    sol = anchor.solution
    if sol.unmet_rps:
        return False
    old_cap = {c.config: c.capacity_rps for c in anchor.problem.candidates}
    old_req = {d.model: d.required_rps for d in anchor.problem.demands}
    new_cap: dict[ConfigKey, float] = {c.config: c.capacity_rps for c in problem.candidates}
    met = served_rps({c.config: sol.counts.get(c.config, 0) for c in problem.candidates}, new_cap)
    for d in problem.demands:
        r0 = old_req[d.model]
        if d.required_rps > met.get(d.model, 0.0) + UNMET_TOL_RPS:
            return False
        low = 1.0 - max(0.0, tolerance.get(d.model, 0.0))
        for k, cap in new_cap.items():
            # required / capacity: the demand in replicas of k; not below the anchor's by more than the noise
            if k.model == d.model and d.required_rps * old_cap[k] < r0 * cap * low:
                return False
    return True


def reusable(problem: CountProblem, anchors: Sequence[Solved], tolerance: Mapping[str, float]) -> Solved | None:
    """The anchor whose solution `problem` reuses (the module docstring), None: solve it.
    `tolerance`: per model, the relative noise of its required rate (0: only a rise reuses)."""
    for a in anchors:
        if _same_discrete(a.problem, problem) and _holds(a, problem, tolerance):
            return a
    return None


def reused(anchor: Solved) -> CountSolution:
    """The anchor's solution as this cycle's: the same counts, a report that says it was reused
    (no solver ran: no solver time)."""
    r = anchor.solution.report
    return replace(anchor.solution, report=replace(r, backend=f"{r.backend} (reused)", wall_s=0.0))
