"""Issue 19, item 1: the controller never dies of its state store. A store that cannot be written
("database or disk is full", a read-only state directory) ends each cycle before anything is acted
on, raises an alert naming the store, its path and the error, keeps the report API and /healthz up
("degraded"), and the controller resumes by itself once writes succeed; what was recorded stays
(PRAGMA integrity_check). Real Mosquitto and Prometheus; the controller's own cycles.

"Disk full" is real SQLite SQLITE_FULL: the database may not grow past its size (`PRAGMA
max_page_count`) and is filled to the brim, like `dd` filling the filesystem (the fault suite,
bench/faults.py, does that on a tmpfs with the controller as a process). "Read-only" is the
connection turned `query_only` (the tests run as root, whom chmod does not stop)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.protocol import HostStatus
from fleetplan.controller.state import StateStore
from fleetplan.harness.servers import MosquittoServer, PrometheusServer
from fleetplan.planner.act_types import AlertKey, AlertKind

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def ctrl(mosquitto: MosquittoServer, prometheus: PrometheusServer, tmp_path: Path) -> AsyncIterator[Controller]:
    policy = tmp_path / "policy.yaml"
    policy.write_text((REPO / "config" / "example-policy.yaml").read_text())
    settings = ControllerSettings(
        prometheus_url=prometheus.url, history_s=600.0,
        mqtt=MqttSettings(host=mosquitto.host, port=mosquitto.port, username=mosquitto.controller_user,
                          password=mosquitto.controller_password, keepalive_s=5, backoff_initial_s=0.1,
                          backoff_max_s=0.5))
    c = Controller(settings=settings, policy_path=policy, profiles_path=None, store=StateStore(tmp_path / "state.db"),
                   report_listen="127.0.0.1:0")
    await c.start()
    await asyncio.wait_for(c.link.connected.wait(), 10)
    try:
        yield c
    finally:
        with contextlib.suppress(Exception):
            await c.stop()


def fill(db: sqlite3.Connection) -> None:
    """No room left: the database may not grow, and its free pages are used up."""
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages + 4}")
    db.execute("CREATE TABLE IF NOT EXISTS ballast (b BLOB)")
    with contextlib.suppress(sqlite3.OperationalError):
        for _ in range(10_000):
            db.execute("INSERT INTO ballast VALUES (zeroblob(512))")
    with contextlib.suppress(sqlite3.OperationalError):  # what fits in the last partly used pages
        for _ in range(10_000):
            db.execute("INSERT INTO ballast VALUES (zeroblob(16))")


def free(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA max_page_count = 1073741823")


@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
async def test_a_store_that_cannot_be_written_stops_actuation_alerts_and_recovers(ctrl: Controller, fault: str) -> None:
    db = ctrl.store._db
    for _ in range(2):
        assert (await ctrl.cycle()).get("error") is None
    cycles_before = db.execute("SELECT COUNT(*) FROM cycles").fetchone()[0]
    plans_before = db.execute("SELECT COUNT(*) FROM plans").fetchone()[0]
    assert plans_before >= 1

    if fault == "disk_full":
        fill(db)
    else:
        db.execute("PRAGMA query_only = ON")
    expected = "database or disk is full" if fault == "disk_full" else "readonly"
    for _ in range(3):  # a cycle may still fit in the pages left; the next ones cannot
        summary = await ctrl.cycle()
    assert "error" in summary, summary
    alert = ctrl.runtime_alerts.get(AlertKey(AlertKind.STORE), "")
    assert str(ctrl.store.path) in alert and "state store" in alert and expected in alert, alert
    assert "actuation stopped" in alert
    assert ctrl.metrics.store_writable._value.get() == 0.0

    # the loop lives: the watchdog's health is fine, the report API answers, /healthz says degraded
    assert ctrl.health() == []
    assert ctrl.report_url is not None
    async with httpx.AsyncClient(timeout=10) as http:
        h = await http.get(ctrl.report_url + "/healthz")
        assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
        assert any(str(ctrl.store.path) in d for d in h.json()["degraded"])
        rep = await http.get(ctrl.report_url + "/api/report")
        assert rep.status_code == 200 and any(expected in a for a in rep.json()["alerts"]), rep.text
        if fault == "read_only":  # a pause that cannot be recorded is refused, not half done
            p = await http.post(ctrl.report_url + "/api/pause", json={}, headers={"X-Fleetplan-Request": "1"})
            assert p.status_code == 503 and "cannot be written" in p.text, p.text
            assert not ctrl.pause.paused
        m = await http.get(ctrl.report_url + "/metrics")
        assert "fleetplan_store_writable 0.0" in m.text

    # space comes back: within two cycles the controller acts again, the alert is gone
    if fault == "disk_full":
        free(db)
    else:
        db.execute("PRAGMA query_only = OFF")
    results = [await ctrl.cycle() for _ in range(2)]
    assert results[-1].get("error") is None, results
    assert AlertKey(AlertKind.STORE) not in ctrl.runtime_alerts
    assert ctrl.metrics.store_writable._value.get() == 1.0
    assert ctrl.executor.republish_all is False  # the recovery's republish ran (reconcile clears it)

    # nothing recorded was lost, and the file is sound
    assert db.execute("SELECT COUNT(*) FROM cycles").fetchone()[0] >= cycles_before + 1
    assert db.execute("SELECT COUNT(*) FROM plans").fetchone()[0] > plans_before
    with contextlib.closing(sqlite3.connect(ctrl.store.path)) as other:
        assert other.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_stop_with_a_full_store_does_not_raise(ctrl: Controller) -> None:
    await ctrl.cycle()
    fill(ctrl.store._db)
    ctrl.hosts.on_status("host-z", HostStatus(host="host-z", online=False))  # a status to save at stop
    ctrl.store._db.execute("PRAGMA query_only = ON")
    await ctrl.stop()  # no exception: a clean stop, the WAL keeps what was committed
    with contextlib.closing(sqlite3.connect(ctrl.store.path)) as other:
        assert other.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
