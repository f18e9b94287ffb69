"""Retention of the state store: it keeps what the reports, the audit trail and the brakes read, and
forgets the rest in small steps, so its size stays bounded.

Kept whatever the age: the replicas and builds in use, the desired states, the hosts' statuses and
inventories, ``kv`` (planner state, pause, clock), the active alerts, the latest plan and
observation, and the last `floor_s` (one hour: the brakes' window) of actions, decisions and cycles.
Kept for `keep_s` (the audit trail, `fleetplan history`): decisions, actions, cycles, acks, cleared
alerts, removed replicas and finished builds. Kept for `keep_documents_s`: the plans and observations
(a plan is ~7 KB per model and cycle; the reports read only the latest one, the plan page a day of
decisions). Above `max_bytes` (live pages), the oldest rows go first whatever their age, plans and
observations before the audit trail, never below the floors.

Each cycle deletes at most `rows_per_cycle` rows, `rows_per_step` per transaction (25 for the plan
and observation documents: a short write lock, the report API and `fleetplan hosts confirm` never
wait long), then gives at most `vacuum_pages` free pages back to the file system, 256 per step (a database created with incremental auto-vacuum,
as StateStore creates new ones; an older file keeps its size and reuses its free pages). The WAL is
truncated after checkpoints (StateStore's journal_size_limit). Figures: bench/store_growth.py.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetplan.controller.state import StateStore

__all__ = ["DAY_S", "Pruned", "RetentionRules", "live_bytes", "prune_step"]

log = logging.getLogger(__name__)

DAY_S = 86400.0
HOUR_S = 3600.0


@dataclass(frozen=True)
class RetentionRules:
    keep_s: float = 7 * DAY_S  # the audit trail
    keep_documents_s: float = DAY_S  # plans and observations
    max_bytes: int = 1024 * 1024 * 1024  # live pages of the main file
    rows_per_cycle: int = 2000
    rows_per_step: int = 200  # rows per transaction
    document_rows_per_step: int = 25  # plans/observations per transaction (~9 KB per model each)
    vacuum_pages: int = 2048  # free pages given back per cycle (4 KiB each: 8 MiB)
    vacuum_pages_per_step: int = 256
    floor_s: float = HOUR_S  # never pruned, whatever the size


@dataclass(frozen=True)
class _Table:
    name: str
    order: str  # the column rows are oldest-first by (indexed: the primary key)
    age: str  # the time column compared with the cut-off
    where: str = "1"  # rows that may be pruned at all
    documents: bool = False  # plans/observations: kept keep_documents_s
    keep_latest: bool = False  # the newest row stays whatever the size
    floored: bool = True  # the last floor_s stays whatever the size
    monotonic: bool = True  # `age` grows with `order`: the oldest row tells whether any may go


# in the order the size bound prunes them (heaviest and least read first)
TABLES = (
    _Table("plans", "cycle_id", "created_s", documents=True, keep_latest=True, floored=False),
    _Table("observations", "cycle_id", "created_s", documents=True, keep_latest=True, floored=False),
    _Table("decisions", "cycle_id", "created_s"),
    _Table("cycles", "cycle_id", "started_s"),
    _Table("acks", "ack_id", "received_s"),
    _Table("alerts", "alert_id", "cleared_s", where="active = 0", monotonic=False),
    _Table("actions", "action_id", "updated_s", monotonic=False),
    _Table("replicas", "rowid", "updated_s", where="phase = 'removed'", monotonic=False),
    _Table("builds", "rowid", "updated_s", where="phase = 'removed'", monotonic=False),
)


@dataclass
class Pruned:
    """One cycle's pruning: rows deleted per table, transactions, the longest one, and the live size
    after it (`over`: still above the bound with nothing left that may go)."""

    deleted: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    longest_step_s: float = 0.0
    vacuumed_pages: int = 0
    live_bytes: int = 0
    over: bool = False

    @property
    def rows(self) -> int:
        return sum(self.deleted.values())


def live_bytes(db: sqlite3.Connection) -> int:
    """Bytes of the main file's pages in use (free pages are reused before the file grows)."""
    page_size = int(db.execute("PRAGMA page_size").fetchone()[0])
    pages = int(db.execute("PRAGMA page_count").fetchone()[0])
    free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
    return (pages - free) * page_size


