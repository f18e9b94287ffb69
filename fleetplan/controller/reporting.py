"""What the controller shows of itself: per-model gauges, the plan's alerts, the audit line, and
the documents the report API serves (`report`, `state`). Reads the controller; changes nothing
but metrics and the audit trail."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetplan.controller.observe import Snapshot, to_observation
from fleetplan.planner.act_types import AlertKey, AlertKind

if TYPE_CHECKING:
    from fleetplan.controller.daemon_face import ControllerFace

audit_log = logging.getLogger("fleetplan.audit")  # one JSON line per cycle (the audit trail)


def stored_runtime_alerts(runtime: Mapping[AlertKey, str]) -> dict[str, str]:
    """The runtime alerts under their names in the state store's alerts (`rt/<kind>/<subject>`).

    >>> stored_runtime_alerts({AlertKey(AlertKind.INVENTORY, "gpu-01"): "held"})
    {'rt/inventory/gpu-01': 'held'}
    """
    return {f"rt/{k.text}": v for k, v in runtime.items()}


def plan_alerts(doc: Mapping[str, Any]) -> list[str]:
    """Alerts the stored plan raises: unmet demand; observed latency above the SLO while the profiles predict it holds."""
    out = []
    obs = doc.get("observation") or {}
    for m in doc.get("explanation", {}).get("models", []):
        if m.get("unmet_rps"):
            out.append(f"{m['model']}: {m['unmet_rps']:.2f} rps of demand cannot be served (capacity short)")
        o = obs.get(m["model"]) or {}
        seen = o.get("ttft_p99_ms")
        pred = [c["predicted_ttft_p99_ms"] for c in m["configs"] if c["predicted_ttft_p99_ms"] is not None]
        # the model says the SLO holds but production says otherwise: the profile is optimistic
        if (seen is not None and not o.get("stale") and seen > m["slo_ttft_p99_ms"] and pred
                and max(pred) <= m["slo_ttft_p99_ms"] and (o.get("rate_rps") or 0) > 0):
            out.append(
                f"{m['model']}: observed p99 TTFT {seen:.0f} ms > SLO {m['slo_ttft_p99_ms']:.0f} ms while the "
                f"profiles predict {max(pred):.0f} ms at this load: profiles optimistic (re-benchmark) or "
                "engines overloaded"
            )
    return out


def update_metrics(ctrl: ControllerFace, doc: Mapping[str, Any], snap: Snapshot) -> None:
    """The controller's per-model gauges from this cycle's plan and observation."""
    m = ctrl.metrics
    planned: dict[str, int] = {}
    for r in doc["plan"]["replicas"]:
        planned[r["model"]] = planned.get(r["model"], 0) + 1
    rep = ctrl.hosts.reported()
    running: dict[str, int] = {}
    desired: dict[str, int] = {}
    for row in ctrl.store.active_replicas():
        desired[row.model] = desired.get(row.model, 0) + 1
        rs = rep.get(row.replica_id)
        if rs is not None and rs[1].state.value == "ready":
            running[row.model] = running.get(row.model, 0) + 1
    m.keep_models(set(ctrl.model_names()))
    for name in ctrl.model_names():
        m.planned_replicas.labels(name).set(planned.get(name, 0))
        m.running_replicas.labels(name).set(running.get(name, 0))
        m.desired_replicas.labels(name).set(desired.get(name, 0))
    for me in doc["explanation"]["models"]:
        name = me["model"]
        m.demand_rps.labels(name).set(me["demand_rps"])
        m.capacity_rps.labels(name).set(me["capacity_rps"])
        m.slo_ttft_p99_seconds.labels(name).set(me["slo_ttft_p99_ms"] / 1000)
        m.slo_itl_p99_seconds.labels(name).set(me["slo_itl_p99_ms"] / 1000)
        m.unmet_demand_rps.labels(name).set(me["unmet_rps"])
        if me.get("uncertainty_usd_h") is not None:
            m.uncertainty_usd_h.labels(name).set(me["uncertainty_usd_h"])
        if me.get("observed_missed_share"):
            low, high = me["observed_missed_share"]
            m.slo_missed_ratio.labels(name, "low").set(low)
            m.slo_missed_ratio.labels(name, "high").set(high)
        if me.get("error_budget"):
            b = me["error_budget"]
            for bound, good, left in zip(("low", "high"), b["good_share"], b["budget_left"], strict=True):
                m.slo_good_ratio.labels(name, bound).set(good)
                m.slo_budget_remaining_ratio.labels(name, bound).set(left)
        ttfts = [c["predicted_ttft_p99_ms"] for c in me["configs"] if c["predicted_ttft_p99_ms"] is not None]
        itls = [c["predicted_itl_p99_ms"] for c in me["configs"] if c["predicted_itl_p99_ms"] is not None]
        if ttfts:
            m.predicted_ttft_p99_seconds.labels(name).set(max(ttfts) / 1000)
        if itls:
            m.predicted_itl_p99_seconds.labels(name).set(max(itls) / 1000)
        o = snap.models.get(name)
        if o is not None and o.ttft_p99_ms is not None:
            m.observed_ttft_p99_seconds.labels(name).set(o.ttft_p99_ms / 1000)
        if o is not None and o.itl_p99_ms is not None:
            m.observed_itl_p99_seconds.labels(name).set(o.itl_p99_ms / 1000)
    update_correction_metrics(ctrl, doc)
    m.plan_usd_h.set(doc["plan"]["usd_h"])
    update_inventory_metrics(ctrl)
    m.stale_models.set(sum(1 for name, o in snap.models.items() if o.stale and name in desired))

def update_inventory_metrics(ctrl: ControllerFace) -> None:
    """fleetplan_inventory_mismatch{host} 1 per host whose inventory is held (its runtime alert);
    hosts that agree again lose their series."""
    m = ctrl.metrics
    mismatched = {k.subject for k in ctrl.runtime_alerts if k.kind is AlertKind.INVENTORY}
    for labels in list(m.inventory_mismatch._metrics):
        if labels[0] not in mismatched:
            m.inventory_mismatch.remove(*labels)
    for host in mismatched:
        m.inventory_mismatch.labels(host).set(1.0)


def update_correction_metrics(ctrl: ControllerFace, doc: Mapping[str, Any]) -> None:
    """fleetplan_profile_correction_ratio{model,config}: the plan's capacity factor per config
    (1.0: the profile is trusted); a config that left the plan loses its label set."""
    from fleetplan.controller.metrics import correction_series

    series = correction_series(doc)
    gauge = ctrl.metrics.profile_correction_ratio
    for labels in ctrl.correction_labels - set(series):
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
    for labels, value in series.items():
        gauge.labels(*labels).set(value)
    ctrl.correction_labels = set(series)


def audit(ctrl: ControllerFace, cid: int, now_s: float, doc: dict[str, Any], snap: Snapshot, fleet: Any,
           issued: Any) -> str:
    """The cycle's decision record (planner/audit.py): stored, and one JSON line to the journal."""
    from fleetplan.planner.audit import decision_record, fleet_view, inputs_digest

    digest = inputs_digest({"observation": snap.to_json(), "fleet": fleet_view(fleet),
                            "policy": ctrl.policy.policy.model_dump(mode="json")})
    rec = decision_record(cycle_id=cid, now_s=now_s, digest=digest, plan_doc=doc, issued=issued)
    ctrl.store.save_decision(rec)
    audit_log.info("%s", json.dumps({"event": "fleetplan.decision", **rec}, default=str, sort_keys=True))
    return str(rec["decision_id"])


