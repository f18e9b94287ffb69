"""The fault suite's faults: each `_fault_NAME` injects one fault into the running lab and returns
its `Injection` (when it happened, what it excuses); `FaultSuite.run_one` measures the rest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import time

from fleetplan.harness.fault_core import FaultSuiteCore, Injection
from fleetplan.harness.procs import port_is_free
from fleetplan.harness.rig_tools import ready_replicas


class ProcessFaults(FaultSuiteCore):
    """Processes killed or lost: the controller, an agent, an engine, Mosquitto, Prometheus, a host;
    and bad messages on the wire."""

    async def _restart_controller(self) -> None:
        await asyncio.to_thread(self.ctrl.start)

    async def _kill_controller(self) -> float:
        t = time.monotonic()
        await asyncio.to_thread(self.ctrl.kill9)
        return t

    async def _fault_controller_after_start(self) -> Injection:
        """kill -9, restart, kill -9 again as soon as the report API answers (before the first
        statuses are in), restart."""
        t = await self._kill_controller()
        await self._restart_controller()
        await self._kill_controller()
        await self._restart_controller()
        return Injection(t)

    async def _fault_controller_mid_scale_up(self) -> Injection:
        """min_replicas = fleet + 1 by SIGHUP; kill -9 once the new replica is in the desired state."""
        n = await asyncio.to_thread(self.fleet_size)
        if n + 1 > self._policy_over.get("max_replicas", 4):
            raise RuntimeError(f"{n} replicas already: max_replicas leaves no room for a scale-up")
        await self._set_policy(min_replicas=n + 1)
        grown = await self.wait_for(lambda: len(self.fleet_ids() or ()) > n, 30, poll_s=0.1)
        notes = [] if grown else ["no start seen within 30 s: killed anyway"]
        t = await self._kill_controller()
        await self._restart_controller()
        self.target = n + 1
        return Injection(t, notes=notes, floor=n)

    async def _fault_controller_mid_drain(self) -> Injection:
        """min_replicas back to 1 (the load needs fewer): kill -9 while the surplus replica drains."""
        def draining() -> set[str]:
            rep = self._report()
            return {r["replica_id"] for r in rep["fleet"] if r["phase"] == "draining"} if rep else set()

        n = await asyncio.to_thread(self.fleet_size)
        mark = await asyncio.to_thread(self._action_mark)
        await self._set_policy(min_replicas=1)
        ids = await self.wait_for(draining, 45, poll_s=0.1)
        t = await self._kill_controller()
        # what the controller had decided to remove before it died (a drain it had begun, or planned)
        intended = {r[0] for r in await asyncio.to_thread(self._removals_since, mark, True)} | set(ids)
        notes = ([f"killed while {sorted(ids)} drained; removals decided before: {sorted(intended)}"] if ids
                 else ["no drain seen within 45 s: killed anyway"])
        await self._restart_controller()
        self.target = max(1, n - len(intended))
        return Injection(t, excused=intended, notes=notes, floor=self.target)

    async def _fault_controller_random(self) -> Injection:
        delay = self.rng.uniform(0.0, 3.0)  # a 30 s cycle is 1.5 s wall: any point of two cycles
        await asyncio.sleep(delay)
        t = await self._kill_controller()
        await self._restart_controller()
        return Injection(t, notes=[f"killed {delay:.2f} s into the window"])

    _fault_controller_random_1 = _fault_controller_random
    _fault_controller_random_2 = _fault_controller_random

    async def _fault_agent_kill9(self) -> Injection:
        host = await asyncio.to_thread(self._serving_host)
        t = time.monotonic()
        proc = self.rig.agents[host]
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)
        await asyncio.sleep(1.0)  # systemd RestartSec
        self.rig.start_agent(host)
        return Injection(t, notes=[f"agent of {host}"])

    async def _fault_engine_kill9(self) -> Injection:
        rep = await asyncio.to_thread(self.ctrl.report)
        rid = ready_replicas(rep)[0]["replica_id"]
        pid = next(p for p, r in await asyncio.to_thread(self.rig.engine_processes) if r == rid)
        t = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return Injection(t, excused={rid}, kills_serving=True, notes=[f"engine of {rid}"], engines_kept=False)

    async def _fault_mosquitto_kill9(self) -> Injection:
        m = self.rig.lab.mosquitto
        t = time.monotonic()

        def kill_restart() -> None:
            m.proc.stop(sig=signal.SIGKILL)
            m.proc = None
            deadline = time.monotonic() + 10
            while not port_is_free(m.port) and time.monotonic() < deadline:
                time.sleep(0.05)
            m.start()

        await asyncio.to_thread(kill_restart)
        return Injection(t)

    async def _fault_prometheus_empty(self) -> Injection:
        p = self.rig.lab.prometheus
        t = time.monotonic()

        def kill_wipe_restart() -> None:
            p.proc.stop(sig=signal.SIGKILL)
            p.proc = None
            shutil.rmtree(p.tsdb_dir, ignore_errors=True)
            p.start()

        await asyncio.to_thread(kill_wipe_restart)
        return Injection(t, notes=["restarted with an empty TSDB"])

    async def _fault_bad_messages(self) -> Injection:
        """A burst of bad statuses and acks on one host's topics, with that host's credentials. The
        broker ties the client id to the user, so the burst takes the agent's session over: the agent
        is paused (SIGSTOP) meanwhile and reconnects when it resumes."""
        import aiomqtt

        from fleetplan.controller.protocol import ack_topic, status_topic

        if self.bad_payloads is None:
            raise ValueError("bad_messages needs a payload generator")
        host, status = await self._serving_status()
        lab = self.rig.lab
        burst = self.bad_payloads(status)
        agent = self.rig.agents[host]
        h = lab.host(host)
        topics = {"status": status_topic(host), "ack": ack_topic(host)}
        t = time.monotonic()
        agent.send_signal(signal.SIGSTOP)
        try:
            async with aiomqtt.Client(lab.mqtt_host, lab.mqtt_port, username=h.mqtt_user, password=h.mqtt_password,
                                      protocol=aiomqtt.ProtocolVersion.V5) as client:
                for kind, payload in burst:
                    await client.publish(topics[kind], payload, qos=1, retain=(kind == "status"))
        finally:
            agent.send_signal(signal.SIGCONT)
        size = sum(len(p) for _, p in burst)
        notes = [f"{len(burst)} messages ({size / 1e6:.1f} MB) on {host}'s topics in {time.monotonic() - t:.1f} s"]
        await asyncio.sleep(2.0)
        if agent.poll() is not None:
            notes.append(f"agent of {host} exited {agent.returncode}; restarted")
            self.rig.start_agent(host)
        return Injection(t, notes=notes)

    async def _fault_host_lost(self) -> Injection:
        """A host dies for good: its agent and engines are kill -9'ed and stay down."""
        rep = await asyncio.to_thread(self.ctrl.report)
        host = await asyncio.to_thread(self._serving_host)
        on_host = {r["replica_id"] for r in rep["fleet"] if r["host"] == host}
        engines = [(p, r) for p, r in await asyncio.to_thread(self.rig.engine_processes) if r in on_host]
        t = time.monotonic()
        self.rig.agents[host].kill()
        for pid, _ in engines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # an engine leads its process group
        self.lost_hosts.add(host)
        await asyncio.to_thread(self.rig.agents[host].wait, 10)
        return Injection(t, excused=on_host, kills_serving=True, engines_kept=False,
                         notes=[f"{host} lost with {len(engines)} engines ({', '.join(sorted(on_host))})"])


