"""A sick Prometheus and a stepping clock, through the controller's own cycles (real Mosquitto, a
Prometheus-like HTTP server on loopback: tests/integration/fake_prometheus.py).

- Prometheus answering late, trickling its answer a byte at a time, or answering valid JSON of the
  wrong shape: every model fails static (stale, nothing scaled), an alert names Prometheus and the
  query, no cycle raises, and the cycle ends within the observation's deadline, not the fault's.
- The controller's wall clock stepped -1 h and then +1 h (an injected wall clock; the system clock
  is not touched): the cycle that sees the step takes no action and alerts "the clock stepped",
  the controller's own clock does not move, the next cycle plans on known demand again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetplan.controller.clocks import SteadyClock
from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.state import StateStore
from fleetplan.harness.servers import MosquittoServer
from fleetplan.planner.act_types import AlertKey, AlertKind
from tests.integration.fake_prometheus import SICK_ANSWERS, FakePrometheus

REPO = Path(__file__).resolve().parents[2]
DEMAND = {"llama-3-8b": 2.4, "llama-3-70b": 0.5}


class SteppableWall:
    """The wall clock as `time.time()` plus an offset the test sets (a step)."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset_s


@pytest.fixture
async def prom() -> AsyncIterator[FakePrometheus]:
    p = FakePrometheus(DEMAND)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def _controller(mosquitto: MosquittoServer, prom: FakePrometheus, tmp_path: Path,
                      wall: SteppableWall, *, query_deadline_s: float = 3.0, observe_deadline_s: float = 4.0) -> Controller:
    policy = tmp_path / "policy.yaml"
    policy.write_text((REPO / "config" / "example-policy.yaml").read_text())
    settings = ControllerSettings(
        prometheus_url=prom.url, history_s=600.0, cycle_s=3.0, host_offline_grace_s=0.0,
        # generous: a busy test machine
        prometheus_query_deadline_s=query_deadline_s, observe_deadline_s=observe_deadline_s,
        mqtt=MqttSettings(host=mosquitto.host, port=mosquitto.port, username=mosquitto.controller_user,
                          password=mosquitto.controller_password, keepalive_s=5, backoff_initial_s=0.1,
                          backoff_max_s=0.5))
    clocks = SteadyClock(wall=wall)
    c = Controller(settings=settings, policy_path=policy, profiles_path=None,
                   store=StateStore(tmp_path / "state.db", clock=clocks.now), report_listen="127.0.0.1:0",
                   clocks=clocks)
    await c.start()
    return c


@pytest.fixture
async def wall() -> SteppableWall:
    return SteppableWall()


@pytest.fixture
async def ctrl(mosquitto: MosquittoServer, prom: FakePrometheus, tmp_path: Path,
               wall: SteppableWall) -> AsyncIterator[Controller]:
    c = await _controller(mosquitto, prom, tmp_path, wall)
    try:
        yield c
    finally:
        with contextlib.suppress(Exception):
            await c.stop()


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The controller's error lines (a cycle that raised logs one)."""
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("fleetplan")]


def _plans(ctrl: Controller) -> set[int]:
    return {r[0] for r in ctrl.store._db.execute("SELECT cycle_id FROM plans")}


def _known(ctrl: Controller) -> dict[str, float | None]:
    snap = ctrl.last_snapshot
    assert snap is not None
    return {m: (None if snap.models[m].stale else snap.models[m].rate_rps) for m in DEMAND}