@dataclass(frozen=True)
class StateInputs:
    """What GET /api/state serializes, as the controller holds it (immutable objects)."""

    generated_s: float
    now_s: float
    policy_path: str
    policy: Any  # the loaded Policy (frozen) or None
    fleet: Any  # planner Fleet or None
    planner_state: Any
    observation: Any  # planner Observation of the last snapshot, or None
    observed_s: float | None
    profiles: Any


def state_inputs(ctrl: ControllerFace) -> StateInputs:
    """The planner's inputs as the controller holds them now (event loop: reads the hosts and the store)."""
    policy = ctrl.policy.policy
    snap = ctrl.last_snapshot
    obs = None
    if snap is not None and policy is not None:
        obs = to_observation(snap, ctrl.model_names())
    return StateInputs(
        generated_s=ctrl.wall(), now_s=ctrl.clock.now(), policy_path=str(ctrl.policy_path), policy=policy,
        fleet=ctrl.build_fleet() if policy is not None else None, planner_state=ctrl.planner_state,
        observation=obs, observed_s=snap.now_s if snap is not None else None, profiles=ctrl.profiles)


def state_doc(i: StateInputs) -> dict[str, Any]:
    """GET /api/state (for `fleetplan what-if`): the loaded policy, the fleet + planner state (a
    CURRENT document), the last observation (a DEMAND document) and the profiles. Pure: it may run
    in a worker thread."""
    from fleetplan.planner.serde import fleet_to_dict, observation_to_dict

    return {
        "generated_s": i.generated_s,
        "now_s": i.now_s,
        "policy_path": i.policy_path,
        "policy": i.policy.model_dump(mode="json") if i.policy is not None else None,
        "fleet": fleet_to_dict(i.fleet, i.planner_state) if i.fleet is not None else None,
        "demand": observation_to_dict(i.observation, i.observed_s) if i.observation is not None else None,
        "profiles": i.profiles.to_json_dict() if i.profiles is not None else None,
    }


