"""Absurd engine counters (1e300 rps, inf, NaN, negative) are unknown demand, not a number: the plan
fails static, keeps min_replicas and says why; stage 1 never plans below min_replicas when its
solver cannot handle the numbers it is given."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from planner_helpers import H100, TRT, VLLM, caps, hosts, key, observe, policy

from fleetplan.planner.core import MAX_PLAUSIBLE_RPS, plan_to_dict, plan_with_capacities
from fleetplan.planner.counts import Candidate, CountProblem, ModelDemand, solve_counts
from fleetplan.planner.types import Fleet, ModelObservation, Observation, PlannerState

NOW = 1_700_000_000.0
CAPS = caps({key("m8", VLLM, tp=1): 10.0, key("m70", VLLM, tp=4): 4.0})
MINS = {"m8": {"min_replicas": 2}, "m70": {"min_replicas": 1}}


def _per_model(result: object) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in result.plan.counts:  # type: ignore[attr-defined]
        out[c.config.model] = out.get(c.config.model, 0) + c.replicas
    return out


@pytest.mark.parametrize("rate", [1e300, 1e18, MAX_PLAUSIBLE_RPS * 1.01, math.inf, math.nan, -5.0])
def test_absurd_rate_is_unknown_and_the_plan_keeps_min_replicas(rate: float) -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, model_extra=MINS)
    r = plan_with_capacities(observe({"m8": rate, "m70": 3.0}), Fleet(hosts(2)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert _per_model(r) == {"m8": 2, "m70": 1}  # min_replicas; m70's 3 rps fit one replica
    m8 = r.explanation.models[0]
    assert m8.model == "m8" and m8.observed_rps is None and m8.required_rps == 0.0
    assert any(n.startswith(f"observed rate {rate!r} is not a valid rate") for n in m8.notes), m8.notes
    assert any("fail static" in n for n in m8.notes)
    assert all(s.status == "OPTIMAL" for s in r.explanation.solver if s.stage == "counts")
    json.dumps(plan_to_dict(r), allow_nan=False)  # the report carries no inf/NaN


def test_a_large_but_plausible_rate_is_demand() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, model_extra=MINS)
    r = plan_with_capacities(observe({"m8": 1e5, "m70": 3.0}), Fleet(hosts(2)), p, CAPS,
                             PlannerState.initial(), NOW)
    m8 = r.explanation.models[0]
    assert m8.observed_rps == 1e5 and m8.unmet_rps > 0  # best effort: the whole fleet, min_replicas kept
    assert _per_model(r) == {"m8": 12, "m70": 1}


def test_absurd_history_samples_and_peaks_are_ignored() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, model_extra=MINS)
    history = tuple((NOW - 60.0 * i, 1e300 if i % 2 else 25.0) for i in range(10, 0, -1))
    obs = Observation({"m8": ModelObservation("m8", 25.0, 500.0, 200.0, history=history, peak_rps=math.inf),
                       "m70": ModelObservation("m70", 3.0, 500.0, 200.0, peak_rps=1e300)})
    r = plan_with_capacities(obs, Fleet(hosts(2)), p, CAPS, PlannerState.initial(), NOW)
    m8, m70 = r.explanation.models
    assert any(n.startswith("5 rate sample(s) in the history are not valid rates") for n in m8.notes), m8.notes
    assert any("peak rate inf is not a valid rate" in n for n in m8.notes)
    assert any("peak rate 1e+300 is not a valid rate" in n for n in m70.notes)
    assert m8.required_rps == pytest.approx(25.0) and _per_model(r) == {"m8": 3, "m70": 1}


def test_absurd_capacity_is_not_a_candidate() -> None:
    p = policy(tps={"m8": [1, 2], "m70": [4]}, model_extra=MINS)
    table = caps({key("m8", VLLM, tp=1): 10.0, key("m8", VLLM, tp=2): 1e300, key("m70", VLLM, tp=4): 4.0})
    r = plan_with_capacities(observe({"m8": 35.0, "m70": 3.0}), Fleet(hosts(2)), p, table,
                             PlannerState.initial(), NOW)
    assert {(c.config.model, c.config.tp): c.replicas for c in r.plan.counts} == {("m8", 1): 4, ("m70", 4): 1}


@pytest.mark.parametrize("backend", ["SCIP", "cp-sat"])
def test_stage1_given_unrepresentable_demand_keeps_current_and_tops_up_min_replicas(backend: str) -> None:
    """The core never passes such a number; if one gets through, the fallback still holds the floor."""
    cands = (Candidate(key("a", TRT, H100, 1), 14.0, 3.0, 45.0), Candidate(key("b", VLLM, H100, 4), 4.0, 12.0, 90.0))
    problem = CountProblem(candidates=cands,
                           demands=(ModelDemand("a", 1e300, 1, 2, None), ModelDemand("b", 10.0, 1, 1, None)),
                           slots={H100: {1: 32, 2: 16, 4: 8, 8: 4}}, current={key("a", TRT, H100, 1): 1},
                           backend=backend)
    sol = solve_counts(problem)
    assert sol.report.status.endswith("+KEPT_CURRENT"), sol.report.status
    assert sol.counts == {key("a", TRT, H100, 1): 2, key("b", VLLM, H100, 4): 1}
    assert sol.min_missed == {}


def test_stage1_fallback_without_room_keeps_what_runs() -> None:
    cands = (Candidate(key("a", TRT, H100, 1), 14.0, 3.0, 45.0),)
    problem = CountProblem(candidates=cands, demands=(ModelDemand("a", math.inf, 1, 4, None),),
                           slots={H100: {1: 2}}, current={key("a", TRT, H100, 1): 1})
    sol = solve_counts(dataclasses.replace(problem, backend="cp-sat"))
    assert sol.report.status.endswith("+KEPT_CURRENT") and sol.counts == {key("a", TRT, H100, 1): 2}
    assert sol.min_missed == {"a": 2}
