"""The controller's side of a plan nobody can carry out (controller/executor.py over a real state
store): the lab's agents host-a and host-b under a policy whose hosts are gpu-01..04 -> one alert
naming both sides, in the report; the starts deferred every cycle are three action-log rows with a
count, not three more rows per cycle."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from fleetplan.controller.protocol import parse_status
from fleetplan.planner import act_port
from fleetplan.planner.act_types import AlertKey, AlertKind
from fleetplan.planner.types import Action, ActionKind, ConfigKey, Replica, ReplicaState
from tests.unit.controller.test_failsafe_inventory import make, status
from tests.unit.planner.planner_helpers import BF16, H100, VLLM

CFG = ConfigKey("llama-3-8b", VLLM, H100, 1, BF16)


def starts() -> list[Action]:
    return [Action(ActionKind.START, Replica(f"llama_g{i}", CFG, "gpu-01", (i,), ReplicaState.STARTING),
                   "demand") for i in range(3)]


def test_unknown_agents_and_a_plan_on_policy_hosts_alert_once_and_log_once_with_a_count(tmp_path: Path) -> None:
    c = make(tmp_path)
    try:
        for h in ("host-a", "host-b"):
            c._on_status(h, parse_status(status(h), host=h))
        c.link.connected.set()
        c.executor.connected_wall = c.wall() - 3600
        for cycle in range(1, 6):
            counts = asyncio.run(act_port.execute(c.executor, starts(), planned_on=None, cycle_id=cycle)).counts
            assert counts["deferred"] == 3 and counts["start"] == 0
        db = sqlite3.connect(tmp_path / "s.db")
        rows = db.execute("SELECT kind, host, status, repeats, detail FROM actions ORDER BY action_id").fetchall()
        db.close()
        assert len(rows) == 3, rows  # not 15
        assert all(r[:4] == ("start", "gpu-01", "deferred", 5) for r in rows), rows
        assert "host gpu-01 has no online agent (deferred 5 times" in rows[0][4]
        text = c.runtime_alerts[AlertKey(AlertKind.UNREACHABLE)]
        assert "gpu-01" in text and "host-a, host-b" in text
        report_alerts = c.report()["alerts"]
        assert sum("cannot be carried out" in a for a in report_alerts) == 1
        assert any("host-a" in a and "not in the policy's hosts" in a for a in report_alerts)
    finally:
        c.store.close()


def test_the_lab_agents_under_the_example_policy_are_told_without_a_plan_on_them(tmp_path: Path) -> None:
    c = make(tmp_path)
    try:
        for h in ("host-a", "host-b"):
            c._on_status(h, parse_status(status(h), host=h))
        c.link.connected.set()
        c.executor.connected_wall = c.wall() - 3600
        assert {h.name: h.gpu_count for h in c.build_fleet().hosts} == {"host-a": 0, "host-b": 0}  # held
        asyncio.run(act_port.execute(c.executor, [], planned_on=None, cycle_id=1))
        text = c.runtime_alerts[AlertKey(AlertKind.UNREACHABLE)]
        assert "no host the policy lists has an online agent (gpu-01, gpu-02, gpu-03, gpu-04)" in text
        assert "host-a, host-b" in text
    finally:
        c.store.close()
