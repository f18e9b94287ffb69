"""Where no config of a model reaches the SLO for its length mix (every one misses more than 1% of
requests even idle), the plan serves demand only with the configs that reach the most: an L40S or
a TP1 replica that cannot serve long prompts within the SLO at all is not bought because it is
cheap per "capacity" (planner/capacity.py `below_best_reach`)."""

from __future__ import annotations

from planner_helpers import A100, TRT, VLLM, hosts, key, observe, policy

from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.types import ActionKind, Fleet, PlannerState, Replica, ReplicaState

NOW = 1_700_000_000.0
CHEAP = key("m8", VLLM, A100, 1)  # $1/h, 2 rps sized from its floor, but 47% of requests at best
V2 = key("m8", VLLM, tp=2)  # $6/h, reaches 87%
T2 = key("m8", TRT, tp=2)  # $6/h, reaches 89.3%
TABLE = {CHEAP: CapacityInfo(2.0, "ttft", floor_share=0.47), V2: CapacityInfo(1.0, "ttft", floor_share=0.87),
         T2: CapacityInfo(1.2, "ttft", floor_share=0.893)}
FLEET = Fleet(hosts(2) + hosts(2, A100, prefix="a"))


def _policy(cached: bool, delay_s: float = 0.0):  # type: ignore[no-untyped-def]
    return policy(models=("m8",), tps={"m8": [1, 2]}, prices={"h100": 3.0, "a100": 1.0},
                  cached=[("m8", "h100", 2)] if cached else [], scaling={"scale_down_delay_s": delay_s})


def test_only_the_configs_that_reach_the_most_serve_demand_and_the_plan_says_why() -> None:
    res = plan_with_capacities(observe({"m8": 3.0}), FLEET, _policy(cached=True), TABLE, PlannerState.initial(),
                               NOW)
    assert {c.config: c.replicas for c in res.target.counts} == {T2: 3}  # not 2 x the $1/h A100 replica
    note = next(n for n in res.explanation.models[0].notes if n.startswith("no config meets the SLO"))
    assert "the best reaches 89.3% of requests" in note and "m8/vllm/a100x1/bf16 (47.0%)" in note
    assert "m8/vllm/h100x2/bf16 (87.0%)" in note
    # and the alternatives say so, not "cheaper, but the joint solve kept the chosen mix"
    alt = next(a for a in res.explanation.models[0].alternatives if a.config == CHEAP)
    assert "an idle replica meets it for 47.00% of requests, another config reaches 89.30%" in alt.detail


def test_while_the_best_awaits_its_build_the_best_ready_config_serves() -> None:
    res = plan_with_capacities(observe({"m8": 3.0}), FLEET, _policy(cached=False), TABLE, PlannerState.initial(),
                               NOW)
    # the build that reaches more is started (it is not priced against replicas that reach less) ...
    assert any(a.kind is ActionKind.BUILD and a.replica.config == T2 for a in res.actions)
    assert {c.config: c.replicas for c in res.target.counts} == {T2: 3}
    # ... and until it is built, the best of the ready configs serves the demand, not min_replicas
    assert {c.config: c.replicas for c in res.plan.counts} == {V2: 3}


def test_replicas_short_of_the_best_reach_are_not_held_by_the_scale_down_delay() -> None:
    # two A100 replicas run from a plan made before the long prompts were seen; the scale-down delay
    # holds surplus CAPACITY, and these serve no demand: they go once their replacements serve
    running = tuple(Replica(f"r{i}", CHEAP, "a00", (i,), ReplicaState.READY, 8000 + i, NOW - 600) for i in range(2))
    res = plan_with_capacities(observe({"m8": 3.0}), Fleet(FLEET.hosts, running), _policy(cached=True, delay_s=900),
                               TABLE, PlannerState.initial(), NOW)
    assert {c.config: c.replicas for c in res.plan.counts} == {T2: 3}
    assert not any("scale-down delayed" in n for n in res.explanation.notes), res.explanation.notes
    assert any("make-before-break" in n for n in res.explanation.notes)  # serving until T2 is READY
    assert not any(a.kind is ActionKind.DRAIN for a in res.actions)
