"""The per-host agent: desired state from MQTT -> engine instances on this host's GPUs.

Level-triggered: the agent keeps the last accepted :class:`~fleetplan.controller.protocol.DesiredState`
(persisted in its state directory) and every second makes the host match it — starts missing
replicas from its OWN launch templates (pinned with CUDA_VISIBLE_DEVICES to the given GPU indices
and a port), health-waits before reporting them ready, stops replicas that left the desired state
(SIGTERM, wait, SIGKILL), restarts failed ones with a capped backoff and runs engine builds.

This module holds the `Agent`: the desired state it applies, its status and the builds it runs; the
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
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fleetplan.controller.actuators import (
    Actuator,
    Exited,
    Handle,
    LaunchSpec,
    StartError,
)
from fleetplan.controller.agent_config import (
    ENGINE_MANIFEST,
    AgentConfig,
    engine_slug,
    holds_engine,
    make_actuator,
    substitute,
)
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
from fleetplan.shared.atomic import atomic_write_text

log = logging.getLogger(__name__)

SCAN_WAIT_S = 2.0  # a reconcile pass waits at most this long for the engine cache directory's read


@dataclass(frozen=True)
class CacheScan:
    """What one read of the engine cache directory found (read_engine_manifests)."""

    found: tuple[tuple[str, CachedEngine], ...] = ()  # (directory name, the engine with its path)
    # (directory name, its manifest's mtime in ns) of manifests this host cannot use: not read again
    # until the manifest changes
    foreign: tuple[tuple[str, int], ...] = ()
    warnings: tuple[str, ...] = ()


def read_engine_manifests(cache_dir: Path, skip: frozenset[str], gpu: Any,
                          foreign: Mapping[str, int] | None = None) -> CacheScan:
    """The engine directories of `cache_dir` (those not in `skip`) whose manifest describes an engine
    for GPU type `gpu`. Blocking file I/O: the agent runs it in a thread. A directory without a
    manifest is not an engine yet (a build still writing); one built for another GPU type, one whose
    manifest describes another engine than its name says, or one whose manifest does not parse is
    `foreign`, with its manifest's mtime: `foreign` (name -> mtime) of an earlier scan are not read
    (nor warned of) again until their manifest changes, e.g. when an operator mends it."""
    known = foreign or {}
    try:
        dirs = [d for d in cache_dir.iterdir() if d.name not in skip]
    except FileNotFoundError:
        return CacheScan()
    except OSError as exc:
        return CacheScan(warnings=(f"cannot read {cache_dir}: {exc.strerror or exc}",))
    found: list[tuple[str, CachedEngine]] = []
    unusable: list[tuple[str, int]] = []
    warnings: list[str] = []
    for d in dirs:
        manifest = d / ENGINE_MANIFEST
        try:
            stamp = manifest.stat().st_mtime_ns
            if known.get(d.name) == stamp:
                continue  # unusable when read, and not changed since
            engine = CachedEngine.model_validate_json(manifest.read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            continue  # not an engine, or one still being built
        except (OSError, ValueError) as exc:
            warnings.append(f"ignoring {manifest}: {exc}")
            if not isinstance(exc, OSError):
                unusable.append((d.name, stamp))
            continue
        if engine_slug(engine.model, engine.gpu, engine.tp, engine.precision) != d.name:
            warnings.append(f"ignoring {manifest}: it describes another engine than its directory's")
            unusable.append((d.name, stamp))
        elif engine.gpu != gpu:
            unusable.append((d.name, stamp))  # built for another GPU type: not usable here
        else:
            found.append((d.name, engine.model_copy(update={"path": str(d)})))
    return CacheScan(tuple(found), tuple(unusable), tuple(warnings))

_PROGRESS_RE = re.compile(r"FLEETPLAN_PROGRESS[ =:]+([0-9]*\.?[0-9]+)")


def _agent_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetplan")
    except PackageNotFoundError:
        return "0+unknown"


# ------------------------------------------------------------------------------------------


@dataclass
class _Instance:
    replica: DesiredReplica
    state: ReplicaPhase
    since_s: float
    handle: Handle | None = None
    error: str | None = None
    restarts: int = 0
    retry_at: float = 0.0  # monotonic; when a FAILED replica may be started again
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


class Agent:
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

    # ---- paths and persistence ----
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

    def _save_desired(self, desired: DesiredState) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config.state_dir / "desired.json", desired.model_dump_json(indent=1))

    def _save_engines(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        data = [e.model_dump(mode="json") for e in self.engines.values()]
        atomic_write_text(self.config.state_dir / "engines.json", json.dumps(data, indent=1))

    def _mark(self) -> None:
        self._changed.set()

    async def _scan_engine_cache(self) -> None:
        """Engines another host built into a cache directory shared with this one (NFS and the like):
        every finished build leaves a manifest (ENGINE_MANIFEST) in its engine directory, and an
        engine for this host's GPU type found with one is held and reported from then on. Without
        this a shared cache is never used: the planner places an engine's replicas only on the
        hosts that report it, so this host would never be asked for one and never look.

        The directory is read in a thread, waited for at most SCAN_WAIT_S: a network filesystem that
        hangs delays neither the event loop (MQTT, statuses) nor this reconcile pass; a scan still
        running is not started again, and its result is taken when it returns."""
        if self._scan is None:
            self._scan = asyncio.create_task(asyncio.to_thread(
                read_engine_manifests, self.config.cache_dir, frozenset(self.engines), self.config.gpu,
                dict(self._foreign_engines)), name="engine-cache-scan")
        done, _ = await asyncio.wait({self._scan}, timeout=SCAN_WAIT_S)
        if not done:
            if not self._scan_slow:
                log.warning("reading the engine cache directory %s takes over %.0f s; reconciling without it",
                            self.config.cache_dir, SCAN_WAIT_S)
                self._scan_slow = True
            return
        task, self._scan, self._scan_slow = self._scan, None, False
        scan = task.result()
        for message in scan.warnings:
            log.warning("%s", message)
        self._foreign_engines.update(scan.foreign)
        found = False
        for name, engine in scan.found:
            if name not in self.engines:
                self.engines[name] = engine
                log.info("engine found in the shared cache directory: %s", engine.path)
                found = True
        if found:
            try:
                self._save_engines()
            except OSError as exc:
                log.warning("cannot save engines.json in %s: %s", self.config.state_dir, exc.strerror or exc)
            self._mark()

    def _find_stored_engines(self, desired: DesiredState) -> None:
        """Engines the desired replicas need that sit in the engine cache directory without this
        agent having built them: prebuilt ones an operator stored there (the policy's
        `cached_builds`), or a cache directory shared between hosts. A directory with anything in it
        counts as the engine, as a build's does (`_build_finished`); from then on it is reported."""
        found = False
        for r in desired.replicas:
            template = self.config.launch_templates.get(r.template)
            slug = engine_slug(r.model, r.gpu, r.tp, r.precision)
            if template is None or not template.needs_engine_dir or slug in self.engines:
                continue
            engine_dir = self.config.cache_dir / slug
            try:
                stored = holds_engine(engine_dir)
            except OSError as exc:
                log.warning("cannot read %s: %s", engine_dir, exc.strerror or exc)
                continue
            if stored:
                self.engines[slug] = CachedEngine(model=r.model, engine=r.engine, gpu=r.gpu, tp=r.tp,
                                                  precision=r.precision, path=str(engine_dir))
                log.info("engine found in the cache directory: %s", engine_dir)
                found = True
        if found:
            try:
                self._save_engines()
            except OSError as exc:  # still held: the directory is the engine, the list only a record
                log.warning("cannot save engines.json in %s: %s", self.config.state_dir, exc.strerror or exc)
            self._mark()

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
            engines_cached=frozenset((e.model, e.engine, e.gpu, e.tp, e.precision) for e in self.engines.values()),
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

    def launch_spec(self, replica: DesiredReplica) -> LaunchSpec:
        template = self.config.launch_templates[replica.template]
        values = self._values(replica)
        env = {k: substitute(v, values) for k, v in template.env.items()}
        env.update(CUDA_VISIBLE_DEVICES=values["gpu_indices"], FLEETPLAN_REPLICA_ID=replica.replica_id)
        return LaunchSpec(replica.replica_id, tuple(substitute(a, values) for a in template.argv), env,
                          template.cwd)

    def build_spec(self, build: DesiredBuild) -> LaunchSpec:
        template = self.config.build_templates[build.template]
        values = self._values(build)
        env = {k: substitute(v, values) for k, v in template.env.items()}
        env.update(CUDA_VISIBLE_DEVICES=values["gpu_indices"], FLEETPLAN_BUILD_ID=build.build_id)
        return LaunchSpec(build.build_id, tuple(substitute(a, values) for a in template.argv), env, template.cwd)

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

    def _build_timeout_s(self, template: str) -> float:
        known = self.config.build_templates.get(template)
        return known.timeout_s if known is not None else 4 * 3600.0

    def _replica_failed(self, inst: _Instance, exited: Exited) -> None:
        tail = self.actuator.log_tail(inst.replica.replica_id, 400).strip().splitlines()
        last = f"; last log line: {tail[-1][:200]}" if tail else ""
        first, cap = self.config.restart_backoff_s
        delay = min(cap, first * 2 ** min(inst.restarts, 20))
        log.warning("replica %s %s%s; restart in %.0fs", inst.replica.replica_id, exited.detail, last, delay)
        if inst.task is not None and not inst.task.done() and inst.task is not asyncio.current_task():
            inst.task.cancel()
        inst.state = ReplicaPhase.FAILED
        inst.since_s = time.time()
        inst.error = f"{exited.detail}{last}"
        inst.handle = None
        inst.retry_at = time.monotonic() + delay
        inst.restarts += 1
        self._drop_record(inst.replica.replica_id)
        self._mark()

    async def _start_replica(self, replica: DesiredReplica, previous: _Instance | None) -> None:
        spec = self.launch_spec(replica)
        inst = previous or _Instance(replica, ReplicaPhase.STARTING, time.time())
        self.instances[replica.replica_id] = inst
        try:
            handle = await self.actuator.start(spec)
        except StartError as exc:
            self._replica_failed(inst, Exited(None, str(exc)))
            return
        self._save_record("replica", replica, handle)
        inst.handle, inst.state, inst.since_s, inst.error = handle, ReplicaPhase.STARTING, time.time(), None
        log.info("started replica %s (%s, pid %s, port %s, GPUs %s)", replica.replica_id, replica.template,
                 handle.pid, replica.port, spec.env.get("CUDA_VISIBLE_DEVICES"))
        inst.task = asyncio.create_task(self._health_wait(inst, handle))
        self._mark()

    def _health_url(self, replica: DesiredReplica) -> str:
        template = self.config.launch_templates.get(replica.template)
        path = template.health_path if template else "/health"
        return f"http://{self.config.health_host}:{replica.port}{path}"

    async def _adopted_ready(self, replica: DesiredReplica, *, was_ready: bool, attempts: int = 3) -> bool:
        """Whether a re-adopted engine (the same process: pid, start time and command line checked)
        serves: its health endpoint answers 200. One that was ready before the restart and does not
        answer in time (a busy host: the fault suite's agent kill -9 on 2 loaded cores) stays ready,
        as a running replica does between health probes; only an answer other than 200 (starting,
        draining) makes it "starting" again. Why: a "starting" status unroutes the replica, and
        with every replica of a model on this host, requests would get 503 until the next probe."""
        import httpx

        async with httpx.AsyncClient(timeout=2.0) as client:
            for attempt in range(attempts):
                try:
                    return (await client.get(self._health_url(replica))).status_code == 200
                except httpx.HTTPError as exc:
                    log.info("re-adopted replica %s: health probe %d/%d failed (%s)", replica.replica_id,
                             attempt + 1, attempts, exc)
                    if attempt + 1 < attempts:
                        await asyncio.sleep(0.5)
        return was_ready

    async def _health_wait(self, inst: _Instance, handle: Handle) -> None:
        import httpx

        template = self.config.launch_templates.get(inst.replica.template)
        timeout_s = template.startup_timeout_s if template else 900.0
        url = self._health_url(inst.replica)
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while inst.handle is handle and inst.state == ReplicaPhase.STARTING:
                try:
                    response = await client.get(url)
                    if response.status_code == 200:
                        inst.state, inst.since_s = ReplicaPhase.READY, time.time()
                        log.info("replica %s ready (%s)", inst.replica.replica_id, url)
                        with contextlib.suppress(OSError):
                            self._save_record("replica", inst.replica, handle, ready_s=inst.since_s)
                        self._mark()
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    log.warning("replica %s not healthy after %.0fs: stopping it", inst.replica.replica_id,
                                timeout_s)
                    await self.actuator.stop(handle, template.stop_timeout_s if template else 30.0)
                    self._replica_failed(inst, Exited(None, f"not healthy at {url} after {timeout_s:.0f}s"))
                    return
                await asyncio.sleep(0.25)

    def _begin_stop(self, inst: _Instance) -> None:
        if inst.task is not None and not inst.task.done():
            inst.task.cancel()
        if inst.handle is None:
            del self.instances[inst.replica.replica_id]
            self._mark()
            return
        inst.state, inst.since_s = ReplicaPhase.DRAINING, time.time()
        inst.task = asyncio.create_task(self._stop_replica(inst))
        self._mark()

    async def _stop_replica(self, inst: _Instance) -> None:
        assert inst.handle is not None
        template = self.config.launch_templates.get(inst.replica.template)
        exited = await self.actuator.stop(inst.handle, template.stop_timeout_s if template else 30.0)
        log.info("stopped replica %s: %s", inst.replica.replica_id, exited.detail)
        self._drop_record(inst.replica.replica_id)
        if self.instances.get(inst.replica.replica_id) is inst:
            del self.instances[inst.replica.replica_id]
        self._wake.set()
        self._mark()

    # ---- builds ----
    async def _start_build(self, build: DesiredBuild) -> None:
        b = _Build(build, BuildPhase.RUNNING, time.time())
        self.builds[build.build_id] = b
        with contextlib.suppress(OSError):  # under systemd the build's own user owns the cache
            self._progress_path(build.build_id).parent.mkdir(parents=True, exist_ok=True)
            self._progress_path(build.build_id).unlink(missing_ok=True)  # not a previous run's
        try:
            b.handle = await self.actuator.start(self.build_spec(build))
        except StartError as exc:
            b.state, b.error = BuildPhase.FAILED, str(exc)
            self._mark()
            return
        self._save_record("build", build, b.handle)
        log.info("started build %s (%s, pid %s)", build.build_id, build.template, b.handle.pid)
        self._mark()

    def _read_progress(self, b: _Build) -> None:
        value: float | None = None
        progress_file = self._progress_path(b.build.build_id)
        with contextlib.suppress(OSError, ValueError):
            value = float(progress_file.read_text().strip())
        if value is None and getattr(self.actuator, "logs_are_cheap", False):
            found = _PROGRESS_RE.findall(self.actuator.log_tail(b.build.build_id, 4000))
            if found:
                with contextlib.suppress(ValueError):
                    value = float(found[-1])
        if value is not None and abs(value - b.progress) > 1e-9:
            b.progress = min(1.0, max(0.0, value))
            self._mark()

    def _build_finished(self, b: _Build, exited: Exited) -> None:
        d = b.build
        engine_dir = self.config.cache_dir / engine_slug(d.model, d.gpu, d.tp, d.precision)
        ok = exited.code == 0 or (exited.code is None and holds_engine(engine_dir))
        b.handle = None
        b.since_s = time.time()
        self._drop_record(d.build_id)
        if ok:
            b.state, b.progress = BuildPhase.DONE, 1.0
            engine = CachedEngine(model=d.model, engine=d.engine, gpu=d.gpu, tp=d.tp, precision=d.precision,
                                  path=str(engine_dir), built_s=time.time())
            self.engines[engine_slug(d.model, d.gpu, d.tp, d.precision)] = engine
            try:  # written last: hosts sharing the cache directory take the engine as finished from here
                atomic_write_text(engine_dir / ENGINE_MANIFEST, engine.model_dump_json(exclude={"path"}, indent=1))
            except OSError as exc:  # held here still; only other hosts will not find it
                log.warning("cannot write %s in %s: %s", ENGINE_MANIFEST, engine_dir, exc.strerror or exc)
            self._save_engines()
            log.info("build %s done: %s", d.build_id, engine_dir)
        else:
            b.state, b.error = BuildPhase.FAILED, exited.detail
            log.warning("build %s failed: %s", d.build_id, exited.detail)
        self._mark()

    async def _stop_build(self, b: _Build, *, failed: bool = False) -> None:
        if b.handle is not None:
            await self.actuator.stop(b.handle, 30.0)
            self._drop_record(b.build.build_id)
            b.handle = None
        if not failed and self.builds.get(b.build.build_id) is b:
            del self.builds[b.build.build_id]
        self._wake.set()
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
