"""MQTT for the agent and the controller: connection settings, the reconnect backoff and the one
reconnect loop (`session_loop`) both run; each side only says what a session does.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)


class MqttTls(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: Path | None = None  # None: the system trust store
    cert_file: Path | None = None  # client certificate (optional, mutual TLS)
    key_file: Path | None = None  # None: the key is in cert_file

    @model_validator(mode="after")
    def _key_with_cert(self) -> MqttTls:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file (the client certificate it belongs to)")
        return self


class MqttSettings(BaseModel):
    """Broker address and credentials. Give `password` or `password_file` (preferred: not in the
    config file itself; the file's content is stripped of surrounding whitespace)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    username: str | None = None
    password: str | None = None
    password_file: Path | None = None
    tls: MqttTls | None = None
    keepalive_s: int = Field(default=15, ge=5, le=3600)
    client_id: str | None = None
    backoff_initial_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _one_password(self) -> MqttSettings:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give either password or password_file, not both")
        return self

    def resolved_password(self) -> str | None:
        if self.password_file is not None:
            return self.password_file.read_text().strip()
        return self.password


def client_kwargs(settings: MqttSettings) -> dict[str, Any]:
    """Keyword arguments for aiomqtt.Client (MQTT v5) from the settings (reads password_file)."""
    import aiomqtt

    kwargs: dict[str, Any] = {
        "hostname": settings.host,
        "port": settings.port,
        "username": settings.username,
        "password": settings.resolved_password(),
        "protocol": aiomqtt.ProtocolVersion.V5,
        "keepalive": settings.keepalive_s,
        "identifier": settings.client_id,
        "timeout": 10.0,
    }
    if settings.tls is not None:
        kwargs["tls_context"] = tls_context(settings.tls)
    return kwargs


class MqttFileError(Exception):
    """A TLS file of the MQTT settings cannot be used (the message names the setting and the path)."""


def tls_context(tls: MqttTls) -> ssl.SSLContext:
    """The client's TLS context: verify the broker against ca_file (or the system store) and, when
    cert_file is set, present that client certificate (mutual TLS)."""
    try:
        context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    except OSError as exc:  # ssl.SSLError is an OSError; neither names the file
        raise MqttFileError(f"mqtt.tls.ca_file {tls.ca_file}: {exc.strerror or exc}") from exc
    if tls.cert_file is not None:
        try:
            context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)
        except OSError as exc:
            raise MqttFileError(f"mqtt.tls.cert_file {tls.cert_file} / key_file {tls.key_file}: "
                                f"{exc.strerror or exc}") from exc
    return context


class Backoff:
    """Capped exponential backoff with full jitter in [delay/2, delay]."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0, rng: random.Random | None = None) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay_s(self) -> float:
        delay: float = min(self.max_s, self.initial_s * (2.0 ** min(self.attempt, 30)))
        self.attempt += 1
        return delay * (0.5 + 0.5 * self._rng.random())

    def reset(self) -> None:
        self.attempt = 0


# A session must last this long before the backoff starts again from its first step: a broker that
# accepts and then drops us at once (a client id taken over, an ACL refusal) is not hammered.
STABLE_SESSION_S = 10.0


async def session_loop(
    settings: MqttSettings,
    session: Callable[[Any], Awaitable[None]],
    *,
    identifier: str,
    will: Any = None,
    on_down: Callable[[str], None] | None = None,
    stable_s: float = STABLE_SESSION_S,
) -> None:
    """Connect, run `session(client)` until the connection ends, back off (capped, jittered) and
    connect again; forever (only cancellation ends it). The one reconnect loop of the agent and the
    controller. `on_down(error)` hears why a session ended; a bug in `session` is logged with its
    traceback and treated like a lost connection, so it never ends the loop."""
    import aiomqtt

    backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s)
    while True:
        connected_at: float | None = None
        error = "session ended"
        try:
            # per attempt: a TLS file or password file that is missing is logged and retried, and a
            # renewed client certificate is used from the next connection on
            kwargs = {**client_kwargs(settings), "identifier": settings.client_id or identifier}
            if will is not None:
                kwargs["will"] = will
            async with aiomqtt.Client(**kwargs) as client:
                connected_at = time.monotonic()
                log.info("MQTT connected to %s:%s as %s", settings.host, settings.port, settings.username)
                await session(client)
        except* aiomqtt.MqttError as group:
            error = f"MQTT broker {settings.host}:{settings.port}: {group.exceptions[0]}"
            log.warning("%s; reconnecting", error)
        except* MqttFileError as group:  # a config problem: say which file, no traceback
            error = str(group.exceptions[0])
            log.error("%s; retrying", error)
        except* Exception as group:  # a bug in `session`, or an unreadable password_file
            error = f"MQTT session failed: {type(group.exceptions[0]).__name__}: {group.exceptions[0]}"
            log.error("%s; reconnecting", error, exc_info=group.exceptions[0])
        if on_down is not None:
            on_down(error)
        if connected_at is not None and time.monotonic() - connected_at >= stable_s:
            backoff.reset()
        await asyncio.sleep(backoff.next_delay_s())
