"""The controller's durable state: SQLite in WAL mode, one transaction per step.

What is stored (all JSON columns are plain dicts, never pickles):

- ``replicas``: every replica the controller ever allocated, with its placement and a ``phase``:
  ``desired`` (in a host's desired state), ``draining`` (still desired, removed from routing,
  waiting for in-flight requests), ``removed`` (no longer desired). A replica id and its port are
  allocated and COMMITTED before any desired state naming them is published, so a crash after the
  publish replays the same id: never a duplicate engine.
- ``desired``: per host, the last desired version and payload (committed BEFORE publishing), and
  the last acked version.
- ``plans``/``observations``/``actions``/``acks``/``alerts``/``events``: the history the report
  API serves; ``actions`` carry a status (planned, published, acked, done, failed, deferred).
- ``kv``: small values such as the planner state, the policy error and the actuation pause.
- ``decisions``: one record per cycle (planner/audit.py: id, inputs digest, plan summary, actions
  issued and held back, why); the audit trail `fleetplan history` and the plan page read.
- ``host_inventory``: per host, the GPUs recorded from its first report, the policy or an operator's
  confirmation (planner/inventory.py judges each report against it; controller/state_inventory.py).

The history tables are pruned in small steps (controller/state_retention.py); a new database uses
incremental auto-vacuum so the file shrinks as they are.

Crash recovery (kill -9 at any moment): on start the daemon re-derives each host's desired state
from ``replicas`` (phase desired/draining), bumps the version and republishes; draining replicas
resume their drain. Orphans (a replica an agent reports that this database never allocated, e.g.
started by hand or by a controller whose database was lost) are ADOPTED: recorded as phase
``desired`` with origin ``adopted``, so they keep serving and the planner scales them like any
other replica (via drain). Replicas the database marks ``removed`` that an agent still reports are
not adopted: the agent is stopping them because they are absent from its desired state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

# the records' types are the act core's (planner/act.py decides on them; this module persists them)
from fleetplan.planner.act import (
    ActionStatus,
    BuildRow,
    DesiredRow,
    Effect,
    FinishBuild,
    MarkReady,
    NewBuild,
    NewReplica,
    Note,
    Phase,
    Record,
    ReplicaRow,
    SetPhase,
)
from fleetplan.planner.act_types import Repeat

__all__ = ["ActionStatus", "BuildRow", "DesiredRow", "Phase", "ReplicaRow", "StateStore", "read_history"]

SCHEMA_VERSION = 1
WAL_LIMIT_BYTES = 8 * 1024 * 1024
MAX_VERSION = 2**53 - 1  # desired versions stay exact integers (fleetplan.controller.protocol.MAX_WIRE_INT)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replicas (
    replica_id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    model TEXT NOT NULL,
    engine TEXT NOT NULL,
    gpu TEXT NOT NULL,
    tp INTEGER NOT NULL,
    precision TEXT NOT NULL,
    gpu_indices TEXT NOT NULL,
    port INTEGER NOT NULL,
    template TEXT NOT NULL,
    phase TEXT NOT NULL,
    origin TEXT NOT NULL DEFAULT 'planned',
    created_s REAL NOT NULL,
    updated_s REAL NOT NULL,
    drain_started_s REAL,
    ready_s REAL
);
CREATE INDEX IF NOT EXISTS replicas_phase ON replicas(phase, host);
CREATE TABLE IF NOT EXISTS builds (
    build_id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    model TEXT NOT NULL,
    engine TEXT NOT NULL,
    gpu TEXT NOT NULL,
    tp INTEGER NOT NULL,
    precision TEXT NOT NULL,
    gpu_indices TEXT NOT NULL,
    template TEXT NOT NULL,
    phase TEXT NOT NULL,
    created_s REAL NOT NULL,
    updated_s REAL NOT NULL,
    result TEXT
);
CREATE TABLE IF NOT EXISTS desired (
    host TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    payload TEXT NOT NULL,
    published_s REAL,
    acked_version INTEGER,
    ack_accepted INTEGER,
    ack_errors TEXT
);
CREATE TABLE IF NOT EXISTS cycles (
    cycle_id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_s REAL NOT NULL,
    now_s REAL NOT NULL,
    finished_s REAL,
    status TEXT NOT NULL,
    summary TEXT
);
CREATE TABLE IF NOT EXISTS observations (
    cycle_id INTEGER PRIMARY KEY,
    created_s REAL NOT NULL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS plans (
    cycle_id INTEGER PRIMARY KEY,
    created_s REAL NOT NULL,
    solve_s REAL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS actions (
    action_id INTEGER PRIMARY KEY AUTOINCREMENT,
    cycle_id INTEGER,
    created_s REAL NOT NULL,
    updated_s REAL NOT NULL,
    kind TEXT NOT NULL,
    replica_id TEXT,
    host TEXT,
    model TEXT,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS actions_status ON actions(status);
CREATE TABLE IF NOT EXISTS acks (
    ack_id INTEGER PRIMARY KEY AUTOINCREMENT,
    host TEXT NOT NULL,
    version INTEGER,
    accepted INTEGER NOT NULL,
    errors TEXT NOT NULL,
    received_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS host_status (
    host TEXT PRIMARY KEY,
    payload TEXT NOT NULL,
    received_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS alerts (
    alert_id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_s REAL NOT NULL,
    key TEXT NOT NULL,
    text TEXT NOT NULL,
    active INTEGER NOT NULL DEFAULT 1,
    cleared_s REAL
);
CREATE INDEX IF NOT EXISTS alerts_active ON alerts(active, key);
CREATE TABLE IF NOT EXISTS decisions (
    cycle_id INTEGER PRIMARY KEY,
    decision_id TEXT NOT NULL,
    created_s REAL NOT NULL,
    now_s REAL NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_created ON decisions(created_s);
CREATE TABLE IF NOT EXISTS host_inventory (
    host TEXT PRIMARY KEY,
    gpu TEXT NOT NULL,
    gpu_count INTEGER NOT NULL,
    nvlink_groups TEXT NOT NULL,
    since_s REAL NOT NULL,
    voucher TEXT NOT NULL
);
"""

