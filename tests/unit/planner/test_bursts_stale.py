"""Bursts across stale observations: a start inside a burst makes the next reading stale (the new
replica's window is not covered yet), and the burst memory must outlive that cycle."""

from __future__ import annotations

from planner_helpers import hosts, policy
from test_plan_evidence import NOW, TRUE, _obs

from fleetplan.models import profile as mp
from fleetplan.planner.core import plan
from fleetplan.planner.types import Fleet, PlannerState, PlanResult

P = policy(models=("m8",), scaling={"scale_down_delay_s": 300, "cycle_s": 60},
           model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}, "headroom": 0.0}})
PROFILES = mp.ProfileSet((TRUE,))


def _required(r: PlanResult) -> float:
    return r.explanation.models[0].required_rps


def test_a_stale_cycle_keeps_the_burst_memory() -> None:
    burst = plan(_obs(10.0, 0, None, None, peak_rps=60.0), Fleet(hosts(2)), P, PROFILES, PlannerState.initial(), NOW)
    stale = plan(_obs(10.0, 0, None, None, stale=True), Fleet(hosts(2)), P, PROFILES, burst.next_state, NOW + 60)
    assert _required(stale) == _required(burst)  # the stale cycle plans on the burst it remembers
    assert any(n.startswith("bursts:") for n in stale.explanation.models[0].notes)
    after = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), P, PROFILES, stale.next_state, NOW + 120)
    assert _required(after) == _required(burst)  # and hands it on: not forgotten within the SLO's period
    gone = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), P, PROFILES, after.next_state, NOW + 3700)
    assert _required(gone) < _required(burst) / 3


def test_a_stale_peak_is_a_lower_bound_that_raises_capacity() -> None:
    calm = plan(_obs(10.0, 0, None, None, stale=True), Fleet(hosts(2)), P, PROFILES, PlannerState.initial(), NOW)
    peak = plan(_obs(10.0, 0, None, None, stale=True, peak_rps=60.0), Fleet(hosts(2)), P, PROFILES,
                PlannerState.initial(), NOW)
    assert _required(peak) > 3 * _required(calm)
    assert peak.next_state.bursts and peak.next_state.bursts[0][0] == "m8"
