"""planner/uncertainty.py: the $/h a plan spends because its estimates are not certain yet, and why."""

from __future__ import annotations

from fleetplan.planner.capacity import CapacityInfo, Speeds
from fleetplan.planner.types import ConfigExplanation, ModelExplanation
from fleetplan.planner.uncertainty import cost_of_uncertainty
from tests.unit.planner.planner_helpers import key, policy

C = key("m8", tp=1)


def _model(replicas: int, required_rps: float, demand_rps: float = 10.0) -> ModelExplanation:
    cfg = ConfigExplanation(C, replicas, 5.0, "itl", demand_rps / replicas, None, None, 3.0 * replicas)
    return ModelExplanation("m8", demand_rps, demand_rps, demand_rps, 0.0, required_rps, 5.0 * replicas,
                            5.0 * replicas, 0.0, 500.0, 50.0, 3.0 * replicas, (cfg,), ())


def test_an_extrapolating_profile_applied_at_half_speed_costs_the_replicas_it_adds() -> None:
    p = policy(tps={"m8": [1], "m70": [4]})
    price = p.price_usd_h(C.gpu) or 0.0
    # applied at x0.5 while extrapolating (5 rps per replica), the profile itself says 10 rps
    table = {C: CapacityInfo(5.0, "itl", profile_rps=10.0, extrapolating=("prompts up to 9000 (p99)",))}
    u = cost_of_uncertainty(_model(2, 10.0), p, table, {C: Speeds(0.5, 0.5)}, {}, {}, {})
    assert u.ideal_usd_h == price  # one replica at 10 rps serves the 10 rps
    assert abs(u.usd_h - price) < 1e-9
    assert len(u.why) == 1 and u.why[0].startswith("extrapolating: ")


def test_a_confirmed_estimate_and_no_burst_cost_nothing_and_a_burst_floor_is_named() -> None:
    p = policy(tps={"m8": [1], "m70": [4]})
    table = {C: CapacityInfo(5.0, "itl", profile_rps=5.0)}
    u = cost_of_uncertainty(_model(2, 10.0), p, table, {}, {}, {}, {})
    assert u.usd_h == 0.0 and u.why == ()
    u = cost_of_uncertainty(_model(3, 14.0), p, table, {}, {}, {}, {})  # required above demand: bursts
    assert u.usd_h > 0 and any(w.startswith("burst floor") for w in u.why)
