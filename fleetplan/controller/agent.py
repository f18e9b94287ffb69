"""The per-host agent: desired state from MQTT -> engine instances on this host's GPUs.

Level-triggered: the agent keeps the last accepted :class:`~fleetplan.controller.protocol.DesiredState`
(persisted in its state directory) and every second makes the host match it — starts missing
replicas from its OWN launch templates (pinned with CUDA_VISIBLE_DEVICES to the given GPU indices
and a port), health-waits before reporting them ready, stops replicas that left the desired state
(SIGTERM, wait, SIGKILL), restarts failed ones with a capped backoff and runs engine builds.

This module holds the `Agent`: the desired state it applies, its status and its MQTT session; its
parts are mixins in their own modules (`agent_replicas` the replica supervisor, `agent_builds` the
engine builds, `agent_cache` the engine cache, `agent_base` the state they share and persist); the
configuration (templates, actuator, placeholders) is `fleetplan.controller.agent_config`.

Safety properties:

- Nothing from the wire becomes argv: a message names a template of this agent's config and
  validated parameters; each placeholder is substituted inside one argv item, no shell anywhere.
- A message that fails validation is rejected as a whole (error ack); nothing running changes.
- Versions never go backwards: an older version is acked as rejected and ignored.
- The broker or controller going away changes nothing on the host: engines keep running on the
  last accepted desired state; the agent reconnects with capped jittered backoff.
- SIGTERM stops the agent, NOT the engines (own sessions / own systemd units). On restart the
  agent re-adopts them from its state directory (pid + kernel start time + cmdline must match),
  so it never starts a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from fleetplan.controller.actuators import (
    Actuator,
    Handle,
    StartError,
)
from fleetplan.controller.agent_base import _Build, _Instance
from fleetplan.controller.agent_builds import Builds
from fleetplan.controller.agent_cache import CacheScan, EngineCache
from fleetplan.controller.agent_config import (
    AgentConfig,
    engine_slug,
    make_actuator,
)
from fleetplan.controller.agent_replicas import ReplicaSupervisor
from fleetplan.controller.mqtt import session_loop
from fleetplan.controller.protocol import (
    Ack,
    BuildPhase,
    BuildStatus,
    CachedEngine,
    DesiredBuild,
    DesiredReplica,
    DesiredState,
    HostLimits,
    HostStatus,
    ProtocolError,
    ReplicaPhase,
    ReplicaStatus,
    ack_topic,
    check_desired,
    check_version,
    desired_topic,
    parse_desired,
    payload_version,
    status_topic,
    to_payload,
)
from fleetplan.models.profile import ConfigKey
from fleetplan.shared.atomic import atomic_write_text

log = logging.getLogger(__name__)


def _agent_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetplan")
    except PackageNotFoundError:
        return "0+unknown"




class Agent(EngineCache, Builds, ReplicaSupervisor):
    """One host's agent. `run()` until cancelled; engines outlive it."""

    def __init__(self, config: AgentConfig, actuator: Actuator | None = None) -> None:
        self.config = config
        self.actuator = actuator or make_actuator(config)
        self.desired: DesiredState | None = None
        self.instances: dict[str, _Instance] = {}
        self.builds: dict[str, _Build] = {}
        self.engines: dict[str, CachedEngine] = {}
        # engine directories of the cache whose manifest this host cannot use (another GPU type, a
        # manifest describing another engine, or one that does not parse): read again, and warned of
        # again, only when the manifest changes, not every reconcile pass
        self._foreign_engines: dict[str, int] = {}  # name -> manifest mtime (read_engine_manifests)
        self._scan: asyncio.Task[CacheScan] | None = None  # a cache directory read still running
        self._scan_slow = False  # its slowness was logged
        self.connected = False
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._client: Any = None
        self._version = _agent_version()
        self.host_errors: dict[str, str] = {}  # reported in status.errors

    def _save_desired(self, desired: DesiredState) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config.state_dir / "desired.json", desired.model_dump_json(indent=1))

    # ---- restore after restart ----
    async def restore(self) -> None:
        """Load the last accepted desired state, the engine cache and re-adopt running instances."""
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.config.state_dir / "desired.json"
        if path.exists():
            try:
                self.desired = parse_desired(path.read_bytes())
            except ProtocolError as exc:
                log.error("ignoring %s: %s", path, exc)
                self.host_errors["desired"] = f"{path}: {exc}"
        engines_path = self.config.state_dir / "engines.json"
        if engines_path.exists():
            try:
                for item in json.loads(engines_path.read_text()):
                    engine = CachedEngine.model_validate(item)
                    self.engines[engine_slug(engine.model, engine.gpu, engine.tp, engine.precision)] = engine
            except (ValueError, TypeError) as exc:
                log.error("ignoring %s: %s", engines_path, exc)
        if self.desired is not None:
            self._find_stored_engines(self.desired)
            errors = check_desired(self.desired, self.limits())
            if errors:  # e.g. the agent config lost a template since: wait for a new desired state
                msg = f"saved desired version {self.desired.version} no longer fits this config: {errors[0]}"
                log.error("%s; leaving running instances alone until a new version arrives", msg)
                self.host_errors["desired"] = msg
                self.desired = None
        if not self._records_dir.is_dir():
            return
        now = time.time()
        for record_path in sorted(self._records_dir.glob("*.json")):
            try:
                record = json.loads(record_path.read_text())
                handle = Handle.from_dict(record["handle"])
                kind = record["kind"]
                spec: DesiredReplica | DesiredBuild = (
                    DesiredReplica.model_validate(record["spec"]) if kind == "replica"
                    else DesiredBuild.model_validate(record["spec"])
                )
            except (ValueError, KeyError, TypeError) as exc:
                log.error("unreadable instance record %s (%s): removed", record_path, exc)
                record_path.unlink()
                continue
            adopted = await self.actuator.adopt(handle)
            if adopted is None:
                log.info("instance %s (pid %s) no longer runs: record dropped", handle.instance_id, handle.pid)
                record_path.unlink()
                continue
            if isinstance(spec, DesiredReplica):
                # Check health at once so that the first status after a restart says "ready" for
                # engines that were serving (no routing flap in the controller).
                ready = await self._adopted_ready(spec, was_ready=isinstance(record.get("ready_s"), float))
                since = record.get("ready_s") if ready else None
                self.instances[spec.replica_id] = _Instance(
                    spec, ReplicaPhase.READY if ready else ReplicaPhase.STARTING,
                    since if isinstance(since, float) else now, handle=adopted)
                log.info("re-adopted replica %s (pid %s, %s)", spec.replica_id, adopted.pid,
                         "ready" if ready else "starting")
            else:
                log.info("re-adopted build %s (pid %s)", spec.build_id, adopted.pid)
                self.builds[spec.build_id] = _Build(spec, BuildPhase.RUNNING, now, handle=adopted)

    # ---- desired state messages ----
    def limits(self) -> HostLimits:
        return HostLimits(
            host=self.config.host,
            gpu=self.config.gpu,
            gpu_count=self.config.gpu_count,
            port_range=self.config.port_range,
            launch_templates={name: t.engine for name, t in self.config.launch_templates.items()},
            build_templates=frozenset(self.config.build_templates),
            models=frozenset(self.config.models) if self.config.models is not None else None,
            engine_templates_need_cache=frozenset(
                name for name, t in self.config.launch_templates.items() if t.needs_engine_dir
            ),
            engines_cached=frozenset(ConfigKey(e.model, e.engine, e.gpu, e.tp, e.precision) for e in self.engines.values()),
        )

    def handle_desired(self, payload: bytes) -> Ack | None:
        """Validate and (if valid) accept a desired-state payload. None: nothing to ack (empty)."""
        host = self.config.host
        if not payload.strip():
            log.info("empty desired-state payload (retained message cleared): keeping the current state")
            return None
        try:
            desired = parse_desired(payload, host=host)
        except ProtocolError as exc:
            log.warning("rejected desired state: %s", exc)
            return Ack(version=payload_version(payload), accepted=False, errors=(str(exc),), host=host,
                       received_s=time.time())
        applied = self.desired.version if self.desired is not None else None
        reason = check_version(applied, desired.version)
        if reason is None and applied == desired.version and desired != self.desired:
            reason = (f"desired version {desired.version} was already applied with different content; "
                      "publish a new version")
        if reason is None:
            self._find_stored_engines(desired)
        errors = [reason] if reason else check_desired(desired, self.limits())
        if errors:
            log.warning("rejected desired version %s: %s", desired.version, "; ".join(errors))
            return Ack(version=desired.version, accepted=False, errors=tuple(errors), host=host,
                       received_s=time.time())
        if desired != self.desired:
            try:
                self._save_desired(desired)
            except OSError as exc:
                error = f"cannot save the desired state in {self.config.state_dir}: {exc.strerror or exc}"
                log.error("rejected desired version %s: %s", desired.version, error)
                return Ack(version=desired.version, accepted=False, errors=(error,), host=host,
                           received_s=time.time())
            self.host_errors.pop("desired", None)
            self.desired = desired
            log.info("accepted desired version %s: %d replicas, %d builds", desired.version,
                     len(desired.replicas), len(desired.builds))
            self._wake.set()
            self._mark()
        return Ack(version=desired.version, accepted=True, host=host, received_s=time.time())

    # ---- status ----
    def status(self, *, online: bool = True) -> HostStatus:
        replicas = []
        for inst in sorted(self.instances.values(), key=lambda i: i.replica.replica_id):
            r = inst.replica
            replicas.append(ReplicaStatus(
                replica_id=r.replica_id, template=r.template, model=r.model, engine=r.engine, gpu=r.gpu,
                tp=r.tp, precision=r.precision, gpu_indices=r.gpu_indices, port=r.port, state=inst.state,
                since_s=inst.since_s, pid=inst.handle.pid if inst.handle else None,
                unit=inst.handle.unit if inst.handle else None, error=inst.error, restarts=inst.restarts,
                role=r.role,
            ))
        builds = []
        for b in sorted(self.builds.values(), key=lambda x: x.build.build_id):
            d = b.build
            builds.append(BuildStatus(
                build_id=d.build_id, template=d.template, model=d.model, engine=d.engine, gpu=d.gpu, tp=d.tp,
                precision=d.precision, gpu_indices=d.gpu_indices, state=b.state,
                progress=min(1.0, max(0.0, b.progress)), since_s=b.since_s,
                pid=b.handle.pid if b.handle else None, error=b.error,
            ))
        return HostStatus(
            host=self.config.host, online=online, gpu=self.config.gpu, gpu_count=self.config.gpu_count,
            nvlink_groups=self.config.nvlink_groups, replicas=tuple(replicas), builds=tuple(builds),
            engines_cached=tuple(self.engines.values()), agent_version=self._version, updated_s=time.time(),
            desired_version=self.desired.version if self.desired else None,
            port_range=self.config.port_range, templates=tuple(sorted(self.config.launch_templates)),
            template_engines={name: t.engine for name, t in sorted(self.config.launch_templates.items())},
            cached_templates=tuple(sorted(n for n, t in self.config.launch_templates.items() if t.needs_engine_dir)),
            models_allowed=tuple(self.config.models) if self.config.models is not None else None,
            build_templates=tuple(sorted(self.config.build_templates)),
            errors=tuple(self.host_errors.values()),
        )

    # ---- reconcile ----
    async def reconcile_once(self) -> None:
        await self._scan_engine_cache()
        if self.desired is None:
            # Nothing accepted yet (first start, no broker): leave re-adopted instances alone.
            await self._poll_all()
            return
        await self._poll_all()
        want = {r.replica_id: r for r in self.desired.replicas}
        want_builds = {b.build_id: b for b in self.desired.builds}
        for rid, inst in list(self.instances.items()):
            if (rid not in want or want[rid] != inst.replica) and inst.state != ReplicaPhase.DRAINING:
                self._begin_stop(inst)
        for bid, b in list(self.builds.items()):
            if bid not in want_builds or want_builds[bid] != b.build:
                if b.handle is not None and (b.task is None or b.task.done()):
                    b.task = asyncio.create_task(self._stop_build(b))
                elif b.handle is None:
                    del self.builds[bid]
                    self._mark()
        now = time.monotonic()
        for bid, build in want_builds.items():
            if bid not in self.builds and self._busy(bid, build.gpu_indices, None) is None:
                await self._start_build(build)
        for rid, replica in want.items():
            current = self.instances.get(rid)
            if current is not None and not (current.state == ReplicaPhase.FAILED and current.handle is None
                                            and now >= current.retry_at and current.replica == replica):
                continue
            if self._busy(rid, replica.gpu_indices, replica.port) is not None:
                continue  # waits for the previous holder to drain
            await self._start_replica(replica, current)

    async def _poll_all(self) -> None:
        for inst in list(self.instances.values()):
            if inst.handle is None or inst.state == ReplicaPhase.DRAINING:
                continue
            exited = await self.actuator.poll(inst.handle)
            if exited is not None:
                self._replica_failed(inst, exited)
            elif inst.state == ReplicaPhase.STARTING and (inst.task is None or inst.task.done()):
                inst.task = asyncio.create_task(self._health_wait(inst, inst.handle))  # e.g. re-adopted
        for b in list(self.builds.values()):
            if b.handle is None or b.state != BuildPhase.RUNNING:
                continue
            self._read_progress(b)
            exited = await self.actuator.poll(b.handle)
            if exited is not None:
                self._build_finished(b, exited)
            elif (time.monotonic() - b.started_mono > self._build_timeout_s(b.build.template)
                  and (b.task is None or b.task.done())):
                log.warning("build %s timed out: stopping it", b.build.build_id)
                b.state, b.since_s = BuildPhase.FAILED, time.time()
                b.error = f"build timed out after {self._build_timeout_s(b.build.template):.0f}s"
                b.task = asyncio.create_task(self._stop_build(b, failed=True))
                self._mark()

    async def reconcile_loop(self) -> None:
        while True:
            try:
                await self.reconcile_once()
                if self.host_errors.pop("reconcile", None) is not None:
                    self._mark()
            except (OSError, StartError, KeyError, ValueError) as exc:  # keep going; the next pass retries
                log.error("reconcile failed: %s", exc)
                if self.host_errors.get("reconcile") != f"reconcile failed: {exc}":
                    self.host_errors["reconcile"] = f"reconcile failed: {exc}"
                    self._mark()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.reconcile_interval_s)

    # ---- MQTT ----
    async def mqtt_loop(self) -> None:
        """The MQTT session (controller.mqtt.session_loop reconnects): last will = offline, the
        desired-state subscription, statuses published on change. Engines keep running without it."""
        import aiomqtt

        offline = json.dumps({"host": self.config.host, "online": False}).encode()
        will = aiomqtt.Will(status_topic(self.config.host), offline, qos=1, retain=True)
        await session_loop(self.config.mqtt, self._session, identifier=f"fleetplan-agent-{self.config.host}",
                           will=will, on_down=self._down)

    async def _session(self, client: Any) -> None:
        await client.subscribe(desired_topic(self.config.host), qos=1)
        self._client, self.connected = client, True
        async with asyncio.TaskGroup() as group:
            group.create_task(self._receive(client))
            group.create_task(self._publish_loop(client))

    def _down(self, error: str) -> None:
        self._client, self.connected = None, False

    async def _receive(self, client: Any) -> None:
        async for message in client.messages:
            payload = message.payload if isinstance(message.payload, bytes | bytearray) else (
                str(message.payload).encode() if message.payload is not None else b"")
            try:
                ack = self.handle_desired(bytes(payload))
            except Exception as exc:  # a bug must not end the loop (nor crash-loop on a retained message)
                log.exception("handling a desired-state message failed")
                ack = Ack(version=payload_version(bytes(payload)), accepted=False, host=self.config.host,
                          errors=(f"desired state for {self.config.host}: not handled: {type(exc).__name__}: {exc}",),
                          received_s=time.time())
            if ack is not None:
                await client.publish(ack_topic(self.config.host), to_payload(ack), qos=1)

    async def _publish_loop(self, client: Any) -> None:
        while True:
            self._changed.clear()
            try:
                payload = to_payload(self.status())
            except Exception:  # a bug in building the status must not end the MQTT loop: retry later
                log.exception("building the status failed; not published")
            else:
                await client.publish(status_topic(self.config.host), payload, qos=1, retain=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.config.status_interval_s)
            await asyncio.sleep(0.05)  # coalesce bursts of changes

    async def publish_final_status(self) -> None:
        """On a clean stop: retained status with online=false but the replicas (they keep running)."""
        client = self._client
        if client is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                client.publish(status_topic(self.config.host), to_payload(self.status(online=False)),
                               qos=1, retain=True),
                timeout=2.0,
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Restore, then reconcile and talk MQTT until `stop` is set. Engines are NOT stopped."""
        await self.restore()
        tasks = [asyncio.create_task(self.reconcile_loop(), name="reconcile"),
                 asyncio.create_task(self.mqtt_loop(), name="mqtt")]
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper:
                    task.result()  # a crashed loop: raise it
            await self.publish_final_status()
        finally:
            for task in [*tasks, stopper]:
                task.cancel()
            for inst in self.instances.values():
                if inst.task is not None:
                    inst.task.cancel()
            for b in self.builds.values():
                if b.task is not None:
                    b.task.cancel()
            if self._scan is not None:
                self._scan.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
        log.info("agent stopped; %d engine instances left running", len(self.instances))
