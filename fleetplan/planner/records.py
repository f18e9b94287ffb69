"""The controller's records as a pure reducer: the act core's effects in, the records and what to
write out. Pure; the daemon's state store (controller/state.py) persists the writes in SQLite and the
replay (sim/control.py) keeps the records in memory, so both keep them by the same rules:

- replica and build ids come from one sequence, in effect order (`r00001`, `b00002`, ...);
- a phase change stamps `updated_s`; the first DRAINING stamps `drain_started_s` and a later one
  keeps it (a drain resumed after a restart keeps its deadline);
- a replica is ready from the first `MarkReady` (`ready_s` is never moved);
- a finished build leaves the desired state with its result (`done` or `failed: <error>`);
- a finished drain (`Drained`, an effect like the others) removes the replica and closes its drain
  in the action log with a `stop` entry of the cycle that drained it;
- the brakes' history (planner/brakes.py `PastAction`) is read from the action log: the first
  start, and the first drain or stop, of each replica a cycle acted on (`history`).

Worked example: a cycle starts a replica, a later reconcile sees it ready, a cycle drains it and the
drain finishes.

>>> from fleetplan.planner.act_types import NewReplica, Note, ActionStatus, MarkReady, SetPhase, Phase
>>> row = ReplicaRow("", "h1", "m", "vllm", "h100", 2, "bf16", (0, 1), 8000, "vllm", Phase.DESIRED,
...                  "planned", 10.0, 10.0, None, None)
>>> s = apply(Records(), [NewReplica(row, Note("start", ActionStatus.PUBLISHED, "scale up"))], 10.0, cycle_id=1)
>>> list(s.records.replicas), s.records.next_seq
(['r00001'], 2)
>>> s = apply(s.records, [MarkReady("r00001")], 70.0, cycle_id=None)
>>> s.records.replicas["r00001"].ready_s
70.0
>>> drain = SetPhase("r00001", Phase.DRAINING, Note("drain", ActionStatus.PUBLISHED, "scale down",
...                                                         replica_id="r00001"))
>>> s = apply(s.records, [drain], 500.0, cycle_id=2)
>>> s = apply(s.records, [drain], 520.0, cycle_id=3)  # drained again: the first start is kept
>>> s.records.replicas["r00001"].drain_started_s
500.0
>>> s = apply(s.records, [Drained("r00001", timed_out=False)], 530.0, cycle_id=None)
>>> s.records.replicas, [str(w.row.phase) for w in s.writes if isinstance(w, PutReplica)]
({}, ['removed'])
>>> sorted((p.direction.value, p.at_s, p.gpus) for p in history(s.records.log))
[('down', 500.0, 2), ('up', 10.0, 2)]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from fleetplan.planner.act_types import (
    ActionStatus,
    BuildRow,
    Effect,
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
from fleetplan.planner.brakes import HOUR_S, Direction, PastAction

__all__ = [
    "Drained",
    "LogEntry",
    "LogNote",
    "LogRepeat",
    "LogUpdate",
    "PutBuild",
    "PutReplica",
    "Records",
    "Step",
    "Write",
    "apply",
    "drain_reason",
    "history",
    "needs",
]


@dataclass(frozen=True)
class Drained:
    """A drain finished: in-flight requests reached 0, or its deadline passed (`timed_out`) with
    `last_inflight` requests still in flight (None: unknown) after `deadline_s`."""

    replica_id: str
    timed_out: bool
    last_inflight: float | None = None
    deadline_s: float | None = None

    @property
    def reason(self) -> str:
        return drain_reason(self.timed_out, self.last_inflight, self.deadline_s)


def drain_reason(timed_out: bool, last_inflight: float | None, deadline_s: float | None) -> str:
    """Why a drain ended, as the action log and the drain alert say it.

    >>> drain_reason(False, 0.0, 120.0)
    'in-flight requests reached 0'
    >>> drain_reason(True, 3.0, 120.0)
    'drain deadline 120 s passed: stopped with 3 request(s) in flight cut'
    >>> drain_reason(True, None, 120.0)
    'drain deadline 120 s passed: stopped with requests in flight unknown'
    """
    if not timed_out:
        return "in-flight requests reached 0"
    cut = f"{last_inflight:.0f} request(s) in flight cut" if last_inflight is not None else "requests in flight unknown"
    deadline = f"{deadline_s:.0f} s " if deadline_s is not None else ""
    return f"drain deadline {deadline}passed: stopped with {cut}"


@dataclass(frozen=True)
class LogEntry:
    """One action-log entry as the brakes read it: an action of `kind` on replica `replica_id` of
    `gpus` GPUs at `at_s`, decided by a cycle (`by_cycle`) or not (a reconcile's, an adoption's)."""

    kind: str
    status: str
    by_cycle: bool
    at_s: float
    replica_id: str | None
    gpus: int | None  # None: unknown (its replica's record is gone); counted as 1

    def actuation(self) -> Direction | None:
        """Which way this entry moved the fleet for the brakes; None: it did nothing (deferred,
        failed, only planned, not a cycle's, not a start, drain or stop)."""
        if not self.by_cycle or not self.replica_id or self.kind not in ("start", "drain", "stop"):
            return None
        if self.status in (ActionStatus.DEFERRED, ActionStatus.FAILED, ActionStatus.PLANNED):
            return None
        return Direction.UP if self.kind == "start" else Direction.DOWN


def history(entries: Iterable[LogEntry]) -> list[PastAction]:
    """The brakes' history from action-log entries: the first start, and the first drain or stop,
    of each replica a cycle acted on (a drain that later finishes with a stop counts once).

    >>> log = [LogEntry("start", "published", True, 10.0, "r1", 4), LogEntry("drain", "published", True, 50.0, "r1", 4),
    ...        LogEntry("stop", "done", True, 90.0, "r1", 4), LogEntry("start", "deferred", True, 95.0, "r2", 1),
    ...        LogEntry("adopt", "done", False, 99.0, "r3", 1)]
    >>> [(p.direction.value, p.at_s, p.gpus) for p in history(log)]
    [('up', 10.0, 4), ('down', 50.0, 4)]
    """
    first: dict[tuple[Direction, str], PastAction] = {}
    for e in entries:
        d = e.actuation()
        if d is None or e.replica_id is None:
            continue
        key = (d, e.replica_id)
        seen = first.get(key)
        if seen is None or e.at_s < seen.at_s:
            first[key] = PastAction(d, e.at_s, max(1, e.gpus or 1))
    return list(first.values())


# ---- what the store writes ------------------------------------------------------------------


@dataclass(frozen=True)
class PutReplica:
    """Write this replica row (`new`: insert, else replace the row of its id)."""

    row: ReplicaRow
    new: bool = False


@dataclass(frozen=True)
class PutBuild:
    row: BuildRow
    new: bool = False


@dataclass(frozen=True)
class LogNote:
    """Append `note` to the action log, of cycle `cycle_id`; `cycle_of`: of the cycle of that
    replica's latest drain entry instead (a drain's end belongs to the decision that drained it)."""

    note: Note
    cycle_id: int | None
    cycle_of: str | None = None


@dataclass(frozen=True)
class LogUpdate:
    """Move the log entries of `kind` on `subject_id` whose status is one of `from_status` (None:
    any) to `status`, at `now_s`; `detail` replaces theirs unless None."""

    subject_id: str
    kind: str
    from_status: tuple[ActionStatus, ...] | None
    status: ActionStatus
    detail: str | None


@dataclass(frozen=True)
class LogRepeat:
    """The deferral of entry `action_id` again: its count and detail move on."""

    action_id: int
    count: int
    detail: str


@dataclass(frozen=True)
class SetSequence:
    """The id sequence's next value."""

    next_seq: int


Write = PutReplica | PutBuild | LogNote | LogUpdate | LogRepeat | SetSequence


@dataclass(frozen=True)
class Records:
    """What the reducer reads: the active replicas (desired or draining, by id; a row of another
    phase given here is updated like one), the builds in progress, the ids ever allocated, the
    next id, and the action-log entries of the last hour the brakes read (`history`).

    The replay keeps all of it here; the daemon's store loads what one `apply` needs (`needs`) and
    keeps the rest in its tables (ids, the action log)."""

    replicas: Mapping[str, ReplicaRow] = field(default_factory=dict)
    builds: Mapping[str, BuildRow] = field(default_factory=dict)
    known_ids: frozenset[str] = frozenset()
    next_seq: int = 1
    log: tuple[LogEntry, ...] = ()


@dataclass(frozen=True)
class Step:
    """One `apply`: the records after it, and the writes that persist it, in order."""

    records: Records
    writes: tuple[Write, ...]

    def notes(self) -> list[Note]:
        """The action-log entries this step appends."""
        return [w.note for w in self.writes if isinstance(w, LogNote)]


RecordEffect = Effect | Drained


def needs(effects: Iterable[RecordEffect]) -> tuple[frozenset[str], frozenset[str]]:
    """(replica ids, build ids) whose rows `apply` reads for `effects`: what a store loads.

    >>> [sorted(ids) for ids in needs([MarkReady("r1"), Drained("r2", False)])]
    [['r1', 'r2'], []]
    """
    rids: set[str] = set()
    bids: set[str] = set()
    for e in effects:
        if isinstance(e, SetPhase | MarkReady | Drained):
            rids.add(e.replica_id)
        elif isinstance(e, FinishBuild):
            bids.add(e.build.build_id)
    return frozenset(rids), frozenset(bids)


class _Acc:
    """The records being reduced (mutable inside one `apply` only)."""

    def __init__(self, r: Records, now_s: float) -> None:
        self.replicas = dict(r.replicas)
        self.builds = dict(r.builds)
        self.known = set(r.known_ids)
        self.seq = r.next_seq
        self.log = [e for e in r.log if e.at_s > now_s - HOUR_S]
        self.writes: list[Write] = []
        self.now_s = now_s

    def allocate(self, prefix: str) -> str:
        rid = f"{prefix}{self.seq:05d}"
        self.seq += 1
        self.writes.append(SetSequence(self.seq))
        return rid

    def put(self, row: ReplicaRow, *, new: bool = False) -> None:
        if row.phase == Phase.REMOVED:
            self.replicas.pop(row.replica_id, None)
        else:
            self.replicas[row.replica_id] = row
        self.writes.append(PutReplica(row, new))

    def note(self, n: Note, cycle_id: int | None, *, cycle_of: str | None = None, gpus: int | None = None) -> None:
        self.writes.append(LogNote(n, cycle_id, cycle_of))
        # a drain's end belongs to the cycle that drained it
        entry = LogEntry(n.kind, n.status, cycle_id is not None or cycle_of is not None, self.now_s, n.replica_id,
                         gpus)
        if entry.actuation() is not None:
            self.log.append(entry)

    def records(self) -> Records:
        return Records(self.replicas, self.builds, frozenset(self.known), self.seq, tuple(self.log))


def apply(records: Records, effects: Iterable[RecordEffect], now_s: float, *, cycle_id: int | None) -> Step:
    """The records after `effects` (in order) at `now_s`, and the writes that persist them;
    `cycle_id`: the cycle whose decision they are (None: a reconcile's, an adoption's, a drain's end).

    An effect on a replica or build the records do not hold changes no record (its log entries are
    still written)."""
    acc = _Acc(records, now_s)
    for e in effects:
        _one(acc, e, cycle_id)
    return Step(acc.records(), tuple(acc.writes))


def _gpus(acc: _Acc, rid: str | None) -> int | None:
    row = acc.replicas.get(rid or "")
    return row.tp if row is not None else None


def _one(acc: _Acc, e: RecordEffect, cycle_id: int | None) -> None:
    now = acc.now_s
    if isinstance(e, NewReplica):
        rid = e.row.replica_id or acc.allocate("r")
        acc.known.add(rid)
        acc.put(replace(e.row, replica_id=rid), new=True)
        acc.note(replace(e.note, replica_id=rid), cycle_id, gpus=e.row.tp)
    elif isinstance(e, NewBuild):
        bid = e.row.build_id or acc.allocate("b")
        brow = replace(e.row, build_id=bid)
        acc.builds[bid] = brow
        acc.writes.append(PutBuild(brow, new=True))
        acc.note(replace(e.note, replica_id=bid), cycle_id)
    elif isinstance(e, SetPhase):
        gpus = _gpus(acc, e.replica_id)
        cur = acc.replicas.get(e.replica_id)
        if cur is not None:
            started = cur.drain_started_s
            if e.phase == Phase.DRAINING and started is None:
                started = now
            acc.put(replace(cur, phase=e.phase, updated_s=now, drain_started_s=started))
        if e.cancel_start:
            acc.writes.append(LogUpdate(e.replica_id, "start", (ActionStatus.PUBLISHED, ActionStatus.ACKED),
                                        ActionStatus.CANCELLED, None))
        if e.note is not None:
            acc.note(e.note, cycle_id, gpus=gpus)
    elif isinstance(e, MarkReady):
        cur = acc.replicas.get(e.replica_id)
        if cur is not None and cur.ready_s is None:
            acc.put(replace(cur, ready_s=now))
        acc.writes.append(LogUpdate(e.replica_id, "start", (ActionStatus.PUBLISHED, ActionStatus.ACKED),
                                    ActionStatus.DONE, "ready"))
    elif isinstance(e, FinishBuild):
        b = e.build
        held = acc.builds.pop(b.build_id, None)
        if held is not None:
            acc.writes.append(PutBuild(replace(held, phase=Phase.REMOVED, updated_s=now,
                                               result="done" if e.ok else f"failed: {e.error}")))
        acc.writes.append(LogUpdate(b.build_id, "build", None, ActionStatus.DONE if e.ok else ActionStatus.FAILED,
                                    "engine built" if e.ok else f"build failed: {e.error}"))
    elif isinstance(e, Record):
        acc.note(e.note, cycle_id, gpus=_gpus(acc, e.note.replica_id))
    elif isinstance(e, Repeat):
        acc.writes.append(LogRepeat(e.action_id, e.count, e.note.detail))
    elif isinstance(e, Drained):
        cur = acc.replicas.get(e.replica_id)
        if cur is None or cur.phase != Phase.DRAINING:
            return
        reason = e.reason
        acc.put(replace(cur, phase=Phase.REMOVED, updated_s=now))
        acc.writes.append(LogUpdate(e.replica_id, "drain", (ActionStatus.PUBLISHED,), ActionStatus.DONE,
                                    f"drained ({reason})"))
        acc.note(Note("stop", ActionStatus.DONE, f"drained: {reason}", replica_id=e.replica_id, host=cur.host,
                      model=cur.model), None, cycle_of=e.replica_id, gpus=cur.tp)
    else:
        raise TypeError(f"unknown effect {e!r}")
