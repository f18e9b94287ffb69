"""The act core's data: the controller's records (`ReplicaRow`, `BuildRow`, `DesiredRow` and their
phases), its inputs (`HostReport`, `ReportedReplica`, `ReportedBuild`, `ActSettings`, `ActView`) and
its effects (`NewReplica`, `NewBuild`, `SetPhase`, `MarkReady`, `FinishBuild`, `Record`, gathered in an
`ActDecision`), with the alert keys. Pure; `fleetplan.planner.act` re-exports every public name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

from fleetplan.models.config_key import Role
from fleetplan.models.names import parse_engine, parse_gpu, parse_precision
from fleetplan.planner.host_grace import within_grace
from fleetplan.planner.types import ConfigKey, ReplicaState


class Phase(StrEnum):
    """A replica row's phase in the controller's records."""

    DESIRED = "desired"  # in its host's desired state
    DRAINING = "draining"  # out of routing, in-flight requests finishing; still desired
    REMOVED = "removed"  # out of the desired state (the agent stops it)


class ActionStatus(StrEnum):
    PLANNED = "planned"
    PUBLISHED = "published"
    ACKED = "acked"
    DONE = "done"
    FAILED = "failed"
    DEFERRED = "deferred"
    CANCELLED = "cancelled"


class BuildState(StrEnum):
    """An engine build as the agent reports it."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class AlertKind(StrEnum):
    """What a runtime alert is about (an `AlertKey`'s kind)."""

    # raised by the act core
    MQTT = "mqtt"
    READY_TIMEOUT = "ready"
    BUILD_FAILED = "build"
    ORPHAN = "orphan"
    DRAIN_TIMEOUT = "drain"
    ACK_TIMEOUT = "ack"
    REJECTED = "rejected"
    UNREACHABLE = "unreachable"  # the plan needs hosts no agent serves (act_execute.unreachable)
    # raised by the controller's adapters
    PUBLISH = "publish"  # a host's desired state not published (MQTT down)
    ROUTING = "routing"  # the last routing update failed
    ROUTER = "router"  # the router is down or refuses
    STORE = "store"  # the state store refused a write
    RETENTION = "retention"  # the state store is above its size bound
    CLOCK = "clock"  # the wall clock stepped
    CYCLE = "cycle"  # a cycle failed with an exception
    POLICY = "policy"  # a policy reload was rejected
    PROFILES = "profiles"  # a profiles reload failed
    WIRE = "wire"  # a host's malformed messages
    FLAP = "flap"  # a host going online/offline too often
    INVENTORY = "inventory"  # a host's reported inventory is held (planner/inventory.py)


class DeferCause(StrEnum):
    """Why an action was deferred; the same action deferred for the same cause cycle after cycle is
    one action-log row with a count (`Repeat`), not a row per cycle."""

    MQTT_DOWN = "mqtt-down"
    INCOMPLETE = "incomplete"  # statuses still arriving after a (re)connect
    NO_AGENT = "no-agent"  # the host has no online agent
    GPUS_BUSY = "gpus-busy"
    NO_PORT = "no-port"
    UNOFFERED = "unoffered"  # the host's agent offers no template for it
    STARTING = "starting"  # start before stop: a replica of the model is still starting
    NOT_STARTED = "not-started"  # start before stop: the replacement could not start
    WAITS_GPUS = "waits-gpus"  # start before stop: the replacement waits for busy GPUs


@dataclass(frozen=True)
class AlertKey:
    """A runtime alert's key: what it is about (`kind`) and of what (`subject`: a host, replica or
    build id; "" for the controller as a whole). Compared by kind, never by its text; `text` is its
    name in the state store's alerts (`<kind>/<subject>`).

    >>> AlertKey(AlertKind.ORPHAN, "r00042").text, AlertKey(AlertKind.MQTT).text
    ('orphan/r00042', 'mqtt')
    """

    kind: AlertKind
    subject: str = ""

    @property
    def text(self) -> str:
        return f"{self.kind.value}/{self.subject}" if self.subject else self.kind.value


