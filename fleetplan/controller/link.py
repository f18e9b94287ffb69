"""The controller's MQTT session: status, ack and (its own retained) desired-state subscriptions,
bounded parsing of every message, desired-state publishing. Reconnects through
`controller.mqtt.session_loop`, the loop the agent runs too."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.protocol import (
    ACK_WILDCARD,
    DESIRED_WILDCARD,
    STATUS_WILDCARD,
    DesiredState,
    HostStatus,
    ProtocolError,
    host_from_topic,
    parse_ack,
    parse_desired,
    parse_status,
)

log = logging.getLogger(__name__)


class MqttLink:
    """The controller's MQTT session: status/ack subscriptions, desired publishing, reconnects.

    Every message is parsed with the protocol's bounds; a bad one is rejected (logged with its host,
    field and value, counted through `on_reject`) and never ends the loop that reads the next one:
    only cancellation ends `run()`."""

    def __init__(
        self,
        settings: MqttSettings,
        on_status: Callable[[str, HostStatus], None],
        on_ack: Callable[[str, Any], None],
        on_connect: Callable[[], None],
        on_reject: Callable[[str, str], None] | None = None,
        on_desired: Callable[[str, DesiredState | None], None] | None = None,
    ) -> None:
        self.settings = settings
        self._on_status = on_status
        self._on_ack = on_ack
        self._on_connect = on_connect
        self._on_reject = on_reject
        self._on_desired = on_desired
        self._client: Any = None
        self.connected = asyncio.Event()
        self.last_error: str | None = None
        self._log_wall: dict[str, float] = {}  # host -> last rejection logged (monotonic)
        self._suppressed: dict[str, int] = {}

    async def run(self) -> None:
        from fleetplan.controller.mqtt import session_loop

        await session_loop(self.settings, self._session, identifier=f"fleetplan-controller-{os.getpid()}",
                           on_down=self._down)

    async def _session(self, client: Any) -> None:
        # desired first: its retained messages (what this controller last published) arrive before
        # the statuses, so adoption can check a reported replica against them
        if self._on_desired is not None:
            await client.subscribe(DESIRED_WILDCARD, qos=1)
        await client.subscribe(STATUS_WILDCARD, qos=1)
        await client.subscribe(ACK_WILDCARD, qos=1)
        self._client = client
        self.connected.set()
        self.last_error = None
        self._on_connect()
        async for msg in client.messages:
            self._dispatch(str(msg.topic), bytes(msg.payload or b""))

    def _down(self, error: str) -> None:
        self._client = None
        self.connected.clear()
        self.last_error = error

    def _dispatch(self, topic: str, payload: bytes) -> None:
        """Parse and hand on one message; whatever is wrong with it stays with it."""
        host = host_from_topic(topic)
        if host is None:
            return
        try:
            if topic.endswith("/desired"):
                if self._on_desired is not None:  # our own retained output; empty = cleared
                    self._on_desired(host, parse_desired(payload, host=host) if payload.strip() else None)
                return
            if not payload:
                return
            if topic.endswith("/status"):
                status = parse_status(payload, host=host)
                if status.host != host:
                    raise ProtocolError(
                        f"host status from {host}: host = {status.host!r}: differs from the topic's host {host!r}"
                    )
                self._on_status(host, status)
            elif topic.endswith("/ack"):
                ack = parse_ack(payload, host=host)
                if ack.host != host:
                    raise ProtocolError(f"ack from {host}: host = {ack.host!r}: differs from the topic's host {host!r}")
                self._on_ack(host, ack)
        except ProtocolError as exc:
            self._reject(host, str(exc))
        except Exception as exc:  # a handler's bug: this message is lost, the loop is not
            log.exception("handling a message on %s failed", topic)
            self._reject(host, f"message on {topic} could not be handled: {type(exc).__name__}: {exc}"[:500])

    def _reject(self, host: str, text: str) -> None:
        now = time.monotonic()
        if now - self._log_wall.get(host, -1.0e18) >= 1.0:  # at most one line per host per second
            more = self._suppressed.pop(host, 0)
            log.warning("rejected message: %s%s", text, f" (+{more} more from {host} not logged)" if more else "")
            self._log_wall[host] = now
        else:
            self._suppressed[host] = self._suppressed.get(host, 0) + 1
        if self._on_reject is not None:
            self._on_reject(host, text)

    async def publish(self, topic: str, payload: bytes) -> bool:
        client = self._client
        if client is None:
            return False
        try:
            await client.publish(topic, payload, qos=1, retain=True)
            return True
        except Exception as exc:  # aiomqtt.MqttError and friends; the reconcile step retries
            log.warning("publish to %s failed: %s", topic, exc)
            return False
