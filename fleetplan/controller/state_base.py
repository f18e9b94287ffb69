"""The state store's base: the SQLite database (WAL, one transaction per step), its schema, the
transaction that records why a write failed, and the small key-value table. The store's parts are
layered over it by concern (controller/state_log.py the cycle log, decisions, action log and
alerts; controller/state_desired.py the desired states, acks and host statuses; controller/state.py
the replica and build records and `StateStore`)."""


import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleetplan.planner.act import BuildRow, ReplicaRow

# the records' types are the act core's (planner/act.py decides on them; this module persists them)

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
    ready_s REAL,
    role TEXT NOT NULL DEFAULT 'aggregated'
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


def replica_row(r: sqlite3.Row) -> ReplicaRow:
    """A replicas-table row as the act core's record."""
    return ReplicaRow(
        replica_id=r["replica_id"], host=r["host"], model=r["model"], engine=r["engine"], gpu=r["gpu"],
        tp=int(r["tp"]), precision=r["precision"], gpu_indices=tuple(json.loads(r["gpu_indices"])),
        port=int(r["port"]), template=r["template"], phase=r["phase"], origin=r["origin"],
        created_s=r["created_s"], updated_s=r["updated_s"], drain_started_s=r["drain_started_s"],
        ready_s=r["ready_s"], role=r["role"],
    )


def build_row(r: sqlite3.Row) -> BuildRow:
    """A builds-table row as the act core's record."""
    return BuildRow(
        build_id=r["build_id"], host=r["host"], model=r["model"], engine=r["engine"], gpu=r["gpu"],
        tp=int(r["tp"]), precision=r["precision"], gpu_indices=tuple(json.loads(r["gpu_indices"])),
        template=r["template"], phase=r["phase"], created_s=r["created_s"], updated_s=r["updated_s"],
        result=r["result"],
    )


class StoreBase:
    """The database, its transactions and the key-value table (a base of `StateStore`)."""


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
        if "role" not in {r[1] for r in self._db.execute("PRAGMA table_info(replicas)").fetchall()}:
            # a database written before roles: every replica it holds serves whole requests
            self._db.execute("ALTER TABLE replicas ADD COLUMN role TEXT NOT NULL DEFAULT 'aggregated'")
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
