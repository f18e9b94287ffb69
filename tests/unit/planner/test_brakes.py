"""planner/brakes.py: advisory mode, pause and the blast-radius limits, without servers."""

from __future__ import annotations

import pytest

from fleetplan.planner.brakes import (
    HOUR_S,
    BrakeLimits,
    Direction,
    Limit,
    Mode,
    PastAction,
    apply_brakes,
    brakes_to_dict,
)
from fleetplan.planner.policy import PolicyError
from fleetplan.planner.types import Action, ActionKind, Replica, ReplicaState
from tests.unit.planner.planner_helpers import key, policy, policy_dict

NOW = 1_000_000.0
M = "m70"
TP4 = key(M, tp=4)
CAP = {TP4: 2.0}


def rep(rid: str, host: str = "h1", gpus: tuple[int, ...] = (0, 1, 2, 3),
        state: ReplicaState = ReplicaState.READY) -> Replica:
    return Replica(rid, TP4, host, gpus, state, 8100, NOW - 1000)


def drain(r: Replica) -> list[Action]:
    return [Action(ActionKind.DRAIN, r, "surplus"), Action(ActionKind.STOP, r, "surplus; after drain")]


def start(rid: str, host: str = "h2", gpus: tuple[int, ...] = (0, 1, 2, 3)) -> Action:
    return Action(ActionKind.START, Replica(rid, TP4, host, gpus, ReplicaState.STARTING), "start")


def four_ready() -> list[Replica]:
    return [rep("r1", "h1", (0, 1, 2, 3)), rep("r2", "h1", (4, 5, 6, 7)),
            rep("r3", "h2", (0, 1, 2, 3)), rep("r4", "h2", (4, 5, 6, 7))]


def run(actions: list[Action], limits: BrakeLimits, replicas: list[Replica], *, history: list[PastAction] = (),  # type: ignore[assignment]
        mode: Mode = Mode.ACTIVE, paused: bool = False):  # type: ignore[no-untyped-def]
    return apply_brakes(actions, history, limits, mode=mode, paused=paused, replicas=replicas, capacity_rps=CAP,
                        now_s=NOW)


def ids(actions: tuple[Action, ...]) -> list[tuple[str, str]]:
    return [(a.kind.value, a.replica.replica_id) for a in actions]


def test_no_limits_allows_everything_in_order() -> None:
    reps = four_ready()
    acts = [start("s1"), *drain(reps[0]), *drain(reps[1])]
    b = run(acts, BrakeLimits(), reps)
    assert list(b.allowed) == acts and b.held == ()


@pytest.mark.parametrize(("mode", "paused", "limit"), [
    (Mode.ADVISORY, False, Limit.ADVISORY), (Mode.ACTIVE, True, Limit.PAUSED), (Mode.ADVISORY, True, Limit.ADVISORY),
])
def test_advisory_and_pause_hold_every_action(mode: Mode, paused: bool, limit: Limit) -> None:
    reps = four_ready()
    acts = [start("s1"), *drain(reps[0]), Action(ActionKind.STOP, rep("f", state=ReplicaState.FAILED), "failed")]
    b = run(acts, BrakeLimits(), reps, mode=mode, paused=paused)
    assert b.allowed == ()
    assert [h.action for h in b.held] == acts
    assert {h.limit for h in b.held} == {limit}
    assert all(h.text().startswith(f"held back by {limit.value}: ") for h in b.held)


def test_gpus_stopped_per_hour_holds_a_large_scale_down() -> None:
    reps = four_ready()
    acts = [a for r in reps[1:] for a in drain(r)]  # 4 -> 1 replica: 12 GPUs
    b = run(acts, BrakeLimits(max_gpus_stopped_per_hour=4), reps)
    assert ids(b.allowed) == [("drain", "r2"), ("stop", "r2")]
    assert [(h.action.kind.value, h.action.replica.replica_id) for h in b.held] == [
        ("drain", "r3"), ("stop", "r3"), ("drain", "r4"), ("stop", "r4")]
    assert {h.limit for h in b.held} == {Limit.GPUS_STOPPED_PER_HOUR}
    assert "4 GPU(s) stopped in the last hour + 4 > 4" in b.held[0].detail
    assert b.gpus_stopped_last_hour == 4


def test_history_counts_only_the_last_hour() -> None:
    reps = four_ready()
    old = [PastAction(Direction.DOWN, NOW - HOUR_S - 1, 4)]
    recent = [PastAction(Direction.DOWN, NOW - 60, 4)]
    lim = BrakeLimits(max_gpus_stopped_per_hour=4)
    assert ids(run(drain(reps[0]), lim, reps, history=old).allowed) == [("drain", "r1"), ("stop", "r1")]
    b = run(drain(reps[0]), lim, reps, history=recent)
    assert b.allowed == () and len(b.held) == 2


def test_gpus_started_per_hour_and_a_smaller_later_start_still_fits() -> None:
    small = Action(ActionKind.START, Replica("s3", key(M, tp=1), "h2", (7,), ReplicaState.STARTING), "start")
    acts = [start("s1", gpus=(0, 1, 2, 3)), start("s2", gpus=(4, 5, 6, 7)), small]
    b = run(acts, BrakeLimits(max_gpus_started_per_hour=6), [],
            history=[PastAction(Direction.UP, NOW - 10, 1)])
    assert ids(b.allowed) == [("start", "s1"), ("start", "s3")]
    assert [(h.action.replica.replica_id, h.limit) for h in b.held] == [("s2", Limit.GPUS_STARTED_PER_HOUR)]
    assert b.gpus_started_last_hour == 6


