"""The controller's `fleetplan_mqtt_connected` follows its MQTT session with a real broker: 0 before
it connects, 1 while connected, 0 while the broker is down, 1 again after the reconnect. The
FleetplanMQTTDown alert (config/prometheus/fleetplan-alerts.yml) reads it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from pathlib import Path

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.state import StateStore
from fleetplan.harness.servers import MosquittoServer


def _gauge(ctrl: Controller, name: str) -> float:
    text = ctrl.metrics.render().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not exported"
    return float(m.group(1))


async def _until(ctrl: Controller, value: float, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _gauge(ctrl, "fleetplan_mqtt_connected") != value:
        assert time.monotonic() < deadline, f"fleetplan_mqtt_connected never became {value}"
        await asyncio.sleep(0.05)


async def test_mqtt_connected_gauge_follows_the_session(mosquitto: MosquittoServer, tmp_path: Path) -> None:
    settings = ControllerSettings(mqtt=MqttSettings(
        host=mosquitto.host, port=mosquitto.port, username=mosquitto.controller_user,
        password=mosquitto.controller_password, backoff_initial_s=0.1, backoff_max_s=0.3,
    ))
    store = StateStore(tmp_path / "state.db")
    ctrl = Controller(settings, tmp_path / "policy.yaml", None, store)
    assert _gauge(ctrl, "fleetplan_mqtt_connected") == 0.0
    task = asyncio.create_task(ctrl.link.run())
    try:
        await _until(ctrl, 1.0, 10)
        await asyncio.to_thread(mosquitto.stop)
        await _until(ctrl, 0.0, 10)
        assert ctrl.link.last_error is not None
        await asyncio.to_thread(mosquitto.restart)  # waits for the port, starts on it again
        await _until(ctrl, 1.0, 15)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ctrl.prom.aclose()
        store.close()
        if not mosquitto.running:
            mosquitto.start()
