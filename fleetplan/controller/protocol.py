"""MQTT payloads between the controller and the per-host agents (pydantic, JSON on the wire).

Topics (prefix ``fleetplan/``):

- ``fleetplan/hosts/<host>/desired`` controller -> agent, retained, :class:`DesiredState`.
  ``version`` increases with every change; the agent ignores (and acks as rejected) older versions.
- ``fleetplan/hosts/<host>/ack`` agent -> controller, :class:`Ack` per desired version received.
- ``fleetplan/hosts/<host>/status`` agent -> controller, retained, :class:`HostStatus`; the last will
  is ``{"host": <host>, "online": false}`` (engines may still run; treat replicas as unknown).

Two levels of validation:

1. The models themselves (static): strict id/template/model patterns, ``tp == len(gpu_indices)``,
   no GPU used twice, no port used twice, unique ids. :func:`parse_desired` raises
   :class:`ProtocolError` with one line naming the field and the value.
2. :func:`check_desired` against what a host can do (:class:`HostLimits`: GPU type and count, port
   range, launch/build templates of the agent's own config). The controller may call it before
   publishing; the agent always does and acks the errors.

Nothing here becomes a shell command: the agent substitutes validated values as single argv items
into templates from its own config.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from fleetplan.models.names import (
    Engine,
    GpuType,
    Precision,
    UnknownNameError,
    parse_engine,
    parse_gpu,
    parse_precision,
)
from fleetplan.models.profile import ConfigKey, Role
from fleetplan.planner.agent_rules import (
    AgentLimits,
    WantedBuild,
    WantedReplica,
    conflicts,
    refusals,
)

TOPIC_PREFIX = "fleetplan"
PROTOCOL_VERSION = 1

# Replica/build ids end up in file names and systemd instance names: keep them boring.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
# Template names come from the agent's own config.
TEMPLATE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
# Host names are MQTT topic levels: no '/', '+', '#'.
HOST_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
# Model names are passed as one argv item (e.g. "meta-llama/Llama-3.1-8B-Instruct"); no '..',
# no leading '-' (could read as an option), no whitespace or shell metacharacters.
MODEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:+-]{0,199}$"

_ID_RE = re.compile(ID_PATTERN)
_MODEL_RE = re.compile(MODEL_PATTERN)
_HOST_RE = re.compile(HOST_PATTERN)


class ProtocolError(ValueError):
    """A payload that is not valid; the message is one line naming the field and the value."""


# ---- wire bounds: everything from the wire is bounded before (and while) it is parsed ----------
MAX_PAYLOAD_BYTES = 256 * 1024  # a status of 256 replicas is ~100 KiB; bounds the cost of one message
MAX_JSON_DEPTH = 16  # the deepest legitimate path is 4 (status.nvlink_groups[i][j])
MAX_WIRE_INT = 2**53 - 1  # integers exact in every JSON implementation (and in SQLite's int64)
MAX_TEXT = 2000  # free text (errors): longer is clipped, never rejected (it is diagnostics)
MAX_ERRORS = 50  # items of an `errors` list (more are summarised)
MAX_NAME = 512  # names that are not matched by a pattern (allowlist entries, paths, units)
MAX_ITEMS = 256  # replicas, builds, cached engines, templates per host
MAX_TIME_S = 1e11  # unix seconds (year 5138); anything larger is not a clock reading


def _clip_text(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_TEXT:
        return value[: MAX_TEXT - 20] + f"... (+{len(value) - MAX_TEXT + 20} chars)"
    return value


def _clip_errors(value: Any) -> Any:
    if isinstance(value, list | tuple) and len(value) > MAX_ERRORS:
        return [*value[: MAX_ERRORS - 1], f"... and {len(value) - MAX_ERRORS + 1} more errors"]
    return value


class ReplicaPhase(StrEnum):
    """Replica states as the agent reports them (same values as fleetplan.planner.types.ReplicaState)."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # leaving desired state: SIGTERM sent, waiting for the exit
    STOPPED = "stopped"
    FAILED = "failed"


