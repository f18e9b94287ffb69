"""The correction on the controller side: rendered from the stored plan document (report, explain) and
exported as fleetplan_profile_correction_ratio{model,config}.

The plan documents come from the real planner: profiles 1.6x optimistic (fleetplan.models.mix.scaled), a fleet
whose observed latency is what the true profiles predict, three cycles with the state carried."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetplan.controller.metrics import ControllerMetrics, correction_series
from fleetplan.controller.report import explanation_for, render_explain, render_report
from fleetplan.harness.demo import demo_policy
from fleetplan.harness.rig_tools import PROFILES  # the lab's profiles (70B TP4, vLLM + TRT-LLM)
from fleetplan.models.mix import LengthMix, predict_mix, scaled
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.profile import ProfileSet
from fleetplan.planner.core import plan, plan_to_dict
from fleetplan.planner.policy import load_policy_dict
from fleetplan.planner.serde import state_from_dict
from fleetplan.planner.types import (
    ConfigKey,
    ConfigObservation,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    PlannerState,
    Replica,
    ReplicaState,
)

M = "llama-3.1-70b"
VLLM = ConfigKey(M, Engine.VLLM, GpuType.H100, 4, Precision.BF16)
ISL, OSL = 1024, 256
T0 = 1_900_000_000.0


def _setup() -> tuple[Any, ProfileSet, ProfileSet]:
    if not PROFILES.exists():
        pytest.skip(f"{PROFILES} missing")
    doc = demo_policy(models=(M,), engines=("vllm",), cycle_s=30.0, scale_down_delay_s=120.0, max_actions=4,
                      min_replicas=1, max_replicas=6, ttft_p99_ms=800.0, itl_p99_ms=100.0, isl=ISL, osl=OSL)
    for m in doc["models"]:
        m["allowed"]["tp"] = [4]
    truth = ProfileSet.from_json_dict(json.loads(PROFILES.read_text()))
    optimistic = ProfileSet(tuple(scaled(p, 1.6) for p in truth.profiles))
    return load_policy_dict(doc, "test-policy"), truth, optimistic


def _docs(cycles: int = 3) -> list[dict[str, Any]]:
    policy, truth, optimistic = _setup()
    true_prof = truth.get(M, Engine.VLLM, GpuType.H100, 4)
    assert true_prof is not None
    hosts = tuple(HostInventory(f"h{i}", GpuType.H100, 8) for i in range(2))
    rate = 1.0
    reps = tuple(Replica(f"r{i}", VLLM, f"h{i}", (0, 1, 2, 3), ReplicaState.READY, 8000 + i, T0 - 3600)
                 for i in range(2))
    pred = predict_mix(true_prof, LengthMix.single(ISL, OSL), rate / len(reps))  # what the fleet really does
    state = PlannerState.initial()
    docs = []
    for i in range(cycles):
        now = T0 + 30.0 * i
        ev = ConfigObservation(VLLM, len(reps), rate, pred.ttft_p99_ms, pred.itl_p99_ms, 200.0)
        obs = Observation({M: ModelObservation(M, rate, ISL, OSL, pred.ttft_p99_ms, pred.itl_p99_ms,
                                               history=((now - 60, rate), (now, rate)), configs=(ev,))})
        result = plan(obs, Fleet(hosts, reps), policy, optimistic, state, now)
        doc = plan_to_dict(result)
        doc["now_s"] = now
        doc["cycle_id"] = i + 1
        docs.append(doc)
        state = result.next_state
    return docs


def _config(doc: dict[str, Any]) -> dict[str, Any]:
    (m,) = doc["explanation"]["models"]
    (c,) = [c for c in m["configs"] if c["engine"] == "vllm"]
    return c


def test_the_stored_plan_carries_the_correction_and_the_report_shows_it() -> None:
    docs = _docs()
    c = _config(docs[-1])
    assert c["capacity_factor"] < 0.85, c
    assert c["observed_ttft_p99_ms"] is not None and c["observed_rps_per_replica"] == pytest.approx(0.5)
    corr = [k for k in docs[-1]["next_state"]["corrections"] if k["engine"] == "vllm"]
    assert corr and corr[0]["since_s"] is not None and corr[0]["observations"] == 3
    # the stored state reads back (what the daemon does after a restart)
    st = state_from_dict(docs[-1]["next_state"], "test")
    assert any(k.config == VLLM and k.observations == 3 for k in st.corrections)

    data = {"generated_s": T0, "cycle_id": 3, "plan": docs[-1], "fleet": [], "actions": []}
    text = render_report(data)
    assert "per config: profile vs the fleet's latency" in text
    assert f"{M}: length mix isl mean 1024" in text
    assert f"x {c['capacity_factor']:.2f} (corrected)" in text
    assert "observed at 0.50 rps/replica" in text
    assert "in force since 2030-" in text  # T0 = 2030-03-17: the correction's since_s, as a date
    ex = render_explain(data, M)
    assert ex is not None
    assert "length mix used for capacity: isl mean 1024" in ex and "correction: engine speed vs profile" in ex
    assert "corrected profile predicts at" in ex and "in force since" in ex
    e = explanation_for(data, M)
    assert e is not None and e["corrections"] and e["corrections"][0]["model"] == M


def test_first_plan_has_no_correction_and_says_so() -> None:
    policy, _, optimistic = _setup()
    hosts = tuple(HostInventory(f"h{i}", GpuType.H100, 8) for i in range(2))
    obs = Observation({M: ModelObservation(M, 0.5, ISL, OSL)})
    doc = plan_to_dict(plan(obs, Fleet(hosts), policy, optimistic, PlannerState.initial(), T0))
    doc["now_s"] = T0
    text = render_report({"generated_s": T0, "plan": doc, "fleet": [], "actions": []})
    assert "(profile trusted)" in text and "correction: none (no evidence yet)" in text
    assert "observed: no evidence from this config" in text


def test_correction_gauge_follows_the_plan_and_drops_configs_that_left_it() -> None:
    docs = _docs(2)
    series = correction_series(docs[-1])
    assert (M, "vllm/h100x4/bf16") in series and series[(M, "vllm/h100x4/bf16")] < 1.0
    metrics = ControllerMetrics()
    g = metrics.profile_correction_ratio
    for (model, cfg), v in series.items():
        g.labels(model, cfg).set(v)
    text = metrics.render().decode()
    assert f'fleetplan_profile_correction_ratio{{config="vllm/h100x4/bf16",model="{M}"}}' in text
    empty = {"explanation": {"models": [{"model": M, "configs": []}]}}
    assert correction_series(empty) == {}


def test_daemon_removes_the_label_set_of_a_config_that_left_the_plan() -> None:
    from types import SimpleNamespace

    from fleetplan.controller.reporting import update_correction_metrics

    fake = SimpleNamespace(metrics=ControllerMetrics(), correction_labels=set())

    def doc(*configs: tuple[str, float]) -> dict[str, Any]:
        return {"explanation": {"models": [{"model": M, "configs": [
            {"engine": e, "gpu": "h100", "tp": 4, "precision": "bf16", "capacity_factor": f} for e, f in configs]}]}}

    update_correction_metrics(fake, doc(("vllm", 0.7), ("trtllm", 1.0)))  # type: ignore[arg-type]
    text = fake.metrics.render().decode()
    assert 'config="vllm/h100x4/bf16"' in text and 'config="trtllm/h100x4/bf16"' in text
    update_correction_metrics(fake, doc(("vllm", 0.65)))  # type: ignore[arg-type]
    text = fake.metrics.render().decode()
    assert f'fleetplan_profile_correction_ratio{{config="vllm/h100x4/bf16",model="{M}"}} 0.65' in text
    assert 'config="trtllm/h100x4/bf16"' not in text
