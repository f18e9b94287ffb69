"""Per-model gauges leave with the model: a model removed from the policy stops being exported."""

from __future__ import annotations

from fleetplan.controller.metrics import ControllerMetrics


def test_a_model_that_left_the_policy_is_no_longer_exported() -> None:
    m = ControllerMetrics()
    for name in ("llama", "mistral"):
        m.planned_replicas.labels(name).set(2)
        m.demand_rps.labels(name).set(1.5)
    m.keep_models({"llama"})
    text = m.render().decode()
    assert 'fleetplan_planned_replicas{model="llama"} 2.0' in text
    assert 'model="mistral"' not in text
