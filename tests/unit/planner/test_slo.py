"""The SLO users write (the ratio form: targets, an objective over a rolling period, a per-window
floor, an opt-in "every window" kind), and the error budget the plan reports from the engines'
histograms (planner/slo.py), carried in the planner state and the plan JSON."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from planner_helpers import caps, hosts, key, policy_dict

from fleetplan.planner.core import plan_to_dict, plan_with_capacities
from fleetplan.planner.policy import Policy, PolicyError, load_policy_dict
from fleetplan.planner.serde import state_from_dict
from fleetplan.planner.slo import ObjectiveKind
from fleetplan.planner.types import Fleet, ModelObservation, Observation, PlannerState, PlanResult

INF = math.inf
M = "m8"
KEY = key(M)
T0 = 1_700_000_000.0
# TTFT target 1 s on a bucket edge: 1% of the window's requests above it (exact); ITL all fast
MISS_1PCT = ((0.5, 95.0), (1.0, 99.0), (INF, 100.0))
NO_MISS = ((0.5, 99.0), (1.0, 100.0), (INF, 100.0))
FAST_ITL = ((0.05, 100.0), (INF, 100.0))


def _policy(**slo: Any) -> Policy:
    d = policy_dict(models=(M,), tps={M: [1]})
    d["models"][0]["slo"] = {"ttft_p99_ms": 1000, "itl_p99_ms": 80, **slo}
    return load_policy_dict(d, "slo-policy")


def test_the_old_spelling_reads_as_targets_at_a_99pct_objective_over_an_hour() -> None:
    s = _policy().models[0].slo
    assert (s.ttft_p99_ms, s.itl_p99_ms, s.objective, s.period_s, s.kind, s.floor) == \
        (1000.0, 80.0, 0.99, 3600.0, ObjectiveKind.PERIOD, 0.99)


def test_the_ratio_form() -> None:
    d = policy_dict(models=(M,))
    d["models"][0]["slo"] = {"ttft_ms": 1500, "itl_ms": 60, "objective": 0.995, "period_s": 86400,
                             "window_floor": 0.98, "kind": "every_window"}
    s = load_policy_dict(d, "p").models[0].slo
    assert (s.ttft_p99_ms, s.itl_p99_ms, s.objective, s.period_s, s.floor, s.kind) == \
        (1500.0, 60.0, 0.995, 86400.0, 0.98, ObjectiveKind.EVERY_WINDOW)


@pytest.mark.parametrize(("slo", "says"), [
    ({"window_floor": 0.995}, "models[0].slo: window_floor 0.995 is above the objective 0.99"),
    ({"kind": "p99"}, "models[0].slo.kind = 'p99'"),
    ({"objective": 1.0}, "models[0].slo.objective = 1.0"),
    ({"period_s": 10}, "models[0].slo.period_s = 10"),
    ({"ttft_ms": 900}, "ttft_p99_ms"),  # both spellings of one target
])
def test_a_bad_slo_names_the_field_and_value(slo: dict[str, Any], says: str) -> None:
    with pytest.raises(PolicyError) as e:
        _policy(**slo)
    assert says in str(e.value) and "slo-policy" in str(e.value)


def _obs(rate: float, ttft: tuple[tuple[float, float], ...], stale: bool = False) -> Observation:
    return Observation({M: ModelObservation(M, rate, 500.0, 200.0, stale=stale, ttft_buckets=ttft,
                                            tpot_buckets=FAST_ITL)})


def _cycles(p: Policy, readings: list[tuple[float, tuple[tuple[float, float], ...], bool]],
            state: PlannerState | None = None, t0: float = T0) -> tuple[PlanResult, PlannerState]:
    """One plan per reading, 60 s apart (the policy's cycle), the state carried."""
    st = state or PlannerState.initial()
    r = None
    for i, (rate, ttft, stale) in enumerate(readings):
        r = plan_with_capacities(_obs(rate, ttft, stale), Fleet(hosts(1)), p, caps({KEY: 5.0}), st, t0 + 60.0 * i,
                                 counterfactuals=False)
        st = r.next_state
    assert r is not None
    return r, st


def test_the_budget_is_the_periods_misses_against_the_objective_and_survives_a_restart() -> None:
    p = _policy()
    # 30 minutes at 2 rps: 20 of them miss 1% of their requests, 10 miss none -> 0.67% missed
    readings = [(2.0, MISS_1PCT if i % 3 else NO_MISS, False) for i in range(30)]
    r, st = _cycles(p, readings)
    b = r.explanation.models[0].error_budget
    assert b is not None
    assert b.requests == pytest.approx(2.0 * 60 * 30)
    assert b.good_share == pytest.approx((1 - 0.2 / 30, 1 - 0.2 / 30), abs=1e-9)  # targets on bucket edges
    assert b.budget_left == pytest.approx((1 / 3, 1 / 3))  # 2/3 of the 1% spent
    assert b.worst_slice_good_share == pytest.approx(0.99)
    doc = json.loads(json.dumps(plan_to_dict(r)))  # the plan JSON carries it as the reports read it
    eb = doc["explanation"]["models"][0]["error_budget"]
    assert eb["kind"] == "period" and eb["objective"] == 0.99
    assert eb["budget_left"] == pytest.approx([1 / 3, 1 / 3])
    restored = state_from_dict(doc["next_state"])  # what the daemon stores and reloads
    assert restored.budget == st.budget
    r2, _ = _cycles(p, [(2.0, NO_MISS, False)], restored, T0 + 60.0 * 30)
    assert r2.explanation.models[0].error_budget.requests == pytest.approx(2.0 * 60 * 31)  # type: ignore[union-attr]


def test_the_period_rolls_and_an_unknown_window_adds_nothing() -> None:
    p = _policy(period_s=600)  # ten minutes, for the test
    bad, _ = _cycles(p, [(2.0, MISS_1PCT, False)] * 3 + [(2.0, NO_MISS, True)] * 2)
    b = bad.explanation.models[0].error_budget
    assert b is not None and b.requests == pytest.approx(360.0)  # the stale windows are not counted
    assert b.budget_left == pytest.approx((0.0, 0.0))  # 1% missed against a 1% budget: spent
    later, _ = _cycles(p, [(2.0, MISS_1PCT, False)] * 3 + [(2.0, NO_MISS, False)] * 12)
    b2 = later.explanation.models[0].error_budget
    assert b2 is not None and b2.good_share[0] == pytest.approx(1.0)  # the misses left the period
    assert b2.budget_left == pytest.approx((1.0, 1.0))


def test_a_target_inside_a_bucket_is_a_range_and_a_stricter_objective_is_said() -> None:
    p = _policy(ttft_p99_ms=750, objective=0.999)  # 0.75 s inside (0.5, 1.0]: 1-5% may have missed
    r, _ = _cycles(p, [(2.0, MISS_1PCT, False)])
    b = r.explanation.models[0].error_budget
    assert b is not None
    assert b.good_share == pytest.approx((0.95, 0.99))
    assert b.budget_left[0] < b.budget_left[1] < 0  # overspent whichever way the bucket reads
    assert any("sized for the p99" in n for n in r.explanation.models[0].notes)


def test_explain_and_the_plan_page_show_the_budget_left() -> None:
    from fleetplan.controller.page import render_page
    from fleetplan.controller.report import render_explain

    readings = [(2.0, MISS_1PCT if i % 3 else NO_MISS, False) for i in range(30)]
    r, _ = _cycles(_policy(), readings)
    doc = json.loads(json.dumps(plan_to_dict(r)))
    text = render_explain({"plan": doc}, M) or ""
    # 30 of the 60 minutes counted, 2/3 of the 1% spent
    assert ("SLO over the last 1 h (99% of requests, 30 min of it counted so far): 99.33% good, 33% of the "
            "error budget left; worst slice 99.00%") in text
    page = render_page({"plan": doc, "cycle_id": 30}, {}, T0 + 60.0 * 30)
    assert "<h2>SLO and error budget</h2>" in page and "33% of the error budget left" in page
    empty = render_page({"plan": {"explanation": {"models": []}}}, {}, T0)
    assert "no request counted yet" in empty
