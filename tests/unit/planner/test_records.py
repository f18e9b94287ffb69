"""The records reducer (planner/records.py): the rules the daemon's store and the replay share."""

from __future__ import annotations

from fleetplan.planner import records
from fleetplan.planner.act_types import (
    ActionStatus,
    BuildRow,
    FinishBuild,
    MarkReady,
    NewBuild,
    NewReplica,
    Note,
    Phase,
    Record,
    Repeat,
    ReplicaRow,
    SetPhase,
)
from fleetplan.planner.brakes import HOUR_S, Direction
from fleetplan.planner.records import (
    Drained,
    LogNote,
    LogUpdate,
    PutBuild,
    PutReplica,
    Records,
    apply,
    history,
)


def _row(tp: int = 1, rid: str = "") -> ReplicaRow:
    return ReplicaRow(rid, "h1", "m", "vllm", "h100", tp, "bf16", tuple(range(tp)), 8000, "vllm", Phase.DESIRED,
                      "planned", 0.0, 0.0, None, None)


def _build() -> BuildRow:
    return BuildRow("", "h1", "m", "trtllm", "h100", 1, "bf16", (0,), "trtllm-build", Phase.DESIRED, 0.0, 0.0, None)


def _start(tp: int = 1) -> NewReplica:
    return NewReplica(_row(tp), Note("start", ActionStatus.PUBLISHED, "up"))


def _drain(rid: str) -> SetPhase:
    return SetPhase(rid, Phase.DRAINING, Note("drain", ActionStatus.PUBLISHED, "down", replica_id=rid))


def test_ids_come_from_one_sequence_in_effect_order() -> None:
    build = NewBuild(_build(), Note("build", ActionStatus.PUBLISHED, "build"))
    s = apply(Records(), [_start(), build, _start()], 5.0, cycle_id=1)
    assert list(s.records.replicas) == ["r00001", "r00003"]
    assert list(s.records.builds) == ["b00002"]
    assert s.records.next_seq == 4 and s.records.known_ids == {"r00001", "r00003"}
    # each new row's log entry names it
    assert [w.note.replica_id for w in s.writes if isinstance(w, LogNote)] == ["r00001", "b00002", "r00003"]
    # an id given (an adopted engine) is kept and takes nothing from the sequence
    s2 = apply(s.records, [NewReplica(_row(rid="x9"), Note("adopt", ActionStatus.DONE, "orphan"))], 6.0, cycle_id=None)
    assert "x9" in s2.records.replicas and s2.records.next_seq == 4


def test_the_first_drain_start_and_the_first_ready_time_are_kept() -> None:
    s = apply(Records(), [_start()], 0.0, cycle_id=1)
    s = apply(s.records, [MarkReady("r00001")], 30.0, cycle_id=None)
    s = apply(s.records, [MarkReady("r00001")], 40.0, cycle_id=None)
    assert s.records.replicas["r00001"].ready_s == 30.0
    s = apply(s.records, [_drain("r00001")], 100.0, cycle_id=2)
    s = apply(s.records, [_drain("r00001")], 150.0, cycle_id=3)
    row = s.records.replicas["r00001"]
    assert (row.phase, row.drain_started_s, row.updated_s) == (Phase.DRAINING, 100.0, 150.0)


def test_a_finished_drain_removes_the_replica_and_closes_its_drain_entry() -> None:
    s = apply(Records(), [_start(2)], 0.0, cycle_id=1)
    s = apply(s.records, [_drain("r00001")], 100.0, cycle_id=2)
    done = apply(s.records, [Drained("r00001", timed_out=True, last_inflight=2.0, deadline_s=120.0)], 220.0,
                 cycle_id=None)
    assert "r00001" not in done.records.replicas
    put = [w for w in done.writes if isinstance(w, PutReplica)]
    assert [(w.row.phase, w.row.updated_s) for w in put] == [(Phase.REMOVED, 220.0)]
    upd = [w for w in done.writes if isinstance(w, LogUpdate)]
    assert upd == [LogUpdate("r00001", "drain", (ActionStatus.PUBLISHED,), ActionStatus.DONE,
                             "drained (drain deadline 120 s passed: stopped with 2 request(s) in flight cut)")]
    stop = [w for w in done.writes if isinstance(w, LogNote)]
    assert len(stop) == 1 and stop[0].cycle_of == "r00001" and stop[0].note.kind == "stop"
    # the brakes count the replica's way down once, at the drain
    assert sorted((p.direction, p.at_s, p.gpus) for p in history(done.records.log)) == [
        (Direction.DOWN, 100.0, 2), (Direction.UP, 0.0, 2)]
    # a replica not draining (or gone) is not drained twice
    again = apply(done.records, [Drained("r00001", timed_out=False)], 230.0, cycle_id=None)
    assert again.writes == () and again.records.replicas == done.records.replicas


def test_builds_leave_the_records_with_their_result() -> None:
    s = apply(Records(), [NewBuild(_build(), Note("build", ActionStatus.PUBLISHED, "b"))], 0.0, cycle_id=1)
    b = s.records.builds["b00001"]
    done = apply(s.records, [FinishBuild(b, ok=False, error="oom")], 50.0, cycle_id=None)
    assert done.records.builds == {}
    put = [w for w in done.writes if isinstance(w, PutBuild)]
    assert [(w.row.phase, w.row.result) for w in put] == [(Phase.REMOVED, "failed: oom")]
    assert [w.status for w in done.writes if isinstance(w, LogUpdate)] == [ActionStatus.FAILED]


def test_the_brakes_history_holds_only_what_cycles_did_in_the_last_hour() -> None:
    deferred = Record(Note("start", ActionStatus.DEFERRED, "gpus busy", replica_id="r00009"))
    s = apply(Records(), [_start(4), deferred], 0.0, cycle_id=1)
    s = apply(s.records, [SetPhase("r00001", Phase.REMOVED, Note("stop", ActionStatus.DONE, "not ready",
                                                                  replica_id="r00001"))], 10.0, cycle_id=None)
    assert [(p.direction, p.gpus) for p in history(s.records.log)] == [(Direction.UP, 4)]  # reconcile: not counted
    later = apply(s.records, [], HOUR_S + 1.0, cycle_id=2)
    assert later.records.log == ()  # older than an hour: the brakes no longer read it


def test_an_effect_on_a_record_not_held_changes_no_record() -> None:
    s = apply(Records(), [MarkReady("r7"), SetPhase("r7", Phase.REMOVED, cancel_start=True),
                          Repeat(12, 3, Note("start", ActionStatus.DEFERRED, "x", detail="still busy"))], 1.0,
              cycle_id=None)
    assert s.records == Records()
    assert not any(isinstance(w, PutReplica) for w in s.writes)
    assert [type(w).__name__ for w in s.writes] == ["LogUpdate", "LogUpdate", "LogRepeat"]
    assert records.needs([MarkReady("r7"), FinishBuild(_build(), ok=True)]) == (frozenset({"r7"}), frozenset({""}))
