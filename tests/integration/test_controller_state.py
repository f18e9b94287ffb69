"""The controller's SQLite state store, report API auth and sd_notify, without the lab."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetplan.controller.executor import inflight_from_metrics
from fleetplan.controller.runner import sd_notify
from fleetplan.controller.state import Phase, ReplicaRow, StateStore
from fleetplan.planner.act import ActionStatus, NewReplica, Note, SetPhase
from fleetplan.planner.records import Drained, history

ROOT = Path(__file__).resolve().parents[2]


def _row(rid: str, host: str = "h1", gpus: tuple[int, ...] = (0,), port: int = 8100) -> ReplicaRow:
    now = time.time()
    return ReplicaRow(rid, host, "m", "vllm", "h100", len(gpus), "bf16", gpus, port, "vllm", Phase.DESIRED,
                      "planned", now, now, None, None)


def _start(s: StateStore, c: sqlite3.Connection, **kw: Any) -> str:
    """A new replica row through the records reducer (its id allocated in `c`'s transaction)."""
    (note,) = s.persist(c, [NewReplica(_row("", **kw), Note("start", ActionStatus.PUBLISHED, "test"))], 1)
    assert note.replica_id is not None
    return note.replica_id


def test_ids_and_desired_versions_survive_reopen(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    s = StateStore(db)
    with s.tx() as c:
        rid = _start(s, c)
        payload = s.stage_desired(c, "h1")
    assert payload["version"] == 1 and [r["replica_id"] for r in payload["replicas"]] == [rid]
    s.close()  # as good as kill -9 after the commit: WAL is durable
    s = StateStore(db)
    assert [r.replica_id for r in s.active_replicas()] == [rid]
    with s.tx() as c:
        rid2 = _start(s, c, gpus=(1,), port=8101)
        assert rid2 != rid  # never reused
        s.persist(c, [SetPhase(rid, Phase.DRAINING)], None)
        p2 = s.stage_desired(c, "h1")
    assert [r["replica_id"] for r in p2["replicas"]] == [rid, rid2]  # draining stays desired
    assert p2["version"] == 2
    # an agent that applied v7 from an older database: the next version goes above it
    s.note_version_floor("h1", 7)
    with s.tx() as c:
        s.persist(c, [SetPhase(rid, Phase.REMOVED), SetPhase(rid2, Phase.REMOVED)], None)
        p3 = s.stage_desired(c, "h1")
    assert p3["version"] == 8 and p3["replicas"] == []
    assert s.known_ids() == {rid, rid2}


def test_a_finished_drain_is_persisted_as_the_records_reducer_says(tmp_path: Path) -> None:
    clock = [1000.0]
    s = StateStore(tmp_path / "state.db", clock=lambda: clock[0])
    with s.tx() as c:
        rid = _start(s, c, gpus=(0, 1))
    clock[0] = 1100.0
    s.apply([SetPhase(rid, Phase.DRAINING, Note("drain", ActionStatus.PUBLISHED, "down", replica_id=rid))], 7)
    clock[0] = 1150.0
    s.apply([SetPhase(rid, Phase.DRAINING)], None)  # a drain resumed: its start is kept
    assert s.get_replica(rid).drain_started_s == 1100.0  # type: ignore[union-attr]
    clock[0] = 1200.0
    s.apply([Drained(rid, timed_out=False)], None)
    row = s.get_replica(rid)
    assert row is not None and (row.phase, row.updated_s) == (Phase.REMOVED, 1200.0)
    acts = {(a["kind"], a["status"], a["cycle_id"]) for a in s.actions()}
    assert acts == {("start", "published", 1), ("drain", "done", 7), ("stop", "done", 7)}
    # the brakes read one way up and one way down, at the drain
    assert sorted((p.direction.value, p.at_s, p.gpus) for p in history(s.action_entries(0.0))) == [
        ("down", 1100.0, 2), ("up", 1000.0, 2)]


def test_version_floor_is_range_checked_even_from_an_old_database(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    s.note_version_floor("h1", 2**63)  # the protocol refuses it already; the store too
    assert s.get_kv("version_floor/h1") is None
    s.set_kv("version_floor/h1", 2**63)  # as an older controller could have stored it
    with s.tx() as c:
        assert s.stage_desired(c, "h1")["version"] == 1  # ignored: the next cycle does not fail
    s.note_version_floor("h1", 41)
    with s.tx() as c:
        assert s.stage_desired(c, "h1")["version"] == 42
    s.close()


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    with pytest.raises(RuntimeError), s.tx() as c:
        _start(s, c)
        raise RuntimeError("crash mid-step")
    assert s.active_replicas() == []
    with s.tx() as c:
        assert _start(s, c) == "r00001"  # the sequence bump rolled back too


def _child_writes_then_dies(path: str) -> None:
    s = StateStore(path)
    with s.tx() as c:
        _start(s, c)
        s.stage_desired(c, "h1")
    with s.tx() as c:  # an uncommitted step when the process is killed
        _start(s, c, gpus=(1,), port=8101)
        os.kill(os.getpid(), 9)


def test_kill9_keeps_committed_step_loses_only_the_open_one(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    p = multiprocessing.get_context("spawn").Process(target=_child_writes_then_dies, args=(str(db),))
    p.start()
    p.join(30)
    assert p.exitcode == -9
    s = StateStore(db)
    assert [r.replica_id for r in s.active_replicas()] == ["r00001"]
    assert s.desired_rows()["h1"].version == 1
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_alerts_are_replaced_and_history_kept(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.db")
    s.set_alerts("", {"a": "prometheus down", "b": "host h2 offline"})
    s.set_alerts("", {"a": "prometheus down"})
    assert [a["text"] for a in s.active_alerts()] == ["prometheus down"]
    assert len(s.recent_alerts()) == 2


def test_inflight_parsing_of_engine_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n'
        'vllm:num_requests_waiting_by_reason{reason="x"} 9\n'
    )
    assert inflight_from_metrics(text) == 5.0
    assert inflight_from_metrics("trtllm_num_requests_running 0\n") == 0.0
    assert inflight_from_metrics("something_else 1\n") is None


def test_sd_notify_sends_datagrams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sd_notify("READY=1")
        assert srv.recv(100) == b"READY=1"
        # a receiver that never reads must not block the sender (the controller's event loop)
        t0 = time.monotonic()
        results = [sd_notify("WATCHDOG=1") for _ in range(2000)]
        assert time.monotonic() - t0 < 5 and not all(results)
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify("READY=1")


class _FakeCtrl:
    """Only what the report server reads: a report dict, the decisions of a store, metrics and a
    cycle count."""

    cycle_count = 3
    time_scale = 1.0

    def __init__(self) -> None:
        from fleetplan.controller.metrics import ControllerMetrics
        from fleetplan.controller.report_snapshot import ReportSnapshot

        self.metrics = ControllerMetrics()
        self.metrics.planned_replicas.labels("m").set(2)
        self.reports = ReportSnapshot()
        self.store = StateStore(":memory:")

    def report(self) -> dict[str, object]:
        return {"plan": None, "fleet": [], "alerts": ["x"], "actions": [], "policy": {}, "generated_s": time.time()}

    def wall(self) -> float:
        return time.time()

    def health(self) -> list[str]:
        return list(self.problems)

    problems: tuple[str, ...] = ()


async def test_report_api_requires_token_off_loopback() -> None:
    from fleetplan.controller.report import render_report, start_report_server

    runner, url = await start_report_server(_FakeCtrl(), "0.0.0.0:0", "s3cret")
    try:
        port = url.rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as c:
            assert (await c.get(base + "/api/report")).status_code == 401
            assert (await c.get(base + "/api/report", headers={"Authorization": "Bearer nope"})).status_code == 401
            r = await c.get(base + "/api/report", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.json()["alerts"] == ["x"]
            m = await c.get(base + "/metrics", headers={"Authorization": "Bearer s3cret"})
            assert 'fleetplan_planned_replicas{model="m"} 2.0' in m.text
            assert (await c.get(base + "/healthz")).status_code == 200
        assert "ALERTS (1)" in render_report(json.loads(r.text))
    finally:
        await runner.cleanup()
    with pytest.raises(SystemExit):
        await start_report_server(_FakeCtrl(), "0.0.0.0:0", None)


async def test_state_api_feeds_policy_check_and_explain_renders_the_stored_counterfactuals(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real Controller (no MQTT/Prometheus needed for this): a plan stored as a cycle stores it;
    `explain` renders its alternatives from the report API; GET /api/state (bearer token) gives
    `policy check --controller` the controller's policy, fleet and last observation."""
    import asyncio

    import yaml

    from fleetplan.controller.daemon import Controller, ControllerSettings
    from fleetplan.controller.observe import ModelMetrics, Snapshot
    from fleetplan.controller.report import render_explain, start_report_server
    from fleetplan.harness.cli import main
    from fleetplan.planner.core import plan, plan_to_dict
    from fleetplan.planner.types import PlannerState

    root = ROOT
    now_s = 1731574800.0  # config/example-demand.yaml's time_s (business hours)
    store = StateStore(tmp_path / "state.db")
    ctrl = Controller(ControllerSettings(), root / "config/example-policy.yaml", None, store)
    runner = None
    try:
        assert ctrl.load_policy(initial=True)
        ctrl.policy.load_profiles()  # no profiles file: roofline priors
        ctrl.planner_state = PlannerState.initial()
        with store.tx() as c:
            store.insert_replica(c, ReplicaRow("r00001", "gpu-04", "llama-3-70b", "vllm", "h100", 8, "bf16",
                                               tuple(range(8)), 8100, "vllm", Phase.DESIRED, "planned", now_s,
                                               now_s, None, None))
        ctrl.last_snapshot = Snapshot(
            {"llama-3-8b": ModelMetrics("llama-3-8b", 60.0, 820.0, 200.0, stale=False),
             "llama-3-70b": ModelMetrics("llama-3-70b", 12.0, 820.0, 200.0, stale=False)},
            {}, (), True, time.time(), now_s)
        # the cycle's way: plan, plan_to_dict, save_plan (reports render it, never recompute)
        from fleetplan.controller.observe import to_observation

        result = plan(to_observation(ctrl.last_snapshot, ctrl.model_names()), ctrl.build_fleet(),
                      ctrl.policy.policy, ctrl.profiles, ctrl.planner_state, now_s)
        doc = plan_to_dict(result)
        doc["cycle_id"] = 1
        store.save_plan(1, doc, 0.05, doc["next_state"])

        runner, url = await start_report_server(ctrl, "127.0.0.1:0", "s3cret")
        auth = {"Authorization": "Bearer s3cret"}
        async with httpx.AsyncClient() as c:
            assert (await c.get(url + "/api/state")).status_code == 401  # same auth as the report
            state = (await c.get(url + "/api/state", headers=auth)).json()
            report = (await c.get(url + "/api/report", headers=auth)).json()
        assert state["policy"]["models"][0]["name"] == "llama-3-8b"
        assert [r["replica_id"] for r in state["fleet"]["replicas"]] == ["r00001"]
        assert state["demand"]["time_s"] == now_s and state["demand"]["models"]["llama-3-8b"]["rate_rps"] == 60.0
        assert state["profiles"] is not None

        for model in ("llama-3-8b", "llama-3-70b"):
            text = render_explain(report, model)
            assert text is not None and "why not the others" in text
            stored = next(m for m in report["plan"]["explanation"]["models"] if m["model"] == model)
            assert stored["alternatives"]
            for a in stored["alternatives"]:
                row = next(x for x in text.splitlines() if x.strip().startswith(f"{a['engine']} {a['gpu']} tp{a['tp']}"))
                assert f"{a['usd_h']:.2f}" in row and a["reason"] in row
        assert any("cheaper above" in (render_explain(report, m) or "") or "cheaper below" in (render_explain(report, m) or "")
                   for m in ("llama-3-8b", "llama-3-70b"))
        assert "SLO +10%" in (render_explain(report, "llama-3-8b") or "")

        # policy check --controller: the unedited policy changes nothing; a tighter SLO does
        capsys.readouterr()
        same = await asyncio.to_thread(main, ["policy", "check", str(root / "config/example-policy.yaml"),
                                              "--controller", url, "--token", "s3cret"])
        out = capsys.readouterr().out
        assert same == 0 and "RESULT: no change (exit 0)" in out
        tight = yaml.safe_load((root / "config/example-policy.yaml").read_text())
        tight["models"][0]["slo"]["itl_p99_ms"] = 30
        (tmp_path / "tight.yaml").write_text(yaml.safe_dump(tight))
        changed = await asyncio.to_thread(main, ["policy", "check", str(tmp_path / "tight.yaml"),
                                                 "--controller", url, "--token", "s3cret"])
        out = capsys.readouterr().out
        assert changed == 1 and "llama-3-8b" in out and "RESULT: CHANGE (exit 1)" in out
        # a wrong token: the controller's state cannot be read (exit 2, said on stderr)
        bad = await asyncio.to_thread(main, ["what-if", "--policy", str(tmp_path / "tight.yaml"),
                                             "--controller", url, "--token", "nope"])
        assert bad == 2 and "HTTP 401" in capsys.readouterr().err
    finally:
        if runner is not None:
            await runner.cleanup()
        await ctrl.prom.aclose()
        store.close()