class BuildPhase(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


ReplicaId = Annotated[str, Field(pattern=ID_PATTERN)]
TemplateName = Annotated[str, Field(pattern=TEMPLATE_PATTERN)]
HostName = Annotated[str, Field(pattern=HOST_PATTERN)]
ModelName = Annotated[str, Field(pattern=MODEL_PATTERN)]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]
GpuIndex = Annotated[int, Field(strict=True, ge=0, le=1023)]
Tp = Annotated[int, Field(strict=True, ge=1, le=64)]
Version = Annotated[int, Field(strict=True, ge=0, le=MAX_WIRE_INT)]
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_WIRE_INT)]
Pid = Annotated[int, Field(strict=True, ge=1, le=2**22)]  # Linux pid_max limit
UnixTime = Annotated[float, Field(strict=True, ge=0.0, le=MAX_TIME_S)]
Text = Annotated[str, BeforeValidator(_clip_text)]
Errors = Annotated[tuple[Text, ...], BeforeValidator(_clip_errors)]
Name = Annotated[str, Field(max_length=MAX_NAME)]


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN/Infinity never get into a model, whoever constructs it
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _EngineConfigMixin(_Strict):
    """Shared normalisation: engine/GPU/precision spellings are parsed with fleetplan.models.names."""

    @field_validator("engine", "gpu", "precision", mode="before", check_fields=False)
    @classmethod
    def _normalise_names(cls, value: Any, info: Any) -> Any:
        if not isinstance(value, str):
            return value
        parse = {"engine": parse_engine, "gpu": parse_gpu, "precision": parse_precision}[info.field_name]
        try:
            return parse(value)
        except UnknownNameError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("model", check_fields=False)
    @classmethod
    def _model_no_dotdot(cls, value: str) -> str:
        if ".." in value or "//" in value:
            raise ValueError(f"model name {value!r} must not contain '..' or '//'")
        return value


def _check_indices(indices: Sequence[int], tp: int, what: str) -> None:
    if len(set(indices)) != len(indices):
        raise ValueError(f"{what}: gpu_indices {list(indices)} repeat a GPU")
    if len(indices) != tp:
        raise ValueError(f"{what}: tp={tp} needs {tp} gpu_indices, got {list(indices)}")


class DesiredReplica(_EngineConfigMixin):
    replica_id: ReplicaId
    template: TemplateName
    model: ModelName
    engine: Engine
    gpu: GpuType
    tp: Tp
    precision: Precision
    gpu_indices: tuple[GpuIndex, ...] = Field(max_length=64)
    port: Port
    # one pool of a disaggregated model (its template carries the engine's flags); an aggregated
    # replica's message leaves it out, so peers that predate roles read it unchanged
    role: Role = Field(default=Role.AGGREGATED, exclude_if=lambda r: r is Role.AGGREGATED)

    @model_validator(mode="after")
    def _consistent(self) -> DesiredReplica:
        _check_indices(self.gpu_indices, self.tp, f"replica {self.replica_id}")
        return self


class DesiredBuild(_EngineConfigMixin):
    """An engine build (TRT-LLM) run with an allowlisted build template on the given GPUs."""

    build_id: ReplicaId
    template: TemplateName
    model: ModelName
    engine: Engine = Engine.TRTLLM
    gpu: GpuType
    tp: Tp
    precision: Precision
    gpu_indices: tuple[GpuIndex, ...] = Field(max_length=64)

    @model_validator(mode="after")
    def _consistent(self) -> DesiredBuild:
        _check_indices(self.gpu_indices, self.tp, f"build {self.build_id}")
        return self


