"""The plan as a JSON document: what the state store keeps and the reports render. Pure."""

from __future__ import annotations

from typing import Any

from fleetplan.planner.counterfactual import alternative_to_dict, relaxation_to_dict
from fleetplan.planner.serde import state_to_dict
from fleetplan.planner.slo import ErrorBudget
from fleetplan.planner.types import (
    ConfigCount,
    ConfigKey,
    ModelPools,
    Plan,
    PlanResult,
    Replica,
    SolverReport,
)

__all__ = ["budget_to_dict", "plan_to_dict", "replica_to_dict"]


def _config_dict(c: ConfigKey) -> dict[str, Any]:
    return {"model": c.model, "engine": c.engine.value, "gpu": c.gpu.value, "tp": c.tp,
            "precision": c.precision.value, "role": c.role.value}


def replica_to_dict(r: Replica) -> dict[str, Any]:
    return {"replica_id": r.replica_id, **_config_dict(r.config), "host": r.host,
            "gpu_indices": list(r.gpu_indices), "state": r.state.value, "port": r.port, "since_s": r.since_s}


def _plan_dict(p: Plan) -> dict[str, Any]:
    return {
        "replicas": [replica_to_dict(r) for r in p.replicas],
        "counts": [_count_dict(c) for c in p.counts],
        "gpus": p.gpus,
        "usd_h": p.usd_h,
    }


def _count_dict(c: ConfigCount) -> dict[str, Any]:
    return {**_config_dict(c.config), "replicas": c.replicas, "capacity_per_replica_rps": c.capacity_per_replica_rps,
            "usd_h": c.usd_h}


def pools_to_dict(p: ModelPools | None) -> dict[str, Any] | None:
    """A model's disaggregated pools (planner/disagg_plan.py); None: aggregated replicas only."""
    if p is None:
        return None
    pre, dec = p.replicas()
    return {"prefill": [_count_dict(c) for c in p.prefill], "decode": [_count_dict(c) for c in p.decode],
            "prefill_replicas": pre, "decode_replicas": dec, "ratio": p.ratio(), "capacity_rps": p.capacity_rps,
            "aggregated_usd_h": p.aggregated_usd_h, "pair_usd_h": p.pair_usd_h, "flip_rate_rps": p.flip_rate_rps,
            "flip_isl_scale": p.flip_isl_scale, "flip_link_gb_s": p.flip_link_gb_s, "link_gb_s": p.link_gb_s,
            "paired_prefill_replicas": p.paired_prefill}


def budget_to_dict(b: ErrorBudget | None) -> dict[str, Any] | None:
    """A model's SLO over its period (planner/slo.py); each [lo, hi] bounds the truth (the engines'
    histogram buckets); budget_left < 0: overspent. None: no request counted yet."""
    if b is None:
        return None
    return {"kind": b.kind.value, "objective": b.objective, "period_s": b.period_s, "window_floor": b.window_floor,
            "requests": b.requests, "covered_s": b.covered_s, "good_share": list(b.good_share),
            "budget_left": list(b.budget_left), "worst_slice_good_share": b.worst_slice_good_share}


def _report_dict(r: SolverReport) -> dict[str, Any]:
    return {"stage": r.stage, "backend": r.backend, "status": r.status, "objective": r.objective,
            "best_bound": r.best_bound, "gap": r.gap, "wall_s": r.wall_s}


def plan_to_dict(result: PlanResult) -> dict[str, Any]:
    """A JSON-able document of the whole result; reports render this and never recompute."""
    e = result.explanation
    return {
        "plan": _plan_dict(result.plan),
        "target": _plan_dict(result.target),
        "actions": [{"kind": a.kind.value, "reason": a.reason, "replica": replica_to_dict(a.replica)}
                    for a in result.actions],
        "deferred_actions": [{"kind": a.kind.value, "reason": a.reason, "replica": replica_to_dict(a.replica)}
                             for a in result.deferred_actions],
        "explanation": {
            "models": [{
                "model": m.model, "observed_rps": m.observed_rps, "forecast_rps": m.forecast_rps,
                "demand_rps": m.demand_rps, "headroom": m.headroom, "required_rps": m.required_rps,
                "capacity_rps": m.capacity_rps, "target_capacity_rps": m.target_capacity_rps,
                "unmet_rps": m.unmet_rps, "slo_ttft_p99_ms": m.slo_ttft_p99_ms,
                "slo_itl_p99_ms": m.slo_itl_p99_ms, "usd_h": m.usd_h, "notes": list(m.notes),
                "configs": [{**_config_dict(c.config), "replicas": c.replicas,
                             "capacity_per_replica_rps": c.capacity_per_replica_rps, "binding": c.binding,
                             "load_per_replica_rps": c.load_per_replica_rps,
                             "predicted_ttft_p99_ms": c.predicted_ttft_p99_ms,
                             "predicted_itl_p99_ms": c.predicted_itl_p99_ms, "usd_h": c.usd_h,
                             "profile_capacity_rps": c.profile_capacity_rps,
                             "capacity_factor": c.capacity_factor, "correction": c.correction,
                             "extrapolating": list(c.extrapolating),
                             "observed_ttft_p99_ms": c.observed_ttft_p99_ms,
                             "observed_itl_p99_ms": c.observed_itl_p99_ms,
                             "observed_rps_per_replica": c.observed_rps_per_replica,
                             "predicted_attainment": c.predicted_attainment,
                             "last_replica_attainment": c.last_replica_attainment,
                             "floor_share": c.floor_share, "knee_rps": c.knee_rps}
                            for c in m.configs],
                "length_mix": m.length_mix,
                "uncertainty_usd_h": m.uncertainty_usd_h,
                "uncertainty_why": list(m.uncertainty_why),
                "observed_missed_share": (list(m.observed_missed_share)
                                          if m.observed_missed_share is not None else None),
                "alternatives": [alternative_to_dict(a) for a in m.alternatives],
                "error_budget": budget_to_dict(m.error_budget),
                "pools": pools_to_dict(m.pools),
                "held_unproven": list(m.held_unproven),
            } for m in e.models],
            "relaxations": [relaxation_to_dict(r) for r in e.relaxations],
            "binding_constraints": list(e.binding_constraints),
            "solver": [_report_dict(r) for r in e.solver],
            "objective": e.objective,
            "gap": e.gap,
            "solve_s": e.solve_s,
            "usd_h": e.usd_h,
            "target_usd_h": e.target_usd_h,
            "notes": list(e.notes),
        },
        "next_state": state_to_dict(result.next_state),
    }
