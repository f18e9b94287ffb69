"""The agent over MQTT with TLS (optional in the config): a Mosquitto TLS listener with a
throwaway CA (tests/integration/certs.py) and password logins; the agent verifies the broker
certificate against `mqtt.tls.ca_file`. Client certificates: test_mqtt_client_cert_tls.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import pytest

from fleetplan.controller.agent import Agent
from fleetplan.controller.agent_config import AgentConfig, sim_agent_config
from fleetplan.controller.protocol import parse_status, status_topic
from fleetplan.harness.servers import MosquittoServer
from tests.integration.certs import HAVE_OPENSSL, MOSQUITTO, Usage, make_ca, tls_mosquitto

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL or not Path(MOSQUITTO).exists(),
                                reason="openssl or mosquitto not installed")


@dataclass(frozen=True)
class TlsBroker:
    dir: Path
    port: int
    users: MosquittoServer  # user names and passwords
    ca_files: dict[str, Path]  # "good": the CA that signed the broker's certificate; "other": another


@pytest.fixture(scope="module")
def tls_broker() -> Iterator[TlsBroker]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-agent-tls-") as tmp:
        d = Path(tmp)
        good, other = make_ca(d, "good-ca"), make_ca(d, "other-ca")
        server = good.issue(d, "good-server", cn="127.0.0.1", usage=Usage.SERVER)
        with tls_mosquitto(d, good, server, hosts=("tls-host",), require_certificate=False) as broker:
            yield TlsBroker(d, broker.port, broker.users, {"good": good.cert, "other": other.cert})


def _config(b: TlsBroker, ca: str) -> AgentConfig:
    agent = b.users.agents["tls-host"]
    data = sim_agent_config(host="tls-host", gpu="h100", gpu_count=2, mqtt_host="127.0.0.1", mqtt_port=b.port,
                            mqtt_user=agent.user, mqtt_password=agent.password, port_range=(20000, 20010),
                            state_dir=b.dir / f"state-{ca}", status_interval_s=1)
    data["mqtt"]["tls"] = {"ca_file": str(b.ca_files[ca])}
    return AgentConfig.model_validate(data)


async def _first_status(b: TlsBroker, timeout_s: float) -> dict[str, object] | None:
    context = ssl.create_default_context(cafile=str(b.ca_files["good"]))
    async with aiomqtt.Client("127.0.0.1", b.port, username=b.users.observer.user, password=b.users.observer.password,
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


async def _run_agent(config: AgentConfig, b: TlsBroker, timeout_s: float) -> dict[str, object] | None:
    stop = asyncio.Event()
    task = asyncio.create_task(Agent(config).run(stop))
    try:
        return await _first_status(b, timeout_s)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_agent_connects_over_tls_with_the_right_ca(tls_broker: TlsBroker) -> None:
    status = await _run_agent(_config(tls_broker, "good"), tls_broker, timeout_s=15)
    assert status is not None and status["host"] == "tls-host"


async def test_agent_refuses_a_broker_certificate_from_another_ca(
    tls_broker: TlsBroker, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fleetplan.controller"):
        assert await _run_agent(_config(tls_broker, "other"), tls_broker, timeout_s=2.5) is None
    assert "certificate verify failed" in caplog.text.lower()