class DesiredState(_Strict):
    """What the controller wants on one host. Level-triggered: the full set, not a delta."""

    version: Version
    replicas: tuple[DesiredReplica, ...] = Field(default=(), max_length=MAX_ITEMS)
    builds: tuple[DesiredBuild, ...] = Field(default=(), max_length=MAX_ITEMS)

    @model_validator(mode="after")
    def _no_conflicts(self) -> DesiredState:
        errors = desired_conflicts(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self


def _wanted(desired: DesiredState) -> tuple[list[WantedReplica], list[WantedBuild]]:
    """The desired state as the agent rules read it (planner/agent_rules.py)."""
    return ([WantedReplica(r.replica_id, r.template, ConfigKey(r.model, r.engine, r.gpu, r.tp, r.precision, r.role),
                           tuple(r.gpu_indices), r.port) for r in desired.replicas],
            [WantedBuild(b.build_id, b.template, ConfigKey(b.model, b.engine, b.gpu, b.tp, b.precision),
                         tuple(b.gpu_indices)) for b in desired.builds])


def desired_conflicts(desired: DesiredState) -> list[str]:
    """Ids, ports and GPUs used twice inside one desired state (`agent_rules.conflicts`)."""
    return conflicts(*_wanted(desired))


class Ack(_Strict):
    """The agent's answer to one desired version (ACL denials are silent; acks are not)."""

    version: Version | None  # None: the payload was so broken that it had no integer version
    accepted: StrictBool
    errors: Errors = ()
    host: HostName
    received_s: UnixTime | None = None  # agent wall clock (unix seconds)


class ReplicaStatus(_Strict):
    replica_id: ReplicaId
    template: TemplateName | None = None
    model: ModelName
    engine: Engine
    gpu: GpuType | None = None
    tp: Tp
    precision: Precision
    gpu_indices: tuple[GpuIndex, ...] = Field(max_length=64)
    port: Port
    state: ReplicaPhase
    since_s: UnixTime | None = None  # unix seconds when the replica entered `state`
    pid: Pid | None = None  # process actuator
    unit: Name | None = None  # systemd actuator, e.g. fleetplan-engine@r1.service
    error: Text | None = None
    restarts: Count = 0
    role: Role = Field(default=Role.AGGREGATED, exclude_if=lambda r: r is Role.AGGREGATED)


class BuildStatus(_Strict):
    build_id: ReplicaId
    template: TemplateName | None = None
    model: ModelName
    engine: Engine = Engine.TRTLLM
    gpu: GpuType
    tp: Tp
    precision: Precision
    gpu_indices: tuple[GpuIndex, ...] = Field(max_length=64)
    state: BuildPhase
    progress: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] = 0.0
    since_s: UnixTime | None = None
    pid: Pid | None = None
    error: Text | None = None


class CachedEngine(_Strict):
    """A built engine the host holds (usable by launch templates with ``{engine_dir}``)."""

    model: ModelName
    engine: Engine = Engine.TRTLLM
    gpu: GpuType
    tp: Tp
    precision: Precision
    path: Annotated[str, Field(max_length=4096)] | None = None
    built_s: UnixTime | None = None


class HostStatus(_Strict):
    """What an agent reports. ``online=false`` (last will) carries only ``host``: the agent is gone,
    its engines may still be running — treat its replicas as unknown, not as stopped."""

    host: HostName
    online: StrictBool
    gpu: GpuType | None = None
    gpu_count: Annotated[int, Field(strict=True, ge=1, le=1024)] | None = None
    nvlink_groups: tuple[Annotated[tuple[GpuIndex, ...], Field(max_length=1024)], ...] = Field(
        default=(), max_length=1024)
    replicas: tuple[ReplicaStatus, ...] = Field(default=(), max_length=MAX_ITEMS)
    builds: tuple[BuildStatus, ...] = Field(default=(), max_length=MAX_ITEMS)
    engines_cached: tuple[CachedEngine, ...] = Field(default=(), max_length=MAX_ITEMS)
    agent_version: Annotated[str, Field(max_length=100)] | None = None
    updated_s: UnixTime | None = None
    desired_version: Version | None = None  # last accepted desired version (None: none yet)
    port_range: tuple[Port, Port] | None = None
    # launch template names this agent offers
    templates: tuple[TemplateName, ...] = Field(default=(), max_length=MAX_ITEMS)
    # launch template -> engine
    template_engines: dict[TemplateName, Engine] = Field(default_factory=dict, max_length=MAX_ITEMS)
    # launch templates that need a built engine ({engine_dir})
    cached_templates: tuple[TemplateName, ...] = Field(default=(), max_length=MAX_ITEMS)
    # the agent's model allowlist (None: any)
    models_allowed: tuple[Name, ...] | None = Field(default=None, max_length=100_000)
    build_templates: tuple[TemplateName, ...] = Field(default=(), max_length=MAX_ITEMS)
    errors: Errors = ()  # host-level problems (e.g. state dir unreadable)


# --------------------------------------------------------------------------------------------
# Context checks (what this host can do)


HostLimits = AgentLimits  # the facts about one host a desired state is checked against


def check_desired(desired: DesiredState, limits: HostLimits) -> list[str]:
    """Errors (one line each) for everything this host cannot run; empty when all is fine
    (`agent_rules.refusals`)."""
    return refusals(*_wanted(desired), limits)


