"""The controller daemon: every cycle observe -> plan -> act, safely, and say why.

One asyncio loop; a plain interval loop (`_cycle_loop`) runs `cycle()`: cycles never overlap, a
late one is not made up for, a SIGHUP reload is applied between cycles.
Each cycle:

1. reconcile with what the agents report (adopt orphans, note ready replicas, retry unacked
   desired states, time out replicas that never became ready);
2. observe Prometheus (controller/observe.py; stale -> fail static);
3. plan (planner.plan in a worker thread; the plan dict is stored and is what reports render);
4. act: START (replica id + port allocated and committed BEFORE the desired state naming them is
   published; never on GPUs still in use), then DRAIN (only when no replica of the same model is
   still starting: start before stop; removed from the nginx upstream, reload, wait for the
   replica's in-flight requests to reach 0 or a timeout, then removed from the desired state),
   STOP (a replica that never served is removed at once; a serving one is drained first);
5. routing: nginx upstreams (ready, non-draining replicas), endpoints JSON, Prometheus file_sd
   targets, all written atomically.

The planner already caps actions per cycle and applies the scale-down delay.
Signals (one place, `_install_signals`): SIGHUP reloads the policy before the next cycle (validated
first; an invalid file keeps the old policy and the error shows in reports); SIGTERM/SIGINT finish
the current step and stop cleanly within `stop_deadline_s` (drains in progress are resumed by the
next start); a second SIGTERM/SIGINT exits at once. sd_notify READY=1,
WATCHDOG=1, STOPPING=1 via $NOTIFY_SOCKET.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetplan.controller.metrics import ControllerMetrics
from fleetplan.controller.mqtt import Backoff, MqttSettings, client_kwargs
from fleetplan.controller.observe import (
    _RUNNING,
    _WAITING,
    Observer,
    ObserverConfig,
    PromClient,
    PrometheusError,
    Snapshot,
    to_observation,
)
from fleetplan.controller.protocol import (
    ACK_WILDCARD,
    DESIRED_WILDCARD,
    STATUS_WILDCARD,
    DesiredState,
    HostStatus,
    ProtocolError,
    desired_topic,
    host_from_topic,
    parse_ack,
    parse_desired,
    parse_status,
)
from fleetplan.controller.state import ActionStatus, Phase, ReplicaRow, StateStore
from fleetplan.planner import act
from fleetplan.planner.act import (
    ActDecision,
    ActSettings,
    ActView,
    BuildState,
    HostReport,
    ReportedBuild,
    ReportedReplica,
)

log = logging.getLogger(__name__)
audit_log = logging.getLogger("fleetplan.audit")  # one JSON line per cycle (the audit trail)


# ---------------------------------------------------------------------------------------------
# settings


class RoutingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nginx_upstreams_path: Path | None = None
    nginx_reload_command: tuple[str, ...] | None = None  # argv, e.g. ["nginx", "-s", "reload"]
    endpoints_path: Path | None = None
    file_sd_path: Path | None = None


class ControllerSettings(BaseModel):
    """The controller's own config (YAML, `--config`); the policy is a separate file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_url: str = "http://127.0.0.1:9090"
    mqtt: MqttSettings = MqttSettings()
    routing: RoutingSettings = RoutingSettings()
    lab_dir: Path | None = None  # take Prometheus, MQTT, nginx and paths from a lab's lab.json
    host_addresses: dict[str, str] = Field(default_factory=dict)  # host -> address engines listen on
    default_host_address: str | None = None  # None: the host name itself
    templates: dict[str, str] = Field(default_factory=dict)  # engine -> launch template name
    default_port_range: tuple[int, int] = (8100, 8199)
    ack_timeout_s: float = Field(default=10.0, gt=0)  # wall seconds
    ready_timeout_s: float = Field(default=600.0, gt=0)  # wall seconds
    drain_timeout_s: float = Field(default=120.0, gt=0)  # wall seconds
    stop_deadline_s: float = Field(default=30.0, gt=0)  # SIGTERM: the current step finishes within this
    drain_settle_s: float = Field(default=1.0, ge=0)  # after the reload, before trusting "0 running"
    drain_poll_s: float = Field(default=0.5, gt=0)
    host_offline_grace_s: float = Field(default=60.0, ge=0)  # wall; an agent gone longer = host offline
    observe_window_s: float = Field(default=60.0, gt=0)  # wall seconds of rate() windows
    # request-rate history for the forecast (wall seconds): 8 days lets the planner fit daily
    # seasonality (it needs >= 2 days); 5-minute steps keep the range query at ~2300 points
    history_s: float = Field(default=8 * 86400.0, gt=0)
    history_step_s: float = Field(default=300.0, gt=0)
    cycle_s: float | None = None  # override the policy's scaling.cycle_s (simulated seconds)
    report_token_file: Path | None = None


def load_settings(path: str | Path | None) -> ControllerSettings:
    if path is None:
        return ControllerSettings()
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"{p}: cannot read controller config: {exc}") from None
    try:
        return ControllerSettings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise SystemExit(f"{p}: {loc} = {err.get('input')!r}: {err['msg']}") from None


# ---------------------------------------------------------------------------------------------
# small helpers


def sd_notify(message: str) -> bool:
    """systemd notify protocol over $NOTIFY_SOCKET (no dependency); False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)  # never block the event loop on a receiver that does not read
            s.connect(addr)
            s.send(message.encode())
        return True
    except BlockingIOError:
        log.warning("sd_notify(%s): notify socket full, message dropped", message.split("\n")[0])
        return False
    except OSError as exc:
        log.warning("sd_notify(%s) failed: %s", message.split("\n")[0], exc)
        return False


@dataclass
class Clock:
    """The controller's clock. time_scale K: simulated seconds run K x faster than wall seconds
    (lab); the origin is persisted so a restarted controller continues the same simulated time."""

    time_scale: float = 1.0
    origin_wall: float = 0.0
    origin_sim: float = 0.0
    wall: Callable[[], float] = time.time

    def now(self) -> float:
        return self.to_sim(self.wall())

    def to_sim(self, wall_s: float) -> float:
        if self.time_scale == 1.0:
            return wall_s
        return self.origin_sim + (wall_s - self.origin_wall) * self.time_scale



def _engine_metrics_path(engine: str) -> str:
    return "/prometheus/metrics" if engine == "trtllm" else "/metrics"


_INFLIGHT_RE = re.compile(rf"^({_RUNNING}|{_WAITING})(\{{[^}}]*\}})?\s+([0-9.eE+-]+|NaN)\s*$")


def inflight_from_metrics(text: str) -> float | None:
    """running + waiting requests from an engine's /metrics exposition; None if not exported."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _INFLIGHT_RE.match(line)
        if m:
            seen = True
            with contextlib.suppress(ValueError):
                total += float(m.group(m.lastindex or 1))
    return total if seen else None