def state(ctrl: ControllerFace) -> dict[str, Any]:
    """The planner's inputs as the controller holds them (GET /api/state)."""
    return state_doc(state_inputs(ctrl))

def report(ctrl: ControllerFace) -> dict[str, Any]:
    """Everything the report API serves; the plan is the STORED plan dict, never recomputed."""
    last = ctrl.store.last_plan()
    rep = ctrl.hosts.reported()
    fleet = []
    for row in ctrl.store.active_replicas():
        rs = rep.get(row.replica_id)
        fleet.append({
            **row.to_json(),
            "endpoint": ctrl.executor.endpoint(row),
            "routed": row.replica_id in ctrl.executor.routed,
            "reported_state": rs[1].state.value if rs else None,
            "reported_error": rs[1].error if rs else None,
        })
    hosts = {}
    for host, st in sorted(ctrl.hosts.statuses.items()):
        hosts[host] = {
            "online": st.online, "usable": ctrl.hosts.online(host), "gpu": st.gpu.value if st.gpu else None,
            "gpu_count": st.gpu_count, "desired_version": st.desired_version,
            "replicas": len(st.replicas), "last_status_age_s": round(ctrl.wall() - ctrl.hosts.status_wall.get(host, 0), 1),
        }
    desired = {
        h: {"version": d.version, "acked_version": d.acked_version, "ack_accepted": d.ack_accepted,
            "ack_errors": list(d.ack_errors), "published_s": d.published_s}
        for h, d in ctrl.store.desired_rows().items()
    }
    stored = ctrl.store.active_alerts()
    keys = {a["key"] for a in stored}
    alerts = [a["text"] for a in stored]
    alerts.extend(v for k, v in stored_runtime_alerts(ctrl.runtime_alerts).items() if k not in keys)
    return {
        "generated_s": ctrl.wall(),
        "now_s": ctrl.clock.now(),
        "time_scale": ctrl.time_scale,
        "policy": {"path": str(ctrl.policy_path), "loaded_s": ctrl.policy.loaded_s, "error": ctrl.policy.error},
        "mqtt_connected": ctrl.link.connected.is_set(),
        "actuation": ctrl.actuation(),
        "cycle_id": last[0] if last else None,
        "solve_s": last[2] if last else None,
        "plan": last[1] if last else None,
        "fleet": fleet,
        "hosts": hosts,
        "desired": desired,
        "builds": [b.to_json() for b in ctrl.store.builds()[-20:]],
        "actions": ctrl.store.actions(limit=40),
        "action_counts": ctrl.store.action_counts(),
        "history": ctrl.store.cycles(limit=30),
        "alerts": list(dict.fromkeys(alerts)),
    }
