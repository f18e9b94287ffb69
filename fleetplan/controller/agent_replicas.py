"""The agent's replica supervisor: engines started from its own launch templates, health-waited
before they are reported ready, restarted with a capped jittered backoff when they fail, stopped
(SIGTERM, wait, SIGKILL) when they leave the desired state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fleetplan.controller.actuators import Exited, Handle, LaunchSpec, StartError
from fleetplan.controller.agent_base import AgentBase, _Instance
from fleetplan.controller.agent_config import substitute
from fleetplan.controller.mqtt import Backoff
from fleetplan.controller.protocol import DesiredReplica, ReplicaPhase

log = logging.getLogger(__name__)


class ReplicaSupervisor(AgentBase):
    """Starts, health-waits, restarts and stops the desired replicas (a mixin of `Agent`)."""

    def launch_spec(self, replica: DesiredReplica) -> LaunchSpec:
        template = self.config.launch_templates[replica.template]
        values = self._values(replica)
        env = {k: substitute(v, values) for k, v in template.env.items()}
        env.update(CUDA_VISIBLE_DEVICES=values["gpu_indices"], FLEETPLAN_REPLICA_ID=replica.replica_id)
        return LaunchSpec(replica.replica_id, tuple(substitute(a, values) for a in template.argv), env,
                          template.cwd)

    def _replica_failed(self, inst: _Instance, exited: Exited) -> None:
        tail = self.actuator.log_tail(inst.replica.replica_id, 400).strip().splitlines()
        last = f"; last log line: {tail[-1][:200]}" if tail else ""
        if inst.backoff is None:
            first, cap = self.config.restart_backoff_s
            inst.backoff = Backoff(first, cap)
        delay = inst.backoff.next_delay_s()  # capped, jittered: replicas failing together do not restart together
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
