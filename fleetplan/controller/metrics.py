"""The controller's own Prometheus metrics, in a fresh registry (no global default registry)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ControllerMetrics", "config_label", "correction_series"]


class ControllerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.planned_replicas = Gauge(
            "fleetplan_planned_replicas", "replicas in the current plan", ["model"], registry=r
        )
        self.running_replicas = Gauge(
            "fleetplan_running_replicas", "replicas reported ready by the agents", ["model"], registry=r
        )
        self.desired_replicas = Gauge(
            "fleetplan_desired_replicas", "replicas in the hosts' desired states (incl. draining)",
            ["model"], registry=r,
        )
        self.solve_seconds = Histogram(
            "fleetplan_solve_seconds", "wall seconds of plan() per cycle", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )
        self.predicted_ttft_p99_seconds = Gauge(
            "fleetplan_predicted_ttft_p99_seconds", "plan's predicted p99 TTFT (worst config)", ["model"], registry=r
        )
        self.observed_ttft_p99_seconds = Gauge(
            "fleetplan_observed_ttft_p99_seconds", "observed p99 TTFT", ["model"], registry=r
        )
        self.predicted_itl_p99_seconds = Gauge(
            "fleetplan_predicted_itl_p99_seconds", "plan's predicted p99 ITL (worst config)", ["model"], registry=r
        )
        self.observed_itl_p99_seconds = Gauge("fleetplan_observed_itl_p99_seconds", "observed p99 ITL", ["model"], registry=r)
        self.demand_rps = Gauge("fleetplan_demand_rps", "demand the plan serves", ["model"], registry=r)
        self.capacity_rps = Gauge(
            "fleetplan_capacity_rps", "capacity of the replicas in the current plan", ["model"], registry=r
        )
        self.slo_ttft_p99_seconds = Gauge("fleetplan_slo_ttft_p99_seconds", "the policy's p99 TTFT SLO", ["model"], registry=r)
        self.slo_itl_p99_seconds = Gauge("fleetplan_slo_itl_p99_seconds", "the policy's p99 ITL SLO", ["model"], registry=r)
        self.unmet_demand_rps = Gauge(
            "fleetplan_unmet_demand_rps", "required rps the plan cannot serve", ["model"], registry=r
        )
        self.plan_usd_h = Gauge("fleetplan_plan_usd_per_hour", "cost of the current plan", registry=r)
        self.uncertainty_usd_h = Gauge(
            "fleetplan_uncertainty_usd_per_hour",
            "$/h the plan spends above what its corrected profiles would need with no uncertainty left",
            ["model"], registry=r)
        # planner/evidence.py slo_missed_share: the engines' histograms bound the share (at least,
        # at most; equal where the SLO's targets are bucket edges)
        self.slo_missed_ratio = Gauge(
            "fleetplan_observed_slo_missed_ratio",
            "share of the last window's requests that missed the SLO (TTFT or ITL above its target), "
            "as the engines' histogram buckets bound it", ["model", "bound"], registry=r)
        # planner/slo.py: the SLO over its period and the error budget left, bounded by the buckets
        self.slo_good_ratio = Gauge(
            "fleetplan_slo_good_ratio", "share of the SLO period's requests served within the SLO",
            ["model", "bound"], registry=r)
        self.slo_budget_remaining_ratio = Gauge(
            "fleetplan_slo_error_budget_remaining_ratio",
            "share of the SLO period's error budget left (below 0: overspent)", ["model", "bound"], registry=r)
        self.actions = Counter(
            "fleetplan_actions", "actions executed", ["kind", "status"], registry=r
        )
        # the brakes (planner/brakes.py): 0 in advisory mode or while paused; held actions per limit
        self.actuating = Gauge(
            "fleetplan_actuating", "1 if the controller acts on its plans (active mode, not paused)", registry=r
        )
        self.actions_held = Gauge(
            "fleetplan_actions_held", "planned actions held back this cycle", ["limit"], registry=r
        )
        self.cycles = Counter("fleetplan_cycles", "control cycles", ["status"], registry=r)
        self.alerts_active = Gauge("fleetplan_alerts_active", "active alerts", registry=r)
        self.stale_models = Gauge("fleetplan_stale_models", "models observed stale (fail static)", registry=r)
        self.policy_reloads = Counter("fleetplan_policy_reloads", "SIGHUP reloads", ["result"], registry=r)
        self.profile_correction_ratio = Gauge(
            "fleetplan_profile_correction_ratio",
            "capacity per replica the plan uses / what the profile alone says, per serving config "
            "(1.0: profile trusted; < 1: the fleet's latency says the engines are slower than profiled)",
            ["model", "config"], registry=r,
        )
        self.last_cycle_timestamp = Gauge(
            "fleetplan_last_cycle_timestamp_seconds", "unix time of the last finished cycle", registry=r
        )
        # 1 while the controller's MQTT session is up (the controller binds it to its link)
        self.mqtt_connected = Gauge("fleetplan_mqtt_connected", "1 if connected to the MQTT broker", registry=r)
        # the machine around the controller (issue 19): its state store, the router, the hosts' inventory
        self.store_writable = Gauge(
            "fleetplan_store_writable",
            "1 if the last write to the state store succeeded (0: no actuation until it can be written)", registry=r,
        )
        self.router_up = Gauge(
            "fleetplan_router_up",
            "1 if the router (nginx) answers its health probe and took the last routing reload", registry=r,
        )
        self.store_writable.set(1.0)  # until a write fails
        self.router_up.set(1.0)  # until a probe or a reload fails
        self.router_reload_failures = Counter(
            "fleetplan_router_reload_failures", "routing reloads the router refused or could not take", registry=r
        )
        self.report_refused = Counter(
            "fleetplan_report_refused",
            "report API reads answered 503 because report_max_concurrent were in flight", registry=r,
        )
        self.inventory_mismatch = Gauge(
            "fleetplan_inventory_mismatch",
            "1 if the host's agent reports GPUs its policy inventory does not have (the planner uses the agreed "
            "inventory)", ["host"], registry=r,
        )

    def per_model(self) -> tuple[Gauge, ...]:
        """The gauges labelled by model first."""
        return (self.planned_replicas, self.running_replicas, self.desired_replicas, self.predicted_ttft_p99_seconds,
                self.observed_ttft_p99_seconds, self.predicted_itl_p99_seconds, self.observed_itl_p99_seconds, self.demand_rps,
                self.capacity_rps, self.slo_ttft_p99_seconds, self.slo_itl_p99_seconds, self.unmet_demand_rps,
                self.uncertainty_usd_h, self.slo_missed_ratio, self.slo_good_ratio,
                self.slo_budget_remaining_ratio)

    def keep_models(self, models: set[str]) -> None:
        """Remove the series of models that left the policy (a stale gauge would keep alerting)."""
        for gauge in self.per_model():
            for labels in list(gauge._metrics):  # the label sets it holds (prometheus_client has no public list)
                if labels[0] not in models:
                    gauge.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def config_label(c: Mapping[str, Any]) -> str:
    """The `config` label of a serving config in a plan document: engine/gpuxTP/precision."""
    return f"{c['engine']}/{c['gpu']}x{c['tp']}/{c['precision']}"


def correction_series(doc: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(model, config) -> capacity_factor of every config in the stored plan's explanation."""
    out: dict[tuple[str, str], float] = {}
    for m in (doc.get("explanation") or {}).get("models", []):
        for c in m.get("configs", []):
            f = c.get("capacity_factor")
            if isinstance(f, int | float):
                out[(str(m["model"]), config_label(c))] = float(f)
    return out