@dataclass(frozen=True)
class ReplicaRow:
    """One replica the controller allocated (or adopted), as the state store keeps it."""

    replica_id: str
    host: str
    model: str
    engine: str
    gpu: str
    tp: int
    precision: str
    gpu_indices: tuple[int, ...]
    port: int
    template: str
    phase: str
    origin: str
    created_s: float
    updated_s: float
    drain_started_s: float | None
    ready_s: float | None
    role: str = Role.AGGREGATED.value  # what it serves: whole requests, or one pool of a disaggregated model

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_indices"] = list(self.gpu_indices)
        return d

    @property
    def config(self) -> ConfigKey:
        """The configuration (the row keeps its fields as the state store's strings)."""
        return ConfigKey(self.model, parse_engine(self.engine), parse_gpu(self.gpu), self.tp,
                         parse_precision(self.precision), Role(self.role))

    def desired_entry(self) -> dict[str, Any]:
        """The entry of this replica in its host's desired state (controller/protocol.py); a pool's
        replica names its role (an aggregated one does not: agents that predate roles accept it)."""
        d: dict[str, Any] = {
            "replica_id": self.replica_id,
            "template": self.template,
            "model": self.model,
            "engine": self.engine,
            "gpu": self.gpu,
            "tp": self.tp,
            "precision": self.precision,
            "gpu_indices": list(self.gpu_indices),
            "port": self.port,
        }
        if self.role != Role.AGGREGATED.value:
            d["role"] = self.role
        return d


@dataclass(frozen=True)
class BuildRow:
    """A TensorRT-LLM engine build the controller put in a host's desired state."""

    build_id: str
    host: str
    model: str
    engine: str
    gpu: str
    tp: int
    precision: str
    gpu_indices: tuple[int, ...]
    template: str
    phase: str  # desired | removed
    created_s: float
    updated_s: float
    result: str | None  # done | failed: ... | None while running

    @property
    def config(self) -> ConfigKey:
        """The configuration (the row keeps its fields as the state store's strings)."""
        return ConfigKey(self.model, parse_engine(self.engine), parse_gpu(self.gpu), self.tp,
                         parse_precision(self.precision))

    def desired_entry(self) -> dict[str, Any]:
        return {
            "build_id": self.build_id, "template": self.template, "model": self.model, "engine": self.engine,
            "gpu": self.gpu, "tp": self.tp, "precision": self.precision, "gpu_indices": list(self.gpu_indices),
        }

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_indices"] = list(self.gpu_indices)
        return d


@dataclass(frozen=True)
class DesiredRow:
    host: str
    version: int
    payload: dict[str, Any]
    published_s: float | None
    acked_version: int | None
    ack_accepted: bool | None
    ack_errors: tuple[str, ...]


# ---- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportedReplica:
    """An engine an agent reports (or a replica a retained desired state names)."""

    replica_id: str
    state: ReplicaState
    model: str
    engine: str
    gpu: str | None
    tp: int
    precision: str
    gpu_indices: tuple[int, ...]
    port: int
    template: str | None = None
    since_s: float | None = None  # in this state since (the agent's clock; None: not reported)
    role: str = Role.AGGREGATED.value


@dataclass(frozen=True)
class ReportedBuild:
    build_id: str
    state: BuildState
    gpu_indices: tuple[int, ...]
    error: str | None = None


@dataclass(frozen=True)
class HostReport:
    """A host's last status. `online=False` (the agent's last will): its engines may still run."""

    name: str
    online: bool
    gpu: str | None = None
    gpu_count: int | None = None
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    port_range: tuple[int, int] | None = None
    templates: tuple[str, ...] = ()
    build_templates: tuple[str, ...] = ()
    replicas: tuple[ReportedReplica, ...] = ()
    builds: tuple[ReportedBuild, ...] = ()
    offline_since_s: float | None = None  # when it went offline (None: online, or unknown)

    def lost(self, now_s: float, grace_s: float) -> bool:
        """Offline for longer than the grace: its replicas serve nobody (routing dropped them)."""
        return not within_grace(self.online, self.offline_since_s, now_s=now_s, grace_s=grace_s)


@dataclass(frozen=True)
class ActSettings:
    ready_timeout_s: float = 900.0
    ack_timeout_s: float = 10.0
    host_offline_grace_s: float = 60.0
    default_port_range: tuple[int, int] = (8000, 8999)
    # engine -> the agent template to ask for (Policy.agent_template); absent: the engine's name
    # ("vllm", "trtllm") for launches and "<engine>-build" for builds
    launch_templates: Mapping[str, str] = field(default_factory=dict)
    build_templates: Mapping[str, str] = field(default_factory=dict)
    listed_hosts: frozenset[str] = frozenset()  # the policy's `hosts:` (empty: it lists none)