def limits_from_status(status: HostStatus) -> HostLimits | None:
    """The host's limits as its agent reports them (None while offline or incomplete), so that a
    controller can run :func:`check_desired` before publishing."""
    if not status.online or status.gpu is None or status.gpu_count is None or status.port_range is None:
        return None
    return HostLimits(
        host=status.host, gpu=status.gpu, gpu_count=status.gpu_count, port_range=status.port_range,
        launch_templates=dict(status.template_engines), build_templates=frozenset(status.build_templates),
        engine_templates_need_cache=frozenset(status.cached_templates),
        models=frozenset(status.models_allowed) if status.models_allowed is not None else None,
        engines_cached=frozenset(ConfigKey(e.model, e.engine, e.gpu, e.tp, e.precision) for e in status.engines_cached),
    )


def check_version(applied: int | None, incoming: int) -> str | None:
    """None when `incoming` may be applied after `applied`; else the reason (version going back)."""
    if applied is not None and incoming < applied:
        return f"desired version {incoming} is older than the applied version {applied}; ignored"
    return None


# --------------------------------------------------------------------------------------------
# Topics and (de)serialisation


def _host(host: str) -> str:
    if not _HOST_RE.fullmatch(host):
        raise ProtocolError(f"host name {host!r} does not match {HOST_PATTERN}")
    return host


def desired_topic(host: str) -> str:
    return f"{TOPIC_PREFIX}/hosts/{_host(host)}/desired"


def status_topic(host: str) -> str:
    return f"{TOPIC_PREFIX}/hosts/{_host(host)}/status"


def ack_topic(host: str) -> str:
    return f"{TOPIC_PREFIX}/hosts/{_host(host)}/ack"


STATUS_WILDCARD = f"{TOPIC_PREFIX}/hosts/+/status"
ACK_WILDCARD = f"{TOPIC_PREFIX}/hosts/+/ack"
DESIRED_WILDCARD = f"{TOPIC_PREFIX}/hosts/+/desired"


def host_from_topic(topic: str) -> str | None:
    """'fleetplan/hosts/h1/status' -> 'h1'; None for anything else."""
    parts = topic.split("/")
    if len(parts) == 4 and parts[0] == TOPIC_PREFIX and parts[1] == "hosts" and _HOST_RE.fullmatch(parts[2]):
        return parts[2]
    return None


def to_payload(message: BaseModel) -> bytes:
    return message.model_dump_json().encode()


_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def field_name(part: Any) -> str:
    """One step of a field path as text: plain keys and indices as they are, anything else quoted
    (an attacker's key may contain ':', ' = ', quotes or newlines)."""
    if isinstance(part, int) or (isinstance(part, str) and _PLAIN_KEY_RE.fullmatch(part)):
        return str(part)
    return repr(str(part)[:40])


def _one_line(what: str, exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(field_name(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("value_error", "assertion_error", "missing") or "input" not in err:
            parts.append(f"{loc}: {msg}")
        else:
            parts.append(f"{loc}: {msg} (got {err['input']!r:.80})")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    text = f"{what}: " + "; ".join(parts) + more
    return text.replace("\r", "\\r").replace("\n", "\\n")  # one line, whatever the keys were


class _Rejected:
    """A JSON value the protocol refuses (NaN, Infinity, an out-of-range number): kept in place
    while parsing so that the error can name the field it sits in."""

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str) -> None:
        self.text, self.why = text, why


def _reject_constant(text: str) -> _Rejected:
    return _Rejected(text, "NaN and Infinity are not allowed")


def _bounded_float(text: str) -> float | _Rejected:
    value = float(text)
    return value if math.isfinite(value) else _Rejected(text, "number out of range (not a finite float)")


def _bounded_int(text: str) -> int | _Rejected:
    if len(text.lstrip("-")) > 16:  # before int(): 10**5000 costs time and raises past 4300 digits
        return _Rejected(text[:40] + ("..." if len(text) > 40 else ""), f"integer out of range (|n| <= {MAX_WIRE_INT})")
    value = int(text)
    return value if -MAX_WIRE_INT <= value <= MAX_WIRE_INT else _Rejected(
        text, f"integer out of range (|n| <= {MAX_WIRE_INT})")


_STRINGS_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKETS_ONLY = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when a JSON text nests brackets deeper than `limit` (brackets inside strings do not
    count). Linear and in C: strings blanked, brackets kept, then `limit` passes each removing the
    innermost "()" pairs; whatever is left was deeper (or unbalanced, which is not JSON anyway). A
    200,000-level document is refused before any recursive parser sees it."""
    brackets = _STRINGS_RE.sub(b"", raw).translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    if b"(" * (limit + 1) in brackets:
        return True  # the usual attack: a run of opening brackets
    for _ in range(limit):
        if not brackets:
            return False
        shorter = brackets.replace(b"()", b"")
        if len(shorter) == len(brackets):
            break  # no innermost pair left: unbalanced
        brackets = shorter
    return bool(brackets) and brackets.count(b"(") == brackets.count(b")")


def _find_rejected(data: Any) -> tuple[str, _Rejected] | None:
    """(field path, value) of the first refused number, depth-first; the depth is already bounded."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Rejected):
            return path or "(top level)", value
        if isinstance(value, dict):
            stack.extend((f"{path}.{field_name(k)}" if path else field_name(k), v)
                         for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(value))))
    return None


