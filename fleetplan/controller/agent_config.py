"""The agent's configuration: its launch and build templates (the only argv an agent ever runs, with
the allowed placeholders), the actuator (process or systemd), `load_agent_config`, the lab's
`sim_agent_config`, and the placeholder substitution (`substitute`, one argv item at a time).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetplan.controller.actuators import (
    Actuator,
    ProcessActuator,
    SystemdActuator,
)
from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.protocol import (
    HOST_PATTERN,
    MAX_NAME,
    TEMPLATE_PATTERN,
)
from fleetplan.models.names import (
    Engine,
    GpuType,
    Precision,
    UnknownNameError,
    parse_engine,
    parse_gpu,
)

LAUNCH_PLACEHOLDERS = frozenset(
    {"model", "port", "tp", "gpu", "precision", "replica_id", "gpu_indices", "engine_dir", "host", "state_dir"}
)
BUILD_PLACEHOLDERS = frozenset(
    {"model", "tp", "gpu", "precision", "build_id", "gpu_indices", "engine_dir", "host", "state_dir",
     "progress_file"}
)
_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class AgentConfigError(ValueError):
    """An invalid agent config; the message names the file, the field and the value."""


def _check_placeholders(items: list[str], allowed: frozenset[str], where: str) -> None:
    for item in items:
        for name in _PLACEHOLDER_RE.findall(item):
            if name not in allowed:
                raise ValueError(
                    f"{where}: unknown placeholder {{{name}}} in {item!r}; allowed: "
                    + ", ".join(f"{{{p}}}" for p in sorted(allowed))
                )


class LaunchTemplate(BaseModel):
    """How this host starts one kind of engine. argv items may contain placeholders."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Engine
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    health_path: str = "/health"
    startup_timeout_s: float = Field(default=900.0, gt=0)
    stop_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: Any) -> Any:
        return parse_engine(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _placeholders(self) -> LaunchTemplate:
        _check_placeholders([*self.argv, *self.env.values()], LAUNCH_PLACEHOLDERS, "launch template")
        if not self.health_path.startswith("/"):
            raise ValueError(f"health_path must start with '/', got {self.health_path!r}")
        return self

    @property
    def needs_engine_dir(self) -> bool:
        return any("{engine_dir}" in item for item in [*self.argv, *self.env.values()])


class BuildTemplate(BaseModel):
    """An allowlisted engine build (e.g. trtllm-build). Progress: print `FLEETPLAN_PROGRESS 0.42`
    lines or write the fraction to {progress_file}. Exit 0 = the engine in {engine_dir} is ready."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float = Field(default=4 * 3600.0, gt=0)

    @model_validator(mode="after")
    def _placeholders(self) -> BuildTemplate:
        _check_placeholders([*self.argv, *self.env.values()], BUILD_PLACEHOLDERS, "build template")
        return self


class ActuatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["process", "systemd"] = "process"
    systemctl: str = "/usr/bin/systemctl"
    env_dir: Path = Path("/etc/fleetplan/engines")
    unit_prefix: str = "fleetplan-engine"
    journalctl: str | None = "/usr/bin/journalctl"  # last log lines of a failed engine; None: off


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(pattern=HOST_PATTERN)
    gpu: GpuType
    gpu_count: int = Field(ge=1, le=1024)
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    mqtt: MqttSettings
    port_range: tuple[int, int] = (18000, 18999)
    state_dir: Path = Path("/var/lib/fleetplan-agent")
    engine_cache_dir: Path | None = None  # default: <state_dir>/engines
    actuator: ActuatorConfig = ActuatorConfig()
    launch_templates: dict[str, LaunchTemplate] = Field(default_factory=dict)
    build_templates: dict[str, BuildTemplate] = Field(default_factory=dict)
    models: list[Annotated[str, Field(max_length=MAX_NAME)]] | None = None  # optional allowlist of model names
    health_host: str = "127.0.0.1"
    status_interval_s: float = Field(default=15.0, gt=0)
    reconcile_interval_s: float = Field(default=1.0, gt=0)
    restart_backoff_s: tuple[float, float] = (5.0, 300.0)  # first, cap

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu(cls, value: Any) -> Any:
        return parse_gpu(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> AgentConfig:
        lo, hi = self.port_range
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"port_range {list(self.port_range)} must be [first, last] within 1-65535")
        for group in self.nvlink_groups:
            bad = [g for g in group if not 0 <= g < self.gpu_count]
            if bad:
                raise ValueError(f"nvlink_groups: GPU index {bad[0]} out of range 0-{self.gpu_count - 1}")
        for name in [*self.launch_templates, *self.build_templates]:
            if not re.match(TEMPLATE_PATTERN, name):
                raise ValueError(f"template name {name!r} must match {TEMPLATE_PATTERN}")
        return self

    @property
    def cache_dir(self) -> Path:
        return self.engine_cache_dir or self.state_dir / "engines"


def load_agent_config(path: Path) -> AgentConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise AgentConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise AgentConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise AgentConfigError(f"{path}: expected a mapping at the top level")
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = f" (got {err['input']!r:.80})" if err["type"] != "missing" and "input" in err else ""
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise AgentConfigError(
            f"{path}: {loc}: {err['msg'].removeprefix('Value error, ')}{value}{more}"
        ) from None
    except UnknownNameError as exc:
        raise AgentConfigError(f"{path}: {exc}") from None


# A build stand-in for the lab: reports progress, then writes a marker "engine" into {engine_dir}.
_SIM_BUILD_SCRIPT = (
    "import os, sys, time\n"
    "out, progress_file, total_s = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
    "os.makedirs(os.path.dirname(progress_file), exist_ok=True)\n"
    "for i in range(1, 11):\n"
    "    time.sleep(total_s / 10)\n"
    "    print(f'FLEETPLAN_PROGRESS {i / 10}', flush=True)\n"
    "os.makedirs(out, exist_ok=True)\n"
    "open(os.path.join(out, 'rank0.engine'), 'w').write('simulated engine')\n"
)


def sim_agent_config(
    *, host: str, gpu: str, gpu_count: int, mqtt_host: str, mqtt_port: int, mqtt_user: str,
    mqtt_password: str, port_range: tuple[int, int], state_dir: Path, time_scale: float = 1.0,
    startup_s: float | None = None, build_wall_s: float = 5.0,
    nvlink_groups: tuple[tuple[int, ...], ...] | None = None, python: str | None = None,
    status_interval_s: float = 5.0,
) -> dict[str, Any]:
    """An agent config (as a dict, dump it to YAML) for a lab host running simulated engines.

    Launch templates ``vllm`` and ``trtllm`` start `fleetplan sim-engine` with the replica's
    model/GPU/TP/precision/port; ``trtllm-build`` is a build template that takes `build_wall_s`.
    `startup_s` is the engine's SIMULATED startup delay (None: the persona's default).
    """
    import sys

    py = python or sys.executable

    def engine(persona: str) -> dict[str, Any]:
        argv = [py, "-m", "fleetplan", "sim-engine", "--persona", persona, "--model", "{model}",
                "--gpu", "{gpu}", "--tp", "{tp}", "--precision", "{precision}", "--port", "{port}",
                "--replica-id", "{replica_id}", "--gpu-indices", "{gpu_indices}", "--time-scale", str(time_scale)]
        if startup_s is not None:
            argv += ["--startup-s", str(startup_s)]
        return {"engine": persona, "argv": argv, "health_path": "/health", "startup_timeout_s": 300.0,
                "stop_timeout_s": 60.0}

    return {
        "host": host, "gpu": gpu, "gpu_count": gpu_count,
        "nvlink_groups": [list(g) for g in (nvlink_groups or (tuple(range(gpu_count)),))],
        "mqtt": {"host": mqtt_host, "port": mqtt_port, "username": mqtt_user, "password": mqtt_password,
                 "keepalive_s": 10, "backoff_initial_s": 0.2, "backoff_max_s": 5.0},
        "port_range": list(port_range), "state_dir": str(state_dir), "status_interval_s": status_interval_s,
        "actuator": {"kind": "process"},
        "launch_templates": {"vllm": engine("vllm"), "trtllm": engine("trtllm")},
        "build_templates": {"trtllm-build": {
            "argv": [py, "-c", _SIM_BUILD_SCRIPT, "{engine_dir}", "{progress_file}", str(build_wall_s)],
            "timeout_s": max(60.0, build_wall_s * 10)}},
    }


def make_actuator(config: AgentConfig) -> Actuator:
    if config.actuator.kind == "systemd":
        return SystemdActuator(config.actuator.env_dir, systemctl=config.actuator.systemctl,
                               unit_prefix=config.actuator.unit_prefix, journalctl=config.actuator.journalctl)
    return ProcessActuator(config.state_dir / "logs")


def substitute(item: str, values: Mapping[str, str]) -> str:
    """Replace {name} placeholders inside ONE argv item; the result stays one argv item."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], item)


# written into an engine's directory when its build finished: what the engine is, for hosts that share
# the cache directory (controller/agent.py `_scan_engine_cache`)
ENGINE_MANIFEST = "fleetplan-engine.json"


def holds_engine(engine_dir: Path) -> bool:
    """An engine directory with anything in it is the engine (what a build leaves, what an operator
    stores, what trtllm-serve loads). Raises OSError when the directory cannot be read."""
    return engine_dir.is_dir() and any(engine_dir.iterdir())


def engine_slug(model: str, gpu: GpuType, tp: int, precision: Precision) -> str:
    safe = model.replace("/", "--").replace(":", "-")
    return f"{safe}__{gpu.value}__tp{tp}__{precision.value}"
