"""The agent's engine cache: engines stored in its cache directory (prebuilt by an operator, or built
by another host sharing the directory), found and held so that the host reports them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetplan.controller.agent_base import AgentBase
from fleetplan.controller.agent_config import ENGINE_MANIFEST, engine_slug, holds_engine
from fleetplan.controller.protocol import CachedEngine, DesiredState

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


class EngineCache(AgentBase):
    """Finds the engines of the cache directory this host can use (a mixin of `Agent`)."""

    _foreign_engines: dict[str, int]
    _scan: asyncio.Task[CacheScan] | None
    _scan_slow: bool

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