@dataclass(frozen=True)
class ActView:
    """Everything one decision reads: the hosts' reports and the controller's records, at `now_s`."""

    now_s: float  # wall clock seconds (the store's clock)
    hosts: Mapping[str, HostReport]
    replicas: tuple[ReplicaRow, ...]  # active: desired or draining
    builds: tuple[BuildRow, ...]  # desired (in progress)
    desired: Mapping[str, DesiredRow]
    known_ids: frozenset[str]  # every replica id this database ever allocated
    settings: ActSettings = ActSettings()
    retained: Mapping[str, tuple[ReportedReplica, ...]] = field(default_factory=dict)  # broker's copy
    connected_since_s: float | None = None  # MQTT connected since (None: not connected)
    republish_all: bool = False  # after a (re)connect: the broker may have lost retained states
    noted: frozenset[tuple[str, str]] = frozenset()  # (config label, why) build deferrals already recorded
    deferrals: Mapping[DeferKey, Deferral] = field(default_factory=dict)  # deferred last time, still open

    @cached_property
    def replica_ids(self) -> frozenset[str]:
        """The ids of `replicas` (computed once per view: asked once per host)."""
        return frozenset(r.replica_id for r in self.replicas)

    def reported(self) -> dict[str, tuple[str, ReportedReplica]]:
        """replica id -> (host, report) from the agents' last statuses."""
        return reported_by_id(self.hosts)


def reported_by_id(hosts: Mapping[str, HostReport]) -> dict[str, tuple[str, ReportedReplica]]:
    """replica id -> (host, report) from the agents' last statuses."""
    return {r.replica_id: (h.name, r) for h in hosts.values() for r in h.replicas}


# ---- effects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Note:
    """One row of the action log: what was done (or not) and why."""

    kind: str  # start | drain | stop | build | adopt
    status: ActionStatus
    reason: str
    detail: str = ""
    replica_id: str | None = None
    host: str | None = None
    model: str | None = None
    cause: DeferCause | None = None  # a deferral's cause
    subject: str = ""  # what a deferral is of: the replica id, or a new replica's config label
    action_id: int | None = None  # its row, once written (the store allocates it)

    def defer_key(self) -> DeferKey | None:
        """The identity of a deferral across cycles: the same action, the same cause."""
        if self.cause is None:
            return None
        return (self.kind, self.subject, self.host or "", self.model or "", self.cause)


# (kind, subject, host, model, cause): one deferral, whatever its reason text and detail say
DeferKey = tuple[str, str, str, str, DeferCause]


@dataclass(frozen=True)
class Deferral:
    """A deferral open since an earlier cycle: its action-log row and how often it was deferred."""

    action_id: int
    count: int
    since_s: float


@dataclass(frozen=True)
class NewReplica:
    """Insert a replica row (replica_id None: the store allocates it) with its log entry."""

    row: ReplicaRow
    note: Note


@dataclass(frozen=True)
class NewBuild:
    row: BuildRow  # build_id "" : the store allocates it
    note: Note


@dataclass(frozen=True)
class SetPhase:
    replica_id: str
    phase: Phase
    note: Note | None = None
    cancel_start: bool = False  # the replica's pending start action is cancelled


@dataclass(frozen=True)
class MarkReady:
    replica_id: str


@dataclass(frozen=True)
class FinishBuild:
    build: BuildRow
    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class Record:
    note: Note


@dataclass(frozen=True)
class Repeat:
    """The deferral of row `action_id` again: its count is now `count` (`note`: the latest detail)."""

    action_id: int
    count: int
    note: Note


Effect = NewReplica | NewBuild | SetPhase | MarkReady | FinishBuild | Record | Repeat


@dataclass(frozen=True)
class ActDecision:
    """Effects in order; hosts to publish after the new rows (`publish_first`) and after the
    removals (`publish`); replicas to drain once routing excludes them; alerts raised or cleared."""

    effects: tuple[Effect, ...] = ()
    publish_first: frozenset[str] = frozenset()
    publish: frozenset[str] = frozenset()
    drains: tuple[str, ...] = ()
    alerts: Mapping[AlertKey, str] = field(default_factory=dict)
    cleared: frozenset[AlertKey] = frozenset()
    counts: Mapping[str, int] = field(default_factory=dict)
    noted: frozenset[tuple[str, str]] = frozenset()
    # this decision's deferrals still open (new ones get their row id once written); None: the
    # decision says nothing about deferrals (reconcile, adopt)
    deferrals: Mapping[DeferKey, Deferral] | None = None
