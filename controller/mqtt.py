"""MQTT connection settings and reconnect backoff shared by the agent and the controller.

Only settings and small helpers live here; each side owns its own aiomqtt session loop.
"""

from __future__ import annotations

import random
import ssl
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MqttTls(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: Path | None = None  # None: the system trust store
    cert_file: Path | None = None  # client certificate (optional, mutual TLS)
    key_file: Path | None = None


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
        context = ssl.create_default_context(
            cafile=str(settings.tls.ca_file) if settings.tls.ca_file else None
        )
        if settings.tls.cert_file is not None:
            context.load_cert_chain(
                str(settings.tls.cert_file), str(settings.tls.key_file) if settings.tls.key_file else None
            )
        kwargs["tls_context"] = context
    return kwargs


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
