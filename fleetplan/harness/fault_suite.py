"""The fault suite: each fault on the lab with load flowing, measured the same way.

One Rig, one controller (one state database) and one steady Load for the whole run: the faults run
one after the other, each starting from a settled fleet (every replica ready and routed, every
desired state acked, engines == desired replicas, the fleet unchanged for 3 s). The load never
stops between faults (a gap would read as a demand drop). Per fault:

- requests sent / ok / failed: those SENT inside the fault's window (settle + fault + recovery +
  the rest of `seconds`); `unexplained` = failed requests that were not in flight on a process the
  fault killed (only the engine and host-lost faults kill serving processes; a failure of a
  request sent before the kill counts as in flight on it);
- duplicates: replica ids that had two live engines at once (sampled every 0.5 s all along);
- orphans: engines that no desired state names, 15 s after recovery (stops take a moment);
- scale-downs: how far the desired fleet (replicas in the desired state and not draining; those the
  fault killed count as kept) fell below what it had before the fault, sampled every 0.5 s from
  the fault to the end of the window. A replacement (make-before-break: the new replica first)
  does not dip; a drain the planner decided before a controller kill (mid drain) lowers the floor.
  The drains and stops in the window are listed from the controller's database for diagnosis;
- recover_s: from the fault to the first moment the fleet is settled again (a cycle completed
  after the fault, every replica ready and routed, at least as many replicas as before, desired
  states acked, engines == desired replicas, hosts reporting, an observation that is not stale and
  reads at least half the offered load), None if not within `recover_timeout_s`.

The harness plays systemd: a killed controller, agent, Mosquitto or Prometheus is restarted at
once (an agent after 1 s); a lost host is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetplan.harness.demo import Rig
from fleetplan.harness.procs import port_is_free
from fleetplan.harness.rig_tools import MODEL, ControllerProc, Load, policy_doc, ready_replicas

# (topic kind "status" | "ack", payload) for a burst of bad messages, built from the host's real status
BadPayloads = Callable[[dict[str, Any]], list[tuple[str, bytes]]]

CONTROLLER_FAULTS = ("controller_after_start", "controller_mid_scale_up", "controller_mid_drain",
                     "controller_random_1", "controller_random_2")
MACHINE_FAULTS = ("store_disk_full", "router_kill_restart", "lying_status")  # issue 19
ALL_FAULTS = (*CONTROLLER_FAULTS, "agent_kill9", "engine_kill9", "mosquitto_kill9", "prometheus_empty",
              "bad_messages", *MACHINE_FAULTS, "host_lost")  # host_lost last: the host stays gone


@dataclass
class FaultResult:
    name: str
    sent: int = 0
    ok: int = 0
    failed: int = 0
    unexplained: int = 0  # failed, and not in flight on a killed process
    duplicates: int = 0
    orphans: int = 0
    scale_downs: int = 0
    recover_s: float | None = None
    notes: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list, repr=False)  # the controller's log in the window

    @property
    def goals_met(self) -> bool:
        return (self.recover_s is not None and self.duplicates == 0 and self.orphans == 0
                and self.scale_downs == 0 and self.unexplained == 0)

    def line(self) -> str:
        rec = "-" if self.recover_s is None else f"{self.recover_s:.1f}"
        return (f"{self.name:24s} {self.sent:6d} {self.ok:6d} {self.failed:6d} {self.unexplained:6d} "
                f"{self.duplicates:4d} {self.orphans:4d} {self.scale_downs:5d} {rec:>8s}  "
                f"{'ok' if self.goals_met else 'MISSED'}")


HEADER = (f"{'fault':24s} {'sent':>6s} {'ok':>6s} {'failed':>6s} {'unexpl':>6s} {'dup':>4s} {'orph':>4s} "
          f"{'scdn':>5s} {'recover_s':>8s}  goal")


@dataclass
class Injection:
    t_s: float  # time.monotonic() of the fault
    excused: set[str] = field(default_factory=set)  # replicas whose drain/stop the fault explains
    kills_serving: bool = False  # a serving process was killed: requests in flight on it may fail
    notes: list[str] = field(default_factory=list)
    engines_kept: bool = True  # the fault must leave every (other) engine running as it was
    outage: tuple[float, float] | None = None  # the router was down: requests sent then could not be served
    floor: int | None = None  # replicas the fleet must keep (None: what it had before the fault)


class FaultSuite:
    def __init__(self, rig: Rig, ctrl: ControllerProc, load: Load, *, seconds: float = 20.0,
                 recover_timeout_s: float = 60.0, seed: int = 0, bad_payloads: BadPayloads | None = None,
                 policy_over: dict[str, Any] | None = None, log: Callable[[str], None] = print,
                 state_mount: Path | None = None, hold_s: float = 8.0, router_hold_s: float = 4.0) -> None:
        self.rig, self.ctrl, self.load = rig, ctrl, load
        self.seconds = seconds
        self.recover_timeout_s = recover_timeout_s
        self.rng = random.Random(seed)
        self.bad_payloads = bad_payloads
        self.log = log
        self.lost_hosts: set[str] = set()
        self.target = 1  # replicas the fleet must have when settled
        self._window_start = time.monotonic()
        self._dups: set[str] = set()
        self._min_present: int | None = None  # fewest replicas kept in the desired state since the fault
        self._killed: set[str] = set()  # replicas the running fault killed (count as kept)
        self._sampler: asyncio.Task[None] | None = None
        self._policy_over: dict[str, Any] = dict(policy_over or {})  # what the controller's policy_doc was made with
        self.state_mount = state_mount  # the filesystem of the state database (store_disk_full fills it)
        self.hold_s = hold_s  # how long the disk stays full, the status lies
        # how long nginx stays down: requests that fail at the router never reach an engine, so the
        # observed demand drops; past the policy's scale_down_delay_s (6 s wall here) the planner
        # scales down on it (docs/faults.md: open, the planner's side)
        self.router_hold_s = router_hold_s

    # ---------------------------------------------------------------------------------------------
    # observation

    def _report(self) -> dict[str, Any] | None:
        try:
            return self.ctrl.report()
        except Exception:  # down (killed, restarting): not settled
            return None

    def _engines(self) -> Counter[str]:
        return Counter(rid for _, rid in self.rig.engine_processes())

    def cycle_id(self) -> int:
        rep = self._report()
        return int((rep or {}).get("cycle_id") or 0)

    def health(self, min_cycle: int = 0) -> str | None:
        """None when settled (from cycle `min_cycle` on), else what is not (blocking: run in a thread)."""
        rep = self._report()
        if rep is None:
            return "controller report API down"
        if (rep["cycle_id"] or 0) < min_cycle:
            return "no complete cycle since the fault"
        if not rep["mqtt_connected"]:
            return "controller not connected to MQTT"
        for name in (h.name for h in self.rig.lab.hosts if h.name not in self.lost_hosts):
            h = rep["hosts"].get(name)
            if h is None or not h["online"] or h["last_status_age_s"] >= 3:
                return f"host {name} not reporting"
            d = rep["desired"].get(name)
            if d is not None and (d["acked_version"] != d["version"] or not d["ack_accepted"]):
                return f"desired state of {name} not acked"
        fleet = rep["fleet"]
        if any(r["phase"] != "desired" for r in fleet):
            return "a replica is draining"
        if any(r["host"] in self.lost_hosts for r in fleet):
            return "replicas of the lost host still desired"
        ready = ready_replicas(rep)
        if len(ready) != len(fleet) or len(fleet) < self.target:
            return f"{len(ready)} of {len(fleet)} replicas ready (want >= {self.target})"
        obs = ((rep.get("plan") or {}).get("observation") or {}).get(MODEL) or {}
        if obs.get("stale", True):
            return "observation stale"
        if (obs.get("rate_rps") or 0.0) < 0.5 * self.load.rate_rps:  # e.g. an emptied Prometheus refilling
            return f"observed {obs.get('rate_rps')} rps of {self.load.rate_rps:g}"
        engines = self._engines()
        if any(n > 1 for n in engines.values()):
            return "duplicate engine"
        if set(engines) != {r["replica_id"] for r in fleet}:
            return "engines != desired replicas"
        return None

    def fleet_ids(self) -> set[str] | None:
        rep = self._report()
        return None if rep is None else {r["replica_id"] for r in rep["fleet"]}

    def fleet_size(self) -> int:
        return len(self.fleet_ids() or ())

    def _kept(self) -> int | None:
        """Replicas in the desired state and not draining (those the fault killed count as kept)."""
        rep = self._report()
        if rep is None:
            return None
        return len({r["replica_id"] for r in rep["fleet"] if r["phase"] == "desired"} | self._killed)

    async def _sample(self) -> None:
        while True:
            engines = await asyncio.to_thread(self._engines)
            self._dups.update(rid for rid, n in engines.items() if n > 1)
            kept = await asyncio.to_thread(self._kept)
            if kept is not None and self._min_present is not None:
                self._min_present = min(self._min_present, kept)
            await asyncio.sleep(0.5)

    def _action_mark(self) -> int:
        with contextlib.closing(sqlite3.connect(f"file:{self.ctrl.state_db}?mode=ro", uri=True, timeout=10)) as db:
            row = db.execute("SELECT COALESCE(MAX(action_id), 0) FROM actions").fetchone()
            return int(row[0])

    def _removals_since(self, mark: int, decided: bool = False) -> list[tuple[str, str, str, str]]:
        """(replica id, kind, status, reason) of the drains and stops after action `mark` that did
        something (`decided`: also those only planned or deferred)."""
        skip = ("failed", "cancelled") if decided else ("deferred", "failed", "planned", "cancelled")
        with contextlib.closing(sqlite3.connect(f"file:{self.ctrl.state_db}?mode=ro", uri=True, timeout=10)) as db:
            rows = db.execute(
                "SELECT replica_id, kind, status, reason FROM actions WHERE action_id > ? AND kind IN "
                f"('drain', 'stop') AND status NOT IN ({','.join('?' * len(skip))}) "
                "ORDER BY action_id", (mark, *skip)).fetchall()
        return [(str(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]

    async def wait_for(self, pred: Callable[[], Any], timeout_s: float, poll_s: float = 0.25) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = await asyncio.to_thread(pred)
            if got or time.monotonic() >= deadline:
                return got
            await asyncio.sleep(poll_s)

    def content(self) -> str | None:
        """health(), and the planner wants the fleet as it is (no surplus waiting out the scale-down
        delay): a fault must not start while the planner is about to scale down on its own."""
        why = self.health()
        if why is not None:
            return why
        plan = (self._report() or {}).get("plan") or {}
        surplus = (plan.get("next_state") or {}).get("surplus_since_s")
        expl = plan.get("explanation") or {}
        if (surplus or (expl.get("target_usd_h") or 0.0) < (expl.get("usd_h") or 0.0) - 1e-6
                or "scale-down delayed" in json.dumps(expl)):  # also: held for a recent peak
            return "the planner has a surplus (scale-down delay running)"
        return None

    async def settle(self, timeout_s: float = 90.0, stable_s: float = 3.0) -> str | None:
        """Wait for a settled fleet that stays the same for `stable_s`; None or what is not settled."""
        deadline = time.monotonic() + timeout_s
        why: str | None = "not checked"
        while time.monotonic() < deadline:
            why = await asyncio.to_thread(self.content)
            if why is None:
                ids = await asyncio.to_thread(self.fleet_ids)
                await asyncio.sleep(stable_s)
                why = await asyncio.to_thread(self.content)
                if why is None and await asyncio.to_thread(self.fleet_ids) == ids:
                    return None
                why = why or "fleet changed"
            await asyncio.sleep(0.5)
        return why

    # ---------------------------------------------------------------------------------------------
    # running

    async def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler

    async def run(self, names: Sequence[str]) -> list[FaultResult]:
        results = []
        for name in names:
            try:
                res = await self.run_one(name)
            except Exception as exc:  # the harness failed (e.g. a controller that will not restart): say so, go on
                res = FaultResult(name, notes=[f"harness error: {type(exc).__name__}: {str(exc)[:2000]}"])
                self._window_start = time.monotonic()
                with contextlib.suppress(Exception):
                    if self.ctrl.proc is None or self.ctrl.proc.poll() is not None:
                        await asyncio.to_thread(self.ctrl.start)
            self.log(res.line() + ("  " + "; ".join(res.notes) if res.notes else ""))
            results.append(res)
        return results

    async def run_one(self, name: str) -> FaultResult:
        res = FaultResult(name)
        t_window = self._window_start
        why = await self.settle()
        if why is not None:
            res.notes.append(f"not settled before the fault: {why}")
        self.target = await asyncio.to_thread(self.fleet_size)  # what the settled fleet has
        cycle0 = await asyncio.to_thread(self.cycle_id)
        mark = await asyncio.to_thread(self._action_mark)
        engines_before = {rid: pid for pid, rid in await asyncio.to_thread(self.rig.engine_processes)}
        log_from = self._log_size()
        self._dups.clear()
        self._killed = set()
        n_before = self.target
        self._min_present = n_before
        inject: Callable[[], Awaitable[Injection]] = getattr(self, f"_fault_{name}")
        inj = await inject()
        res.notes += inj.notes
        if inj.kills_serving:
            self._killed = set(inj.excused)
        floor = n_before if inj.floor is None else inj.floor
        if inj.floor is not None:  # an intended change during the injection: count from here on
            self._min_present = floor
        t_rec = time.monotonic()
        deadline = inj.t_s + self.recover_timeout_s
        last_why: str | None = "not checked"
        while time.monotonic() < deadline:
            last_why = await asyncio.to_thread(self.health, cycle0 + 2)  # a whole cycle after the fault
            if last_why is None:
                res.recover_s = time.monotonic() - inj.t_s
                break
            await asyncio.sleep(0.2)
        if res.recover_s is None:
            res.notes.append(f"not recovered after {time.monotonic() - t_rec:.0f} s: {last_why}")
        if inj.engines_kept:
            now = {rid: pid for pid, rid in await asyncio.to_thread(self.rig.engine_processes)}
            changed = sorted(rid for rid, pid in engines_before.items() if rid in now and now[rid] != pid)
            if changed:
                res.notes.append(f"engines restarted: {changed}")
        await asyncio.sleep(max(0.0, inj.t_s + self.seconds - time.monotonic()))
        # orphans: engines no desired state names, once stops had time to finish
        orphans: set[str] = set()
        for _ in range(30):
            ids = await asyncio.to_thread(self.fleet_ids)
            engines = await asyncio.to_thread(self._engines)
            orphans = set(engines) - ids if ids is not None else set()
            if ids is not None and not orphans:
                break
            await asyncio.sleep(0.5)
        res.orphans = len(orphans)
        if orphans:
            res.notes.append(f"orphan engines {sorted(orphans)}")
        res.duplicates = len(self._dups)
        if self._dups:
            res.notes.append(f"duplicate engines for {sorted(self._dups)}")
        kept = await asyncio.to_thread(self._kept)
        low = min(x for x in (self._min_present, kept, floor) if x is not None)
        res.scale_downs = max(0, floor - low)
        removals = [r for r in await asyncio.to_thread(self._removals_since, mark) if r[0] not in inj.excused]
        if removals:  # replacements (make-before-break) and the planner's own changes show here too
            res.notes.append("removed: " + ", ".join(f"{k} {rid} ({st}: {reason})" for rid, k, st, reason in removals))
        if res.scale_downs:
            res.notes.append(f"the desired fleet fell to {low} replicas (floor {floor})")
        # requests: those sent in this window, once they all finished
        t_end = time.monotonic()
        await self.wait_for(lambda: self.load.unfinished_before(t_end) == 0, 30)
        sent = self.load.sent_between(t_window, t_end)
        res.sent = len(sent)
        res.ok = sum(1 for _, r in sent if r.outcome == "ok")
        res.failed = res.sent - res.ok
        bad = [(t, r) for t, r in sent if r.outcome != "ok" and not (inj.kills_serving and t < inj.t_s)
               and not (inj.outage is not None and inj.outage[0] <= t <= inj.outage[1])]
        res.unexplained = len(bad)
        if bad:
            kinds = Counter(f"{r.outcome}{'' if r.status is None else ' ' + str(r.status)}" for _, r in bad)
            res.notes.append("unexplained failures: " + ", ".join(f"{n}x {k}" for k, n in kinds.most_common()))
        self._window_start = t_end
        res.log_lines = self._log_since(log_from)
        return res

    def _log_size(self) -> int:
        try:
            return self.ctrl.log_path.stat().st_size
        except OSError:
            return 0

    def _log_since(self, offset: int) -> list[str]:
        try:
            with open(self.ctrl.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace").splitlines()
        except OSError:
            return []

    # ---------------------------------------------------------------------------------------------
    # the faults

    async def _restart_controller(self) -> None:
        await asyncio.to_thread(self.ctrl.start)

    async def _kill_controller(self) -> float:
        t = time.monotonic()
        await asyncio.to_thread(self.ctrl.kill9)
        return t

    async def _set_policy(self, **over: Any) -> None:
        self._policy_over.update(over)
        self.ctrl.write_policy(policy_doc(**self._policy_over))
        self.ctrl.signal(signal.SIGHUP)

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

    def _serving_host(self) -> str:
        rep = self.ctrl.report()
        hosts = Counter(r["host"] for r in ready_replicas(rep) if r["host"] not in self.lost_hosts)
        return str(hosts.most_common(1)[0][0])

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

    async def _serving_status(self) -> tuple[str, dict[str, Any]]:
        """A host serving the model, and its retained status as the broker holds it (read with the
        observer's credentials)."""
        import aiomqtt

        from fleetplan.controller.protocol import status_topic

        host = await asyncio.to_thread(self._serving_host)
        lab = self.rig.lab
        obs = lab.observer
        async with aiomqtt.Client(lab.mqtt_host, lab.mqtt_port, username=obs.user, password=obs.password,
                                  protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.subscribe(status_topic(host))
            async with asyncio.timeout(10):
                async for msg in client.messages:
                    payload = msg.payload
                    status: dict[str, Any] = json.loads(
                        payload if isinstance(payload, (bytes, bytearray, str)) else b"{}")
                    return host, status
        raise RuntimeError(f"no retained status for {host}")

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

    # ---- the machine around the controller (issue 19) ------------------------------------------

    def _alerts(self) -> list[str]:
        return [str(a) for a in (self._report() or {}).get("alerts", [])]

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


def summary(results: Sequence[FaultResult]) -> str:
    lines = [HEADER, *(r.line() for r in results)]
    tot = FaultResult("TOTAL", sum(r.sent for r in results), sum(r.ok for r in results),
                      sum(r.failed for r in results), sum(r.unexplained for r in results),
                      sum(r.duplicates for r in results), sum(r.orphans for r in results),
                      sum(r.scale_downs for r in results))
    missed = [r.name for r in results if not r.goals_met]
    lines.append(f"{tot.name:24s} {tot.sent:6d} {tot.ok:6d} {tot.failed:6d} {tot.unexplained:6d} "
                 f"{tot.duplicates:4d} {tot.orphans:4d} {tot.scale_downs:5d}")
    lines.append(f"goals missed by: {', '.join(missed)}" if missed else "all goals met")
    return "\n".join(lines)
