"""The lab's Mosquitto: authentication and per-agent ACLs, against the real broker.

ACL denials are silent in MQTT (a denied publish is dropped, a denied subscription delivers
nothing), so each denial is checked against a positive control sent AFTER it on the same
connection: messages from one client are delivered in order, so once the allowed message has
arrived, the denied one would have arrived before it.
"""

from __future__ import annotations

import asyncio
import uuid

import aiomqtt
import pytest

from fleetplan.harness.servers import MosquittoServer


def _client(server: MosquittoServer, user: str | None, password: str | None) -> aiomqtt.Client:
    return aiomqtt.Client(
        server.host,
        server.port,
        username=user,
        password=password,
        identifier=f"test-{uuid.uuid4().hex[:8]}",
        protocol=aiomqtt.ProtocolVersion.V5,
        timeout=5,
    )


async def _collect_until(
    client: aiomqtt.Client, stop_topic: str, stop_payload: bytes | None = None, timeout_s: float = 5.0
) -> list[tuple[str, bytes]]:
    """Messages received until one on `stop_topic` (with `stop_payload` if given) arrives (included)."""
    seen: list[tuple[str, bytes]] = []
    async with asyncio.timeout(timeout_s):
        async for message in client.messages:
            payload = message.payload if isinstance(message.payload, bytes) else str(message.payload).encode()
            seen.append((str(message.topic), payload))
            if str(message.topic) == stop_topic and stop_payload in (None, payload):
                return seen
    return seen


async def test_unauthenticated_client_is_refused(mosquitto: MosquittoServer) -> None:
    with pytest.raises(aiomqtt.MqttError):
        async with _client(mosquitto, None, None):
            pass


async def test_wrong_password_is_refused(mosquitto: MosquittoServer) -> None:
    with pytest.raises(aiomqtt.MqttError):
        async with _client(mosquitto, mosquitto.controller_user, "not-the-password"):
            pass
    agent = mosquitto.agents["host-a"]
    with pytest.raises(aiomqtt.MqttError):  # an agent's name with another agent's password
        async with _client(mosquitto, agent.user, mosquitto.agents["host-b"].password):
            pass


async def test_agent_cannot_publish_outside_its_topics(mosquitto: MosquittoServer) -> None:
    a = mosquitto.agents["host-a"]
    async with (
        _client(mosquitto, mosquitto.controller_user, mosquitto.controller_password) as controller,
        _client(mosquitto, a.user, a.password) as agent_a,
    ):
        await controller.subscribe("fleetplan/#", qos=1)
        # Denied: another host's status and ack, its own desired (read-only), outside the tree.
        for topic in (
            "fleetplan/hosts/host-b/status",
            "fleetplan/hosts/host-b/ack",
            "fleetplan/hosts/host-a/desired",
            "fleetplan/other",
        ):
            await agent_a.publish(topic, b'{"forged": true}', qos=1)
        # Allowed, sent last: its own ack and status.
        await agent_a.publish("fleetplan/hosts/host-a/ack", b'{"version": 1}', qos=1)
        await agent_a.publish("fleetplan/hosts/host-a/status", b'{"online": true}', qos=1)
        seen = await _collect_until(controller, "fleetplan/hosts/host-a/status")
    assert [t for t, _ in seen] == ["fleetplan/hosts/host-a/ack", "fleetplan/hosts/host-a/status"]


async def test_agent_cannot_read_another_hosts_desired(mosquitto: MosquittoServer) -> None:
    a = mosquitto.agents["host-a"]
    async with _client(mosquitto, mosquitto.controller_user, mosquitto.controller_password) as controller:
        await controller.publish(
            "fleetplan/hosts/host-b/desired", b'{"version": 7, "for": "b"}', qos=1, retain=True
        )
        await controller.publish(
            "fleetplan/hosts/host-a/desired", b'{"version": 3, "for": "a"}', qos=1, retain=True
        )
    async with _client(mosquitto, a.user, a.password) as agent_a:
        await agent_a.subscribe("fleetplan/hosts/host-b/desired", qos=1)
        await agent_a.subscribe("fleetplan/hosts/+/status", qos=1)
        await agent_a.subscribe("fleetplan/hosts/+/desired", qos=1)
        seen = await _collect_until(agent_a, "fleetplan/hosts/host-a/desired")
    assert seen == [("fleetplan/hosts/host-a/desired", b'{"version": 3, "for": "a"}')]


async def test_controller_reads_and_writes_everything(mosquitto: MosquittoServer) -> None:
    b = mosquitto.agents["host-b"]
    async with (
        _client(mosquitto, mosquitto.controller_user, mosquitto.controller_password) as controller,
        _client(mosquitto, b.user, b.password) as agent_b,
    ):
        await agent_b.subscribe("fleetplan/hosts/host-b/desired", qos=1)
        await controller.subscribe("fleetplan/hosts/host-b/ack", qos=1)
        await controller.publish("fleetplan/hosts/host-b/desired", b'{"version": 8}', qos=1, retain=True)
        got = await _collect_until(agent_b, "fleetplan/hosts/host-b/desired", b'{"version": 8}')
        assert got[-1] == ("fleetplan/hosts/host-b/desired", b'{"version": 8}')
        await agent_b.publish("fleetplan/hosts/host-b/ack", b'{"version": 8, "accepted": true}', qos=1)
        acks = await _collect_until(controller, "fleetplan/hosts/host-b/ack")
    assert acks == [("fleetplan/hosts/host-b/ack", b'{"version": 8, "accepted": true}')]


async def test_retained_desired_survives_broker_restart(mosquitto: MosquittoServer) -> None:
    a = mosquitto.agents["host-a"]
    async with _client(mosquitto, mosquitto.controller_user, mosquitto.controller_password) as controller:
        await controller.publish("fleetplan/hosts/host-a/desired", b'{"version": 42}', qos=1, retain=True)
    await asyncio.to_thread(mosquitto.restart)
    async with _client(mosquitto, a.user, a.password) as agent_a:
        await agent_a.subscribe("fleetplan/hosts/host-a/desired", qos=1)
        seen = await _collect_until(agent_a, "fleetplan/hosts/host-a/desired")
    assert seen == [("fleetplan/hosts/host-a/desired", b'{"version": 42}')]
