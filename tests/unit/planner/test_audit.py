"""planner/audit.py: decision records, the inputs digest and the timeline, without servers."""

from __future__ import annotations

from typing import Any

from fleetplan.planner.audit import decision_id, decision_record, inputs_digest, timeline
from fleetplan.planner.types import Action, ActionKind, Replica, ReplicaState
from tests.unit.planner.planner_helpers import key


def plan_doc(replicas: dict[str, int], held: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "plan": {"replicas": [{"model": m} for m, n in replicas.items() for _ in range(n)], "gpus": 4, "usd_h": 12.0},
        "explanation": {
            "models": [{"model": m, "observed_rps": 1.0, "forecast_rps": 1.2, "demand_rps": 1.2, "required_rps": 1.44,
                        "capacity_rps": 1.6 * n, "unmet_rps": 0.0, "usd_h": 12.0 * n, "notes": [f"{m} note"],
                        "configs": [{"replicas": n, "engine": "vllm", "gpu": "h100", "tp": 4}]}
                       for m, n in replicas.items()],
            "binding_constraints": ["inventory h100: 16/16 GPUs"], "notes": [], "target_usd_h": 12.0},
        "brakes": {"mode": "active", "paused": False, "held": list(held)},
    }


def test_digest_is_canonical_and_the_id_names_cycle_and_digest() -> None:
    a = inputs_digest({"x": 1, "y": [1, 2]})
    assert a == inputs_digest({"y": [1, 2], "x": 1}) and a != inputs_digest({"x": 2, "y": [1, 2]})
    assert len(a) == 64 and decision_id(7, a) == f"7-{a[:8]}"


def test_record_carries_plan_summary_actions_held_and_why() -> None:
    r = Replica("r1", key("m", tp=4), "h1", (0, 1, 2, 3), ReplicaState.STARTING)
    held = [{"kind": "drain", "replica_id": "r9", "model": "m", "host": "h2", "limit": "pause", "detail": "paused",
             "text": "x"}]
    rec = decision_record(cycle_id=3, now_s=100.0, digest="ab" * 32, plan_doc=plan_doc({"m": 2}, held),
                          issued=[Action(ActionKind.START, r, "start it")])
    assert rec["decision_id"] == "3-abababab" and rec["mode"] == "active" and rec["paused"] is False
    assert rec["models"]["m"]["replicas"] == 2 and rec["models"]["m"]["capacity_rps"] == 3.2
    assert rec["actions"] == [{"kind": "start", "replica_id": "r1", "model": "m", "host": "h1",
                               "config": "m/vllm/h100x4/bf16", "reason": "start it"}]
    assert rec["held"] == [{k: held[0][k] for k in ("kind", "replica_id", "model", "host", "limit", "detail")}]
    assert "inventory h100: 16/16 GPUs" in rec["why"]


def test_timeline_keeps_changes_joins_actions_and_filters_by_model() -> None:
    recs = [decision_record(cycle_id=i, now_s=float(i), digest=f"{i:064x}", plan_doc=plan_doc(reps), issued=())
            for i, reps in enumerate([{"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 2, "b": 1}], 1)]
    acts = [{"cycle_id": 3, "model": "a", "kind": "start"}, {"cycle_id": 4, "model": "b", "kind": "stop"}]
    out = timeline(recs, acts)
    assert [r["cycle_id"] for r in out] == [1, 3, 4]  # 2 changed nothing
    assert out[1]["changed"] == {"a": (1, 2)} and out[1]["action_rows"] == [acts[0]]
    only_a = timeline(recs, acts, model="a")
    assert [r["cycle_id"] for r in only_a] == [1, 3] and set(only_a[1]["models"]) == {"a"}
    assert len(timeline(recs, acts, changes_only=False)) == 4
