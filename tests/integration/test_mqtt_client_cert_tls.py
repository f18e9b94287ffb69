"""MQTT over TLS with client certificates (mutual TLS): Mosquitto with `require_certificate true`
and `use_identity_as_username true`, so a client's user name (for the ACL and, through
`use_username_as_clientid`, its client id) is the CN of the certificate a throwaway CA signed.

The controller's own MQTT session (`MqttLink`) and an agent connect with their own certificates and
no password, and talk (status in, desired state out, ack back); a client without a certificate, or
with one from another CA, is refused; a valid certificate of another agent cannot write this host's
topics; a TLS file that cannot be read is named and retried, never the end of the MQTT loop."""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from fleetplan.controller.agent import Agent
from fleetplan.controller.agent_config import AgentConfig, sim_agent_config
from fleetplan.controller.link import MqttLink
from fleetplan.controller.mqtt import MqttSettings, MqttTls, client_kwargs, session_loop, tls_context
from fleetplan.controller.protocol import (
    Ack,
    DesiredState,
    HostStatus,
    desired_topic,
    parse_status,
    status_topic,
    to_payload,
)
from tests.integration.certs import (
    HAVE_OPENSSL,
    MOSQUITTO,
    Broker,
    Ca,
    CertKey,
    Usage,
    make_ca,
    tls_mosquitto,
)

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL or not Path(MOSQUITTO).exists(),
                                reason="openssl or mosquitto not installed")

HOST = "tls-host"
OTHER = "tls-other"


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Ca
    controller: CertKey  # CN=controller
    agent: CertKey  # CN=agent-tls-host
    other_agent: CertKey  # CN=agent-tls-other: valid, but another host's identity
    foreign: CertKey  # CN=controller, signed by another CA


@pytest.fixture(scope="module")
def pki_broker() -> Iterator[tuple[Pki, Broker]]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-mqtt-mtls-") as tmp:
        d = Path(tmp)
        ca, rogue_ca = make_ca(d, "fleet-ca"), make_ca(d, "rogue-ca")
        server = ca.issue(d, "broker", cn="127.0.0.1", usage=Usage.SERVER)
        pki = Pki(d, ca, ca.issue(d, "controller", cn="controller", usage=Usage.CLIENT),
                  ca.issue(d, "agent", cn=f"agent-{HOST}", usage=Usage.CLIENT),
                  ca.issue(d, "other-agent", cn=f"agent-{OTHER}", usage=Usage.CLIENT),
                  rogue_ca.issue(d, "foreign", cn="controller", usage=Usage.CLIENT))
        with tls_mosquitto(d, ca, server, hosts=(HOST, OTHER), require_certificate=True) as broker:
            yield pki, broker


def _settings(pki: Pki, port: int, cert: CertKey | None, **extra: Any) -> MqttSettings:
    """Certificate only: no user name, no password (the broker takes the CN)."""
    tls = MqttTls(ca_file=pki.ca.cert, cert_file=cert.cert if cert else None, key_file=cert.key if cert else None)
    return MqttSettings(host="127.0.0.1", port=port, tls=tls, keepalive_s=10, backoff_initial_s=0.2,
                        backoff_max_s=2.0, **extra)


def _agent_config(pki: Pki, port: int) -> AgentConfig:
    data = sim_agent_config(host=HOST, gpu="h100", gpu_count=2, mqtt_host="127.0.0.1", mqtt_port=port,
                            mqtt_user="unused", mqtt_password="unused", port_range=(20000, 20010),
                            state_dir=pki.dir / "agent-state", status_interval_s=1)
    mqtt = _settings(pki, port, pki.agent).model_dump(mode="json", exclude_none=True)
    data["mqtt"] = mqtt  # the agent's YAML `mqtt:` with tls.{ca_file,cert_file,key_file}, no password
    return AgentConfig.model_validate(data)


