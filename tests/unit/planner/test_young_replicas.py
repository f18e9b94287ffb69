"""A replica started in one cycle is not swapped away in the next few unless its model's demand fell
(the cold-start churn: the first TensorRT-LLM replica replaced within ~15 s), and not drained at all
before it has proved itself (planner/scale_down.py)."""

from __future__ import annotations

from planner_helpers import TRT, VLLM, caps, hosts, key, observe, policy

from fleetplan.planner.core import YOUNG_CYCLES, plan_with_capacities
from fleetplan.planner.plan_json import plan_to_dict
from fleetplan.planner.types import ActionKind, Fleet, PlannerState, Replica, ReplicaState

NOW = 1_700_000_000.0
P = policy(models=("m8",), tps={"m8": [1]}, cached=[("m8", "h100", 1)])
TRT1, VLLM1 = key("m8", TRT, tp=1), key("m8", VLLM, tp=1)
# the observed mix made vLLM the cheaper engine after the first plan started TRT-LLM replicas
CAPS = caps({TRT1: 4.0, VLLM1: 7.5})


def fleet(age_s: float, state: ReplicaState = ReplicaState.READY) -> Fleet:
    return Fleet(hosts(1), tuple(Replica(f"t{i}", TRT1, "h00", (i,), state, 8000 + i, NOW - age_s) for i in range(2)))


def drains(r: object) -> list[object]:
    return [a for a in r.actions if a.kind == ActionKind.DRAIN]  # type: ignore[attr-defined]


def target(r: object) -> dict[object, int]:
    return {c.config: c.replicas for c in r.target.counts}  # type: ignore[attr-defined]


def test_a_young_replica_is_not_swapped_away_and_an_old_one_is() -> None:
    cycle_s = P.scaling.cycle_s
    for young in (fleet(0.0, ReplicaState.STARTING), fleet(cycle_s)):
        r = plan_with_capacities(observe({"m8": 6.0}), young, P, CAPS, PlannerState.initial(), NOW)
        assert not drains(r) and target(r) == {TRT1: 2}, r.actions
    old = plan_with_capacities(observe({"m8": 6.0}), fleet((YOUNG_CYCLES + 1) * cycle_s), P, CAPS,
                               PlannerState.initial(), NOW)
    assert target(old) == {VLLM1: 1}  # the swap, once they are older (make-before-break: started first)


def test_a_young_replica_goes_when_demand_fell_once_it_has_proved_itself() -> None:
    young = plan_with_capacities(observe({"m8": 1.0}), fleet(0.0), P, CAPS, PlannerState.initial(), NOW)
    assert not drains(young)  # 1 rps: one of the two is surplus, but neither has served a minute yet
    assert any("not yet proven" in n for n in young.explanation.models[0].notes)
    # and says so in a field a harness or an SRE's script reads: which replicas the timer keeps
    assert young.explanation.models[0].held_unproven == ("t0", "t1")
    assert plan_to_dict(young)["explanation"]["models"][0]["held_unproven"] == ["t0", "t1"]
    old = plan_with_capacities(observe({"m8": 1.0}), fleet((YOUNG_CYCLES + 1) * P.scaling.cycle_s), P, CAPS,
                               PlannerState.initial(), NOW)
    assert len(drains(old)) == 1
    assert old.explanation.models[0].held_unproven == ()
