"""The act core: what the controller does about the plan and about what the agents report. Pure.

The planner decides WHAT the fleet should be; this core decides, each cycle, what the controller
writes and publishes to get there safely, from three inputs: the plan's actions, the hosts' last
reports, and the controller's own records (the state store's rows). It returns effects; the daemon
(controller/daemon.py) executes them (SQLite, MQTT, nginx) and the tests check them without
servers. No I/O, no clock (`now_s` is an input), no threads.

Two calls per cycle, in this order:

- `reconcile(view)` before planning: replicas the agents report READY are marked ready; engine
  builds done or failed leave the desired state (failed: an alert); replicas that never became
  ready within `ready_timeout_s` are removed (an alert); desired states never published, or not
  acked within `ack_timeout_s`, are published again; engines the agents run that this database
  never allocated are adopted only when a desired state this controller published names them
  (`adopt`); a host offline longer than `host_offline_grace_s` is lost: its replicas are not
  counted by the planner (planner side), and nothing here removes them (no scale-down caused by a
  fault).
- `execute(view, actions)` after planning: START -> a new replica row (id allocated by the store,
  port chosen here, committed before the desired state naming it is published), never on GPUs
  still in use (other free GPUs of the type in one NVLink group, else deferred; the planner sees
  such GPUs as held from the next cycle on: `held_gpus`);
  BUILD -> a build row on the GPUs the plan reserved; DRAIN/STOP -> a replica that never served
  is removed at once, a serving one drains, unless another replica of the model is still starting
  (make-before-break). MQTT down, or statuses still missing after a (re)connect: every action is
  deferred with the reason.

Worked example (tests/unit/planner/test_act.py): the plan says START llama on gpu-01 GPUs (0,) and
DRAIN r00007 of the same model; gpu-01 reports GPU 0 free and ports 8000-8001 taken ->
`NewReplica(host='gpu-01', gpu_indices=(0,), port=8002, ...)`, publish gpu-01, and the drain of
r00007 is DEFERRED ("start before stop") until the new replica is READY.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from functools import cached_property
from typing import Any

from fleetplan.models.names import parse_engine, parse_gpu, parse_precision
from fleetplan.planner.types import Action, ActionKind, ConfigKey, ReplicaState


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
    """What a runtime alert is about; its key is `<kind>/<subject>`."""

    MQTT = "mqtt"
    READY_TIMEOUT = "ready"
    BUILD_FAILED = "build"
    ORPHAN = "orphan"
    DRAIN_TIMEOUT = "drain"
    ACK_TIMEOUT = "ack"
    REJECTED = "rejected"


def alert_key(kind: AlertKind, subject: str = "") -> str:
    return f"{kind.value}/{subject}" if subject else kind.value


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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_indices"] = list(self.gpu_indices)
        return d

    @property
    def config(self) -> ConfigKey:
        """The configuration (the row keeps its fields as the state store's strings)."""
        return ConfigKey(self.model, parse_engine(self.engine), parse_gpu(self.gpu), self.tp,
                         parse_precision(self.precision))

    def desired_entry(self) -> dict[str, Any]:
        """The entry of this replica in its host's desired state (controller/protocol.py)."""
        return {
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
        return not self.online and self.offline_since_s is not None and now_s - self.offline_since_s >= grace_s


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


Effect = NewReplica | NewBuild | SetPhase | MarkReady | FinishBuild | Record


@dataclass(frozen=True)
class ActDecision:
    """Effects in order; hosts to publish after the new rows (`publish_first`) and after the
    removals (`publish`); replicas to drain once routing excludes them; alerts raised or cleared."""

    effects: tuple[Effect, ...] = ()
    publish_first: frozenset[str] = frozenset()
    publish: frozenset[str] = frozenset()
    drains: tuple[str, ...] = ()
    alerts: Mapping[str, str] = field(default_factory=dict)
    cleared: frozenset[str] = frozenset()
    counts: Mapping[str, int] = field(default_factory=dict)
    noted: frozenset[tuple[str, str]] = frozenset()


# ---- reconcile ------------------------------------------------------------------------------


def reconcile(view: ActView) -> ActDecision:
    """Bring the records in line with what the agents report (before planning)."""
    adopted = adopt(view)
    effects: list[Effect] = list(adopted.effects)
    alerts = dict(adopted.alerts)
    changed = set(adopted.publish)
    active = {r.replica_id: r for r in view.replicas}
    for host in view.hosts.values():
        if not host.online:
            continue
        for rs in host.replicas:
            row = active.get(rs.replica_id)
            if row is not None and rs.replica_id in view.known_ids and rs.state == ReplicaState.READY \
                    and row.ready_s is None:
                effects.append(MarkReady(row.replica_id))
    for b in view.builds:
        bhost = view.hosts.get(b.host)
        bs = next((x for x in bhost.builds if x.build_id == b.build_id), None) if bhost is not None else None
        if bs is None or bs.state not in (BuildState.DONE, BuildState.FAILED):
            continue
        ok = bs.state == BuildState.DONE
        effects.append(FinishBuild(b, ok, None if ok else bs.error))
        if not ok:
            alerts[alert_key(AlertKind.BUILD_FAILED, b.build_id)] = (
                f"engine build {b.build_id} ({b.model} {b.engine} {b.gpu} tp{b.tp}) failed on {b.host}: {bs.error}"
            )
        changed.add(b.host)
    rep = view.reported()
    timeout = view.settings.ready_timeout_s
    for row in view.replicas:
        if row.phase != Phase.DESIRED or row.ready_s is not None or view.now_s - row.created_s < timeout:
            continue
        seen = rep.get(row.replica_id)
        if seen is not None and seen[1].state == ReplicaState.READY:
            continue
        effects.append(SetPhase(row.replica_id, Phase.REMOVED, Note(
            "stop", ActionStatus.DONE, f"not ready after {timeout:.0f} s", replica_id=row.replica_id,
            host=row.host, model=row.model)))
        alerts[alert_key(AlertKind.READY_TIMEOUT, row.replica_id)] = (
            f"replica {row.replica_id} ({row.model} on {row.host}) not ready after {timeout:.0f} s; removed"
        )
        changed.add(row.host)
    cleared: set[str] = set()
    for host_name, d in view.desired.items():
        if d.acked_version == d.version and d.ack_accepted is False:
            # the agent refused this version: its offending replicas leave it (acks are never awaited
            # inside a cycle; the refusal is acted on here, once, since the new version is unacked)
            refused = rejected(view, host_name, d.version, d.ack_errors)
            effects += refused.effects
            alerts.update(refused.alerts)
            changed |= refused.publish
        key = alert_key(AlertKind.ACK_TIMEOUT, host_name)
        unacked = d.acked_version != d.version and d.published_s is not None and \
            view.now_s - d.published_s > view.settings.ack_timeout_s
        if unacked:
            alerts[key] = (f"host {host_name} did not ack desired v{d.version} within "
                           f"{view.settings.ack_timeout_s:.0f} s (published again)")
        elif d.acked_version == d.version:
            cleared.add(key)
        if view.republish_all or d.published_s is None or unacked:
            changed.add(host_name)
    return ActDecision(tuple(effects), publish=frozenset(changed), alerts=alerts, cleared=frozenset(cleared))


def adopt(view: ActView) -> ActDecision:
    """Engines the agents run that this database never allocated (a lost database): adopted when a
    desired state this controller published (the broker's retained copy: only the controller may
    write it) names them with the same model, engine, GPUs and port, and they conflict with nothing.
    A replica that no controller asked for is never adopted (alert: not routed, not counted)."""
    effects: list[Effect] = []
    alerts: dict[str, str] = {}
    changed: set[str] = set()
    known = set(view.known_ids)
    rows = list(view.replicas)
    for host in sorted(view.hosts.values(), key=lambda h: h.name):
        if not host.online:
            continue
        for rs in host.replicas:
            if rs.replica_id in known or rs.state not in (ReplicaState.STARTING, ReplicaState.READY):
                continue
            key = alert_key(AlertKind.ORPHAN, rs.replica_id)
            asked = next((d for d in view.retained.get(host.name, ()) if d.replica_id == rs.replica_id), None)
            if asked is None or (asked.model, asked.engine, asked.tp, asked.precision, asked.gpu_indices,
                                 asked.port) != (rs.model, rs.engine, rs.tp, rs.precision, rs.gpu_indices,
                                                 rs.port) or (rs.gpu is not None and rs.gpu != asked.gpu):
                alerts[key] = (
                    f"unknown replica {rs.replica_id} reported by {host.name} matches no desired state this "
                    "controller published; not adopted (not routed, not counted)"
                )
                continue
            mine = [r for r in rows if r.host == host.name]
            if {g for r in mine for g in r.gpu_indices} & set(rs.gpu_indices) or rs.port in {r.port for r in mine}:
                alerts[key] = (
                    f"unknown replica {rs.replica_id} on {host.name} conflicts with planned replicas; not adopted "
                    "(the agent stops it)"
                )
                continue
            row = ReplicaRow(
                rs.replica_id, host.name, rs.model, rs.engine, rs.gpu or host.gpu or "", rs.tp, rs.precision,
                rs.gpu_indices, rs.port, rs.template or template_for(view, rs.engine), Phase.DESIRED,
                "adopted", view.now_s, view.now_s, None, view.now_s if rs.state == ReplicaState.READY else None,
            )
            effects.append(NewReplica(row, Note("adopt", ActionStatus.DONE,
                                                "running engine unknown to the controller: adopted",
                                                replica_id=rs.replica_id, host=host.name, model=rs.model)))
            rows.append(row)
            known.add(rs.replica_id)
            changed.add(host.name)
    return ActDecision(tuple(effects), publish=frozenset(changed), alerts=alerts)


def template_for(view: ActView, engine: str, *, build: bool = False) -> str:
    """The agent template for `engine`: the policy's choice (`engines.<engine>.agent_template` /
    `agent_build_template`), else the engine's name, else "<engine>-build" for a build."""
    if build:
        return view.settings.build_templates.get(engine, f"{engine}-build")
    return view.settings.launch_templates.get(engine, engine)


def _unoffered(view: ActView, host: str, template: str, *, build: bool = False) -> str | None:
    """Why `host` cannot run `template` (its agent lists others), or None. An agent that lists
    nothing is not second-guessed: it accepts or rejects the desired state itself."""
    h = view.hosts.get(host)
    offered = (h.build_templates if build else h.templates) if h is not None else ()
    if not offered or template in offered:
        return None
    kind = "build" if build else "launch"
    return (f"host {host} offers no {kind} template {template!r} (it has: {', '.join(sorted(offered))}); "
            f"name one in the policy's engines.<engine>.agent_{'build_' if build else ''}template")


def rejected(view: ActView, host: str, version: int, errors: Sequence[str]) -> ActDecision:
    """The agent rejected a whole desired state: the replicas its errors name (else every replica
    on that host not yet ready) leave the desired state as failed starts; alert; republish.

    Why not retry as is: a rejected state is rejected again (a template the agent does not offer,
    GPUs it does not have); dropping the named replicas lets the next plan place them elsewhere."""
    text = "; ".join(errors) or "no reason given"
    named = {m.group(1) for e in errors for m in _RID_IN_ERROR.finditer(e)}
    rows = [r for r in view.replicas if r.host == host]
    bad = [r for r in rows if r.replica_id in named] or [r for r in rows if r.ready_s is None]
    alerts = {alert_key(AlertKind.REJECTED, host): f"host {host} rejected desired v{version}: {text}"}
    effects = tuple(SetPhase(r.replica_id, Phase.REMOVED, Note("start", ActionStatus.FAILED, "rejected by agent",
                                                               text, r.replica_id, host, r.model)) for r in bad)
    return ActDecision(effects, publish=frozenset({host}) if bad else frozenset(), alerts=alerts)


_RID_IN_ERROR = re.compile(r"replica ([A-Za-z0-9_-]+)")


# ---- execute --------------------------------------------------------------------------------


def _busy(view: ActView, host: str, rows: Sequence[ReplicaRow]) -> tuple[set[int], set[int]]:
    """GPUs and ports on `host` used by desired replicas/builds or by anything its agent still runs."""
    gpus: set[int] = set()
    ports: set[int] = set()
    for row in rows:
        if row.host == host:
            gpus.update(row.gpu_indices)
            ports.add(row.port)
    h = view.hosts.get(host)
    for rs in h.replicas if h is not None else ():
        if rs.state != ReplicaState.STOPPED:
            gpus.update(rs.gpu_indices)
            ports.add(rs.port)
    for b in view.builds:
        if b.host == host:
            gpus.update(b.gpu_indices)
    for bs in h.builds if h is not None else ():
        if bs.state in (BuildState.PENDING, BuildState.RUNNING):
            gpus.update(bs.gpu_indices)
    return gpus, ports


def held_gpus(view: ActView, host: str) -> tuple[int, ...]:
    """GPUs of `host` busy with something the plan does not place: an engine build, an engine its
    agent still runs that no active record names (stopping). The planner's placement avoids them."""
    h = view.hosts.get(host)
    out: set[int] = set()
    for rs in h.replicas if h is not None else ():
        if rs.state != ReplicaState.STOPPED and rs.replica_id not in view.replica_ids:
            out.update(rs.gpu_indices)
    for b in view.builds:
        if b.host == host:
            out.update(b.gpu_indices)
    for bs in h.builds if h is not None else ():
        if bs.state in (BuildState.PENDING, BuildState.RUNNING):
            out.update(bs.gpu_indices)
    return tuple(sorted(out))


def _note(a: Action, status: ActionStatus, detail: str, kind: str | None = None,
          replica_id: str | None = None) -> Note:
    return Note(kind or a.kind.value, status, a.reason, detail, replica_id or a.replica.replica_id,
                a.replica.host, a.replica.config.model)


def incomplete(view: ActView) -> str | None:
    """Why `view` is not complete enough to act on (None: it is). After a (re)connect every host this
    controller has a desired state or a replica for must have reported (retained statuses arrive
    right after subscribing; the offline grace covers dead agents)."""
    return _unreported(_needed_hosts(view), view.hosts, view.now_s,
                       view.connected_since_s, view.settings.host_offline_grace_s)


def plan_deferred(view: ActView) -> str | None:
    """Why no plan should be made from `view` yet (None: plan). A host this controller has a
    desired state or a replica on has not reported since this process started (MQTT not connected
    yet, or statuses still arriving after a (re)connect, within the offline grace): a plan now
    would see that host as gone ("no usable hosts", 0 replicas) and store that as the plan on-call
    reads. With MQTT down but every host's last status known, the plan is still made (the report
    shows what would be done); acting on it waits (`execute`)."""
    if view.connected_since_s is None:
        missing = sorted(_needed_hosts(view) - set(view.hosts))
        return f"MQTT not connected and no status yet from {', '.join(missing)}" if missing else None
    return incomplete(view)


def _needed_hosts(view: ActView) -> set[str]:
    return {*view.desired, *(r.host for r in view.replicas)}


def _unreported(needed: Collection[str], hosts: Mapping[str, HostReport], now_s: float,
                connected_since_s: float | None, grace_s: float) -> str | None:
    if connected_since_s is None:
        return "MQTT down"
    missing = sorted(set(needed) - set(hosts))
    if missing and now_s - connected_since_s < grace_s:
        return f"waiting for status from {', '.join(missing)}"
    return None


@dataclass(frozen=True)
class Routes:
    """Where requests go and what Prometheus scrapes, by replica id."""

    serving: Mapping[str, tuple[str, ...]]  # model -> replicas nginx sends requests to
    scraped: tuple[str, ...]  # replicas Prometheus scrapes: ready, or draining (its last requests)


def routes(replicas: Sequence[ReplicaRow], hosts: Mapping[str, HostReport], models: Sequence[str], *,
           now_s: float, connected_since_s: float | None, grace_s: float) -> Routes | None:
    """The routing for `replicas` (the active rows): a replica serves when it is desired, its host
    reports it ready and the host is not lost (offline past `grace_s`: an agent restart keeps its
    engines routed). None while the hosts' reports are incomplete (MQTT down, or statuses still
    arriving after a restart): the routing written before stays as it is, because a view without
    the hosts that have not reported yet would take their serving replicas out of nginx (the fault
    suite's controller kill -9 mid drain: 4 requests answered 503 in the 0.2 s before the statuses).

    >>> row = ReplicaRow("r1", "h1", "m", "vllm", "h100", 4, "bf16", (0, 1, 2, 3), 8000, "vllm",
    ...                  Phase.DESIRED, "planned", 0.0, 0.0, None, None)
    >>> ready = HostReport("h1", True, replicas=(ReportedReplica("r1", ReplicaState.READY, "m", "vllm",
    ...                    "h100", 4, "bf16", (0, 1, 2, 3), 8000),))
    >>> routes([row], {"h1": ready}, ["m"], now_s=100.0, connected_since_s=0.0, grace_s=60.0).serving
    {'m': ('r1',)}
    >>> routes([row], {}, ["m"], now_s=10.0, connected_since_s=0.0, grace_s=60.0) is None  # h1 not heard yet
    True
    """
    if _unreported({r.host for r in replicas}, hosts, now_s, connected_since_s, grace_s) is not None:
        return None
    reported = reported_by_id(hosts)
    serving: dict[str, list[str]] = {m: [] for m in models}
    scraped: list[str] = []
    for row in replicas:
        rep = reported.get(row.replica_id)
        ready = rep is not None and rep[1].state == ReplicaState.READY
        host = hosts.get(row.host)
        if row.phase == Phase.DESIRED and ready and host is not None and not host.lost(now_s, grace_s):
            serving.setdefault(row.model, []).append(row.replica_id)
        if ready or row.phase == Phase.DRAINING:
            scraped.append(row.replica_id)
    return Routes({m: tuple(ids) for m, ids in serving.items()}, tuple(scraped))


def execute(view: ActView, actions: Sequence[Action], *, planned_on: ActView | None = None) -> ActDecision:
    """The effects of the plan's actions (see the module docstring). `planned_on`: the view the plan
    was made from; incomplete (statuses still arriving after a restart) -> nothing is done, even if
    the view is complete by now: a plan made without the hosts' reports stops what it did not see."""
    if view.connected_since_s is None:
        return _defer_all(actions, "MQTT down", {alert_key(AlertKind.MQTT): "not connected to MQTT; not acting"})
    why = incomplete(view) or (incomplete(planned_on) if planned_on is not None else None)
    if why is not None:
        return _defer_all(actions, why if planned_on is None or incomplete(view) else f"planned while {why}", {})
    effects: list[Effect] = []
    counts = {"start": 0, "drain": 0, "stop": 0, "deferred": 0}
    rows = list(view.replicas)
    cur = view  # with this cycle's new builds (their GPUs are busy for the next starts)
    noted = set(view.noted)
    first: set[str] = set()
    blocked: dict[str, set[tuple[str, int]]] = {}  # model -> (host, GPU) its deferred starts wait for
    unstarted: set[str] = set()  # models with a start deferred for a reason no drain removes
    for a in actions:
        eff: Effect | None
        if a.kind == ActionKind.START:
            eff = _start(cur, a, rows)
            if isinstance(eff, Record):
                busy, _ = _busy(cur, a.replica.host, rows)
                waits = {(a.replica.host, g) for g in a.replica.gpu_indices if g in busy}
                blocked.setdefault(a.replica.config.model, set()).update(waits)
                if not waits:  # deferred for another reason (host, port, template): nothing frees it
                    unstarted.add(a.replica.config.model)
        elif a.kind == ActionKind.BUILD:
            eff = _build(cur, a, rows, noted)
        else:
            continue
        if isinstance(eff, NewReplica):
            rows.append(eff.row)
            counts["start"] += 1
            first.add(eff.row.host)
        elif isinstance(eff, NewBuild):
            cur = replace(cur, builds=(*cur.builds, eff.row))
            counts["build"] = counts.get("build", 0) + 1
            first.add(eff.row.host)
        else:
            counts["deferred"] += 1
        if eff is not None:
            effects.append(eff)
    drains, removed_hosts = _stop_or_drain(view, actions, rows, effects, counts, blocked, unstarted)
    return ActDecision(tuple(effects), publish_first=frozenset(first), publish=frozenset(removed_hosts),
                       drains=tuple(drains), cleared=frozenset({alert_key(AlertKind.MQTT)}), counts=counts,
                       noted=frozenset(noted))


def _defer_all(actions: Sequence[Action], why: str, alerts: Mapping[str, str]) -> ActDecision:
    effects = tuple(Record(_note(a, ActionStatus.DEFERRED, why)) for a in actions)
    return ActDecision(effects, alerts=alerts, counts={"start": 0, "drain": 0, "stop": 0,
                                                       "deferred": len(actions)})


def _start(view: ActView, a: Action, rows: Sequence[ReplicaRow]) -> NewReplica | Record:
    r = a.replica
    host = view.hosts.get(r.host)
    if host is None or not host.online:
        return Record(_note(a, ActionStatus.DEFERRED, f"host {r.host} has no online agent"))
    where, gpus = r.host, tuple(r.gpu_indices)
    busy_gpus, busy_ports = _busy(view, where, rows)
    clash = sorted(busy_gpus & set(gpus))
    moved = ""
    if clash:
        # GPUs still held (an engine stopping, a build, the drained replica of a swap): take other free
        # GPUs of the type in one NVLink group now (the next plan sees them held: held_gpus)
        spot = _free_spot(view, r.config.gpu.value, r.config.tp, rows, prefer=r.host)
        if spot is None:
            return Record(_note(a, ActionStatus.DEFERRED, f"GPUs {clash} on {r.host} still in use"))
        moved = f" (planned GPUs {list(gpus)} on {r.host} busy: moved)"
        where, gpus = spot
        host = view.hosts[where]
        busy_gpus, busy_ports = _busy(view, where, rows)
    lo, hi = host.port_range or view.settings.default_port_range
    port = next((p for p in range(lo, hi + 1) if p not in busy_ports), None)
    if port is None:
        return Record(_note(a, ActionStatus.DEFERRED, f"no free port in {lo}-{hi} on {where}"))
    c = r.config
    template = template_for(view, c.engine.value)
    why_not = _unoffered(view, where, template)
    if why_not is not None:
        return Record(_note(a, ActionStatus.DEFERRED, why_not))
    row = ReplicaRow("", where, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value,
                     gpus, port, template, Phase.DESIRED,
                     "planned", view.now_s, view.now_s, None, None)
    return NewReplica(row, Note("start", ActionStatus.PUBLISHED, a.reason,
                                f"{where} port {port}, GPUs {list(gpus)}{moved}", "", where, c.model))


def _free_spot(view: ActView, gpu: str, tp: int, rows: Sequence[ReplicaRow],
               prefer: str) -> tuple[str, tuple[int, ...]] | None:
    """`tp` free GPUs of type `gpu` inside one NVLink group of an online host (`prefer` first)."""
    for name in sorted(view.hosts, key=lambda h: (h != prefer, h)):
        h = view.hosts[name]
        if not h.online or h.gpu != gpu or h.gpu_count is None:
            continue
        busy, _ = _busy(view, name, rows)
        for g in h.nvlink_groups or (tuple(range(h.gpu_count)),):
            free = [i for i in g if i not in busy]
            if len(free) >= tp:
                return name, tuple(free[:tp])
    return None


def _build(view: ActView, a: Action, rows: Sequence[ReplicaRow],
           noted: set[tuple[str, str]]) -> NewBuild | Record | None:
    """A TensorRT-LLM engine build on the GPUs the plan reserved; a repeated deferral is noted once
    (the planner repeats the BUILD every cycle until it can run)."""
    r = a.replica
    c = r.config
    label = c.label()

    def defer(why: str) -> Record | None:
        if (label, why) in noted:
            return None
        noted.add((label, why))
        return Record(_note(a, ActionStatus.DEFERRED, why))

    key = (c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value)
    if any((b.model, b.engine, b.gpu, b.tp, b.precision) == key for b in view.builds):
        return None  # already building
    host = view.hosts.get(r.host)
    if not r.host or not r.gpu_indices or host is None or not host.online:
        return defer("no free GPUs on an online host to build on yet")
    template = template_for(view, c.engine.value, build=True)
    why_not = _unoffered(view, r.host, template, build=True)
    if why_not is not None:
        return defer(why_not)
    busy, _ = _busy(view, r.host, rows)
    clash = sorted(busy & set(r.gpu_indices))
    if clash:
        return defer(f"GPUs {clash} on {r.host} still in use")
    row = BuildRow("", r.host, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value,
                   tuple(r.gpu_indices), template, Phase.DESIRED, view.now_s, view.now_s, None)
    return NewBuild(row, _note(a, ActionStatus.PUBLISHED, f"template {template}, GPUs {list(r.gpu_indices)}",
                               kind="build", replica_id=""))


def _stop_or_drain(view: ActView, actions: Sequence[Action], rows: Sequence[ReplicaRow], effects: list[Effect],
                   counts: dict[str, int], blocked: Mapping[str, set[tuple[str, int]]],
                   unstarted: set[str]) -> tuple[list[str], set[str]]:
    """DRAIN/STOP: a replica that never served is removed at once; a serving one drains unless a
    replica of the same model is still starting, or its replacement could not start yet on GPUs
    this drain does not free (start before stop). A replacement planned on the drained replica's
    own GPUs needs the drain first: allowed only while another replica of the model serves."""
    active = {r.replica_id: r for r in rows}
    starting = [r for r in rows if r.phase == Phase.DESIRED and r.ready_s is None]
    drains: list[str] = []
    removed: set[str] = set()
    removed_hosts: set[str] = set()
    for a in actions:
        if a.kind not in (ActionKind.DRAIN, ActionKind.STOP):
            continue
        rid = a.replica.replica_id
        row = active.get(rid)
        if row is None or row.phase == Phase.DRAINING or rid in drains or rid in removed:
            continue  # unknown / already removed / drain in progress
        h = view.hosts.get(row.host)
        if h is not None and h.lost(view.now_s, view.settings.host_offline_grace_s):
            # nothing reaches it and its in-flight count is unknowable: a drain would only wait for
            # its deadline while the host's GPUs and the replica's record stay held
            effects.append(SetPhase(rid, Phase.REMOVED, _note(a, ActionStatus.DONE, "removed without draining: "
                                                              "host lost", kind="stop"), cancel_start=True))
            counts["stop"] += 1
            removed_hosts.add(row.host)
            removed.add(rid)
            continue
        if row.ready_s is None or a.replica.state != ReplicaState.READY:
            effects.append(SetPhase(rid, Phase.REMOVED, _note(a, ActionStatus.DONE, "removed (not serving)",
                                                              kind="stop"), cancel_start=True))
            counts["stop"] += 1
            removed_hosts.add(row.host)
            removed.add(rid)
            continue
        if not a.covered and any(r.model == row.model and r.replica_id != rid for r in starting):
            # make-before-break (one rule, planner/core.py `_make_before_break`): the planner marks a
            # drain `covered` when READY capacity without it covers the required rate; any other
            # drain waits while a replacement of its model is starting (this view is the freshest)
            effects.append(Record(_note(a, ActionStatus.DEFERRED,
                                        "start before stop: a replica of this model is still starting")))
            counts["deferred"] += 1
            continue
        if row.model in unstarted:
            effects.append(Record(_note(a, ActionStatus.DEFERRED,
                                        "start before stop: this model's replacement could not start")))
            counts["deferred"] += 1
            continue
        waits = blocked.get(row.model, set())
        others_serving = any(r.model == row.model and r.replica_id != rid and r.ready_s is not None
                             and r.phase == Phase.DESIRED and r.replica_id not in drains for r in rows)
        if waits - {(row.host, g) for g in row.gpu_indices} or (waits and not others_serving):
            # the replacement waits for GPUs this drain does not free, or for this replica's own GPUs
            # while nothing else of the model serves: draining now would be an outage
            effects.append(Record(_note(a, ActionStatus.DEFERRED,
                                        "start before stop: this model's replacement waits for busy GPUs")))
            counts["deferred"] += 1
            continue
        effects.append(SetPhase(rid, Phase.DRAINING, _note(a, ActionStatus.PUBLISHED, "draining: removed from routing",
                                                           kind="drain")))
        drains.append(rid)
        counts["drain"] += 1
    return drains, removed_hosts


# ---- draining -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainProgress:
    """A drain's state between polls of the replica's in-flight requests."""

    started_s: float
    zeros: int = 0  # consecutive polls that saw no request in flight
    last_inflight: float | None = None  # what the last poll saw (None: unknown)


class DrainStep(StrEnum):
    WAIT = "wait"
    DONE = "done"  # in-flight requests reached 0 (twice in a row: one poll may race a new request)
    TIMEOUT = "timeout"  # stopped anyway; alert


def drain_step(progress: DrainProgress, inflight: float | None, now_s: float,
               timeout_s: float) -> tuple[DrainStep, DrainProgress]:
    """One poll of a draining replica: `inflight` requests (None: unknown, e.g. metrics unreachable).

    >>> p = DrainProgress(started_s=0.0)
    >>> drain_step(p, 0.0, 5.0, 120.0)
    (<DrainStep.WAIT: 'wait'>, DrainProgress(started_s=0.0, zeros=1, last_inflight=0.0))
    >>> drain_step(DrainProgress(0.0, 1), 0.0, 10.0, 120.0)[0]
    <DrainStep.DONE: 'done'>
    >>> drain_step(DrainProgress(0.0, 1), None, 130.0, 120.0)[0]
    <DrainStep.TIMEOUT: 'timeout'>
    """
    if now_s - progress.started_s >= timeout_s:
        return DrainStep.TIMEOUT, progress
    zeros = progress.zeros + 1 if inflight is not None and inflight <= 0 else 0
    nxt = replace(progress, zeros=zeros, last_inflight=inflight)
    return (DrainStep.DONE if zeros >= 2 else DrainStep.WAIT), nxt


# A draining replica may serve its last requests slower than the SLO's pace (it may be the one
# that was overloaded): its longest request gets twice the SLO's time per token.
DRAIN_PACE_ALLOWANCE = 2.0


def drain_deadline_s(*, slo_ttft_s: float, slo_itl_s: float, max_output_tokens: float | None,
                     explicit_s: float | None, floor_s: float) -> float:
    """How long a drain waits for in-flight requests before the replica is stopped anyway: the
    policy's explicit `drain_timeout_s`, else the longest request at the SLO's pace (prefill plus
    `max_output_tokens` x p99 ITL, x DRAIN_PACE_ALLOWANCE), never below `floor_s`.

    >>> drain_deadline_s(slo_ttft_s=2.0, slo_itl_s=0.05, max_output_tokens=2000, explicit_s=None, floor_s=120.0)
    204.0
    >>> drain_deadline_s(slo_ttft_s=2.0, slo_itl_s=0.05, max_output_tokens=100, explicit_s=None, floor_s=120.0)
    120.0
    >>> drain_deadline_s(slo_ttft_s=2.0, slo_itl_s=0.05, max_output_tokens=2000, explicit_s=30.0, floor_s=120.0)
    30.0
    """
    if explicit_s is not None:
        return explicit_s
    if max_output_tokens is None:
        return floor_s
    return max(floor_s, DRAIN_PACE_ALLOWANCE * (slo_ttft_s + max_output_tokens * slo_itl_s))


__all__ = [
    "ActDecision", "ActSettings", "ActView", "ActionStatus", "AlertKind", "BuildRow", "BuildState",
    "DesiredRow", "DrainProgress", "DrainStep", "FinishBuild", "HostReport", "MarkReady", "NewBuild",
    "NewReplica", "Note", "Phase", "Record", "ReplicaRow", "ReportedBuild", "ReportedReplica", "Routes",
    "SetPhase", "adopt", "alert_key", "drain_deadline_s", "drain_step", "execute", "held_gpus", "incomplete",
    "plan_deferred", "reconcile", "rejected", "reported_by_id", "routes", "template_for",
]
