"""The audit trail's content: one decision record per cycle. Pure (no I/O, no clock).

A decision is what one cycle concluded: its id (`<cycle id>-<first 8 hex of the inputs digest>`),
the digest of its inputs (observation, fleet, policy), a plan summary per model, the actions it
issued, the actions the brakes held back and why. The daemon stores the record in the state store
(table `decisions`, keyed by cycle id: every action row carries that cycle id) and writes it as one
JSON line to its journal; `fleetplan history` and the plan page read it back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fleetplan.planner.types import Action, Fleet


def inputs_digest(parts: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of the cycle's inputs (same inputs, same digest)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def fleet_view(fleet: Fleet) -> dict[str, Any]:
    """The fleet as the planner saw it, JSON-shaped (for the digest)."""
    return {
        "hosts": [[h.name, h.gpu.value, h.gpu_count, h.online] for h in fleet.hosts],
        "replicas": [[r.replica_id, r.config.label(), r.host, list(r.gpu_indices), r.state.value]
                     for r in fleet.replicas],
        "builds": [[b.config().label(), b.host, b.ready] for b in fleet.builds],
    }


def decision_id(cycle_id: int, digest: str) -> str:
    return f"{cycle_id}-{digest[:8]}"


def _action(a: Action) -> dict[str, Any]:
    r = a.replica
    return {"kind": a.kind.value, "replica_id": r.replica_id, "model": r.config.model, "host": r.host,
            "config": r.config.label(), "reason": a.reason}


def decision_record(
    *,
    cycle_id: int,
    now_s: float,
    digest: str,
    plan_doc: Mapping[str, Any],
    issued: Sequence[Action],
) -> dict[str, Any]:
    """The record of one cycle's decision from the stored plan dict (never recomputed)."""
    e = plan_doc.get("explanation") or {}
    plan = plan_doc.get("plan") or {}
    brakes = plan_doc.get("brakes") or {}
    per_model: dict[str, int] = {}
    for r in plan.get("replicas", []):
        per_model[r["model"]] = per_model.get(r["model"], 0) + 1
    models = {
        m["model"]: {
            "observed_rps": m.get("observed_rps"), "forecast_rps": m.get("forecast_rps"),
            "demand_rps": m.get("demand_rps"), "required_rps": m.get("required_rps"),
            "capacity_rps": m.get("capacity_rps"), "unmet_rps": m.get("unmet_rps"),
            "replicas": per_model.get(m["model"], 0), "usd_h": m.get("usd_h"),
            "configs": [f"{c['replicas']}x {c['engine']} {c['gpu']} tp{c['tp']}" for c in m.get("configs", [])],
            "notes": list(m.get("notes", [])),
        }
        for m in e.get("models", [])
    }
    return {
        "decision_id": decision_id(cycle_id, digest),
        "cycle_id": cycle_id,
        "now_s": now_s,
        "inputs_digest": digest,
        "mode": brakes.get("mode"),
        "paused": bool(brakes.get("paused")),
        "plan": {"replicas": len(plan.get("replicas", [])), "gpus": plan.get("gpus"), "usd_h": plan.get("usd_h"),
                 "target_usd_h": e.get("target_usd_h")},
        "models": models,
        "actions": [_action(a) for a in issued],
        "held": [{k: h.get(k) for k in ("kind", "replica_id", "model", "host", "limit", "detail")}
                 for h in brakes.get("held", [])],
        "why": list(e.get("binding_constraints", [])) + list(e.get("notes", [])),
    }


def timeline(records: Iterable[Mapping[str, Any]], actions: Iterable[Mapping[str, Any]], *,
             model: str | None = None, changes_only: bool = True) -> list[dict[str, Any]]:
    """Decision records joined with the action rows they produced (by cycle id), oldest first,
    optionally for one model; with `changes_only`, cycles that issued, held or changed nothing
    (same replicas per model as the previous record) are left out."""
    by_cycle: dict[int | None, list[Mapping[str, Any]]] = {}
    for a in actions:
        by_cycle.setdefault(a.get("cycle_id"), []).append(a)
    out: list[dict[str, Any]] = []
    prev: dict[str, int] = {}
    for rec in sorted(records, key=lambda r: int(r["cycle_id"])):
        models = rec.get("models") or {}
        counts = {m: int(v.get("replicas") or 0) for m, v in models.items() if model in (None, m)}
        acts = [a for a in by_cycle.get(int(rec["cycle_id"]), []) if model in (None, a.get("model"))]
        held = [h for h in rec.get("held", []) if model in (None, h.get("model"))]
        changed = {m: (prev.get(m), n) for m, n in counts.items() if prev.get(m) != n}
        prev.update(counts)
        if changes_only and not (acts or held or changed):
            continue
        out.append({**rec, "action_rows": acts, "held": held, "changed": changed,
                    "models": {m: v for m, v in models.items() if model in (None, m)}})
    return out
