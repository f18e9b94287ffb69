"""The agent over MQTT with TLS (optional in the config): a Mosquitto TLS listener with a
throwaway CA; the agent verifies the broker certificate against `mqtt.tls.ca_file`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest

from fleetplan.controller.agent import Agent, AgentConfig, sim_agent_config
from fleetplan.controller.protocol import parse_status, status_topic
from fleetplan.harness.lab import free_port

OPENSSL = shutil.which("openssl")
MOSQUITTO = "/usr/sbin/mosquitto"
pytestmark = pytest.mark.skipif(OPENSSL is None or not Path(MOSQUITTO).exists(),
                                reason="openssl or mosquitto not installed")


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca_and_server_cert(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name} test CA",
             "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", f"{name}-server.key",
             "-out", f"{name}-server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", f"{name}-server.csr", "-CA", f"{name}-ca.pem", "-CAkey", f"{name}-ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", f"{name}-server.pem", cwd=d)


@pytest.fixture(scope="module")
def tls_broker() -> Iterator[tuple[Path, int]]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-agent-tls-") as tmp:
        d = Path(tmp)
        _make_ca_and_server_cert(d, "good")
        _make_ca_and_server_cert(d, "other")
        (d / "passwd").write_text("controller:cpw\nagent-tls-host:apw\n")
        (d / "passwd").chmod(0o600)
        subprocess.run(["mosquitto_passwd", "-U", str(d / "passwd")], check=True, timeout=30)
        (d / "acl").write_text("user controller\ntopic readwrite fleetplan/#\n\nuser agent-tls-host\n"
                               "topic read fleetplan/hosts/tls-host/desired\n"
                               "topic write fleetplan/hosts/tls-host/status\n"
                               "topic write fleetplan/hosts/tls-host/ack\n")
        port = free_port()
        lines = [f"listener {port} 127.0.0.1", "allow_anonymous false", f"password_file {d / 'passwd'}",
                 f"acl_file {d / 'acl'}", "use_username_as_clientid true", f"cafile {d / 'good-ca.pem'}",
                 f"certfile {d / 'good-server.pem'}", f"keyfile {d / 'good-server.key'}", "log_dest stderr"]
        if os.geteuid() == 0:
            lines.append("user root")
        (d / "mosquitto.conf").write_text("\n".join(lines) + "\n")
        with (d / "mosquitto.log").open("ab") as log:
            proc = subprocess.Popen([MOSQUITTO, "-c", str(d / "mosquitto.conf")], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 10
            while "running" not in (d / "mosquitto.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            yield d, port
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _config(d: Path, port: int, ca: str) -> AgentConfig:
    data = sim_agent_config(host="tls-host", gpu="h100", gpu_count=2, mqtt_host="127.0.0.1", mqtt_port=port,
                            mqtt_user="agent-tls-host", mqtt_password="apw", port_range=(20000, 20010),
                            state_dir=d / f"state-{ca}", status_interval_s=1)
    data["mqtt"]["tls"] = {"ca_file": str(d / f"{ca}-ca.pem")}
    return AgentConfig.model_validate(data)


async def _first_status(d: Path, port: int, timeout_s: float) -> dict[str, object] | None:
    context = ssl.create_default_context(cafile=str(d / "good-ca.pem"))
    async with aiomqtt.Client("127.0.0.1", port, username="controller", password="cpw",
                              protocol=aiomqtt.ProtocolVersion.V5, tls_context=context) as client:
        await client.subscribe(status_topic("tls-host"), qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                async for message in client.messages:
                    assert isinstance(message.payload, bytes)
                    status = parse_status(message.payload)
                    if status.online:
                        return json.loads(message.payload)
    return None


async def _run_agent(config: AgentConfig, d: Path, port: int, timeout_s: float) -> dict[str, object] | None:
    stop = asyncio.Event()
    task = asyncio.create_task(Agent(config).run(stop))
    try:
        return await _first_status(d, port, timeout_s)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_agent_connects_over_tls_with_the_right_ca(tls_broker: tuple[Path, int]) -> None:
    d, port = tls_broker
    status = await _run_agent(_config(d, port, "good"), d, port, timeout_s=15)
    assert status is not None and status["host"] == "tls-host"


async def test_agent_refuses_a_broker_certificate_from_another_ca(
    tls_broker: tuple[Path, int], caplog: pytest.LogCaptureFixture
) -> None:
    d, port = tls_broker
    with caplog.at_level(logging.WARNING, logger="fleetplan.controller"):
        assert await _run_agent(_config(d, port, "other"), d, port, timeout_s=2.5) is None
    assert "certificate verify failed" in caplog.text.lower()
