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

import json
import logging
import sqlite3
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetplan.controller.state_base import build_row, replica_row
from fleetplan.controller.state_desired import StoreDesired

# the records' types and rules are the act core's and the records reducer's (planner/act.py,
# planner/records.py decide on them; this module persists them)
from fleetplan.planner import records
from fleetplan.planner.act import ActionStatus, BuildRow, DesiredRow, Note, Phase, ReplicaRow

__all__ = ["ActionStatus", "BuildRow", "DesiredRow", "Phase", "ReplicaRow", "StateStore", "read_history"]

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


class StateStore(StoreDesired):
    """Synchronous SQLite store; each public method is one transaction (call from one thread). The
    replica and build records are here; the logs, desired states and the database itself are its
    bases (state_log.py, state_desired.py, state_base.py)."""

    SEQ_KEY = "next_replica_seq"  # the records' id sequence (replicas and builds)

    # -- replicas ---------------------------------------------------------------------------
    def replicas(self, phases: Iterable[str] | None = None) -> list[ReplicaRow]:
        if phases is None:
            rows = self._db.execute("SELECT * FROM replicas ORDER BY created_s, replica_id").fetchall()
        else:
            ph = list(phases)
            q = ",".join("?" * len(ph))
            rows = self._db.execute(
                f"SELECT * FROM replicas WHERE phase IN ({q}) ORDER BY created_s, replica_id", ph
            ).fetchall()
        return [replica_row(r) for r in rows]

    def active_replicas(self) -> list[ReplicaRow]:
        return self.replicas((Phase.DESIRED, Phase.DRAINING))

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        r = self._db.execute("SELECT * FROM replicas WHERE replica_id=?", (replica_id,)).fetchone()
        return None if r is None else replica_row(r)

    def known_ids(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT replica_id FROM replicas").fetchall()}

    def insert_replica(self, conn: sqlite3.Connection, row: ReplicaRow) -> None:
        conn.execute(
            "INSERT INTO replicas(replica_id, host, model, engine, gpu, tp, precision, gpu_indices, port, "
            "template, phase, origin, created_s, updated_s, drain_started_s, ready_s, role) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (row.replica_id, row.host, row.model, row.engine, row.gpu, row.tp, row.precision,
             json.dumps(list(row.gpu_indices)), row.port, row.template, row.phase, row.origin,
             row.created_s, row.updated_s, row.drain_started_s, row.ready_s, row.role),
        )

    def put_replica(self, conn: sqlite3.Connection, row: ReplicaRow) -> None:
        """Write a replica row the records reducer changed (its id is in the table)."""
        conn.execute(
            "UPDATE replicas SET phase=?, updated_s=?, drain_started_s=?, ready_s=? WHERE replica_id=?",
            (row.phase, row.updated_s, row.drain_started_s, row.ready_s, row.replica_id),
        )

    def apply(self, effects: Iterable[records.RecordEffect], cycle_id: int | None) -> list[Note]:
        """Persist an act decision's effects in ONE transaction; returns the action-log notes
        written, with their allocated ids."""
        with self.tx() as c:
            return self.persist(c, effects, cycle_id)

    def persist(self, c: sqlite3.Connection, effects: Iterable[records.RecordEffect],
                cycle_id: int | None) -> list[Note]:
        """Within `c`'s transaction: what the records reducer (planner/records.py) makes of `effects`,
        from the rows they name and the id sequence, written as it says."""
        effects = list(effects)
        rids, bids = records.needs(effects)
        now = self._clock()
        step = records.apply(self._records(c, rids, bids), effects, now, cycle_id=cycle_id)
        return [n for w in step.writes if (n := self._write(c, w, now)) is not None]

    def _records(self, c: sqlite3.Connection, rids: frozenset[str], bids: frozenset[str]) -> records.Records:
        def rows(table: str, key: str, ids: frozenset[str]) -> list[sqlite3.Row]:
            q = ",".join("?" * len(ids))
            return c.execute(f"SELECT * FROM {table} WHERE {key} IN ({q})", sorted(ids)).fetchall() if ids else []

        seq = c.execute("SELECT value FROM kv WHERE key=?", (self.SEQ_KEY,)).fetchone()
        return records.Records(
            replicas={r["replica_id"]: replica_row(r) for r in rows("replicas", "replica_id", rids)},
            builds={b["build_id"]: build_row(b) for b in rows("builds", "build_id", bids)},
            next_seq=int(json.loads(seq["value"])) if seq else 1)

    def _write(self, c: sqlite3.Connection, w: records.Write, now: float) -> Note | None:
        if isinstance(w, records.PutReplica):
            (self.insert_replica if w.new else self.put_replica)(c, w.row)
        elif isinstance(w, records.PutBuild):
            if w.new:
                self.insert_build(c, w.row)
            else:
                c.execute("UPDATE builds SET phase=?, result=?, updated_s=? WHERE build_id=?",
                          (w.row.phase, w.row.result, w.row.updated_s, w.row.build_id))
        elif isinstance(w, records.SetSequence):
            self.set_kv(self.SEQ_KEY, w.next_seq, c)
        elif isinstance(w, records.LogNote):
            cycle_id = w.cycle_id
            if w.cycle_of is not None:  # the decision that drained it
                by = c.execute("SELECT cycle_id FROM actions WHERE replica_id=? AND kind='drain' "
                               "ORDER BY action_id DESC LIMIT 1", (w.cycle_of,)).fetchone()
                cycle_id = by[0] if by else None
            n = w.note
            aid = self.add_action(c, cycle_id=cycle_id, kind=n.kind, replica_id=n.replica_id, host=n.host,
                                  model=n.model, status=n.status, reason=n.reason, detail=n.detail)
            return replace(n, action_id=aid)
        elif isinstance(w, records.LogUpdate):
            st = w.from_status
            only = f" AND status IN ({','.join('?' * len(st))})" if st is not None else ""
            c.execute(f"UPDATE actions SET status=?, updated_s=?, detail=COALESCE(?, detail) "
                      f"WHERE replica_id=? AND kind=?{only}",
                      (w.status, now, w.detail, w.subject_id, w.kind, *(st or ())))
        elif isinstance(w, records.LogRepeat):  # the same deferral again: one row, its count and time move on
            c.execute("UPDATE actions SET updated_s=?, repeats=?, detail=? WHERE action_id=?",
                      (now, w.count, w.detail, w.action_id))
        else:
            raise TypeError(f"unknown write {w!r}")
        return None

    # -- builds --------------------------------------------------------------------------------
    def builds(self, phases: Iterable[str] | None = None) -> list[BuildRow]:
        rows = self._db.execute("SELECT * FROM builds ORDER BY build_id").fetchall()
        out = [build_row(r) for r in rows]
        if phases is not None:
            ph = set(phases)
            out = [b for b in out if b.phase in ph]
        return out

    def insert_build(self, conn: sqlite3.Connection, b: BuildRow) -> None:
        conn.execute(
            "INSERT INTO builds(build_id, host, model, engine, gpu, tp, precision, gpu_indices, template, phase, "
            "created_s, updated_s, result) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (b.build_id, b.host, b.model, b.engine, b.gpu, b.tp, b.precision, json.dumps(list(b.gpu_indices)),
             b.template, b.phase, b.created_s, b.updated_s, b.result),
        )