async def test_controller_and_agent_talk_with_their_own_client_certificates(
    pki_broker: tuple[Pki, Broker]
) -> None:
    pki, broker = pki_broker
    statuses: asyncio.Queue[HostStatus] = asyncio.Queue()
    acks: asyncio.Queue[Ack] = asyncio.Queue()
    rejected: list[str] = []
    link = MqttLink(_settings(pki, broker.port, pki.controller), lambda _h, s: statuses.put_nowait(s),
                    lambda _h, a: acks.put_nowait(a), lambda: None, on_reject=lambda _h, t: rejected.append(t))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(link.run()), asyncio.create_task(Agent(_agent_config(pki, broker.port)).run(stop))]
    try:
        async with asyncio.timeout(30):  # a bound on a hang, not a measurement
            status = await statuses.get()
            while not status.online:
                status = await statuses.get()
            assert status.host == HOST
            assert await link.publish(desired_topic(HOST), to_payload(DesiredState(version=1)))
            ack = await acks.get()
        assert (ack.host, ack.version, ack.accepted) == (HOST, 1, True)
        assert rejected == []
        # the broker took each user name from the certificate (the clients sent none) and made it
        # the client id too (the clients asked for fleetplan-controller-<pid>, fleetplan-agent-<host>)
        for user in ("controller", f"agent-{HOST}"):
            assert re.search(rf"connected from \S+ as {user} \(p5, c\d, k\d+, u'{user}'\)", broker.proc.log_text())
    finally:
        stop.set()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _refusal(settings: MqttSettings) -> str:
    """The TLS alert the broker answers a connection with the TLS context the controller and the
    agent build from `settings` (with TLS 1.3 the client's handshake completes first and the
    refusal is the first thing it reads)."""
    assert settings.tls is not None
    async with asyncio.timeout(30):  # a bound on a hung handshake, not a measurement
        reader, writer = await asyncio.open_connection(settings.host, settings.port, ssl=tls_context(settings.tls))
    try:
        async with asyncio.timeout(30):  # an accepted client would wait here for MQTT data
            with pytest.raises(ssl.SSLError) as refused:
                await reader.read(1)
    finally:
        writer.close()
        # an SSL transport the peer refused may never finish closing (no close_notify): bounded
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(5):
                await writer.wait_closed()
    return str(refused.value)


async def test_a_client_without_a_certificate_is_refused(pki_broker: tuple[Pki, Broker]) -> None:
    pki, broker = pki_broker
    assert "certificate required" in await _refusal(_settings(pki, broker.port, None))


async def test_a_certificate_from_another_ca_is_refused(pki_broker: tuple[Pki, Broker]) -> None:
    pki, broker = pki_broker
    assert "unknown ca" in await _refusal(_settings(pki, broker.port, pki.foreign))


async def test_a_valid_certificate_of_another_agent_cannot_write_this_hosts_topics(
    pki_broker: tuple[Pki, Broker]
) -> None:
    """The ACL user is the CN: agent-tls-other may write only tls-other's topics. Its publish to
    tls-host's status is acknowledged (QoS 1) and dropped; the subscriber's first message on that
    topic is the one published after it by tls-host's own certificate."""
    pki, broker = pki_broker
    topic = status_topic(HOST)
    async with aiomqtt.Client(**client_kwargs(_settings(pki, broker.port, pki.controller))) as watcher:
        await watcher.subscribe(topic, qos=1)
        async with aiomqtt.Client(**client_kwargs(_settings(pki, broker.port, pki.other_agent))) as other:
            await other.publish(topic, b'{"forged": true}', qos=1)
        async with aiomqtt.Client(**client_kwargs(_settings(pki, broker.port, pki.agent))) as own:
            own_status = HostStatus(host=HOST, online=False, gpu="h100", gpu_count=2)
            await own.publish(topic, to_payload(own_status), qos=1)
        async with asyncio.timeout(30):
            first = await anext(aiter(watcher.messages))
    assert isinstance(first.payload, bytes)
    assert parse_status(first.payload, host=HOST).host == HOST  # not the forged one


async def test_an_unreadable_client_certificate_is_named_and_retried(tmp_path: Path) -> None:
    """A missing cert file ends a connection attempt with the setting and the path, and the
    reconnect loop goes on (a renewed or restored file is used at the next attempt)."""
    missing = tmp_path / "gone.pem"
    ca = make_ca(tmp_path, "ca")
    settings = MqttSettings(host="127.0.0.1", port=1, backoff_initial_s=0.01, backoff_max_s=0.02,
                            tls=MqttTls(ca_file=ca.cert, cert_file=missing, key_file=tmp_path / "gone.key"))
    errors: list[str] = []
    two = asyncio.Event()

    def down(error: str) -> None:
        errors.append(error)
        if len(errors) >= 2:
            two.set()

    async def session(_client: Any) -> None:
        raise AssertionError("no session without a certificate")

    task = asyncio.create_task(session_loop(settings, session, identifier="t", on_down=down))
    try:
        async with asyncio.timeout(30):
            await two.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert f"mqtt.tls.cert_file {missing}" in errors[0] and "No such file" in errors[0]
    assert errors[1] == errors[0]


def test_a_key_file_needs_its_certificate() -> None:
    with pytest.raises(ValueError, match="key_file needs cert_file"):
        MqttTls(key_file=Path("/etc/fleetplan/agent.key"))
