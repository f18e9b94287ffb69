"""Fail static blocks only scale-DOWN (issue 11 item 5): a stale model keeps every running replica,
and the rate it still carries (a lower bound: the targets that are up, a window not yet full) can
scale it UP - a lost host is replaced on the evidence that remains."""

from __future__ import annotations

from dataclasses import replace

from planner_helpers import TRT, caps, hosts, key, observe, policy

from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.types import ActionKind, Fleet, PlannerState, Replica, ReplicaState

NOW = 1_700_000_000.0
CAPS = caps({key("m8", TRT, tp=1): 14.0, key("m70", TRT, tp=4): 6.0})
P = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1), ("m70", "h100", 4)])


def running(host: str, gpu: int) -> Replica:
    return Replica(f"m8-{host}-{gpu}", key("m8", TRT, tp=1), host, (gpu,), ReplicaState.READY, 8000 + gpu,
                   NOW - 3600)


def kinds(r: object, kind: ActionKind) -> list[object]:
    return [a for a in r.actions if a.kind == kind and a.replica.config.model == "m8"]  # type: ignore[attr-defined]


CURRENT = (running("h01", 0), running("h01", 1), running("h01", 2))  # 3 x 14 = 42 rps


def test_stale_with_demand_above_capacity_scales_up() -> None:
    r = plan_with_capacities(observe({"m8": 60.0, "m70": 0.0}, stale=["m8"]), Fleet(hosts(2), CURRENT), P, CAPS,
                             PlannerState.initial(), NOW)
    assert set(CURRENT) <= set(r.plan.replicas)  # nothing that runs is taken away
    assert len(kinds(r, ActionKind.START)) == 2  # 60 rps needs 5 x 14: two more
    assert not kinds(r, ActionKind.DRAIN) and not kinds(r, ActionKind.STOP)
    note = " ".join(next(m for m in r.explanation.models if m.model == "m8").notes)
    assert "fail static" in note and "lower bound" in note
    assert [m.model for m in r.explanation.models if m.fail_static] == ["m8"]  # typed, not read from the text


def test_stale_with_demand_below_capacity_does_not_scale_down() -> None:
    r = plan_with_capacities(observe({"m8": 5.0, "m70": 0.0}, stale=["m8"]), Fleet(hosts(2), CURRENT), P, CAPS,
                             PlannerState.initial(), NOW)
    assert set(CURRENT) <= set(r.plan.replicas)
    assert not [a for a in r.actions if a.replica.config.model == "m8"]
    # the same reading, not stale, is evidence for a scale-down: the test above is not vacuous
    known = plan_with_capacities(observe({"m8": 5.0, "m70": 0.0}), Fleet(hosts(2), CURRENT), P, CAPS,
                                 PlannerState.initial(), NOW)
    assert kinds(known, ActionKind.DRAIN)


def test_stale_with_rate_unknown_keeps_what_runs() -> None:
    r = plan_with_capacities(observe({"m8": None, "m70": 0.0}, stale=["m8"]), Fleet(hosts(2), CURRENT), P, CAPS,
                             PlannerState.initial(), NOW)
    assert set(CURRENT) <= set(r.plan.replicas)
    assert not [a for a in r.actions if a.replica.config.model == "m8"]


def test_a_lost_host_is_replaced_while_its_targets_make_the_model_stale() -> None:
    """Two of three replicas were on h00, now offline: their scrape targets are down, so the model is
    stale; the one that is up still sees 30 rps (a lower bound). The lost capacity is replaced now,
    not when the targets leave Prometheus."""
    lost = (running("h00", 0), running("h00", 1))
    h = hosts(3)
    fleet = Fleet((replace(h[0], online=False), *h[1:]), (*lost, running("h01", 0)))
    r = plan_with_capacities(observe({"m8": 30.0, "m70": 0.0}, stale=["m8"]), fleet, P, CAPS,
                             PlannerState.initial(), NOW)
    starts = kinds(r, ActionKind.START)
    assert len(starts) == 2 and all(a.replica.host != "h00" for a in starts)  # type: ignore[attr-defined]
    assert running("h01", 0) in r.plan.replicas