def test_drains_per_host_per_cycle() -> None:
    reps = four_ready()
    acts = [a for r in reps for a in drain(r)]
    b = run(acts, BrakeLimits(max_drains_per_host_per_cycle=1), reps)
    assert ids(b.allowed) == [("drain", "r1"), ("stop", "r1"), ("drain", "r3"), ("stop", "r3")]
    assert {h.action.replica.replica_id for h in b.held} == {"r2", "r4"}
    assert {h.limit for h in b.held} == {Limit.DRAINS_PER_HOST_PER_CYCLE}


def test_capacity_floor_keeps_a_fraction_of_ready_capacity() -> None:
    reps = four_ready()  # 8 rps READY
    acts = [a for r in reps[1:] for a in drain(r)]
    b = run(acts, BrakeLimits(min_ready_capacity_fraction=0.5), reps)  # keep >= 4 rps: 2 of 4 may go
    assert ids(b.allowed) == [("drain", "r2"), ("stop", "r2"), ("drain", "r3"), ("stop", "r3")]
    assert [h.action.replica.replica_id for h in b.held] == ["r4", "r4"]
    assert b.held[0].limit is Limit.CAPACITY_FLOOR
    assert "below 0.5 x 8.00 rps" in b.held[0].detail


def test_floor_never_drains_the_last_ready_replica_but_failed_and_draining_stops_pass() -> None:
    one = [rep("r1")]
    failed = Action(ActionKind.STOP, rep("f1", "h2", state=ReplicaState.FAILED), "replica failed")
    draining = Action(ActionKind.STOP, rep("d1", "h2", (4, 5, 6, 7), state=ReplicaState.DRAINING), "drain in progress")
    b = run([*drain(one[0]), failed, draining], BrakeLimits(min_ready_capacity_fraction=0.1,
                                                            max_gpus_stopped_per_hour=0), one)
    assert ids(b.allowed) == [("stop", "f1"), ("stop", "d1")]
    assert [h.limit for h in b.held] == [Limit.CAPACITY_FLOOR, Limit.CAPACITY_FLOOR]


def test_a_start_waiting_for_a_held_replicas_gpus_is_held_with_it() -> None:
    reps = four_ready()
    acts = [*drain(reps[0]), start("s1", host="h1", gpus=(0, 1, 2, 3))]
    b = run(acts, BrakeLimits(max_gpus_stopped_per_hour=0), reps)
    assert b.allowed == ()
    assert b.held[-1].action.replica.replica_id == "s1"
    assert b.held[-1].limit is Limit.GPUS_STOPPED_PER_HOUR
    assert "waits for the GPUs of r1" in b.held[-1].detail


def test_stopping_a_surplus_replica_not_serving_counts_gpus_but_not_drains() -> None:
    reps = [*four_ready(), rep("r5", "h3", state=ReplicaState.STARTING)]
    stop5 = Action(ActionKind.STOP, reps[4], "surplus (not serving yet)")
    b = run([stop5, *drain(reps[0])], BrakeLimits(max_drains_per_host_per_cycle=0, max_gpus_stopped_per_hour=4),
            reps)
    assert ids(b.allowed) == [("stop", "r5")]
    assert b.held[0].limit is Limit.DRAINS_PER_HOST_PER_CYCLE


def test_brakes_to_dict_is_json_shaped() -> None:
    reps = four_ready()
    lim = BrakeLimits(max_gpus_stopped_per_hour=0)
    d = brakes_to_dict(run(drain(reps[0]), lim, reps), lim)
    assert d["mode"] == "active" and d["paused"] is False and d["allowed"] == 0
    assert d["held"][0]["text"].startswith("held back by max_gpus_stopped_per_hour")
    assert d["held"][0]["model"] == M and d["limits"]["max_gpus_stopped_per_hour"] == 0


def test_policy_mode_and_limits_parse_and_bad_values_name_the_field() -> None:
    p = policy(models=("m70",))
    assert p.mode is Mode.ACTIVE and p.scaling.brake_limits() == BrakeLimits()
    d = policy_dict(models=("m70",), scaling={"max_gpus_stopped_per_hour": 8, "min_ready_capacity_fraction": 0.5})
    d["mode"] = "advisory"
    from fleetplan.planner.policy import load_policy_dict

    p2 = load_policy_dict(d, "p.yaml")
    assert p2.mode is Mode.ADVISORY
    assert p2.scaling.brake_limits() == BrakeLimits(None, 8, None, 0.5)
    d["mode"] = "readonly"
    d["scaling"]["min_ready_capacity_fraction"] = 1.5
    with pytest.raises(PolicyError) as exc:
        load_policy_dict(d, "p.yaml")
    text = str(exc.value)
    assert "p.yaml: mode = 'readonly'" in text
    assert "p.yaml: scaling.min_ready_capacity_fraction = 1.5" in text
