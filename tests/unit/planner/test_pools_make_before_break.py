"""Make-before-break between a model's aggregated replicas and its disaggregated pools: the
planner's one rule (planner/actions.py make_before_break) counts a pool replica's capacity as 0 (a
pool serves no rate alone), so the aggregated replicas are not drained while either pool still has
a replica starting, and on the way back the pools are not drained while aggregated replicas start
and the ready ones do not cover the demand. The act core adds nothing to that: routing sends a
model's requests to its pools only once both have a ready replica (planner/act_drain.py routes)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleetplan.models.config_key import Role
from fleetplan.planner.actions import make_before_break
from fleetplan.planner.placement import Placement
from fleetplan.planner.types import Action, ActionKind, Fleet, Replica, ReplicaState
from tests.unit.planner.planner_helpers import caps, hosts, key

AGG = key("m8")
PRE, DEC = replace(AGG, role=Role.PREFILL), replace(AGG, role=Role.DECODE)
CAPS = caps({AGG: 1.0})  # as planner/core.py passes it: the aggregated table, no pool config


@dataclass(frozen=True)
class Demand:
    required_rps: float


def _rep(rid: str, config: object, gpu: int, state: ReplicaState) -> Replica:
    return Replica(rid, config, "h00", (gpu,), state, 8000 + gpu)  # type: ignore[arg-type]


def _decide(live: tuple[Replica, ...], leaving: tuple[Replica, ...], required_rps: float) -> list[Action]:
    kept = tuple(r for r in live if r not in leaving)
    place = Placement(kept, kept, (), leaving, {})
    actions = [a for r in leaving for a in (Action(ActionKind.DRAIN, r, "replaced"),
                                             Action(ActionKind.STOP, r, "replaced; after drain"))]
    out, _held = make_before_break(actions, Fleet(hosts(1), live), place, CAPS, {"m8": Demand(required_rps)},
                                   hosts(1))
    return [a for a in out if a.kind is ActionKind.DRAIN]


def test_the_aggregated_replicas_serve_until_both_pools_have_a_ready_replica() -> None:
    a1, a2 = _rep("a1", AGG, 0, ReplicaState.READY), _rep("a2", AGG, 1, ReplicaState.READY)
    p1 = _rep("p1", PRE, 2, ReplicaState.READY)
    d1 = _rep("d1", DEC, 3, ReplicaState.STARTING)
    # the prefill pool is ready, the decode pool still starts: no drain
    assert _decide((a1, a2, p1, d1), (a1, a2), 1.5) == []
    # both pools ready: the aggregated replicas drain (not `covered`: the act core still defers
    # them while a replica of the model starts)
    ready = replace(d1, state=ReplicaState.READY)
    drains = _decide((a1, a2, p1, ready), (a1, a2), 1.5)
    assert sorted(a.replica.replica_id for a in drains) == ["a1", "a2"]
    assert not any(a.covered for a in drains)


def test_the_pools_serve_until_the_aggregated_replicas_cover_the_demand() -> None:
    p1, d1 = _rep("p1", PRE, 2, ReplicaState.READY), _rep("d1", DEC, 3, ReplicaState.READY)
    a1, a2 = _rep("a1", AGG, 0, ReplicaState.STARTING), _rep("a2", AGG, 1, ReplicaState.STARTING)
    assert _decide((p1, d1, a1, a2), (p1, d1), 1.5) == []
    # one aggregated replica ready (1 rps of the 1.5 required), the other starting: still held
    one = replace(a1, state=ReplicaState.READY)
    assert _decide((p1, d1, one, a2), (p1, d1), 1.5) == []
    # both ready: the pools drain, covered by the ready aggregated capacity
    both = (p1, d1, one, replace(a2, state=ReplicaState.READY))
    drains = _decide(both, (p1, d1), 1.5)
    assert sorted(a.replica.replica_id for a in drains) == ["d1", "p1"] and all(a.covered for a in drains)