def _one_line_text(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def wire_json(payload: bytes | str, what: str) -> Any:
    """Parse one JSON payload from the wire with bounds: size, nesting depth, no NaN/Infinity,
    integers within +-(2**53-1). Raises ProtocolError naming `what` (host or file), the field and the
    value; nothing else escapes (no RecursionError, OverflowError, UnicodeDecodeError)."""
    raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"{what}: payload = {len(raw)} bytes: larger than the {MAX_PAYLOAD_BYTES} byte limit")
    if json_too_deep(raw):
        raise ProtocolError(
            f"{what}: payload = {_one_line_text(repr(raw[:24]))}...: nested deeper than the limit of "
            f"{MAX_JSON_DEPTH} levels"
        )
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_bounded_float,
                          parse_int=_bounded_int)
    except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as exc:
        raise ProtocolError(
            f"{what}: payload = {_one_line_text(repr(raw[:40]))}{'...' if len(raw) > 40 else ''}: "
            f"not JSON ({_one_line_text(str(exc))[:200]})"
        ) from None
    bad = _find_rejected(data)
    if bad is not None:
        where, value = bad
        raise ProtocolError(f"{what}: {_one_line_text(where)[:200]} = {value.text}: {value.why}")
    return data


def _parse(model: type[BaseModel], payload: bytes | str, what: str) -> Any:
    data = wire_json(payload, what)
    if not isinstance(data, dict):
        raise ProtocolError(
            f"{what}: (top level) = {_one_line_text(repr(data))[:80]}: expected a JSON object, "
            f"got {type(data).__name__}"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(_one_line(what, exc)) from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # a validator's own bug
        raise ProtocolError(f"{what}: (top level): {_one_line_text(str(exc))[:200]}") from None


def _what(kind: str, host: str | None, preposition: str) -> str:
    return f"{kind} {preposition} {host}" if host else kind


def parse_desired(payload: bytes | str, *, host: str | None = None) -> DesiredState:
    """A desired state (for `host`, named in errors when given)."""
    result: DesiredState = _parse(DesiredState, payload, _what("desired state", host, "for"))
    return result


def parse_ack(payload: bytes | str, *, host: str | None = None) -> Ack:
    """An ack (from `host`, named in errors when given)."""
    result: Ack = _parse(Ack, payload, _what("ack", host, "from"))
    return result


def parse_status(payload: bytes | str, *, host: str | None = None) -> HostStatus:
    """A host status (from `host`, named in errors when given)."""
    result: HostStatus = _parse(HostStatus, payload, _what("host status", host, "from"))
    return result


def payload_version(payload: bytes | str) -> int | None:
    """Best effort: the integer ``version`` of a payload that failed validation (for the error ack)."""
    try:
        data = wire_json(payload, "payload")
    except ProtocolError:
        return None
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and 0 <= version <= MAX_WIRE_INT:
        return version
    return None


def is_valid_id(text: str) -> bool:
    return bool(_ID_RE.fullmatch(text))


def is_valid_model(text: str) -> bool:
    return bool(_MODEL_RE.fullmatch(text)) and ".." not in text
