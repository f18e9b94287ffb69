"""The agent's engine builds: started from its own build templates, their progress read, a finished
build's engine held (and its manifest written for hosts sharing the cache directory)."""

from __future__ import annotations

import contextlib
import logging
import re
import time

from fleetplan.controller.actuators import Exited, LaunchSpec, StartError
from fleetplan.controller.agent_base import AgentBase, _Build
from fleetplan.controller.agent_config import ENGINE_MANIFEST, engine_slug, holds_engine, substitute
from fleetplan.controller.protocol import BuildPhase, CachedEngine, DesiredBuild
from fleetplan.shared.atomic import atomic_write_text

log = logging.getLogger(__name__)

_PROGRESS_RE = re.compile(r"FLEETPLAN_PROGRESS[ =:]+([0-9]*\.?[0-9]+)")


class Builds(AgentBase):
    """Runs the desired state's engine builds (a mixin of `Agent`)."""

    def build_spec(self, build: DesiredBuild) -> LaunchSpec:
        template = self.config.build_templates[build.template]
        values = self._values(build)
        env = {k: substitute(v, values) for k, v in template.env.items()}
        env.update(CUDA_VISIBLE_DEVICES=values["gpu_indices"], FLEETPLAN_BUILD_ID=build.build_id)
        return LaunchSpec(build.build_id, tuple(substitute(a, values) for a in template.argv), env, template.cwd)

    def _build_timeout_s(self, template: str) -> float:
        known = self.config.build_templates.get(template)
        return known.timeout_s if known is not None else 4 * 3600.0

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