class MachineFaults(FaultSuiteCore):
    """The machine around the controller: a full state disk, the router killed, a status that lies."""

    def _alive(self) -> None:
        if self.ctrl.proc is None or self.ctrl.proc.poll() is not None:
            code = None if self.ctrl.proc is None else self.ctrl.proc.returncode
            raise RuntimeError(f"the controller exited ({code}):\n{self.ctrl.log_tail(15)}")

    async def _hold(self, until: float, what: str) -> None:
        """Until `until`, the controller's process must live and its report API answer."""
        while time.monotonic() < until:
            self._alive()
            if await asyncio.to_thread(self._report) is None:
                raise RuntimeError(f"the controller's report API did not answer while {what}")
            await asyncio.sleep(0.5)

    async def _fault_store_disk_full(self) -> Injection:
        """The state database's filesystem (a tmpfs) filled to the last byte, like `dd if=/dev/zero`,
        for `hold_s`; then the file removed. The process must live, its report API answer with the
        alert naming the store, and cycles resume; the database must pass PRAGMA integrity_check."""
        if self.state_mount is None:
            raise RuntimeError("store_disk_full needs the state database on its own filesystem "
                               "(bench/faults.py mounts a tmpfs when it can)")
        ballast = self.state_mount / "ballast"
        t0 = time.monotonic()

        def fill() -> None:
            with open(ballast, "wb") as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()

        await asyncio.to_thread(fill)
        # SQLite goes on writing into the space its WAL file already holds (frames are rewritten from
        # the start after a checkpoint): the first refused write comes when the WAL or the database
        # must grow, a few cycles later on a large store. The disk stays full until then, and `hold_s` after.
        t_alert = time.monotonic()
        while time.monotonic() < t0 + 90:
            self._alive()
            if any("cannot be written" in a for a in await asyncio.to_thread(self._alerts)):
                break
            await asyncio.sleep(0.25)
        alerted = time.monotonic() < t0 + 90
        t_alert = time.monotonic()
        notes = [f"first refused write {t_alert - t0:.1f} s after the disk filled" if alerted
                 else "NO store alert within 90 s of a full disk"]
        await self._hold(t_alert + self.hold_s, "the disk was full")
        notes.append(f"{self.state_mount} full for {time.monotonic() - t0:.0f} s, process alive")
        ballast.unlink()
        t = time.monotonic()  # recovery counts from the space returning
        if not alerted:
            raise RuntimeError("; ".join(notes))
        cycle = await asyncio.to_thread(self.cycle_id)
        await self.wait_for(lambda: self.cycle_id() > cycle, 15)
        with contextlib.closing(sqlite3.connect(f"file:{self.ctrl.state_db}?mode=ro", uri=True, timeout=10)) as db:
            notes.append(f"integrity_check {db.execute('PRAGMA integrity_check').fetchone()[0]}")
        return Injection(t, notes=notes)

    async def _fault_router_kill_restart(self) -> Injection:
        """kill -9 nginx (master and worker: nothing answers) for `router_hold_s`, then start it again as
        a new process (what systemd would do): the controller must alert, and route through the new
        master (nginx's pid file). Requests sent while nginx is down cannot be served (explained)."""
        n = self.rig.lab.nginx
        t = time.monotonic()
        await asyncio.to_thread(n.proc.stop, 10.0, signal.SIGKILL)
        n.proc = None
        alerted = await self.wait_for(lambda: any("router" in a and "down" in a for a in self._alerts()), 15)
        notes = [f"router alert after {time.monotonic() - t:.1f} s" if alerted else "NO router alert within 15 s"]
        await self._hold(t + self.router_hold_s, "nginx was down")

        def restart() -> None:
            deadline = time.monotonic() + 10
            while not port_is_free(n.port) and time.monotonic() < deadline:
                time.sleep(0.05)
            n.start()

        await asyncio.to_thread(restart)
        back = time.monotonic()
        if not alerted:
            raise RuntimeError("; ".join(notes))
        cleared = await self.wait_for(lambda: not any("router" in a and "down" in a for a in self._alerts()), 15)
        notes.append(f"alert cleared {time.monotonic() - back:.1f} s after the restart" if cleared
                     else "router alert NOT cleared within 15 s")
        return Injection(t, kills_serving=True, outage=(t, back + 0.5), notes=notes)

    async def _fault_lying_status(self) -> Injection:
        """A status with `gpu_count: 24` (NVLink group 0-23) for an 8-GPU host, with that host's
        credentials, retained, while its agent is paused (SIGSTOP) for `hold_s`: the controller must
        alert and never place a replica on GPU 8 or above; the agent's next status tells the truth."""
        import aiomqtt

        from fleetplan.controller.protocol import status_topic

        host, status = await self._serving_status()
        lab = self.rig.lab
        lie = {**status, "gpu_count": 24, "nvlink_groups": [list(range(24))], "updated_s": time.time()}
        agent = self.rig.agents[host]
        h = lab.host(host)
        t = time.monotonic()
        agent.send_signal(signal.SIGSTOP)
        beyond: set[str] = set()
        try:
            async with aiomqtt.Client(lab.mqtt_host, lab.mqtt_port, username=h.mqtt_user, password=h.mqtt_password,
                                      protocol=aiomqtt.ProtocolVersion.V5) as client:
                await client.publish(status_topic(host), json.dumps(lie).encode(), qos=1, retain=True)
            alerted = await self.wait_for(lambda: any(f"host {host} reports 24" in a for a in self._alerts()), 10)
            while time.monotonic() < t + self.hold_s:
                rep = await asyncio.to_thread(self._report)
                beyond |= {r["replica_id"] for r in (rep or {}).get("fleet", []) if max(r["gpu_indices"] or [0]) >= 8}
                await asyncio.sleep(0.5)
        finally:
            agent.send_signal(signal.SIGCONT)
        notes = [f"{host} claimed 24 GPUs for {self.hold_s:g} s",
                 "inventory alert raised" if alerted else "NO inventory alert within 10 s"]
        if beyond:
            notes.append(f"replicas placed on GPUs >= 8: {sorted(beyond)}")
        await asyncio.sleep(2.0)
        if agent.poll() is not None:
            notes.append(f"agent of {host} exited {agent.returncode}; restarted")
            self.rig.start_agent(host)
        if not alerted or beyond:
            raise RuntimeError("; ".join(notes))
        return Injection(t, notes=notes)
