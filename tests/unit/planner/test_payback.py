"""Engine builds that pay back (planner/payback.py): a build is started for savings the recent traffic
shows, not for one cycle's rate; a model nothing ready can serve builds anyway."""

from __future__ import annotations

from planner_helpers import TRT, VLLM, caps, hosts, key, policy

from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.counts import Candidate
from fleetplan.planner.payback import unpaid_builds
from fleetplan.planner.types import ActionKind, Fleet, ModelObservation, Observation, PlannerState

NOW = 1_700_000_000.0
V, T = key("m70", VLLM, tp=4), key("m70", TRT, tp=4)
POLICY = policy(models=("m70",), tps={"m70": [4]})  # headroom 0, $3 per GPU: $12/h a replica, builds 900 s
READY_V = Candidate(V, 1.75, 12.0, 60.0)
BUILD_T = Candidate(T, 1.92, 12.0, 45.0, build_s=900.0)  # the build: $12/h x 0.25 h = $3


def _history(rates: list[float]) -> tuple[tuple[float, float], ...]:
    """One sample a minute over the last len(rates) minutes, oldest first."""
    n = len(rates)
    return tuple((NOW - 60.0 * (n - 1 - i), r) for i, r in enumerate(rates))


def _observed(rates: list[float]) -> Observation:
    return Observation({"m70": ModelObservation("m70", rates[-1], 500.0, 200.0, history=_history(rates))})


def test_a_build_cheaper_only_for_a_few_minutes_is_not_started() -> None:
    # one TRT-LLM replica where vLLM needs two only while the rate sits in 1.75-1.92: 6 of 60 minutes
    trough = [1.2] * 54 + [1.8] * 6
    got = unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.8}, {"m70": _history(trough)}, NOW)
    assert set(got) == {T}
    assert "would save $1.38/h on average, the build costs $3.00 (pays back in 2.2 h; the limit 1 h)" in got[T]
    # a steady 1.8 rps: $12/h saved, paid back in 15 minutes
    steady = unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.8}, {"m70": _history([1.8] * 60)}, NOW)
    assert steady == {}


def test_the_savings_of_a_peak_that_has_passed_do_not_start_a_build() -> None:
    # 50 minutes at 1.8 rps (TRT-LLM saves a replica), then the rate falls to 1.5 (one replica of either)
    evening = [1.8] * 50 + [1.5] * 10
    got = unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.5}, {"m70": _history(evening)}, NOW)
    assert got == {T: ""}  # the past hour saved $10/h, but not at any rate the plan expects now
    # the same hour while the required rate is still at the peak: the build pays back
    assert unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.8}, {"m70": _history(evening)}, NOW) == {}
    # a rising morning is unchanged: rates below this cycle's count as they were
    morning = [1.2] * 30 + [1.8] * 30
    assert unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.8}, {"m70": _history(morning)}, NOW) == {}


def test_a_model_nothing_ready_serves_builds_anyway_and_kept_configs_stay() -> None:
    trough = _history([1.2] * 60)
    assert unpaid_builds(POLICY, [BUILD_T], {"m70": 1.2}, {"m70": trough}, NOW) == {}
    assert unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.2}, {"m70": trough}, NOW, keep=[T]) == {}
    # saving nothing at any recent rate: dropped, and no note (not news)
    assert unpaid_builds(POLICY, [READY_V, BUILD_T], {"m70": 1.2}, {"m70": trough}, NOW) == {T: ""}


def test_the_plan_starts_a_build_only_where_it_pays_back_and_says_why_not() -> None:
    table = caps({V: 1.75, T: 1.92})
    fleet = Fleet(hosts(2))
    brief = plan_with_capacities(_observed([1.2] * 54 + [1.8] * 6), fleet, POLICY, table, PlannerState.initial(), NOW)
    assert not any(a.kind is ActionKind.BUILD for a in brief.actions)
    assert {c.config for c in brief.target.counts} == {V}
    assert any("engine build not started" in n for n in brief.explanation.models[0].notes)
    steady = plan_with_capacities(_observed([1.8] * 60), fleet, POLICY, table, PlannerState.initial(), NOW)
    assert any(a.kind is ActionKind.BUILD and a.replica.config == T for a in steady.actions)
    assert {c.config for c in steady.target.counts} == {T}
    # samples that are no rate (NaN, negative, absurd) are dropped once, by the plan, before payback
    # reads the history: the steady hour still pays back
    noisy = plan_with_capacities(_observed([1.8] * 20 + [float("nan"), -1.0, 1e12] + [1.8] * 37), fleet, POLICY,
                                 table, PlannerState.initial(), NOW)
    assert {c.config for c in noisy.target.counts} == {T}
