"""Retention of the state store (controller/state_retention.py) against a real StateStore on disk:
history older than its keep time goes, what the reports, audit and brakes need stays, the size bound
prunes the oldest first down to the floors, each cycle deletes a bounded number of rows, and the
file shrinks (incremental auto-vacuum)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fleetplan.controller.settings import ControllerSettings, RetentionSettings
from fleetplan.controller.state import Phase, ReplicaRow, StateStore
from fleetplan.controller.state_retention import DAY_S, HOUR_S, RetentionRules, live_bytes, prune_step
from fleetplan.planner.act_types import AlertKey, AlertKind
from fleetplan.planner.records import history
from tests.unit.controller.test_failsafe_inventory import make

T0 = 1.7e9


def fill(store: StateStore, clock: list[float], cycles: int, step_s: float, plan_bytes: int = 7000) -> None:
    """What daemon cycles write (cycle, observation, plan, decision, an action and an ack each)."""
    for _ in range(cycles):
        now = clock[0]
        cid = store.begin_cycle(now)
        store.save_observation(cid, {"o": "x" * 2000})
        store.save_plan(cid, {"p": "y" * plan_bytes}, 0.01, {"s": 1})
        store.save_decision({"cycle_id": cid, "decision_id": f"d{cid}", "now_s": now})
        store.add_action(None, cycle_id=cid, kind="start", replica_id=f"r{cid}", host="h", model="m",
                         status="published")
        store.record_ack("h", cid, True, [])
        store.finish_cycle(cid, "ok", {})
        clock[0] += step_s


def count(path: Path, table: str) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    finally:
        db.close()


def test_old_history_goes_and_what_the_reports_audit_and_brakes_need_stays(tmp_path: Path) -> None:
    clock = [T0]
    s = StateStore(tmp_path / "s.db", clock=lambda: clock[0])
    now = T0 + 10 * DAY_S
    try:
        fill(s, clock, 10, DAY_S)  # one cycle a day for 10 days
        old = ReplicaRow("r-old", "h", "m", "vllm", "h100", 1, "bf16", (0,), 8000, "vllm", Phase.REMOVED, "planned",
                         T0, T0, None, None)
        serving = ReplicaRow("r-serving", "h", "m", "vllm", "h100", 1, "bf16", (1,), 8001, "vllm", Phase.DESIRED,
                             "planned", T0, T0, None, T0 + 60)
        with s.tx() as c:
            s.insert_replica(c, old)
            s.insert_replica(c, serving)
        clock[0] = T0
        s.set_alerts("", {"a/standing": "since day 0", "a/gone": "cleared on day 0"})
        s.set_alerts("a/gone", {})
        clock[0] = now
        last_plan = s.last_plan()
        p = prune_step(s, RetentionRules(keep_s=7 * DAY_S, keep_documents_s=DAY_S), now)
        assert p.deleted["plans"] == 9 and p.deleted["observations"] == 9  # all but the latest (a day old)
        assert p.deleted["decisions"] == 3 and p.deleted["actions"] == 3 and p.deleted["acks"] == 3
        assert p.deleted["replicas"] == 1 and p.deleted["alerts"] == 1 and not p.over
        assert s.last_plan() == last_plan and s.last_observation() is not None
        assert [r.replica_id for r in s.active_replicas()] == ["r-serving"]
        assert [a["key"] for a in s.active_alerts()] == ["a/standing"]
        assert len(s.decisions()) == 7 and "r-old" not in s.known_ids()
        assert prune_step(s, RetentionRules(keep_s=7 * DAY_S, keep_documents_s=DAY_S), now).rows == 0
    finally:
        s.close()


def test_the_size_bound_prunes_the_oldest_first_down_to_the_brakes_hour(tmp_path: Path) -> None:
    clock = [T0]
    s = StateStore(tmp_path / "s.db", clock=lambda: clock[0])
    try:
        fill(s, clock, 240, 60.0, plan_bytes=20_000)  # 4 hours at 60 s, ~23 KB a cycle
        big = live_bytes(s._db)
        rules = RetentionRules(max_bytes=big // 3, rows_per_cycle=100_000)
        p = prune_step(s, rules, clock[0])
        assert live_bytes(s._db) <= big // 3 and not p.over and p.deleted["plans"] > 0
        assert "actions" not in p.deleted  # plans and observations went first
        # a bound below what must stay: everything but the floors goes, and it says so
        p = prune_step(s, RetentionRules(max_bytes=4096, rows_per_cycle=100_000), clock[0])
        assert p.over
        assert count(tmp_path / "s.db", "plans") == 1  # the latest plan stays
        assert history(s.action_entries(clock[0] - HOUR_S))  # the brakes' hour of actions stays
        assert min(a["created_s"] for a in s.actions(limit=10_000)) >= clock[0] - HOUR_S
    finally:
        s.close()


def test_each_cycle_prunes_a_bounded_number_of_rows_in_small_transactions_and_the_file_shrinks(
        tmp_path: Path) -> None:
    clock = [T0]
    path = tmp_path / "s.db"
    s = StateStore(path, clock=lambda: clock[0])
    try:
        fill(s, clock, 1000, 60.0)
        s._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = path.stat().st_size
        rules = RetentionRules(keep_s=HOUR_S, keep_documents_s=HOUR_S, rows_per_cycle=500, rows_per_step=100,
                               vacuum_pages=100_000)
        p = prune_step(s, rules, clock[0])
        assert p.rows == 500 and p.steps >= 5 and all(n <= 500 for n in p.deleted.values())
        while prune_step(s, rules, clock[0]).rows:
            pass
        assert count(path, "plans") == 60 and count(path, "cycles") == 60  # the last hour
        s._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert path.stat().st_size < before / 4, (before, path.stat().st_size)
    finally:
        s.close()


def test_an_older_store_gains_the_repeats_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE actions (action_id INTEGER PRIMARY KEY AUTOINCREMENT, cycle_id INTEGER, "
               "created_s REAL NOT NULL, updated_s REAL NOT NULL, kind TEXT NOT NULL, replica_id TEXT, host TEXT, "
               "model TEXT, status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '')")
    db.execute("INSERT INTO actions(created_s, updated_s, kind, status) VALUES (1, 1, 'start', 'done')")
    db.commit()
    db.close()
    s = StateStore(path)
    try:
        assert [a["repeats"] for a in s.actions()] == [1]
        assert prune_step(s, RetentionRules(), 2e9).deleted == {"actions": 1}  # auto_vacuum off: no shrink, no error
    finally:
        s.close()


def test_the_controller_prunes_each_reconcile_and_alerts_above_an_unreachable_bound(tmp_path: Path) -> None:
    import asyncio

    c = make(tmp_path)
    try:
        c.executor.settings = ControllerSettings(retention=RetentionSettings(max_mb=0.001))
        c.executor.__post_init__()
        asyncio.run(c.executor.reconcile())
        assert "retention.max_mb" in c.runtime_alerts[AlertKey(AlertKind.RETENTION)]
        assert any("retention.max_mb" in a for a in c.report()["alerts"])
        c.executor.settings = ControllerSettings()
        c.executor.__post_init__()
        asyncio.run(c.executor.reconcile())
        assert AlertKey(AlertKind.RETENTION) not in c.runtime_alerts
    finally:
        c.store.close()
