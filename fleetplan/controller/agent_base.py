"""The agent's shared state and persistence: what every part of the `Agent` reads and writes.

The agent is split by concern (`agent.py` the desired-state applier and its MQTT session;
`agent_replicas.py` the replica supervisor; `agent_builds.py` the engine builds; `agent_cache.py` the
engine cache); each part is a mixin over `AgentBase`, which holds the state they share and the
records they persist in the agent's state directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from fleetplan.controller.actuators import Actuator, Handle
from fleetplan.controller.agent_config import AgentConfig, engine_slug
from fleetplan.controller.mqtt import Backoff
from fleetplan.controller.protocol import (
    BuildPhase,
    CachedEngine,
    DesiredBuild,
    DesiredReplica,
    DesiredState,
    ReplicaPhase,
)
from fleetplan.shared.atomic import atomic_write_text


@dataclass
class _Instance:
    replica: DesiredReplica
    state: ReplicaPhase
    since_s: float
    handle: Handle | None = None
    error: str | None = None
    restarts: int = 0
    retry_at: float = 0.0  # monotonic; when a FAILED replica may be started again
    backoff: Backoff | None = None  # the restart backoff (the agent config's first and cap), once it failed
    task: asyncio.Task[None] | None = None


@dataclass
class _Build:
    build: DesiredBuild
    state: BuildPhase
    since_s: float
    handle: Handle | None = None
    progress: float = 0.0
    error: str | None = None
    started_mono: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None


class AgentBase:
    """The state the agent's parts share (set by `Agent.__init__`) and its persisted records."""

    config: AgentConfig
    actuator: Actuator
    desired: DesiredState | None
    instances: dict[str, _Instance]
    builds: dict[str, _Build]
    engines: dict[str, CachedEngine]
    host_errors: dict[str, str]
    _changed: asyncio.Event
    _wake: asyncio.Event

    @property
    def _records_dir(self) -> Path:
        return self.config.state_dir / "instances"

    def _record_path(self, instance_id: str) -> Path:
        return self._records_dir / f"{instance_id}.json"

    def _save_record(self, kind: str, spec: BaseModel, handle: Handle, ready_s: float | None = None) -> None:
        self._records_dir.mkdir(parents=True, exist_ok=True)
        record = {"kind": kind, "spec": spec.model_dump(mode="json"), "handle": handle.to_dict(),
                  "ready_s": ready_s}
        atomic_write_text(self._record_path(handle.instance_id), json.dumps(record, indent=1))

    def _drop_record(self, instance_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._record_path(instance_id).unlink()

    def _save_engines(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        data = [e.model_dump(mode="json") for e in self.engines.values()]
        atomic_write_text(self.config.state_dir / "engines.json", json.dumps(data, indent=1))

    def _mark(self) -> None:
        self._changed.set()

    def _values(self, spec: DesiredReplica | DesiredBuild) -> dict[str, str]:
        values = {
            "model": spec.model, "tp": str(spec.tp), "gpu": spec.gpu.value, "precision": spec.precision.value,
            "gpu_indices": ",".join(str(g) for g in spec.gpu_indices), "host": self.config.host,
            "state_dir": str(self.config.state_dir),
            "engine_dir": str(self.config.cache_dir / engine_slug(spec.model, spec.gpu, spec.tp, spec.precision)),
        }
        if isinstance(spec, DesiredReplica):
            values.update(port=str(spec.port), replica_id=spec.replica_id)
        else:
            values.update(build_id=spec.build_id, progress_file=str(self._progress_path(spec.build_id)))
        return values

    def _progress_path(self, build_id: str) -> Path:
        return self.config.cache_dir / ".progress" / build_id

    def _busy(self, own_id: str, gpus: tuple[int, ...], port: int | None) -> str | None:
        """Who still holds one of these GPUs or this port (a draining replica, a running build)."""
        for inst in self.instances.values():
            if inst.replica.replica_id == own_id or inst.handle is None:
                continue
            if set(gpus) & set(inst.replica.gpu_indices) or port == inst.replica.port:
                return inst.replica.replica_id
        for b in self.builds.values():
            if b.build.build_id != own_id and b.handle is not None and set(gpus) & set(b.build.gpu_indices):
                return b.build.build_id
        return None