log = logging.getLogger(__name__)


def read_history(path: str | Path, since_s: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(decision records, action rows) created at or after `since_s` (wall seconds), oldest first,
    read through a READ-ONLY connection (safe next to a running controller; writes nothing)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such state database")
    db = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        has = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()}
        decisions = []
        if "decisions" in has:
            decisions = [{**json.loads(r["payload"]), "created_s": float(r["created_s"])} for r in db.execute(
                "SELECT created_s, payload FROM decisions WHERE created_s >= ? ORDER BY cycle_id", (since_s,))]
        actions = []
        if "actions" in has:
            join = ("LEFT JOIN decisions d ON d.cycle_id = a.cycle_id" if "decisions" in has else "")
            dec = "d.decision_id" if "decisions" in has else "NULL"
            actions = [dict(r) for r in db.execute(
                f"SELECT a.*, {dec} AS decision_id FROM actions a {join} WHERE a.created_s >= ? "
                "ORDER BY a.action_id", (since_s,))]
    finally:
        db.close()
    return decisions, actions


class StateStore:
    """Synchronous SQLite store; each public method is one transaction (call from one thread)."""

    def __init__(self, path: str | Path, *, clock: Any = time.time) -> None:
        self.path = Path(path)
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.write_error: str | None = None  # the last failed write (what, where); cleared by the next commit
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        # a new database frees the pages of pruned rows back to the file system in small steps
        # (controller/state_retention.py); an existing one keeps its mode (changing it takes a VACUUM)
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed step survives power loss too
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")  # the WAL shrinks back after a checkpoint
        self._db.executescript(_SCHEMA)
        if "repeats" not in {r[1] for r in self._db.execute("PRAGMA table_info(actions)").fetchall()}:
            self._db.execute("ALTER TABLE actions ADD COLUMN repeats INTEGER NOT NULL DEFAULT 1")
        with self.tx() as c:
            c.execute("INSERT OR IGNORE INTO kv(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # a full disk cannot checkpoint: what is committed stays in the WAL
            self._db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One atomic step: BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any exception).

        A write the database cannot take (sqlite3.OperationalError: "database or disk is full",
        "attempt to write a readonly database", "disk I/O error", ...) rolls back, sets
        `write_error` (what and where) and raises; the next commit clears it."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            self._write_failed(exc)
            raise
        try:
            yield self._db
        except BaseException as exc:
            self._rollback()
            if isinstance(exc, sqlite3.OperationalError):
                self._write_failed(exc)
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            self._rollback()
            self._write_failed(exc)
            raise
        self.write_error = None

    def _rollback(self) -> None:
        # SQLite may have rolled the transaction back itself (SQLITE_FULL, SQLITE_IOERR): a second
        # ROLLBACK would raise "no transaction is active" and hide the error that matters
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _write_failed(self, exc: BaseException) -> None:
        self.write_error = f"state store {self.path} cannot be written: {type(exc).__name__}: {exc}"

    # -- kv ---------------------------------------------------------------------------------
    def get_kv(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if row is None else json.loads(row["value"])

    def set_kv(self, key: str, value: Any, conn: sqlite3.Connection | None = None) -> None:
        sql = "INSERT INTO kv(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value"
        if conn is not None:
            conn.execute(sql, (key, json.dumps(value)))
            return
        with self.tx() as c:
            c.execute(sql, (key, json.dumps(value)))

    def probe_write(self, nbytes: int = 256 * 1024) -> None:
        """Commit (then delete) `nbytes`: after a failed write, whether the store has room for a
        cycle's records again (a few small writes may fit where a plan document does not)."""
        with self.tx() as c:
            self.set_kv("write_probe", "x" * nbytes, c)
        with self.tx() as c:
            c.execute("DELETE FROM kv WHERE key='write_probe'")

    # -- cycles -----------------------------------------------------------------------------
    def begin_cycle(self, now_s: float) -> int:
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO cycles(started_s, now_s, status) VALUES (?, ?, 'running')", (self._clock(), now_s)
            )
            return int(cur.lastrowid or 0)

    def finish_cycle(self, cycle_id: int, status: str, summary: Mapping[str, Any]) -> None:
        with self.tx() as c:
            c.execute(
                "UPDATE cycles SET finished_s=?, status=?, summary=? WHERE cycle_id=?",
                (self._clock(), status, json.dumps(summary), cycle_id),
            )

    def cycles(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM cycles ORDER BY cycle_id DESC LIMIT ?", (limit,)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["summary"] = json.loads(d["summary"]) if d["summary"] else None
            out.append(d)
        return out

    def save_observation(self, cycle_id: int, payload: Mapping[str, Any]) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO observations(cycle_id, created_s, payload) VALUES (?, ?, ?)",
                (cycle_id, self._clock(), json.dumps(payload)),
            )

    def save_plan(
        self, cycle_id: int, payload: Mapping[str, Any], solve_s: float | None, planner_state: Any = None
    ) -> None:
        """The plan dict (rendered by reports, never recomputed) and the planner state, atomically."""
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO plans(cycle_id, created_s, solve_s, payload) VALUES (?, ?, ?, ?)",
                (cycle_id, self._clock(), solve_s, json.dumps(payload, default=str)),
            )
            if planner_state is not None:
                self.set_kv("planner_state", planner_state, c)

    def last_plan(self) -> tuple[int, dict[str, Any], float | None] | None:
        row = self._db.execute("SELECT * FROM plans ORDER BY cycle_id DESC LIMIT 1").fetchone()
        if row is None:
            return None
        return int(row["cycle_id"]), json.loads(row["payload"]), row["solve_s"]

    # -- decisions (the audit trail) ------------------------------------------------------------
    def save_decision(self, record: Mapping[str, Any]) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO decisions(cycle_id, decision_id, created_s, now_s, payload) "
                "VALUES (?, ?, ?, ?, ?)",
                (int(record["cycle_id"]), str(record["decision_id"]), self._clock(), float(record["now_s"]),
                 json.dumps(record, default=str)),
            )

    def decisions(self, since_s: float | None = None, limit: int = 5000) -> list[dict[str, Any]]:
        """Decision records created at or after `since_s` (wall seconds), oldest first."""
        rows = self._db.execute(
            "SELECT created_s, payload FROM decisions WHERE created_s >= ? ORDER BY cycle_id DESC LIMIT ?",
            (since_s if since_s is not None else float("-inf"), limit),
        ).fetchall()
        return [{**json.loads(r["payload"]), "created_s": float(r["created_s"])} for r in reversed(rows)]

    def last_observation(self) -> dict[str, Any] | None:
        row = self._db.execute("SELECT payload FROM observations ORDER BY cycle_id DESC LIMIT 1").fetchone()
        return None if row is None else dict(json.loads(row["payload"]))

    # -- replicas ---------------------------------------------------------------------------
    def _row(self, r: sqlite3.Row) -> ReplicaRow:
        return ReplicaRow(
            replica_id=r["replica_id"], host=r["host"], model=r["model"], engine=r["engine"], gpu=r["gpu"],
            tp=int(r["tp"]), precision=r["precision"], gpu_indices=tuple(json.loads(r["gpu_indices"])),
            port=int(r["port"]), template=r["template"], phase=r["phase"], origin=r["origin"],
            created_s=r["created_s"], updated_s=r["updated_s"], drain_started_s=r["drain_started_s"],
            ready_s=r["ready_s"],
        )

    def replicas(self, phases: Iterable[str] | None = None) -> list[ReplicaRow]:
        if phases is None:
            rows = self._db.execute("SELECT * FROM replicas ORDER BY created_s, replica_id").fetchall()
        else:
            ph = list(phases)
            q = ",".join("?" * len(ph))
            rows = self._db.execute(
                f"SELECT * FROM replicas WHERE phase IN ({q}) ORDER BY created_s, replica_id", ph
            ).fetchall()
        return [self._row(r) for r in rows]

    def active_replicas(self) -> list[ReplicaRow]:
        return self.replicas((Phase.DESIRED, Phase.DRAINING))

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        r = self._db.execute("SELECT * FROM replicas WHERE replica_id=?", (replica_id,)).fetchone()
        return None if r is None else self._row(r)

    def known_ids(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT replica_id FROM replicas").fetchall()}

    def allocate_id(self, conn: sqlite3.Connection, prefix: str = "r") -> str:
        row = conn.execute("SELECT value FROM kv WHERE key='next_replica_seq'").fetchone()
        seq = int(json.loads(row["value"])) if row else 1
        self.set_kv("next_replica_seq", seq + 1, conn)
        return f"{prefix}{seq:05d}"

    def insert_replica(self, conn: sqlite3.Connection, row: ReplicaRow) -> None:
        conn.execute(
            "INSERT INTO replicas(replica_id, host, model, engine, gpu, tp, precision, gpu_indices, port, "
            "template, phase, origin, created_s, updated_s, drain_started_s, ready_s) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (row.replica_id, row.host, row.model, row.engine, row.gpu, row.tp, row.precision,
             json.dumps(list(row.gpu_indices)), row.port, row.template, row.phase, row.origin,
             row.created_s, row.updated_s, row.drain_started_s, row.ready_s),
        )

    def set_phase(self, conn: sqlite3.Connection, replica_id: str, phase: str) -> None:
        now = self._clock()
        if phase == Phase.DRAINING:
            conn.execute(
                "UPDATE replicas SET phase=?, updated_s=?, drain_started_s=COALESCE(drain_started_s, ?) "
                "WHERE replica_id=?",
                (phase, now, now, replica_id),
            )
        else:
            conn.execute("UPDATE replicas SET phase=?, updated_s=? WHERE replica_id=?", (phase, now, replica_id))

    def mark_ready(self, replica_id: str) -> None:
        with self.tx() as c:
            c.execute(
                "UPDATE replicas SET ready_s=COALESCE(ready_s, ?) WHERE replica_id=?", (self._clock(), replica_id)
            )

    def apply(self, effects: Iterable[Effect], cycle_id: int | None) -> list[Note]:
        """Persist an act decision's effects in ONE transaction (ids allocated here, in order);
        returns the action-log notes written, with their allocated ids."""
        notes: list[Note] = []
        with self.tx() as c:
            for e in effects:
                notes.extend(self._apply_one(c, e, cycle_id))
        return notes

    def _apply_one(self, c: sqlite3.Connection, e: Effect, cycle_id: int | None) -> list[Note]:
        now = self._clock()
        if isinstance(e, NewReplica):
            rid = e.row.replica_id or self.allocate_id(c)
            self.insert_replica(c, replace(e.row, replica_id=rid))
            return [self._note(c, replace(e.note, replica_id=rid), cycle_id)]
        if isinstance(e, NewBuild):
            bid = e.row.build_id or self.allocate_build_id(c)
            self.insert_build(c, replace(e.row, build_id=bid))
            return [self._note(c, replace(e.note, replica_id=bid), cycle_id)]
        if isinstance(e, SetPhase):
            self.set_phase(c, e.replica_id, e.phase)
            if e.cancel_start:
                c.execute("UPDATE actions SET status=?, updated_s=? WHERE replica_id=? AND kind='start' AND "
                          "status IN (?, ?)", (ActionStatus.CANCELLED, now, e.replica_id, ActionStatus.PUBLISHED,
                                               ActionStatus.ACKED))
            return [self._note(c, e.note, cycle_id)] if e.note is not None else []
        if isinstance(e, MarkReady):
            c.execute("UPDATE replicas SET ready_s=COALESCE(ready_s, ?) WHERE replica_id=?", (now, e.replica_id))
            c.execute("UPDATE actions SET status=?, updated_s=?, detail=? WHERE replica_id=? AND kind='start' AND "
                      "status IN (?, ?)", (ActionStatus.DONE, now, "ready", e.replica_id, ActionStatus.PUBLISHED,
                                           ActionStatus.ACKED))
            return []
        if isinstance(e, FinishBuild):
            b = e.build
            self.finish_build(c, b.build_id, "done" if e.ok else f"failed: {e.error}")
            c.execute("UPDATE actions SET status=?, updated_s=?, detail=? WHERE replica_id=? AND kind='build'",
                      (ActionStatus.DONE if e.ok else ActionStatus.FAILED, now,
                       "engine built" if e.ok else f"build failed: {e.error}", b.build_id))
            return []
        if isinstance(e, Record):
            return [self._note(c, e.note, cycle_id)]
        if isinstance(e, Repeat):  # the same deferral again: one row, its count and time move on
            c.execute("UPDATE actions SET updated_s=?, repeats=?, detail=? WHERE action_id=?",
                      (now, e.count, e.note.detail, e.action_id))
            return []
        raise TypeError(f"unknown effect {e!r}")

    def _note(self, c: sqlite3.Connection, n: Note, cycle_id: int | None) -> Note:
        aid = self.add_action(c, cycle_id=cycle_id, kind=n.kind, replica_id=n.replica_id, host=n.host,
                              model=n.model, status=n.status, reason=n.reason, detail=n.detail)
        return replace(n, action_id=aid)

    # -- desired state per host ---------------------------------------------------------------
    def desired_rows(self) -> dict[str, DesiredRow]:
        out = {}
        for r in self._db.execute("SELECT * FROM desired").fetchall():
            out[r["host"]] = DesiredRow(
                host=r["host"], version=int(r["version"]), payload=json.loads(r["payload"]),
                published_s=r["published_s"], acked_version=r["acked_version"],
                ack_accepted=None if r["ack_accepted"] is None else bool(r["ack_accepted"]),
                ack_errors=tuple(json.loads(r["ack_errors"] or "[]")),
            )
        return out

    def desired_payload(self, host: str, conn: sqlite3.Connection | None = None) -> dict[str, Any]:
        """The full desired state of `host` derived from the replicas table (phase desired/draining)."""
        db = conn or self._db
        rows = db.execute(
            "SELECT * FROM replicas WHERE host=? AND phase IN (?, ?) ORDER BY replica_id",
            (host, Phase.DESIRED, Phase.DRAINING),
        ).fetchall()
        builds = db.execute(
            "SELECT * FROM builds WHERE host=? AND phase=? ORDER BY build_id", (host, Phase.DESIRED)
        ).fetchall()
        return {
            "replicas": [self._row(r).desired_entry() for r in rows],
            "builds": [self._build_row(b).desired_entry() for b in builds],
        }

    # -- builds --------------------------------------------------------------------------------
    def _build_row(self, r: sqlite3.Row) -> BuildRow:
        return BuildRow(
            build_id=r["build_id"], host=r["host"], model=r["model"], engine=r["engine"], gpu=r["gpu"],
            tp=int(r["tp"]), precision=r["precision"], gpu_indices=tuple(json.loads(r["gpu_indices"])),
            template=r["template"], phase=r["phase"], created_s=r["created_s"], updated_s=r["updated_s"],
            result=r["result"],
        )

    def builds(self, phases: Iterable[str] | None = None) -> list[BuildRow]:
        rows = self._db.execute("SELECT * FROM builds ORDER BY build_id").fetchall()
        out = [self._build_row(r) for r in rows]
        if phases is not None:
            ph = set(phases)
            out = [b for b in out if b.phase in ph]
        return out

    def allocate_build_id(self, conn: sqlite3.Connection) -> str:
        return self.allocate_id(conn, prefix="b")

    def insert_build(self, conn: sqlite3.Connection, b: BuildRow) -> None:
        conn.execute(
            "INSERT INTO builds(build_id, host, model, engine, gpu, tp, precision, gpu_indices, template, phase, "
            "created_s, updated_s, result) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (b.build_id, b.host, b.model, b.engine, b.gpu, b.tp, b.precision, json.dumps(list(b.gpu_indices)),
             b.template, b.phase, b.created_s, b.updated_s, b.result),
        )

    def finish_build(self, conn: sqlite3.Connection, build_id: str, result: str) -> None:
        conn.execute(
            "UPDATE builds SET phase=?, result=?, updated_s=? WHERE build_id=?",
            (Phase.REMOVED, result, self._clock(), build_id),
        )

    def stage_desired(self, conn: sqlite3.Connection, host: str) -> dict[str, Any]:
        """Bump the host's desired version and store the payload to publish (inside `conn`'s tx)."""
        row = conn.execute("SELECT version FROM desired WHERE host=?", (host,)).fetchone()
        version = (int(row["version"]) + 1) if row else 1
        # never go below what an agent may already have applied from an earlier database
        floor = conn.execute("SELECT value FROM kv WHERE key=?", (f"version_floor/{host}",)).fetchone()
        floor_v = json.loads(floor["value"]) if floor is not None else None
        if isinstance(floor_v, int) and 0 <= floor_v < MAX_VERSION:  # an absurd floor (old database) is ignored
            version = max(version, floor_v + 1)
        payload = {"version": version, **self.desired_payload(host, conn)}
        conn.execute(
            "INSERT INTO desired(host, version, payload, published_s) VALUES (?, ?, ?, NULL) "
            "ON CONFLICT(host) DO UPDATE SET version=excluded.version, payload=excluded.payload, "
            "published_s=NULL",
            (host, version, json.dumps(payload)),
        )
        return payload

    def note_version_floor(self, host: str, applied_version: int | None) -> None:
        """Agents report the version they applied; our next version must be above it."""
        self.note_version_floors({host: applied_version})

    def note_version_floors(self, applied: Mapping[str, int | None]) -> None:
        """note_version_floor for many hosts in one transaction (one commit per cycle, not per host)."""
        ok = {h: v for h, v in applied.items() if v is not None and 0 <= v < MAX_VERSION}
        if not ok:
            return  # never a floor no later version can pass (the protocol already bounds it)
        with self.tx() as c:
            for host, version in ok.items():
                cur = self.get_kv(f"version_floor/{host}")
                if not isinstance(cur, int) or not 0 <= cur < MAX_VERSION or cur < version:
                    self.set_kv(f"version_floor/{host}", version, c)

    def mark_published(self, published: Mapping[str, int]) -> None:
        """host -> the desired version just published (one transaction)."""
        if not published:
            return
        now = self._clock()
        with self.tx() as c:
            c.executemany("UPDATE desired SET published_s=? WHERE host=? AND version=?",
                          [(now, host, version) for host, version in published.items()])

    def record_ack(self, host: str, version: int | None, accepted: bool, errors: Iterable[str]) -> None:
        errs = list(errors)
        with self.tx() as c:
            c.execute(
                "INSERT INTO acks(host, version, accepted, errors, received_s) VALUES (?, ?, ?, ?, ?)",
                (host, version, int(accepted), json.dumps(errs), self._clock()),
            )
            c.execute(
                "UPDATE desired SET acked_version=?, ack_accepted=?, ack_errors=? WHERE host=? AND version=?",
                (version, int(accepted), json.dumps(errs), host, version),
            )

    def acks(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM acks ORDER BY ack_id DESC LIMIT ?", (limit,)).fetchall()
        return [{**dict(r), "errors": json.loads(r["errors"])} for r in rows]

    # -- host status ----------------------------------------------------------------------------
    def planner_state(self) -> Any:
        """The planner's state the last cycle saved (planner.types.PlannerState); unreadable or
        absent: a fresh one (logged)."""
        from fleetplan.planner.policy import PolicyError
        from fleetplan.planner.serde import state_from_dict
        from fleetplan.planner.types import PlannerState

        d = self.get_kv("planner_state")
        if not d:
            return PlannerState.initial()
        try:
            return state_from_dict(d, "state store: planner_state")
        except PolicyError as exc:
            log.warning("stored planner state unreadable (%s); starting fresh", exc)
            return PlannerState.initial()

    def save_host_statuses(self, payloads: Mapping[str, Mapping[str, Any]]) -> None:
        """The hosts' last statuses (one transaction for a batch)."""
        if not payloads:
            return
        now = self._clock()
        with self.tx() as c:
            c.executemany(
                "INSERT INTO host_status(host, payload, received_s) VALUES (?, ?, ?) ON CONFLICT(host) DO "
                "UPDATE SET payload=excluded.payload, received_s=excluded.received_s",
                [(host, json.dumps(p, default=str), now) for host, p in payloads.items()],
            )

    def host_statuses(self) -> dict[str, tuple[dict[str, Any], float]]:
        return {
            r["host"]: (json.loads(r["payload"]), float(r["received_s"]))
            for r in self._db.execute("SELECT * FROM host_status").fetchall()
        }

    # -- actions ---------------------------------------------------------------------------------
    def add_action(
        self,
        conn: sqlite3.Connection | None,
        *,
        cycle_id: int | None,
        kind: str,
        replica_id: str | None,
        host: str | None,
        model: str | None,
        status: str,
        reason: str = "",
        detail: str = "",
    ) -> int:
        now = self._clock()
        sql = (
            "INSERT INTO actions(cycle_id, created_s, updated_s, kind, replica_id, host, model, status, reason, "
            "detail) VALUES (?,?,?,?,?,?,?,?,?,?)"
        )
        args = (cycle_id, now, now, kind, replica_id, host, model, status, reason, detail)
        if conn is not None:
            return int(conn.execute(sql, args).lastrowid or 0)
        with self.tx() as c:
            return int(c.execute(sql, args).lastrowid or 0)

    def update_action(
        self, action_id: int, status: str, detail: str | None = None, conn: sqlite3.Connection | None = None
    ) -> None:
        sql = "UPDATE actions SET status=?, updated_s=?, detail=COALESCE(?, detail) WHERE action_id=?"
        args = (status, self._clock(), detail, action_id)
        if conn is not None:
            conn.execute(sql, args)
            return
        with self.tx() as c:
            c.execute(sql, args)

    def update_actions_for(self, replica_id: str, kind: str, from_status: Iterable[str], status: str,
                           detail: str | None = None) -> None:
        st = list(from_status)
        q = ",".join("?" * len(st))
        with self.tx() as c:
            c.execute(
                f"UPDATE actions SET status=?, updated_s=?, detail=COALESCE(?, detail) "
                f"WHERE replica_id=? AND kind=? AND status IN ({q})",
                (status, self._clock(), detail, replica_id, kind, *st),
            )

    def actions(self, limit: int = 50, statuses: Iterable[str] | None = None) -> list[dict[str, Any]]:
        # each action carries the id of the decision (cycle) that issued it
        sel = "SELECT a.*, d.decision_id FROM actions a LEFT JOIN decisions d ON d.cycle_id = a.cycle_id"
        if statuses is None:
            rows = self._db.execute(f"{sel} ORDER BY a.action_id DESC LIMIT ?", (limit,)).fetchall()
        else:
            st = list(statuses)
            q = ",".join("?" * len(st))
            rows = self._db.execute(
                f"{sel} WHERE a.status IN ({q}) ORDER BY a.action_id DESC LIMIT ?", (*st, limit)
            ).fetchall()
        return [dict(r) for r in rows]

    def actuation_history(self, since_s: float) -> list[tuple[str, float, int]]:
        """("start" | "stop", created_s, GPUs) of the replicas a cycle started, or drained/stopped,
        since `since_s` (one row per replica and direction; deferred/failed/planned actions did
        nothing). For the brakes (planner/brakes.py)."""
        rows = self._db.execute(
            "SELECT CASE WHEN a.kind = 'start' THEN 'start' ELSE 'stop' END AS kind, "
            "MIN(a.created_s) AS created_s, COALESCE(MAX(r.tp), 1) AS gpus "
            "FROM actions a LEFT JOIN replicas r ON r.replica_id = a.replica_id "
            "WHERE a.created_s >= ? AND a.cycle_id IS NOT NULL AND a.kind IN ('start', 'drain', 'stop') "
            "AND a.status NOT IN (?, ?, ?) GROUP BY 1, a.replica_id",
            (since_s, ActionStatus.DEFERRED, ActionStatus.FAILED, ActionStatus.PLANNED),
        ).fetchall()
        return [(str(r["kind"]), float(r["created_s"]), int(r["gpus"])) for r in rows]

    def actions_since(self, since_s: float, limit: int = 5000) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT a.*, d.decision_id FROM actions a LEFT JOIN decisions d ON d.cycle_id = a.cycle_id "
            "WHERE a.created_s >= ? ORDER BY a.action_id LIMIT ?", (since_s, limit)
        ).fetchall()
        return [dict(r) for r in rows]

    def action_counts(self) -> dict[str, int]:
        rows = self._db.execute("SELECT kind, status, COUNT(*) AS n FROM actions GROUP BY kind, status").fetchall()
        return {f"{r['kind']}/{r['status']}": int(r["n"]) for r in rows}

    # -- alerts ----------------------------------------------------------------------------------
    def set_alerts(self, key_prefix: str, alerts: Mapping[str, str]) -> None:
        """Make exactly `alerts` (key -> text) active among keys starting with `key_prefix`."""
        now = self._clock()
        with self.tx() as c:
            active = {
                r["key"]: (r["alert_id"], r["text"])
                for r in c.execute(
                    "SELECT alert_id, key, text FROM alerts WHERE active=1 AND key LIKE ?", (key_prefix + "%",)
                ).fetchall()
            }
            for key, (aid, text) in active.items():
                if alerts.get(key) != text:
                    c.execute("UPDATE alerts SET active=0, cleared_s=? WHERE alert_id=?", (now, aid))
            for key, text in alerts.items():
                if key not in active or active[key][1] != text:
                    c.execute("INSERT INTO alerts(created_s, key, text) VALUES (?, ?, ?)", (now, key, text))

    def active_alerts(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM alerts WHERE active=1 ORDER BY alert_id").fetchall()
        return [dict(r) for r in rows]

    def recent_alerts(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM alerts ORDER BY alert_id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(r) for r in rows]