# ---------------------------------------------------------------------------------------------
# MQTT


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
        self._log_wall: dict[str, float] = {}  # host -> last rejection logged (wall)
        self._suppressed: dict[str, int] = {}

    async def run(self) -> None:
        import aiomqtt

        backoff = Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s)
        kwargs = client_kwargs(self.settings)
        if not kwargs.get("identifier"):
            kwargs["identifier"] = f"fleetplan-controller-{os.getpid()}"
        while True:
            try:
                async with aiomqtt.Client(**kwargs) as client:
                    # desired first: its retained messages (what this controller last published) arrive
                    # before the statuses, so adoption can check a reported replica against them
                    if self._on_desired is not None:
                        await client.subscribe(DESIRED_WILDCARD, qos=1)
                    await client.subscribe(STATUS_WILDCARD, qos=1)
                    await client.subscribe(ACK_WILDCARD, qos=1)
                    self._client = client
                    self.connected.set()
                    self.last_error = None
                    backoff.reset()
                    log.info("mqtt connected to %s:%s", self.settings.host, self.settings.port)
                    self._on_connect()
                    async for msg in client.messages:
                        self._dispatch(str(msg.topic), bytes(msg.payload or b""))
            except aiomqtt.MqttError as exc:
                self.last_error = f"MQTT broker {self.settings.host}:{self.settings.port}: {exc}"
                log.warning("%s; reconnecting", self.last_error)
            except Exception as exc:  # a bug must not end the MQTT task: log it, reconnect
                self.last_error = f"MQTT session failed: {type(exc).__name__}: {exc}"
                log.exception("MQTT session failed; reconnecting")
            finally:
                self._client = None
                self.connected.clear()
            await asyncio.sleep(backoff.next_delay_s())

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
        now = time.time()
        if now - self._log_wall.get(host, 0.0) >= 1.0:  # at most one line per host per second
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


# ---------------------------------------------------------------------------------------------
# the controller


def retained_replica(d: Any) -> ReportedReplica:
    """A replica a retained desired state names (what this controller once asked for)."""
    from fleetplan.planner.types import ReplicaState

    return ReportedReplica(d.replica_id, ReplicaState.STARTING, d.model, d.engine.value,
                           d.gpu.value if d.gpu is not None else None, d.tp, d.precision.value,
                           tuple(d.gpu_indices), d.port, d.template)


def host_report(st: HostStatus) -> HostReport:
    """The act core's view of one agent status (protocol types stay at the edge)."""
    from fleetplan.planner.types import ReplicaState

    return HostReport(
        st.host, st.online, st.gpu.value if st.gpu is not None else None, st.gpu_count,
        tuple(tuple(g) for g in st.nvlink_groups), st.port_range,
        tuple(st.templates), tuple(st.build_templates),
        tuple(ReportedReplica(r.replica_id, ReplicaState(r.state.value), r.model, r.engine.value,
                              r.gpu.value if r.gpu is not None else None, r.tp, r.precision.value,
                              tuple(r.gpu_indices), r.port, r.template) for r in st.replicas),
        tuple(ReportedBuild(b.build_id, BuildState(b.state.value), tuple(b.gpu_indices), b.error)
              for b in st.builds),
    )


@dataclass
class PolicyHolder:
    path: Path
    policy: Any = None
    loaded_s: float | None = None
    error: str | None = None
    text_hash: str | None = None