@pytest.mark.parametrize("fault", ["late", "trickle", *SICK_ANSWERS])
async def test_a_sick_prometheus_fails_static_with_an_alert_naming_the_query(
        ctrl: Controller, prom: FakePrometheus, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    summary = await ctrl.cycle()
    assert summary.get("error") is None, summary
    assert _known(ctrl) == pytest.approx(DEMAND)

    prom.mode, prom.sick_match = fault, "time_to_first_token"
    t0 = time.monotonic()
    summaries = [await ctrl.cycle() for _ in range(2)]
    took_s = (time.monotonic() - t0) / 2
    assert all(s.get("error") is None for s in summaries), summaries
    assert AlertKey(AlertKind.CYCLE) not in ctrl.runtime_alerts  # no cycle failed with an exception
    assert not _errors(caplog), caplog.text
    snap = ctrl.last_snapshot
    assert snap is not None and not snap.prometheus_ok
    assert _known(ctrl) == {m: None for m in DEMAND}  # fail static: every model stale, nothing scaled
    alert = " ".join(snap.alerts)
    assert f"prometheus at {prom.url}" in alert and "query ttft_p" in alert, alert
    if fault in ("late", "trickle"):
        assert "no full answer within 3 s" in alert, alert
    # each cycle ended within the observation's deadline (4 s) and its own work, not the fault's
    # 20 s (late) or ~50 s (a 500-byte answer at a byte per 0.1 s)
    print(f"prometheus {fault}: cycle {took_s:.2f} s (observation deadline 4 s, query deadline 3 s)")
    assert took_s < 12.0, took_s

    prom.mode = "ok"
    await ctrl.cycle()
    assert _known(ctrl) == pytest.approx(DEMAND)
    assert ctrl.last_snapshot is not None and ctrl.last_snapshot.prometheus_ok


async def test_the_clock_stepped_back_and_forth_takes_no_action_and_alerts_by_name(
        ctrl: Controller, wall: SteppableWall, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        assert (await ctrl.cycle()).get("error") is None
    assert _known(ctrl) == pytest.approx(DEMAND)
    planned = _plans(ctrl)
    assert planned  # the controller plans before any step

    for step_s in (-3600.0, +3600.0):
        before_s = ctrl.clock.now()
        wall.offset_s += step_s
        summary = await ctrl.cycle()
        # the step's cycle: alerted by name, no plan and no action, the controller's clock unmoved
        assert summary.get("error") is None, summary
        assert f"the clock stepped {step_s:+.0f} s" in summary.get("deferred", ""), summary
        assert ctrl.runtime_alerts[AlertKey(AlertKind.CLOCK)].startswith(f"the clock stepped {step_s:+.0f} s")
        assert _plans(ctrl) == planned
        assert abs(summary["now_s"] - before_s) < 60.0, (summary["now_s"], before_s)
        assert ctrl.health() == []  # no stall read from the wall clock
        # the next cycle plans on known demand (Prometheus is asked at its own time)
        nxt = await ctrl.cycle()
        assert nxt.get("error") is None and "stepped" not in str(nxt.get("deferred")), nxt
        assert _known(ctrl) == pytest.approx(DEMAND)
        assert len(_plans(ctrl)) == len(planned) + 1
        planned = _plans(ctrl)
        assert AlertKey(AlertKind.CLOCK) in ctrl.runtime_alerts  # the alert stands for a while after the step
    assert not _errors(caplog), caplog.text


async def test_prometheus_clock_stepped_back_reads_the_history_afresh(
        ctrl: Controller, prom: FakePrometheus) -> None:
    """Prometheus's clock goes back an hour: the history is read afresh (a range ending before its
    start is never asked), the cycle takes no action, the next one plans on known demand."""
    for _ in range(2):
        await ctrl.cycle()
    planned = _plans(ctrl)
    prom.clock = lambda: time.time() - 3600.0
    summary = await ctrl.cycle()
    assert "Prometheus's clock stepped -3600 s" in summary.get("deferred", ""), summary
    assert _plans(ctrl) == planned
    snap = ctrl.last_snapshot
    assert snap is not None
    assert snap.prometheus_ok, snap.alerts
    assert any(a.startswith("Prometheus's clock stepped -3600 s") for a in snap.alerts)
    nxt = await ctrl.cycle()
    assert "stepped" not in str(nxt.get("deferred")), nxt
    assert _known(ctrl) == pytest.approx(DEMAND)


async def test_the_observations_deadline_names_the_queries_still_unanswered(
        mosquitto: MosquittoServer, prom: FakePrometheus, tmp_path: Path, wall: SteppableWall) -> None:
    """The observation's deadline before the query's (a short cycle: both 2 s at 1.5 s): the alert
    still names Prometheus and the queries it was waiting for, not only that the observation was late."""
    c = await _controller(mosquitto, prom, tmp_path, wall, query_deadline_s=10.0, observe_deadline_s=2.0)
    try:
        await c.cycle()
        prom.mode, prom.sick_match = "late", "time_to_first_token"
        summary = await c.cycle()
        assert summary.get("error") is None, summary
        snap = c.last_snapshot
        assert snap is not None and not snap.prometheus_ok
        alert = " ".join(snap.alerts)
        assert f"prometheus at {prom.url}, query " in alert and "ttft_p" in alert, alert
        assert "no full answer before the observation's deadline (2 s)" in alert, alert
    finally:
        with contextlib.suppress(Exception):
            await c.stop()

