"""Counterfactuals stored with every plan: alternatives, why they lost, flip loads, relaxations."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from planner_helpers import TRT, VLLM, caps, hosts, key, observe, policy

from fleetplan.models.profile import ProfileSet
from fleetplan.planner.core import plan_to_dict, plan_with_capacities
from fleetplan.planner.counterfactual import MANY_MODELS, flip_range
from fleetplan.planner.types import Fleet, LossReason, PlannerState, Replica, ReplicaState

ROOT = Path(__file__).resolve().parents[3]
NOW = 1_700_000_000.0
CAPS = caps({key("m8", VLLM, tp=1): 10.0, key("m8", TRT, tp=1): 14.0, key("m8", VLLM, tp=2): 18.0,
             key("m70", VLLM, tp=4): 4.0, key("m70", TRT, tp=4): 6.0, key("m70", VLLM, tp=8): 7.0})


def _alts(result: object, model: str) -> dict[tuple[str, int, str], object]:
    me = next(m for m in result.explanation.models if m.model == model)  # type: ignore[attr-defined]
    return {(a.config.engine.value, a.config.tp, a.config.gpu.value): a for a in me.alternatives}


def test_flip_range_is_exact_on_the_step_functions() -> None:
    # alternative: 10 rps for $3; chosen: 25 rps for $6 (headroom 0, no minimum)
    # alt cheaper on (0, 10] ($3 < $6) and (25, 30] ($9 < $12); tie on (10, 20]; dearer on (20, 25]
    assert flip_range(20.0, 0.0, 0, (10.0, 3.0), [(25.0, 6.0)], 100.0) == pytest.approx((25.0, 30.0))
    assert flip_range(12.0, 0.0, 0, (10.0, 3.0), [(25.0, 6.0)], 100.0) == pytest.approx((0.0, 10.0))
    assert flip_range(5.0, 0.0, 0, (10.0, 3.0), [(25.0, 6.0)], 100.0) == pytest.approx((0.0, 10.0))  # now
    # headroom scales the breakpoints: required = d x 1.25
    assert flip_range(17.0, 0.25, 0, (10.0, 3.0), [(25.0, 6.0)], 100.0) == pytest.approx((20.0, 24.0))
    # never cheaper: a dominated alternative
    assert flip_range(20.0, 0.0, 0, (10.0, 6.0), [(25.0, 6.0)], 100.0) is None
    # min_replicas 2 applies to both: chosen $12 up to 50 rps, alt $6/$9 up to 30 rps
    assert flip_range(40.0, 0.0, 2, (10.0, 3.0), [(25.0, 6.0)], 100.0) == pytest.approx((0.0, 30.0))


def test_every_allowed_config_not_chosen_is_an_alternative_with_a_reason() -> None:
    p = policy(tps={"m8": [1, 2], "m70": [4, 8]}, prices={"h100": 3.0, "a100": 2.0})
    r = plan_with_capacities(observe({"m8": 40.0, "m70": 12.0}), Fleet(hosts(4)), p, CAPS,
                             PlannerState.initial(), NOW)
    chosen = {c.config for c in r.plan.counts}
    assert {c.config.engine for c in r.plan.counts} == {VLLM}  # TensorRT-LLM engines not built yet
    m8 = _alts(r, "m8")
    assert all(a.config not in chosen for a in m8.values())  # type: ignore[attr-defined]
    # 2 engines x 2 GPU types x 2 TP sizes, minus the chosen one(s)
    assert len(m8) + sum(1 for c in chosen if c.model == "m8") == 8
    trt1 = m8[("trtllm", 1, "h100")]
    assert trt1.reason is LossReason.BUILD_PENDING  # type: ignore[attr-defined]
    assert trt1.replicas == 3 and trt1.usd_h == 9.0  # type: ignore[attr-defined]
    assert m8[("trtllm", 2, "h100")].reason is LossReason.SLO  # type: ignore[attr-defined]  # no capacity
    assert m8[("vllm", 1, "a100")].reason is LossReason.INVENTORY  # type: ignore[attr-defined]  # no host
    m70 = _alts(r, "m70")
    assert m70[("vllm", 8, "h100")].reason is LossReason.COST  # type: ignore[attr-defined]
    assert m70[("vllm", 8, "h100")].usd_h == 48.0  # type: ignore[attr-defined]  # 2 x TP8 for 12 rps
    assert m70[("trtllm", 4, "h100")].reason is LossReason.BUILD_PENDING  # type: ignore[attr-defined]
    doc = plan_to_dict(r)
    json.dumps(doc)
    for m in doc["explanation"]["models"]:
        assert m["alternatives"]
        for a in m["alternatives"]:
            assert set(a) >= {"engine", "tp", "gpu", "usd_h", "reason", "replicas", "flip_rps", "detail"}
            assert a["reason"] in {x.value for x in LossReason}


def test_max_replicas_reason_and_relaxation_by_one_replica() -> None:
    extra = {"m8": {"max_replicas": 4, "allowed": {"engines": ["vllm", "trtllm"], "tp": [1]}}}
    p = policy(models=("m8",), model_extra=extra, cached=[("m8", "h100", 1)])
    r = plan_with_capacities(observe({"m8": 60.0}), Fleet(hosts(2)), p, CAPS, PlannerState.initial(), NOW)
    assert {c.config: c.replicas for c in r.plan.counts} == {key("m8", TRT, tp=1): 4}  # 56 of 60 rps
    alts = _alts(r, "m8")
    assert alts[("vllm", 1, "h100")].reason is LossReason.MAX_REPLICAS  # type: ignore[attr-defined]
    relax = {x.constraint: x for x in r.explanation.relaxations}
    x = relax["max_replicas m8"]
    assert x.model == "m8" and x.step == "+1 replica"
    assert x.unmet_rps_before == pytest.approx(4.0) and x.unmet_rps_after == pytest.approx(0.0)
    assert x.usd_h_after - x.usd_h_before == pytest.approx(3.0)  # one more TP1 replica
    assert "costs $3.00/h" in x.detail
    # no profiles given (capacity table only): the SLO step is said to be skipped, not faked
    assert not [k for k in relax if k.startswith("slo ")]
    assert any("SLO +10% not evaluated" in n for n in r.explanation.notes)
    # the re-solve is reported with the solver's own status
    assert [s.stage for s in r.explanation.solver].count("counterfactual") == 1


def test_relaxation_of_binding_inventory_adds_a_host() -> None:
    p = policy(models=("m8",), model_extra={"m8": {"allowed": {"engines": ["vllm"], "tp": [1]}}})
    r = plan_with_capacities(observe({"m8": 100.0}), Fleet(hosts(1)), p, CAPS, PlannerState.initial(), NOW)
    assert r.explanation.models[0].unmet_rps == pytest.approx(20.0)  # 8 GPUs x 10 rps
    x = {x.constraint: x for x in r.explanation.relaxations}["inventory h100"]
    assert x.step.startswith("+1 host (8 GPUs")
    assert x.unmet_rps_after == pytest.approx(0.0) and x.usd_h_after - x.usd_h_before == pytest.approx(6.0)


def test_a_host_more_changes_nothing_while_the_gpu_budget_still_binds() -> None:
    p = policy(models=("m8",), model_extra={"m8": {"allowed": {"engines": ["vllm"], "tp": [1]}}},
               budget={"max_gpus": 8})
    r = plan_with_capacities(observe({"m8": 100.0}), Fleet(hosts(1)), p, CAPS, PlannerState.initial(), NOW)
    assert "budget max_gpus: 8/8 used" in r.explanation.binding_constraints
    relax = {x.constraint: x for x in r.explanation.relaxations}
    assert relax["inventory h100"].detail.endswith("no change (another constraint still binds)")
    assert relax["budget max_gpus"].detail.endswith("no change (another constraint still binds)")


def test_running_replicas_kept_over_a_cheaper_config_is_churn() -> None:
    extra = {"m8": {"allowed": {"engines": ["vllm", "trtllm"], "tp": [1]}}}
    p = policy(models=("m8",), model_extra=extra, cached=[("m8", "h100", 1)], scaling={"churn_cost_usd_h": 2.0})
    running = tuple(Replica(f"r{i}", key("m8", VLLM, tp=1), "h00", (i,), ReplicaState.READY, 8000 + i)
                    for i in range(4))
    r = plan_with_capacities(observe({"m8": 40.0}), Fleet(hosts(1), running), p, CAPS, PlannerState.initial(), NOW)
    assert {c.config: c.replicas for c in r.plan.counts} == {key("m8", VLLM, tp=1): 4}
    trt = _alts(r, "m8")[("trtllm", 1, "h100")]
    assert trt.reason is LossReason.CHURN and trt.usd_h == 9.0  # type: ignore[attr-defined]


def test_many_models_skip_the_re_solves_and_say_so() -> None:
    names = tuple(f"m{i}" for i in range(MANY_MODELS + 1))
    extra = {n: {"allowed": {"engines": ["vllm"], "tp": [1]}} for n in names}
    table = caps({key(n, VLLM, tp=1): 10.0 for n in names})
    p = policy(models=names, model_extra=extra)
    r = plan_with_capacities(observe({n: 100.0 for n in names}), Fleet(hosts(2)), p, table,
                             PlannerState.initial(), NOW)
    assert r.explanation.relaxations == ()
    assert any("re-solves skipped" in n for n in r.explanation.notes)
    assert "counterfactual" not in [s.stage for s in r.explanation.solver]


def test_plan_command_on_the_example_policy_shows_alternatives_and_a_flip_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleetplan.harness.cli import main

    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(ProfileSet().to_json_dict()))  # no data: roofline priors
    args = ["plan", "--policy", str(ROOT / "config/example-policy.yaml"), "--profiles", str(profiles),
            "--demand", str(ROOT / "config/example-demand.yaml")]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    models = doc["explanation"]["models"]
    assert {m["model"] for m in models} == {"llama-3-8b", "llama-3-70b"}
    for m in models:
        chosen = {(c["engine"], c["tp"]) for c in m["configs"]}
        alts = {(a["engine"], a["tp"]) for a in m["alternatives"]}
        assert alts and not alts & chosen and len(alts | chosen) == 4  # 2 engines x 2 TP sizes on h100
        for a in m["alternatives"]:
            assert a["usd_h"] is not None and a["usd_h"] > 0 and a["reason"] in {x.value for x in LossReason}
    # where the reason is an objective term, the detail quotes the solver's own objective: the chosen
    # configs' terms of both models add up to the stage-1 objective the solver reported
    chosen_obj = []
    for m in models:
        objs = {re.search(r"objective ([\d.]+) vs ([\d.]+)", a["detail"]).group(2)  # type: ignore[union-attr]
                for a in m["alternatives"] if a["reason"] in ("churn", "tie", "lead_time")}
        assert len(objs) <= 1  # one chosen objective per model, when an objective term decided
        chosen_obj.extend(float(x) for x in objs)
    if len(chosen_obj) == len(models):
        assert sum(chosen_obj) == pytest.approx(doc["explanation"]["solver"][0]["objective"], abs=2e-3)
    flips = [a for m in models for a in m["alternatives"] if a["flip_rps"] is not None]
    assert flips and all(a["flip_side"] in ("above", "below") for a in flips)
    # with profiles, the SLO +10% step is re-solved for each model whose replicas are SLO-bound
    assert {r["constraint"] for r in doc["explanation"]["relaxations"]} >= {"slo llama-3-8b", "slo llama-3-70b"}

    assert main(args) == 0
    out = capsys.readouterr().out
    section = out[out.index("ALTERNATIVES"):out.index("PLAN (now)")]
    for m in models:
        head = section.index(f"{m['model']}: chosen")
        for a in m["alternatives"]:
            row = f"{a['engine']} {a['gpu']} tp{a['tp']}"
            line = next(x for x in section[head:].splitlines() if x.strip().startswith(row))
            assert f"{a['usd_h']:.2f}" in line and a["reason"] in line
    assert "cheaper above" in section or "cheaper below" in section
    assert "RELAXATIONS" in out and "SLO +10%" in out


def test_slo_relaxed_capacities_are_larger_and_the_demand_document_round_trips() -> None:
    import yaml

    from fleetplan.planner.capacity import MixedWorkload, capacity_table
    from fleetplan.planner.counterfactual import slo_relaxed_capacities
    from fleetplan.planner.policy import load_policy_text
    from fleetplan.planner.serde import observation_from_dict, observation_to_dict
    from fleetplan.planner.types import ModelObservation, Observation

    p = load_policy_text((ROOT / "config/example-policy.yaml").read_text(), "example-policy.yaml")
    w = {m.name: MixedWorkload(820.0, 200.0) for m in p.models}
    gpus = {h.gpu for h in p.hosts}
    base, _ = capacity_table(p, ProfileSet(), w, gpus)
    relaxed = slo_relaxed_capacities(p, ProfileSet(), w, gpus)
    assert set(relaxed) == set(base)
    assert all(relaxed[k].max_rps >= base[k].max_rps for k in base)
    assert any(relaxed[k].max_rps > base[k].max_rps * 1.01 for k in base)
    assert p.models[0].slo.ttft_p99_ms == 500  # the policy itself is untouched

    demand = yaml.safe_load((ROOT / "config/example-demand.yaml").read_text())
    obs, t = observation_from_dict(demand)
    assert observation_from_dict(observation_to_dict(obs, t)) == (obs, t)
    odd = Observation({"m": ModelObservation("m", float("nan"), 0.0, 200.0, float("inf"), None,
                                             ((1.0, 2.0), (2.0, float("nan"))))})
    back, _ = observation_from_dict(observation_to_dict(odd))
    assert back.models["m"] == ModelObservation("m", None, None, 200.0, None, None, ((1.0, 2.0),))
