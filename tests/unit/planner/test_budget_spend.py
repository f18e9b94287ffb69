"""Spending the error budget where the policy allows it: a window floor below the objective."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner_helpers import BF16, H100, VLLM, hosts, policy

from fleetplan.models import profile as mp
from fleetplan.planner.core import plan
from fleetplan.planner.slo import record
from fleetplan.planner.types import Fleet, ModelObservation, Observation, PlannerState

NOW = 1_700_000_000.0
TRUE = mp.PerfProfile(mp.ConfigKey("m8", VLLM, H100, 1, BF16),
                      mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06, p2_ms=2e-7, q=1.0),
                      kv_tokens=400_000.0,
                      data_range=mp.DataRange((128.0, 4096.0), (64.0, 1024.0), (0.5, 20.0), None, 8))
RATE = 60.0


def _policy(**slo: float) -> object:
    return policy(models=("m8",), model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]},
                                                      "slo": {"ttft_p99_ms": 1000, "itl_p99_ms": 80, **slo}}})


def _ledger(missed_share: float) -> PlannerState:
    """Half an hour of readings at RATE with `missed_share` of the requests missed."""
    led: tuple[Any, ...] = ()
    for k in range(30):
        led = record(led, "m8", NOW - 1800 + 60 * k, RATE, (missed_share, missed_share), 3600.0, 60.0)
    return replace(PlannerState.initial(), budget=led)


def _replicas(p: object, state: PlannerState) -> tuple[int, tuple[str, ...], float]:
    r = plan(Observation({"m8": ModelObservation("m8", RATE, 500.0, 200.0)}), Fleet(hosts(2)), p,  # type: ignore[arg-type]
             mp.ProfileSet((TRUE,)), state, NOW)
    me = r.explanation.models[0]
    return sum(c.replicas for c in r.plan.counts), me.notes, me.configs[0].capacity_per_replica_rps


def test_a_full_budget_under_a_floor_sizes_fewer_replicas_and_says_so() -> None:
    targets, _, cap = _replicas(_policy(objective=0.99), _ledger(0.0))  # no floor: the p99 targets
    spending, notes, cap_spent = _replicas(_policy(objective=0.99, window_floor=0.95), _ledger(0.0))
    assert cap_spent > cap * 1.02 and spending < targets
    assert any("error budget spent: this window sized for 95.00% good requests" in n for n in notes)


def test_a_spent_budget_or_none_counted_plans_the_targets() -> None:
    targets, _, cap = _replicas(_policy(objective=0.99), _ledger(0.0))
    overspent, notes, cap_o = _replicas(_policy(objective=0.99, window_floor=0.95), _ledger(0.03))
    fresh, _, cap_f = _replicas(_policy(objective=0.99, window_floor=0.95), PlannerState.initial())
    assert (overspent, cap_o) == (targets, cap) and (fresh, cap_f) == (targets, cap)
    assert not any("error budget spent" in n for n in notes)


def test_half_the_budget_left_plans_halfway_to_the_floor() -> None:
    _, notes, _ = _replicas(_policy(objective=0.99, window_floor=0.95), _ledger(0.005))
    assert any("sized for 97.00% good requests" in n for n in notes)
