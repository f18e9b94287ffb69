"""What a policy edit would do: the diff between the plan under the old policy and under the new one,
for the same demand, fleet and planner state. Pure; `fleetplan what-if` (fleetplan/harness/cli/whatif.py)
reads the files or the controller's state, plans twice and renders this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetplan.planner.counts import UNMET_TOL_RPS
from fleetplan.planner.types import Action, ConfigKey, Plan, PlanResult

__all__ = ["ConfigChange", "PlanDiff", "SloRisk", "diff_to_dict", "plan_diff"]

_USD_EPS = 1e-6


@dataclass(frozen=True)
class ConfigChange:
    """One config of one model: replicas before and after, and how many start / stop (a replica that
    moves to other GPUs counts as one stop and one start)."""

    config: ConfigKey
    before: int
    after: int
    started: int
    stopped: int


@dataclass(frozen=True)
class SloRisk:
    """A model whose planned capacity (under the new policy) is below what it must serve."""

    model: str
    demand_rps: float
    required_rps: float  # demand x (1 + headroom)
    capacity_before_rps: float
    capacity_after_rps: float
    below_demand: bool  # short of the demand itself, not only of the headroom


@dataclass(frozen=True)
class PlanDiff:
    changes: tuple[ConfigChange, ...]  # the plan for now: configs whose replica count changes
    target_changes: tuple[ConfigChange, ...]  # the target (after engine builds)
    usd_h_before: float
    usd_h_after: float
    target_usd_h_before: float
    target_usd_h_after: float
    slo_risk: tuple[SloRisk, ...]  # under the new policy
    slo_risk_before: tuple[str, ...]  # models at risk under the old policy
    actions: tuple[Action, ...]  # what the new policy would issue this cycle
    deferred_actions: int
    actions_changed: bool  # the new policy's actions differ from the old one's

    @property
    def changed(self) -> bool:
        return bool(self.changes or self.target_changes or self.actions_changed
                    or abs(self.usd_h_after - self.usd_h_before) > _USD_EPS
                    or abs(self.target_usd_h_after - self.target_usd_h_before) > _USD_EPS
                    or {r.model for r in self.slo_risk} != set(self.slo_risk_before))


def _changes(before: Plan, after: Plan) -> tuple[ConfigChange, ...]:
    def spots(p: Plan) -> dict[ConfigKey, list[tuple[str, tuple[int, ...]]]]:
        out: dict[ConfigKey, list[tuple[str, tuple[int, ...]]]] = {}
        for r in p.replicas:
            out.setdefault(r.config, []).append((r.host, r.gpu_indices))
        return out

    b, a = spots(before), spots(after)
    out = []
    for k in sorted(set(a) | set(b)):
        bb, aa = b.get(k, []), a.get(k, [])
        started = len([x for x in aa if x not in bb])
        stopped = len([x for x in bb if x not in aa])
        if started or stopped:
            out.append(ConfigChange(k, len(bb), len(aa), started, stopped))
    return tuple(out)


def _signature(actions: tuple[Action, ...]) -> list[tuple[str, ConfigKey, str, tuple[int, ...]]]:
    return sorted((a.kind.value, a.replica.config, a.replica.host, a.replica.gpu_indices) for a in actions)


def _risk(result: PlanResult) -> dict[str, tuple[float, float, float]]:
    out = {}
    for m in result.explanation.models:
        if m.capacity_rps < m.required_rps - UNMET_TOL_RPS:
            out[m.model] = (m.demand_rps, m.required_rps, m.capacity_rps)
    return out


def plan_diff(before: PlanResult, after: PlanResult) -> PlanDiff:
    """The diff of two plans of the same inputs (old policy -> new policy)."""
    cap_before = {m.model: m.capacity_rps for m in before.explanation.models}
    risk = tuple(
        SloRisk(model, d, req, cap_before.get(model, 0.0), cap, cap < d - UNMET_TOL_RPS)
        for model, (d, req, cap) in sorted(_risk(after).items())
    )
    return PlanDiff(
        changes=_changes(before.plan, after.plan),
        target_changes=_changes(before.target, after.target),
        usd_h_before=before.plan.usd_h,
        usd_h_after=after.plan.usd_h,
        target_usd_h_before=before.target.usd_h,
        target_usd_h_after=after.target.usd_h,
        slo_risk=risk,
        slo_risk_before=tuple(sorted(_risk(before))),
        actions=after.actions,
        deferred_actions=len(after.deferred_actions),
        actions_changed=_signature(before.actions + before.deferred_actions)
        != _signature(after.actions + after.deferred_actions),
    )


def _change_dict(c: ConfigChange) -> dict[str, Any]:
    return {"model": c.config.model, "engine": c.config.engine.value, "gpu": c.config.gpu.value,
            "tp": c.config.tp, "precision": c.config.precision.value, "before": c.before, "after": c.after,
            "started": c.started, "stopped": c.stopped}


def diff_to_dict(d: PlanDiff) -> dict[str, Any]:
    return {
        "changed": d.changed,
        "changes": [_change_dict(c) for c in d.changes],
        "target_changes": [_change_dict(c) for c in d.target_changes],
        "usd_h_before": d.usd_h_before,
        "usd_h_after": d.usd_h_after,
        "target_usd_h_before": d.target_usd_h_before,
        "target_usd_h_after": d.target_usd_h_after,
        "slo_risk": [{"model": r.model, "demand_rps": r.demand_rps, "required_rps": r.required_rps,
                      "capacity_before_rps": r.capacity_before_rps, "capacity_after_rps": r.capacity_after_rps,
                      "below_demand": r.below_demand} for r in d.slo_risk],
        "slo_risk_before": list(d.slo_risk_before),
        "actions": [{"kind": a.kind.value, "reason": a.reason, "replica_id": a.replica.replica_id,
                     "model": a.replica.config.model, "engine": a.replica.config.engine.value,
                     "gpu": a.replica.config.gpu.value, "tp": a.replica.config.tp, "host": a.replica.host,
                     "gpu_indices": list(a.replica.gpu_indices)} for a in d.actions],
        "deferred_actions": d.deferred_actions,
        "actions_changed": d.actions_changed,
    }