@dataclass
class Controller:
    settings: ControllerSettings
    policy_path: Path
    profiles_path: Path | None
    store: StateStore
    time_scale: float = 1.0
    nginx_reload: Callable[[], None] | None = None
    report_listen: str = "127.0.0.1:9470"
    report_token: str | None = None
    metrics: ControllerMetrics = field(default_factory=ControllerMetrics)

    def __post_init__(self) -> None:
        self.policy = PolicyHolder(self.policy_path)
        self.profiles: Any = None
        self.clock = Clock(self.time_scale)
        self.statuses: dict[str, HostStatus] = {}
        self.status_wall: dict[str, float] = {}
        self.offline_since: dict[str, float] = {}
        self._ack_waiters: dict[tuple[str, int], asyncio.Future[Any]] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._republish_all = False
        self.planner_state: Any = None
        self.last_snapshot: Snapshot | None = None
        self.cycle_count = 0
        self.runtime_alerts: dict[str, str] = {}
        self.router: Any = None
        self.prom = PromClient(self.settings.prometheus_url)
        self.link = MqttLink(self.settings.mqtt, self._on_status, self._on_ack, self._on_connect,
                             on_reject=self._on_reject, on_desired=self._on_desired)
        self.retained_desired: dict[str, DesiredState] = {}  # host -> what the broker holds from us
        self.rejected_messages: dict[str, int] = {}  # host -> malformed messages rejected
        self._rejected_wall: dict[str, float] = {}  # host -> last malformed message (wall)
        self.flaps: dict[str, list[float]] = {}  # host -> wall times of online/offline transitions
        self.metrics.mqtt_connected.set_function(lambda: float(self.link.connected.is_set()))
        self.report_runner: Any = None
        self.report_url: str | None = None
        self._correction_labels: set[tuple[str, str]] = set()  # label sets of profile_correction_ratio
        self.routed: set[str] = set()  # replica ids in the nginx upstreams right now
        self._builds_noted: set[tuple[str, str]] = set()
        self._pending_publish: set[str] = set()
        self._connected_wall = time.time()
        self._progress_wall = time.time()  # last finished cycle (or the start)
        self._routing_lock = asyncio.Lock()
        self._routing_task: asyncio.Task[None] | None = None
        from fleetplan.controller.actuation import PauseState

        self.pause = PauseState(False)  # loaded from the store at start
        self._watchdog_period_s: float | None = None
        self._reload_lock = asyncio.Lock()

    # ---- policy & profiles --------------------------------------------------------------
    def _read_policy(self) -> Any:
        """Read + parse + validate the policy file (no controller state touched: runs in a thread).
        Raises PolicyError naming the file, the field and the value."""
        from fleetplan.planner.policy import MAX_POLICY_BYTES, PolicyError, load_policy_text

        try:
            with self.policy_path.open("rb") as f:
                raw = f.read(MAX_POLICY_BYTES + 1)
            text = raw.decode("utf-8")
        except OSError as exc:
            raise PolicyError(str(self.policy_path), [f"cannot read: {exc.strerror or exc}"]) from None
        except UnicodeDecodeError as exc:
            raise PolicyError(str(self.policy_path), [f"byte {exc.start} = {raw[exc.start:exc.start + 1]!r}: "
                                                      "not UTF-8"]) from None
        return load_policy_text(text, str(self.policy_path))

    def load_policy(self, *, initial: bool) -> bool:
        """Read + validate the policy file; on error keep the old policy (or fail at start)."""
        from fleetplan.planner.policy import PolicyError

        try:
            policy = self._read_policy()
        except PolicyError as exc:
            return self._policy_rejected(str(exc), initial=initial)
        self._apply_policy(policy, initial=initial)
        return True

    async def reload_policy(self) -> bool:
        """SIGHUP: parse the policy off the event loop (a huge or hostile file must not stall MQTT and
        the cycle); the last good policy stays on any error."""
        from fleetplan.planner.policy import PolicyError

        async with self._reload_lock:
            try:
                policy = await asyncio.to_thread(self._read_policy)
            except PolicyError as exc:
                return self._policy_rejected(str(exc), initial=False)
            except Exception as exc:  # a parser bug: still keep the last good policy
                log.exception("policy reload failed")
                return self._policy_rejected(f"{self.policy_path}: {type(exc).__name__}: {exc}", initial=False)
            self._apply_policy(policy, initial=False)
            self.load_profiles()
            return True

    def _policy_rejected(self, msg: str, *, initial: bool) -> bool:
        self.policy.error = msg
        self.store.set_kv("policy_error", {"error": msg, "at_s": time.time()})
        self.metrics.policy_reloads.labels("rejected").inc()
        if initial:
            raise SystemExit(msg) from None
        log.error("policy reload rejected, keeping the previous policy: %s", msg)
        self.runtime_alerts["policy"] = f"policy reload rejected (previous policy kept): {msg}"
        return False

    def _apply_policy(self, policy: Any, *, initial: bool) -> None:
        self.policy.policy = policy
        self.policy.loaded_s = time.time()
        self.policy.error = None
        self.store.set_kv("policy_error", None)
        self.runtime_alerts.pop("policy", None)
        self.metrics.policy_reloads.labels("initial" if initial else "ok").inc()
        log.info("policy loaded from %s (%d models)", self.policy_path, len(policy.models))

    def load_profiles(self) -> None:
        from fleetplan.models.profile import ProfileSet

        if self.profiles_path is None:
            self.profiles = ProfileSet()
            return
        from fleetplan.shared.benchfiles import load_profiles

        try:
            self.profiles = load_profiles(self.profiles_path)
        except Exception as exc:
            if self.profiles is None:
                raise SystemExit(str(exc)) from None
            self.runtime_alerts["profiles"] = f"profiles reload failed (previous kept): {exc}"

    def model_names(self) -> list[str]:
        return [m.name for m in self.policy.policy.models]

    def canonical(self, name: str) -> str:
        return str(self.policy.policy.aliases().canonical(name))

    # ---- MQTT callbacks (event loop thread) -------------------------------------------
    WIRE_ALERT_QUIET_S = 300.0  # a host's malformed-message alert clears after this long without one

    def _on_reject(self, host: str, text: str) -> None:
        n = self.rejected_messages[host] = self.rejected_messages.get(host, 0) + 1
        self._rejected_wall[host] = time.time()
        self.runtime_alerts[f"wire/{host}"] = f"host {host}: {n} malformed message(s) rejected; last: {text}"

    def _on_desired(self, host: str, desired: DesiredState | None) -> None:
        """The retained desired state the broker holds for `host` (only this controller may write it)."""
        if desired is None:
            self.retained_desired.pop(host, None)
        else:
            self.retained_desired[host] = desired

    FLAP_WINDOW_S = 60.0
    FLAP_MAX_TRANSITIONS = 3

    def _note_flap(self, host: str, was_online: bool | None, online: bool, now: float) -> None:
        """Count online/offline transitions; more than 3 in 60 s raises an alert (two agents with one
        client id, a crash loop, a bad network)."""
        times = [t for t in self.flaps.get(host, []) if now - t <= self.FLAP_WINDOW_S]
        if was_online is not None and was_online != online:
            times.append(now)
        self.flaps[host] = times
        key = f"flap/{host}"
        if len(times) > self.FLAP_MAX_TRANSITIONS:
            if key not in self.runtime_alerts:
                log.warning("host %s flaps: %d online/offline transitions in %.0f s", host, len(times),
                            self.FLAP_WINDOW_S)
            self.runtime_alerts[key] = (
                f"host {host} flaps: {len(times)} online/offline transitions in {self.FLAP_WINDOW_S:.0f} s "
                "(two agents with the same MQTT client id or credentials? an agent crash-looping?)"
            )
        else:
            self.runtime_alerts.pop(key, None)

    def _on_status(self, host: str, status: HostStatus) -> None:
        now = time.time()
        prev = self.statuses.get(host)
        self._note_flap(host, prev.online if prev is not None else None, status.online, now)
        if host in self._rejected_wall and now - self._rejected_wall[host] > self.WIRE_ALERT_QUIET_S:
            del self._rejected_wall[host]
            self.rejected_messages.pop(host, None)
            self.runtime_alerts.pop(f"wire/{host}", None)
        self.statuses[host] = status if status.online or host not in self.statuses else (
            self.statuses[host].model_copy(update={"online": False})
        )
        self.status_wall[host] = now
        if status.online:
            self.offline_since.pop(host, None)
        else:
            self.offline_since.setdefault(host, now)
        try:
            self.store.save_host_status(host, status.model_dump(mode="json"))
        except Exception as exc:  # never let a DB hiccup kill the MQTT loop
            log.warning("saving status of %s failed: %s", host, exc)
        # a replica became ready: route it now, not at the next cycle
        newly_ready = [r.replica_id for r in status.replicas
                       if r.state.value == "ready" and r.replica_id not in self.routed]
        if newly_ready and not self._stopping.is_set():
            active = {r.replica_id for r in self.store.replicas((Phase.DESIRED,))}
            if active & set(newly_ready) and (self._routing_task is None or self._routing_task.done()):
                self._routing_task = asyncio.get_running_loop().create_task(self.update_routing())

    def _on_ack(self, host: str, ack: Any) -> None:
        self.store.record_ack(host, ack.version, ack.accepted, ack.errors)
        fut = self._ack_waiters.pop((host, ack.version), None) if ack.version is not None else None
        if fut is not None and not fut.done():
            fut.set_result(ack)

    def _on_connect(self) -> None:
        # the broker may have lost retained messages (restart without persistence): republish all
        self._republish_all = True
        self._connected_wall = time.time()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.load_policy(initial=True)
        self.load_profiles()
        origin = self.store.get_kv("clock_origin")
        if origin is None or float(origin.get("time_scale", 1.0)) != self.time_scale:
            now = time.time()
            origin = {"wall": now, "sim": now, "time_scale": self.time_scale}
            self.store.set_kv("clock_origin", origin)
        # a restarted controller continues the simulated clock where the last one was
        last = self.store.get_kv("clock_last")
        if last is not None and self.time_scale != 1.0:
            self.clock.origin_wall = time.time()
            self.clock.origin_sim = float(last["sim"]) + (time.time() - float(last["wall"])) * self.time_scale
        else:
            self.clock.origin_wall = float(origin["wall"])
            self.clock.origin_sim = float(origin["sim"])
        self.planner_state = self._load_planner_state()
        from fleetplan.controller.actuation import load_pause

        self.pause = load_pause(self.store)
        if self.settings.routing.nginx_upstreams_path is not None and self.nginx_reload is not None:
            from fleetplan.controller.routing import NginxRouter

            self.router = NginxRouter(self.settings.routing.nginx_upstreams_path, self.nginx_reload)
        self._tasks.append(asyncio.create_task(self.link.run(), name="mqtt"))
        from fleetplan.controller.report import start_report_server

        self.report_runner, self.report_url = await start_report_server(
            self, self.report_listen, self.report_token
        )
        # resume: republish every host's desired state (version bumped), resume drains
        self._republish_all = True
        for row in self.store.replicas((Phase.DRAINING,)):
            self._start_drain(row.replica_id)
        sd_notify("READY=1\nSTATUS=controller running")
        wd = os.environ.get("WATCHDOG_USEC")
        if wd:
            self._tasks.append(asyncio.create_task(self._watchdog(int(wd) / 1e6), name="watchdog"))

    def _stall_s(self) -> float:
        policy_cycle = self.settings.cycle_s or self.policy.policy.scaling.cycle_s
        return max(3 * policy_cycle / self.time_scale, self._watchdog_period_s or 0.0, 60.0)

    def health(self) -> list[str]:
        """What is wrong with the controller's own loops (empty: healthy). Healthy means the MQTT task
        runs (connected or reconnecting) and a cycle finished recently; /healthz and the systemd
        watchdog both follow it, so a dead loop gets the controller restarted."""
        problems = []
        mqtt = next((t for t in self._tasks if t.get_name() == "mqtt"), None)
        if mqtt is None:
            problems.append("MQTT task not started")
        elif mqtt.done():
            exc = None if mqtt.cancelled() else mqtt.exception()
            problems.append(f"MQTT task ended ({type(exc).__name__}: {exc})" if exc else "MQTT task ended")
        stalled = time.time() - self._progress_wall
        if self.policy.policy is not None and stalled > self._stall_s():
            problems.append(f"no cycle finished for {stalled:.0f} s (limit {self._stall_s():.0f} s)")
        return problems

    async def _watchdog(self, period_s: float) -> None:
        """WATCHDOG=1 only while healthy: a wedged cycle, a dead MQTT task (or loop) gets us restarted."""
        self._watchdog_period_s = period_s
        while True:
            problems = self._ping_watchdog()
            if problems:
                log.error("unhealthy (%s): not pinging the systemd watchdog", "; ".join(problems))
            await asyncio.sleep(period_s / 2)

    def _ping_watchdog(self) -> list[str]:
        """WATCHDOG=1 when healthy and not stopping (after STOPPING=1 systemd wants no more pings)."""
        problems = self.health()
        if not problems and not self._stopping.is_set():
            sd_notify("WATCHDOG=1")
        return problems

    async def stop(self) -> None:
        sd_notify("STOPPING=1")
        self._stopping.set()
        async with self._lock:  # the current step finishes first
            pass
        for t in list(self._drains.values()) + self._tasks:
            t.cancel()
        for t in list(self._drains.values()) + self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.report_runner is not None:
            await self.report_runner.cleanup()
        await self.prom.aclose()
        self.store.close()

    # ---- planner state persistence ---------------------------------------------------------
    def _load_planner_state(self) -> Any:
        from fleetplan.planner.policy import PolicyError
        from fleetplan.planner.serde import state_from_dict
        from fleetplan.planner.types import PlannerState

        d = self.store.get_kv("planner_state")
        if not d:
            return PlannerState.initial()
        try:
            return state_from_dict(d, "state store: planner_state")
        except PolicyError as exc:
            log.warning("stored planner state unreadable (%s); starting fresh", exc)
            return PlannerState.initial()

    # ---- fleet -----------------------------------------------------------------------------
    def host_online(self, host: str) -> bool:
        st = self.statuses.get(host)
        if st is None:
            return False
        if st.online:
            return True
        since = self.offline_since.get(host, time.time())
        return time.time() - since < self.settings.host_offline_grace_s

    def reported(self) -> dict[str, tuple[str, Any]]:
        """replica id -> (host, ReplicaStatus) from the agents' last status."""
        out: dict[str, tuple[str, Any]] = {}
        for host, st in self.statuses.items():
            for rs in st.replicas:
                out[rs.replica_id] = (host, rs)
        return out

    def build_fleet(self) -> Any:
        from fleetplan.models.names import parse_engine, parse_gpu, parse_precision
        from fleetplan.planner.types import (
            ConfigKey,
            EngineBuild,
            Fleet,
            HostInventory,
            Replica,
            ReplicaState,
        )

        hosts = []
        view = self.act_view()
        for host, st in sorted(self.statuses.items()):
            if st.gpu is None or st.gpu_count is None:
                continue
            hosts.append(HostInventory(host, st.gpu, st.gpu_count, st.nvlink_groups, self.host_online(host),
                                       act.held_gpus(view, host)))
        rep = self.reported()
        replicas = []
        for row in self.store.active_replicas():
            state = ReplicaState.STARTING
            since = row.created_s
            if row.phase == Phase.DRAINING:
                state = ReplicaState.DRAINING
                since = row.drain_started_s or row.updated_s
            elif row.replica_id in rep:
                rs = rep[row.replica_id][1]
                state = ReplicaState(rs.state.value)
                if state == ReplicaState.DRAINING:  # agent stopping it: not serving
                    state = ReplicaState.STOPPED
                since = rs.since_s or since
            config = ConfigKey(row.model, parse_engine(row.engine), parse_gpu(row.gpu), row.tp,
                               parse_precision(row.precision))
            replicas.append(Replica(row.replica_id, config, row.host, row.gpu_indices, state, row.port,
                                    self.clock.to_sim(since)))
        builds = []
        for host, st in self.statuses.items():
            for ce in st.engines_cached:
                builds.append(EngineBuild(self.canonical(ce.model), ce.engine, ce.gpu, ce.tp, ce.precision, host,
                                          True, None))
        for b in self.store.builds((Phase.DESIRED,)):  # in progress: the planner must not order it again
            eta = None
            policy = self.policy.policy
            build_s = policy.build_s(ConfigKey(b.model, parse_engine(b.engine), parse_gpu(b.gpu), b.tp,
                                               parse_precision(b.precision)))
            if build_s is not None:
                eta = self.clock.to_sim(b.created_s) + build_s
            builds.append(EngineBuild(b.model, parse_engine(b.engine), parse_gpu(b.gpu), b.tp,
                                      parse_precision(b.precision), b.host, False, eta))
        return Fleet(tuple(hosts), tuple(replicas), tuple(builds))

    def address(self, host: str) -> str:
        return self.settings.host_addresses.get(host) or self.settings.default_host_address or host

    def endpoint(self, row: ReplicaRow) -> str:
        return f"{self.address(row.host)}:{row.port}"

    # ---- routing -----------------------------------------------------------------------------
    async def update_routing(self) -> None:
        """nginx upstreams + endpoints JSON: ready, non-draining replicas; file_sd: ready or draining."""
        if self.advisory():
            return  # advisory mode changes no routing
        async with self._routing_lock:
            await self._update_routing()

    async def _update_routing(self) -> None:
        from fleetplan.controller.routing import ScrapeTarget, write_endpoints_json, write_file_sd

        rep = self.reported()
        endpoints: dict[str, list[str]] = {m: [] for m in self.model_names()}
        routed: set[str] = set()
        targets = []
        for row in self.store.active_replicas():
            rs = rep.get(row.replica_id)
            ready = rs is not None and rs[1].state.value == "ready"
            if row.phase == Phase.DESIRED and ready:
                endpoints.setdefault(row.model, []).append(self.endpoint(row))
                routed.add(row.replica_id)
            if ready or row.phase == Phase.DRAINING:
                targets.append(ScrapeTarget(self.endpoint(row), row.model, row.engine, row.host, row.replica_id))
        r = self.settings.routing
        try:
            if r.file_sd_path is not None:
                await asyncio.to_thread(write_file_sd, r.file_sd_path, targets)
            if r.endpoints_path is not None:
                await asyncio.to_thread(write_endpoints_json, r.endpoints_path, endpoints)
            if self.router is not None:
                await asyncio.to_thread(self.router.apply, endpoints)
            self.routed = routed
            self.runtime_alerts.pop("routing", None)
        except Exception as exc:
            self.runtime_alerts["routing"] = f"routing update failed: {exc}"
            log.error("routing update failed: %s", exc)

    # ---- desired state publishing ------------------------------------------------------------
    async def publish_hosts(self, hosts: set[str], *, bump: bool = True) -> None:
        """Stage (version+1, committed) and publish each host's desired state, then wait for acks."""
        if not hosts or self.advisory():
            return  # advisory mode publishes nothing (a staged state is published once active)
        payloads = {}
        with self.store.tx() as c:
            for h in sorted(hosts):
                payloads[h] = self.store.stage_desired(c, h)
        await asyncio.gather(*(self._publish_one(h, p) for h, p in payloads.items()))

    async def _publish_one(self, host: str, payload: dict[str, Any]) -> None:
        version = int(payload["version"])
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._ack_waiters[(host, version)] = fut
        ok = await self.link.publish(desired_topic(host), json.dumps(payload).encode())
        if not ok:
            self._ack_waiters.pop((host, version), None)
            self.runtime_alerts[f"publish/{host}"] = f"desired v{version} for {host} not published (MQTT down)"
            return
        self.store.mark_published(host, version)
        self.runtime_alerts.pop(f"publish/{host}", None)
        try:
            ack = await asyncio.wait_for(fut, self.settings.ack_timeout_s)
        except TimeoutError:
            self._ack_waiters.pop((host, version), None)
            self.runtime_alerts[f"ack/{host}"] = (
                f"host {host} did not ack desired v{version} within {self.settings.ack_timeout_s:.0f} s "
                "(retried next cycle)"
            )
            return
        self.runtime_alerts.pop(f"ack/{host}", None)
        if not ack.accepted:
            await self._rejected(host, version, payload, list(ack.errors))

    async def _rejected(self, host: str, version: int, payload: dict[str, Any], errors: list[str]) -> None:
        """The agent rejected the whole desired state (act.rejected decides what leaves it)."""
        d = act.rejected(self.act_view(), host, version, errors)
        log.error("%s", d.alerts.get(f"rejected/{host}", f"host {host} rejected desired v{version}"))
        self.apply(d, None)
        if d.publish:
            await self.publish_hosts(set(d.publish))

    # ---- acting: inputs to the act core (planner/act.py) and its effects ----------------------
    def act_view(self) -> ActView:
        """What the act core decides on: the hosts' last reports and this controller's records."""
        s = self.settings
        connected = self._connected_wall if self.link.connected.is_set() else None
        return ActView(
            now_s=time.time(), hosts={h: host_report(st) for h, st in self.statuses.items()},
            replicas=tuple(self.store.active_replicas()), builds=tuple(self.store.builds((Phase.DESIRED,))),
            desired=self.store.desired_rows(), known_ids=frozenset(self.store.known_ids()),
            settings=ActSettings(s.ready_timeout_s, s.ack_timeout_s, s.host_offline_grace_s,
                                 s.default_port_range, dict(s.templates)),
            retained={h: tuple(retained_replica(r) for r in d.replicas) for h, d in self.retained_desired.items()},
            connected_since_s=connected, republish_all=self._republish_all, noted=frozenset(self._builds_noted),
        )

    def apply(self, d: ActDecision, cycle_id: int | None) -> None:
        """Persist the decision's effects (one transaction), count its actions, raise/clear alerts."""
        for note in self.store.apply(d.effects, cycle_id):
            self.metrics.actions.labels(note.kind, note.status).inc()
        for key, text in d.alerts.items():
            if key.startswith("orphan/") and key not in self.runtime_alerts:
                log.warning("%s", text)
            self.runtime_alerts[key] = text
        for key in d.cleared:
            self.runtime_alerts.pop(key, None)
        self._builds_noted |= set(d.noted)

    async def reconcile(self) -> None:
        """Bring the database in line with what the agents report (before planning)."""
        for host, st in self.statuses.items():
            if st.online:
                self.store.note_version_floor(host, st.desired_version)
        d = act.reconcile(self.act_view())
        self.apply(d, None)
        changed = set(d.publish) | self._pending_publish
        self._pending_publish.clear()
        self._republish_all = False
        if changed and self.link.connected.is_set():
            await self.publish_hosts(changed)

    def adopt_orphans(self) -> set[str]:
        """Adopt engines the agents run that this database never allocated (act.adopt); returns the
        hosts whose desired state changed (published by the next reconcile)."""
        d = act.adopt(self.act_view())
        self.apply(d, None)
        self._pending_publish.update(d.publish)
        return set(d.publish)

    async def execute(self, cycle_id: int, result: Any) -> dict[str, int]:
        """The act core's effects of the plan's actions: rows committed, then published, then drains."""
        d = act.execute(self.act_view(), result.actions)
        self.apply(d, cycle_id)
        if d.publish_first or d.publish:
            await self.publish_hosts(set(d.publish_first | d.publish))
        if d.drains:
            await self.update_routing()  # out of the upstream (nginx reloaded) before waiting
            for rid in d.drains:
                self._start_drain(rid)
        return dict(d.counts)

    # ---- draining ------------------------------------------------------------------------------
    def _start_drain(self, rid: str) -> None:
        if rid in self._drains and not self._drains[rid].done():
            return
        self._drains[rid] = asyncio.create_task(self._drain(rid), name=f"drain-{rid}")

    async def _inflight(self, row: ReplicaRow) -> float | None:
        import httpx

        url = f"http://{self.endpoint(row)}{_engine_metrics_path(row.engine)}"
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                resp = await client.get(url)
            if resp.status_code == 200:
                return inflight_from_metrics(resp.text)
        except httpx.HTTPError:
            pass
        try:
            sel = f'{{__name__=~"{_RUNNING}|{_WAITING}",replica="{row.replica_id}"}}'
            res = await self.prom.query(f"sum({sel})")
            return res[0].value if res else None
        except PrometheusError:
            return None

    async def _drain(self, rid: str) -> None:
        row = self.store.get_replica(rid)
        if row is None or row.phase != Phase.DRAINING:
            return
        progress = act.DrainProgress(row.drain_started_s or time.time())
        await asyncio.sleep(self.settings.drain_settle_s)
        while True:
            step, progress = act.drain_step(progress, await self._inflight(row), time.time(),
                                            self.settings.drain_timeout_s)
            if step != act.DrainStep.WAIT:
                break
            await asyncio.sleep(self.settings.drain_poll_s)
        reason = "in-flight requests reached 0" if step == act.DrainStep.DONE else "timeout"
        if step == act.DrainStep.TIMEOUT:
            self.runtime_alerts[act.alert_key(act.AlertKind.DRAIN_TIMEOUT, rid)] = (
                f"replica {rid} still had requests after {self.settings.drain_timeout_s:.0f} s of draining; stopped"
            )
        async with self._lock:
            with self.store.tx() as c:
                self.store.set_phase(c, rid, Phase.REMOVED)
                c.execute(
                    "UPDATE actions SET status=?, updated_s=?, detail=? WHERE replica_id=? AND kind='drain' "
                    "AND status=?",
                    (ActionStatus.DONE, time.time(), f"drained ({reason})", rid, ActionStatus.PUBLISHED),
                )
                by = c.execute("SELECT cycle_id FROM actions WHERE replica_id=? AND kind='drain' "
                               "ORDER BY action_id DESC LIMIT 1", (rid,)).fetchone()  # the decision that drained it
                self.store.add_action(c, cycle_id=by[0] if by else None, kind="stop", replica_id=rid, host=row.host,
                                      model=row.model, status=ActionStatus.DONE, reason=f"drained: {reason}")
            self.metrics.actions.labels("stop", ActionStatus.DONE).inc()
            await self.update_routing()
            await self.publish_hosts({row.host})
        log.info("replica %s drained (%s) and removed", rid, reason)

    # ---- the cycle -----------------------------------------------------------------------------
    async def cycle(self) -> dict[str, Any]:
        if self._stopping.is_set():
            return {}
        async with self._lock:
            return await self._cycle()

    async def _cycle(self) -> dict[str, Any]:
        from fleetplan.planner.core import plan, plan_to_dict

        now_s = self.clock.now()
        self.store.set_kv("clock_last", {"wall": time.time(), "sim": now_s})
        cid = self.store.begin_cycle(now_s)
        status = "ok"
        summary: dict[str, Any] = {"now_s": now_s}
        try:
            await self.reconcile()
            policy = self.policy.policy
            models = self.model_names()
            expected = {r.replica_id for r in self.store.active_replicas()}
            observer = Observer(
                self.prom,
                ObserverConfig(
                    window_s=self.settings.observe_window_s, history_s=self.settings.history_s,
                    history_step_s=self.settings.history_step_s, time_scale=self.time_scale,
                ),
                canonical=self.canonical,
            )
            snap = await observer.snapshot(models, now_s=now_s, expected_replicas=expected)
            self.last_snapshot = snap
            self.store.save_observation(cid, snap.to_json())
            self.adopt_orphans()  # statuses may have arrived while observing: never plan around an unknown engine
            fleet = self.build_fleet()
            obs = to_observation(snap, models, fleet.replicas)  # + length mix and per-config evidence
            t0 = time.perf_counter()
            result = await asyncio.to_thread(plan, obs, fleet, policy, self.profiles, self.planner_state, now_s)
            solve_s = time.perf_counter() - t0
            self.metrics.solve_seconds.observe(solve_s)
            doc = plan_to_dict(result)
            doc["observation"] = {m: mm.to_json() for m, mm in snap.models.items()}
            doc["cycle_id"] = cid
            doc["now_s"] = now_s
            brakes = self._brakes(result, fleet, doc, now_s)
            self.store.save_plan(cid, doc, solve_s, doc["next_state"])
            self.planner_state = result.next_state
            counts = await self.execute(cid, dataclasses.replace(result, actions=brakes.allowed))
            summary["held"] = len(brakes.held)
            summary["decision_id"] = self._audit(cid, now_s, doc, snap, fleet, brakes.allowed)
            await self.update_routing()
            summary.update(counts)
            summary["solve_s"] = round(solve_s, 4)
            summary["planned_replicas"] = len(result.plan.replicas)
            summary["plan_usd_h"] = result.plan.usd_h
            summary["stale_models"] = sorted(m for m, mm in snap.models.items() if mm.stale and m in models)
            self._update_metrics(doc, snap)
            alerts = {f"observe/{i}": a for i, a in enumerate(snap.alerts)}
            alerts.update({f"plan/{i}": n for i, n in enumerate(self._plan_alerts(doc))})
            alerts.update({f"rt/{k}": v for k, v in self.runtime_alerts.items()})
            self.store.set_alerts("", alerts)
            summary["alerts"] = len(alerts)
            self.metrics.alerts_active.set(len(alerts))
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            status = "error"
            summary["error"] = f"{type(exc).__name__}: {exc}"
            log.exception("cycle %s failed", cid)
            self.runtime_alerts["cycle"] = f"cycle {cid} failed: {type(exc).__name__}: {exc}"
        finally:
            self.store.finish_cycle(cid, status, summary)
            self.metrics.cycles.labels(status).inc()
            self.metrics.last_cycle_timestamp.set(time.time())
            self._progress_wall = time.time()
            self.cycle_count += 1
            self._ping_watchdog()
        if status == "ok":
            self.runtime_alerts.pop("cycle", None)
        return summary

    def _plan_alerts(self, doc: Mapping[str, Any]) -> list[str]:
        out = []
        obs = doc.get("observation") or {}
        for m in doc.get("explanation", {}).get("models", []):
            if m.get("unmet_rps"):
                out.append(f"{m['model']}: {m['unmet_rps']:.2f} rps of demand cannot be served (capacity short)")
            o = obs.get(m["model"]) or {}
            seen = o.get("ttft_p99_ms")
            pred = [c["predicted_ttft_p99_ms"] for c in m["configs"] if c["predicted_ttft_p99_ms"] is not None]
            # the model says the SLO holds but production says otherwise: the profile is optimistic
            if (seen is not None and not o.get("stale") and seen > m["slo_ttft_p99_ms"] and pred
                    and max(pred) <= m["slo_ttft_p99_ms"] and (o.get("rate_rps") or 0) > 0):
                out.append(
                    f"{m['model']}: observed p99 TTFT {seen:.0f} ms > SLO {m['slo_ttft_p99_ms']:.0f} ms while the "
                    f"profiles predict {max(pred):.0f} ms at this load: profiles optimistic (re-benchmark) or "
                    "engines overloaded"
                )
        return out

    def _update_metrics(self, doc: Mapping[str, Any], snap: Snapshot) -> None:
        m = self.metrics
        planned: dict[str, int] = {}
        for r in doc["plan"]["replicas"]:
            planned[r["model"]] = planned.get(r["model"], 0) + 1
        rep = self.reported()
        running: dict[str, int] = {}
        desired: dict[str, int] = {}
        for row in self.store.active_replicas():
            desired[row.model] = desired.get(row.model, 0) + 1
            rs = rep.get(row.replica_id)
            if rs is not None and rs[1].state.value == "ready":
                running[row.model] = running.get(row.model, 0) + 1
        m.keep_models(set(self.model_names()))
        for name in self.model_names():
            m.planned_replicas.labels(name).set(planned.get(name, 0))
            m.running_replicas.labels(name).set(running.get(name, 0))
            m.desired_replicas.labels(name).set(desired.get(name, 0))
        for me in doc["explanation"]["models"]:
            name = me["model"]
            m.demand_rps.labels(name).set(me["demand_rps"])
            m.capacity_rps.labels(name).set(me["capacity_rps"])
            m.slo_ttft_p99_ms.labels(name).set(me["slo_ttft_p99_ms"])
            m.slo_itl_p99_ms.labels(name).set(me["slo_itl_p99_ms"])
            m.unmet_demand_rps.labels(name).set(me["unmet_rps"])
            ttfts = [c["predicted_ttft_p99_ms"] for c in me["configs"] if c["predicted_ttft_p99_ms"] is not None]
            itls = [c["predicted_itl_p99_ms"] for c in me["configs"] if c["predicted_itl_p99_ms"] is not None]
            if ttfts:
                m.predicted_ttft_p99_ms.labels(name).set(max(ttfts))
            if itls:
                m.predicted_itl_p99_ms.labels(name).set(max(itls))
            o = snap.models.get(name)
            if o is not None and o.ttft_p99_ms is not None:
                m.observed_ttft_p99_ms.labels(name).set(o.ttft_p99_ms)
            if o is not None and o.itl_p99_ms is not None:
                m.observed_itl_p99_ms.labels(name).set(o.itl_p99_ms)
        self._update_correction_metrics(doc)
        m.plan_usd_h.set(doc["plan"]["usd_h"])
        m.stale_models.set(sum(1 for name, o in snap.models.items() if o.stale and name in desired))

    def _update_correction_metrics(self, doc: Mapping[str, Any]) -> None:
        """fleetplan_profile_correction_ratio{model,config}: the plan's capacity factor per config
        (1.0: the profile is trusted); a config that left the plan loses its label set."""
        from fleetplan.controller.metrics import correction_series

        series = correction_series(doc)
        gauge = self.metrics.profile_correction_ratio
        for labels in self._correction_labels - set(series):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        for labels, value in series.items():
            gauge.labels(*labels).set(value)
        self._correction_labels = set(series)

    # ---- brakes (planner/brakes.py decides; controller/actuation.py reads the store) -------------
    def advisory(self) -> bool:
        from fleetplan.planner.brakes import Mode

        return self.policy.policy is not None and self.policy.policy.mode is Mode.ADVISORY

    def _brakes(self, result: Any, fleet: Any, doc: dict[str, Any], now_s: float) -> Any:
        from fleetplan.controller.actuation import brakes_for, history
        from fleetplan.planner.brakes import Limit, brakes_to_dict

        policy = self.policy.policy
        past = history(self.store, self.clock.to_sim, time.time(), self.time_scale)
        b = brakes_for(result, fleet, doc, policy=policy, paused=self.pause.paused, past=past, now_s=now_s)
        doc["brakes"] = brakes_to_dict(b, policy.scaling.brake_limits())
        self.metrics.actuating.set(0.0 if self.advisory() or self.pause.paused else 1.0)
        for limit in Limit:
            self.metrics.actions_held.labels(limit.value).set(sum(1 for h in b.held if h.limit is limit))
        for h in b.held:
            log.info("cycle %s: %s %s held back by %s: %s", doc.get("cycle_id"), h.action.kind.value,
                     h.action.replica.replica_id, h.limit.value, h.detail)
        return b

    def _audit(self, cid: int, now_s: float, doc: dict[str, Any], snap: Snapshot, fleet: Any,
               issued: Any) -> str:
        """The cycle's decision record (planner/audit.py): stored, and one JSON line to the journal."""
        from fleetplan.planner.audit import decision_record, fleet_view, inputs_digest

        digest = inputs_digest({"observation": snap.to_json(), "fleet": fleet_view(fleet),
                                "policy": self.policy.policy.model_dump(mode="json")})
        rec = decision_record(cycle_id=cid, now_s=now_s, digest=digest, plan_doc=doc, issued=issued)
        self.store.save_decision(rec)
        audit_log.info("%s", json.dumps({"event": "fleetplan.decision", **rec}, default=str, sort_keys=True))
        return str(rec["decision_id"])

    def set_paused(self, paused: bool, reason: str = "") -> dict[str, Any]:
        """Pause/resume actuation (persisted first); the next cycle's act step obeys it."""
        from fleetplan.controller.actuation import save_pause

        self.pause = save_pause(self.store, paused, reason)
        self.metrics.actuating.set(0.0 if self.advisory() or paused else 1.0)
        log.warning("actuation %s%s", "PAUSED" if paused else "resumed", f": {reason}" if reason else "")
        return self.actuation()

    def actuation(self) -> dict[str, Any]:
        policy = self.policy.policy
        return {"mode": policy.mode.value if policy is not None else None, **self.pause.to_json()}

    # ---- report ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The planner's inputs as the controller holds them (GET /api/state, for `fleetplan what-if`):
        the loaded policy, the fleet + planner state (a CURRENT document), the last observation (a DEMAND
        document) and the profiles."""
        from fleetplan.planner.serde import fleet_to_dict, observation_to_dict

        policy = self.policy.policy
        snap = self.last_snapshot
        demand = None
        if snap is not None and policy is not None:
            demand = observation_to_dict(to_observation(snap, self.model_names()), snap.now_s)
        return {
            "generated_s": time.time(),
            "now_s": self.clock.now(),
            "policy_path": str(self.policy_path),
            "policy": policy.model_dump(mode="json") if policy is not None else None,
            "fleet": fleet_to_dict(self.build_fleet(), self.planner_state) if policy is not None else None,
            "demand": demand,
            "profiles": self.profiles.to_json_dict() if self.profiles is not None else None,
        }

    def report(self) -> dict[str, Any]:
        """Everything the report API serves; the plan is the STORED plan dict, never recomputed."""
        last = self.store.last_plan()
        rep = self.reported()
        fleet = []
        for row in self.store.active_replicas():
            rs = rep.get(row.replica_id)
            fleet.append({
                **row.to_json(),
                "endpoint": self.endpoint(row),
                "routed": row.replica_id in self.routed,
                "reported_state": rs[1].state.value if rs else None,
                "reported_error": rs[1].error if rs else None,
            })
        hosts = {}
        for host, st in sorted(self.statuses.items()):
            hosts[host] = {
                "online": st.online, "usable": self.host_online(host), "gpu": st.gpu.value if st.gpu else None,
                "gpu_count": st.gpu_count, "desired_version": st.desired_version,
                "replicas": len(st.replicas), "last_status_age_s": round(time.time() - self.status_wall.get(host, 0), 1),
            }
        desired = {
            h: {"version": d.version, "acked_version": d.acked_version, "ack_accepted": d.ack_accepted,
                "ack_errors": list(d.ack_errors), "published_s": d.published_s}
            for h, d in self.store.desired_rows().items()
        }
        alerts = [a["text"] for a in self.store.active_alerts()]
        for k, v in self.runtime_alerts.items():
            if f"rt/{k}" not in {a["key"] for a in self.store.active_alerts()}:
                alerts.append(v)
        return {
            "generated_s": time.time(),
            "now_s": self.clock.now(),
            "time_scale": self.time_scale,
            "policy": {"path": str(self.policy_path), "loaded_s": self.policy.loaded_s, "error": self.policy.error},
            "mqtt_connected": self.link.connected.is_set(),
            "actuation": self.actuation(),
            "cycle_id": last[0] if last else None,
            "solve_s": last[2] if last else None,
            "plan": last[1] if last else None,
            "fleet": fleet,
            "hosts": hosts,
            "desired": desired,
            "builds": [b.to_json() for b in self.store.builds()][-20:],
            "actions": self.store.actions(limit=40),
            "action_counts": self.store.action_counts(),
            "history": self.store.cycles(limit=30),
            "alerts": list(dict.fromkeys(alerts)),
        }


# ---------------------------------------------------------------------------------------------
# running it


@dataclass
class Signals:
    """What the signals asked for; the loop acts on it between cycles (uvicorn's shape)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stop: bool = False
    reload: bool = False


def _install_signals(ctrl: Controller, sig: Signals) -> None:
    """All signal handling in one place: SIGHUP asks for a policy reload (applied between cycles,
    never inside one); SIGTERM/SIGINT ask for a graceful stop (the current cycle finishes, within
    `stop_deadline_s`); a second SIGTERM/SIGINT forces the exit at once."""
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        log.info("SIGHUP: the policy (%s) is reloaded before the next cycle", ctrl.policy_path)
        sig.reload = True
        sig.wake.set()

    def on_term() -> None:
        if sig.stop:
            log.warning("second stop signal: exiting now")
            sd_notify("STOPPING=1")
            os._exit(1)
        log.info("stop signal: finishing the current cycle (at most %.0f s)", ctrl.settings.stop_deadline_s)
        sig.stop = True
        sig.wake.set()

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_term)


