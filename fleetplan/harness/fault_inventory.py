"""The fault suite's inventory faults: an agent for a host the policy does not list, a listed host
whose GPU count changes, and a plan nobody can carry out (the policy's hosts have no agent while the
lab's agents are online under names it does not know). Each `_fault_NAME` injects the fault,
measures its own goals while it lasts (Injection.missed: each goal missed, with its figure) and
undoes it; `FaultSuite.run_one` measures the usual ones (requests, duplicates, orphans,
scale-downs, recovery).

The inventory rule is planner/inventory.py `judge` (applied by controller/hosts.py): a host the
policy does not list is planned on not at all, a changed host only on what its record and its
report share, each with an alert, until `fleetplan hosts confirm HOST` (the real command, run as a
subprocess on the controller's state database). So that "nothing planned on it" is a decision and
not only an idle planner, the faults raise `min_replicas` by 2 while the host is held: the
placement spreads a model's new replicas over hosts running none of its replicas (best fit among
those), so a believed 24-GPU stranger would take the second new replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Any

from fleetplan.harness.demo import REPO
from fleetplan.harness.fault_core import FaultSuiteCore, Injection
from fleetplan.harness.lab import allocate_port_ranges

UNLISTED_HOST = "host-unlisted"  # a name the lab's policy does not list
UNLISTED_GPUS = 24  # three NVLink groups of 8: the policy's H100 hosts have 8
CHANGED_GPUS = 6  # a listed 8-GPU host's agent reports this many after its first report
FOREIGN_HOSTS = (("gpu-01", 8), ("gpu-02", 8))  # a policy for another fleet: no lab agent has these names
PRESSURE = 2  # replicas min_replicas is raised by while a host is held: a placement decision is made


class InventoryFaults(FaultSuiteCore):
    """A host the policy does not list, a listed host's GPU count changed, a plan no agent can carry
    out (issue 36)."""

    # ---------------------------------------------------------------------------------------------
    # what the controller did on a host

    def _on_host(self, host: str, mark: int) -> list[str]:
        """What the controller decided on `host` since action `mark` (any status: published,
        deferred, planned) and what its desired state and fleet put there."""
        with contextlib.closing(sqlite3.connect(f"file:{self.ctrl.state_db}?mode=ro", uri=True, timeout=10)) as db:
            rows = db.execute("SELECT kind, replica_id, status FROM actions WHERE action_id > ? AND host = ?",
                              (mark, host)).fetchall()
        out = [f"{r[0]} {r[1]} ({r[2]})" for r in rows]
        rep = self._report() or {}
        out += [f"fleet {r['replica_id']} GPUs {r['gpu_indices']}" for r in rep.get("fleet", []) if r["host"] == host]
        return out

    def _placed_at_or_above(self, host: str, first_gpu: int) -> set[str]:
        rep = self._report() or {}
        return {r["replica_id"] for r in rep.get("fleet", [])
                if r["host"] == host and max(r["gpu_indices"] or [0]) >= first_gpu}

    def _alert_with(self, *words: str) -> str | None:
        return next((a for a in self._alerts() if all(w in a for w in words)), None)

    def _confirm_host(self, host: str) -> str:
        """`fleetplan hosts confirm HOST` on the controller's store (the operator's command); its output."""
        done = subprocess.run([sys.executable, "-m", "fleetplan", "hosts", "confirm", host, "--state-db",
                               str(self.ctrl.state_db)], capture_output=True, text=True, cwd=str(REPO),
                              timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"fleetplan hosts confirm {host} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout.strip()

    # ---------------------------------------------------------------------------------------------
    # agents with another inventory

    def _add_agent(self, name: str, gpu_count: int, groups: tuple[tuple[int, ...], ...]) -> None:
        """A new agent for host `name`: its broker user (the password file and ACL rewritten, read
        again by Mosquitto on SIGHUP), port range and config, started like the lab's."""
        lab = self.rig.lab
        m = lab.mosquitto
        from fleetplan.harness.servers import MqttUser

        m.agents[name] = MqttUser(f"agent-{name}", f"pw-{name}-{self.rng.randrange(1 << 30):x}")
        m.write_config()
        os.kill(m.proc.pid, signal.SIGHUP)
        time.sleep(1.0)  # Mosquitto reads the files again on its next loop
        used = {p for h in lab.hosts for p in h.ports} | {m.port, lab.prometheus.port, lab.nginx.port}
        template = lab.hosts[0]
        host = dataclasses.replace(template, name=name, gpu_count=gpu_count, nvlink_groups=groups,
                                   mqtt_user=m.agents[name].user, mqtt_password=m.agents[name].password,
                                   port_range=allocate_port_ranges(1, len(template.ports), exclude=used)[0],
                                   workdir=lab.dir / "hosts" / name)
        host.workdir.mkdir(parents=True, exist_ok=True)
        self.rig.write_agent_config(host)
        self.rig.start_agent(name)

    def _restart_agent_as(self, name: str, gpu_count: int) -> None:
        """The agent of lab host `name` stopped (SIGTERM: its engines keep running, by design) and
        started again reporting `gpu_count` GPUs in one NVLink group (a GPU lost, a board swapped)."""
        self.rig.stop_agent(name)
        h = self.rig.lab.host(name)
        self.rig.write_agent_config(dataclasses.replace(h, gpu_count=gpu_count,
                                                        nvlink_groups=(tuple(range(gpu_count)),)))
        self.rig.start_agent(name)

    async def _pressed(self, n: int, host: str, placed_badly: Any, hold_s: float) -> set[str]:
        """`min_replicas` raised to n + PRESSURE for `hold_s` (at least until the new replicas are
        placed): the replicas `placed_badly()` found meanwhile (sampled every 0.5 s)."""
        await self._set_policy(min_replicas=n + PRESSURE)
        bad: set[str] = set()
        t = time.monotonic()
        while time.monotonic() < t + max(hold_s, 30.0):
            bad |= await asyncio.to_thread(placed_badly)
            if time.monotonic() >= t + hold_s and await asyncio.to_thread(self.fleet_size) >= n + PRESSURE:
                break
            await asyncio.sleep(0.5)
        return bad

    async def _unpress(self, n: int) -> None:
        """`min_replicas` back to 1: the replicas the pressure added drain (intended: the load needs n)."""
        await self._set_policy(min_replicas=1)
        self.target = n

    # ---------------------------------------------------------------------------------------------
    # the faults

    async def _fault_unknown_host(self) -> Injection:
        """An agent for UNLISTED_HOST reporting UNLISTED_GPUS H100 (the policy's hosts have 8). Goals:
        the inventory alert naming it within 15 s; nothing planned or published on it while
        min_replicas asks for PRESSURE more replicas; once `fleetplan hosts confirm` ran, the alert
        cleared within 15 s."""
        name = UNLISTED_HOST
        n = await asyncio.to_thread(self.fleet_size)
        mark = await asyncio.to_thread(self._action_mark)
        t = time.monotonic()
        await asyncio.to_thread(self._add_agent, name, UNLISTED_GPUS,
                                tuple(tuple(range(g, g + 8)) for g in range(0, UNLISTED_GPUS, 8)))
        missed: list[str] = []
        alert = await self.wait_for(lambda: self._alert_with(f"host {name} reports {UNLISTED_GPUS}",
                                                            "not in the policy's hosts"), 15)
        notes = [f"agent for {name} ({UNLISTED_GPUS} GPUs) up; "
                 + (f"alert after {time.monotonic() - t:.1f} s: {alert[:140]!r}" if alert else "NO inventory alert")]
        if not alert:
            missed.append(f"no inventory alert for {name} within 15 s")
        bad = await self._pressed(n, name, lambda: set(self._on_host(name, mark)), self.hold_s)
        grown = await asyncio.to_thread(self.fleet_size)
        notes.append(f"min_replicas {n + PRESSURE}: the fleet grew to {grown} on the listed hosts")
        if bad:
            missed.append(f"planned on {name} before it was confirmed: {sorted(bad)}")
        if alert and not self._alert_with(f"host {name} reports"):
            missed.append("the inventory alert did not stay while the host was held")
        await self._confirm(name, notes, missed, said_chars=80)
        await self._unpress(n)
        await asyncio.to_thread(self.rig.stop_agent, name)  # its status goes offline; nothing runs on it
        # recovery counts from the fault undone (the agent gone, min_replicas back)
        return Injection(time.monotonic(), notes=notes, missed=missed, no_failures=True)

    async def _confirm(self, host: str, notes: list[str], missed: list[str], *, said_chars: int) -> None:
        """`fleetplan hosts confirm HOST`, then the goal: its inventory alert cleared within 15 s."""
        said = await asyncio.to_thread(self._confirm_host, host)
        t_conf = time.monotonic()
        cleared = await self.wait_for(lambda: not self._alert_with(f"host {host} reports"), 15)
        notes.append(f"confirmed ({said[:said_chars]!r}); alert " + (
            f"cleared {time.monotonic() - t_conf:.1f} s after" if cleared else "NOT cleared within 15 s"))
        if not cleared:
            missed.append(f"the alert for {host} stayed after `fleetplan hosts confirm`")

    async def _fault_gpu_count_changed(self) -> Injection:
        """The agent of a listed 8-GPU host (one running no replica, else none on GPU CHANGED_GPUS or
        above) restarted reporting CHANGED_GPUS. Goals: the alert "its GPUs
        changed" within 15 s; no replica on a GPU the record and the report do not share while
        min_replicas asks for PRESSURE more; the alert cleared within 15 s of `fleetplan hosts
        confirm`. Then the agent reports its 8 GPUs again (the policy's entry: believed, no alert)."""
        rep = await asyncio.to_thread(self.ctrl.report)
        used: dict[str, int] = {h.name: 0 for h in self.rig.lab.hosts if h.name not in self.lost_hosts}
        for r in rep["fleet"]:
            if r["host"] in used:
                used[r["host"]] = max(used[r["host"]], 1 + max(r["gpu_indices"] or [0]))
        fits = sorted((u, h) for h, u in used.items() if u <= CHANGED_GPUS)
        if not fits:
            raise RuntimeError(f"every host has a replica on GPU {CHANGED_GPUS} or above: {used}")
        host = fits[0][1]
        gpus = self.rig.lab.host(host).gpu_count
        n = len(rep["fleet"])
        t = time.monotonic()
        await asyncio.to_thread(self._restart_agent_as, host, CHANGED_GPUS)
        missed: list[str] = []
        alert = await self.wait_for(lambda: self._alert_with(f"host {host} reports {CHANGED_GPUS}", "changed"), 15)
        notes = [f"agent of {host} ({used[host]} GPUs in use) restarted reporting {CHANGED_GPUS} of {gpus}; "
                 + (f"alert after {time.monotonic() - t:.1f} s: {alert[:150]!r}" if alert else "NO inventory alert")]
        if not alert:
            missed.append(f"no 'GPUs changed' alert for {host} within 15 s")
        bad = await self._pressed(n, host, lambda: self._placed_at_or_above(host, CHANGED_GPUS), self.hold_s)
        rep = await asyncio.to_thread(self.ctrl.report)
        there = sorted(f"{r['replica_id']} GPUs {r['gpu_indices']}" for r in rep["fleet"] if r["host"] == host)
        notes.append(f"min_replicas {n + PRESSURE}: {len(rep['fleet'])} replicas, on {host}: {there or 'none'}")
        if bad:
            missed.append(f"replicas on {host}'s GPUs >= {CHANGED_GPUS} before the change was confirmed: {sorted(bad)}")
        await self._confirm(host, notes, missed, said_chars=60)
        await self._unpress(n)
        await asyncio.to_thread(self._restart_agent_as, host, gpus)  # the board back: the policy's 8
        again = await self.wait_for(lambda: self._alert_with(f"host {host} reports"), 5)
        if again:
            notes.append(f"after the agent reported {gpus} again: {again[:120]!r}")
        return Injection(time.monotonic(), notes=notes, missed=missed, no_failures=True)

    def _deferrals_since(self, mark: int) -> list[tuple[int, str, str, int]]:
        """(cycle id, kind, host, repeats) of the deferred actions after action `mark`."""
        with contextlib.closing(sqlite3.connect(f"file:{self.ctrl.state_db}?mode=ro", uri=True, timeout=10)) as db:
            rows = db.execute("SELECT cycle_id, kind, host, repeats FROM actions WHERE action_id > ? AND "
                              "status = 'deferred' ORDER BY action_id", (mark,)).fetchall()
        return [(int(r[0] or 0), str(r[1]), str(r[2]), int(r[3] or 1)) for r in rows]

    async def _fault_unreachable_plan(self) -> Injection:
        """The policy's hosts replaced by FOREIGN_HOSTS (SIGHUP), names no lab agent has: every agent
        online is for a host the policy does not list. Goals: one `unreachable` alert naming both
        sides within 15 s; each deferred action logged once with a count (one action row per
        deferred action, its `repeats` growing; one log line); no drain or stop (fail static:
        the replicas serving keep serving); then the policy's hosts back and the alert cleared."""
        lab_hosts = self._policy_over.get("hosts")
        cid0 = await asyncio.to_thread(self.cycle_id)
        mark = await asyncio.to_thread(self._action_mark)
        log_from = self._log_size()
        t = time.monotonic()
        await self._set_policy(hosts=list(FOREIGN_HOSTS))
        foreign = [h for h, _ in FOREIGN_HOSTS]
        agents = [h.name for h in self.rig.lab.hosts if h.name not in self.lost_hosts]
        missed: list[str] = []
        alert = await self.wait_for(lambda: self._alert_with("cannot be carried out", *foreign[:1], *agents), 15)
        notes = [f"alert after {time.monotonic() - t:.1f} s: {alert[:200]!r}" if alert else "NO unreachable alert"]
        if not alert:
            missed.append("no alert naming the policy's hosts without agents and the agents of unlisted hosts")
        await asyncio.sleep(max(0.0, t + max(self.hold_s, 8.0) - time.monotonic()))
        alerts = [a for a in await asyncio.to_thread(self._alerts) if "cannot be carried out" in a]
        cycles = await asyncio.to_thread(self.cycle_id) - cid0
        deferred = await asyncio.to_thread(self._deferrals_since, mark)
        lines = [ln for ln in self._log_since(log_from) if " deferred: " in ln]
        notes.append(f"{cycles} cycles: {len(alerts)} such alert(s); {len(deferred)} deferred action row(s) "
                     f"({', '.join(f'{k} on {h} x{n}' for _, k, h, n in deferred[:4])}); {len(lines)} log line(s)")
        if len(alerts) > 1:
            missed.append(f"{len(alerts)} alerts for one unreachable plan (goal: one)")
        if alert and not alerts:
            missed.append("the alert did not stay while the plan could not be carried out")
        # the plan stays the same while the fault lasts: its deferrals are all new in the first cycle
        # that planned on the new policy (or the next); a row of a later cycle is a deferral logged again
        first = min((c for c, _, _, _ in deferred), default=0)
        again = [d for d in deferred if d[0] > first + 1]
        if again or len(lines) > len(deferred):
            missed.append(f"repeated deferrals logged again: {len(again)} row(s) after cycle {first + 1}, "
                          f"{len(lines)} log line(s) for {len(deferred)} row(s)")
        if deferred and cycles > 3 and max(n for _, _, _, n in deferred) < 2:
            missed.append("no deferral counted its repeats")
        removed = await asyncio.to_thread(self._removals_since, mark, True)
        if removed:
            missed.append("drains or stops while no listed host had an agent: "
                          + ", ".join(f"{k} {r} ({why})" for r, k, _, why in removed))
        await self._set_policy(hosts=lab_hosts or ())
        t_back = time.monotonic()
        cleared = await self.wait_for(lambda: not self._alert_with("cannot be carried out"), 15)
        notes.append("policy's hosts back: alert " + (f"cleared after {time.monotonic() - t_back:.1f} s"
                                                       if cleared else "NOT cleared within 15 s"))
        if not cleared:
            missed.append("the unreachable alert stayed after the policy listed the agents' hosts again")
        return Injection(t_back, notes=notes, missed=missed, no_failures=True)