def _cut(t: _Table, older_than_s: float) -> str:
    return f"{t.age} IS NOT NULL AND {t.age} < {older_than_s!r}"


def _delete(store: StateStore, t: _Table, cond: str, limit: int, out: Pruned,
            perf: Callable[[], float]) -> int:
    """At most `limit` rows of `t` that match `cond` among its `limit` oldest (a bounded read: the
    primary key's order; nothing to delete takes no write lock), in one transaction; returns how many."""
    latest = f"SELECT MAX({t.order}) FROM {t.name}"
    if t.monotonic and store._db.execute(f"SELECT 1 FROM (SELECT {t.age} FROM {t.name} WHERE {t.where} ORDER BY "
                                         f"{t.order} LIMIT 1) WHERE {cond}").fetchone() is None:
        return 0  # its oldest row stays: so do the rest (plans are a page each: no window read)
    window = (f"SELECT {t.order} AS k, {t.age} AS {t.age} FROM {t.name} WHERE {t.where} "
              + (f"AND {t.order} < ({latest}) " if t.keep_latest else "") + f"ORDER BY {t.order} LIMIT ?")
    keys = [r[0] for r in store._db.execute(f"SELECT k FROM ({window}) WHERE {cond}", (limit,)).fetchall()]
    if not keys:
        return 0
    t0 = perf()
    with store.tx() as c:
        n = c.execute(f"DELETE FROM {t.name} WHERE {t.order} IN ({','.join('?' * len(keys))})", keys).rowcount
    out.steps += 1
    out.longest_step_s = max(out.longest_step_s, perf() - t0)
    if n > 0:
        out.deleted[t.name] = out.deleted.get(t.name, 0) + n
    return len(keys)


def prune_step(store: StateStore, rules: RetentionRules, now_s: float, *,
               perf: Callable[[], float] = time.perf_counter) -> Pruned:
    """One cycle's bounded pruning (see the module docstring). `now_s`: the store's clock."""
    out = Pruned()
    budget = rules.rows_per_cycle
    db = store._db
    for t in TABLES:  # by age
        keep = rules.keep_documents_s if t.documents else rules.keep_s
        cond = _cut(t, now_s - max(keep, rules.floor_s if t.floored else 0.0))
        step = rules.document_rows_per_step if t.documents else rules.rows_per_step
        while budget > 0:
            n = _delete(store, t, cond, min(step, budget), out, perf)
            budget -= n
            if n < step:
                break
    size = live_bytes(db)
    for t in TABLES:  # by size: the oldest first whatever their age, down to the floors
        if size <= rules.max_bytes or budget <= 0:
            break
        cond = _cut(t, now_s - rules.floor_s) if t.floored else "1"
        step = rules.document_rows_per_step if t.documents else rules.rows_per_step
        while size > rules.max_bytes and budget > 0:
            n = _delete(store, t, cond, min(step, budget), out, perf)
            budget -= n
            size = live_bytes(db)
            if n == 0:
                break
    out.over = size > rules.max_bytes and budget > 0
    if int(db.execute("PRAGMA auto_vacuum").fetchone()[0]) == 2:  # incremental: give free pages back
        while out.vacuumed_pages < rules.vacuum_pages:
            free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
            pages = min(free, rules.vacuum_pages_per_step, rules.vacuum_pages - out.vacuumed_pages)
            if pages <= 0:
                break
            t0 = perf()
            # stepped to the end (a single execute() frees one page): executescript runs it through
            db.executescript(f"PRAGMA incremental_vacuum({pages});")
            out.vacuumed_pages += pages
            out.longest_step_s = max(out.longest_step_s, perf() - t0)
            out.steps += 1
    out.live_bytes = live_bytes(db)
    return out