async def _cycle_loop(ctrl: Controller, sig: Signals, interval_s: float) -> None:
    """One interval job on a plain asyncio loop: cycles never overlap, a late cycle is not made up
    for (the next starts one interval after the late one began), a reload lands between cycles."""
    loop = asyncio.get_running_loop()
    next_s = loop.time()
    while not sig.stop:
        if sig.reload:
            sig.reload = False
            await ctrl.reload_policy()
        if loop.time() >= next_s:
            next_s = loop.time() + interval_s
            await ctrl.cycle()
            continue
        sig.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sig.wake.wait(), next_s - loop.time())


async def run_controller(ctrl: Controller, *, once: bool = False, cycle_wall_s: float | None = None) -> int:
    await ctrl.start()
    sig = Signals()
    _install_signals(ctrl, sig)
    if once:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctrl.link.connected.wait(), 10.0)
        await ctrl.cycle()
        await ctrl.stop()
        return 0
    policy_cycle = ctrl.settings.cycle_s or ctrl.policy.policy.scaling.cycle_s
    interval = cycle_wall_s or max(0.5, policy_cycle / ctrl.time_scale)
    log.info("controller running: cycle every %.2f s wall (time scale %g), report at %s", interval,
             ctrl.time_scale, ctrl.report_url)
    cycles = asyncio.create_task(_cycle_loop(ctrl, sig, interval), name="cycles")
    try:
        await cycles
    finally:
        log.info("stopping: finishing the current step")
        try:
            await asyncio.wait_for(ctrl.stop(), ctrl.settings.stop_deadline_s)
        except TimeoutError:
            log.error("stop did not finish within %.0f s; exiting anyway", ctrl.settings.stop_deadline_s)
    return 0


def _parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


DEFAULT_CONFIG = Path("/etc/fleetplan/controller.yaml")


# Fills in settings from outside the controller (the lab harness passes its lab.json reader) and
# returns the nginx reloader to use, or None for the settings' own nginx_reload_command.
SettingsHook = Callable[[ControllerSettings], tuple[ControllerSettings, Callable[[], None] | None]]


def _run_reload(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def run_from_args(args: argparse.Namespace, prepare: SettingsHook | None = None) -> int:
    for noisy in ("httpx", "apscheduler", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not audit_log.handlers:  # the decision lines reach the journal whatever the verbosity
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        audit_log.addHandler(handler)
        audit_log.setLevel(logging.INFO)
        audit_log.propagate = False
    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    settings = load_settings(config)
    reload: Callable[[], None] | None = None
    if prepare is not None:
        settings, reload = prepare(settings)
    if reload is None and settings.routing.nginx_reload_command:
        reload = functools.partial(_run_reload, list(settings.routing.nginx_reload_command))

    token = None
    token_file = args.report_token_file or settings.report_token_file
    if token_file:
        token = Path(token_file).read_text().strip()
    host, _ = _parse_listen(args.report_listen)
    if host not in ("127.0.0.1", "::1", "localhost") and not token:
        raise SystemExit(
            f"--report-listen {args.report_listen}: a bearer token is required when not bound to loopback "
            "(--report-token-file)"
        )
    store = StateStore(args.state_db)
    ctrl = Controller(
        settings=settings, policy_path=Path(args.policy), profiles_path=Path(args.profiles) if args.profiles else None,
        store=store, time_scale=args.time_scale, nginx_reload=reload, report_listen=args.report_listen,
        report_token=token,
    )
    return asyncio.run(run_controller(ctrl, once=args.once))
