"""The fault suite's core: its state, the results it records, and what it reads of the rig (the
controller's report and database, the engines, the load) to tell a settled fleet. The faults are
`fault_injections.py`; running them and the table are `fault_suite.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetplan.harness.demo import Rig
from fleetplan.harness.prom_proxy import PromProxy
from fleetplan.harness.rig_tools import MODEL, ControllerProc, Load, policy_doc, ready_replicas

# (topic kind "status" | "ack", payload) for a burst of bad messages, built from the host's real status
BadPayloads = Callable[[dict[str, Any]], list[tuple[str, bytes]]]

CONTROLLER_FAULTS = ("controller_after_start", "controller_mid_scale_up", "controller_mid_drain",
                     "controller_random_1", "controller_random_2")
MACHINE_FAULTS = ("store_disk_full", "router_kill_restart", "lying_status")  # issue 19
# issue 36: on-call readers, a sick Prometheus, the controller's wall clock stepped
CONTROL_PLANE_FAULTS = ("report_readers", "prometheus_wrong_shape", "prometheus_trickle", "prometheus_late",
                        "clock_step_back", "clock_step_forward")
# a host the policy does not list, a listed host's GPU count changed, a plan no agent can carry out
INVENTORY_FAULTS = ("unknown_host", "gpu_count_changed", "unreachable_plan")
LAB_FAULTS = (*CONTROLLER_FAULTS, "agent_kill9", "engine_kill9", "mosquitto_kill9", "prometheus_empty",
              "bad_messages", *MACHINE_FAULTS, *CONTROL_PLANE_FAULTS, *INVENTORY_FAULTS,
              "host_lost")  # host_lost last: the host stays gone
# rows measured off the shared lab: ten cold starts (each its own lab), a week of store growth (no lab)
OWN_ROWS = ("cold_starts", "store_week")
ALL_FAULTS = (*LAB_FAULTS, *OWN_ROWS)


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
    missed: list[str] = field(default_factory=list)  # the fault's own goals it missed (Injection.missed)
    log_lines: list[str] = field(default_factory=list, repr=False)  # the controller's log in the window
    lab: bool = True  # a fault on the shared lab (False: a row of its own, nothing to recover from)

    @property
    def goals_met(self) -> bool:
        return ((self.recover_s is not None or not self.lab) and self.duplicates == 0 and self.orphans == 0
                and self.scale_downs == 0 and self.unexplained == 0 and not self.missed)

    def line(self) -> str:
        rec = "n/a" if not self.lab else "-" if self.recover_s is None else f"{self.recover_s:.1f}"
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
    missed: list[str] = field(default_factory=list)  # the fault's own goals it missed, each with its figure
    no_failures: bool = False  # a goal of the fault: not one request of its window fails


class FaultSuiteCore:
    """The suite's state and its observation of the rig (a base of `FaultSuite`)."""

    def __init__(self, rig: Rig, ctrl: ControllerProc, load: Load, *, seconds: float = 20.0,
                 recover_timeout_s: float = 60.0, seed: int = 0, bad_payloads: BadPayloads | None = None,
                 policy_over: dict[str, Any] | None = None, log: Callable[[str], None] = print,
                 state_mount: Path | None = None, hold_s: float = 8.0, router_hold_s: float = 4.0,
                 prom_proxy: PromProxy | None = None, clock_file: Path | None = None, sick_s: float = 30.0,
                 readers: int = 200) -> None:
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
        self.prom_proxy = prom_proxy  # the controller's Prometheus is this proxy (the sick-Prometheus faults)
        self.clock_file = clock_file  # the controller's libfaketime offset file (the clock faults)
        self.clock_offset_s = 0.0  # what clock_file says now
        self.sick_s = sick_s  # how long Prometheus stays sick, the readers read
        self.readers = readers

    # ---------------------------------------------------------------------------------------------
    # observation

    def _report(self) -> dict[str, Any] | None:
        try:
            return self.ctrl.report()
        except Exception:  # down (killed, restarting): not settled
            return None

    def _alerts(self) -> list[str]:
        return [str(a) for a in (self._report() or {}).get("alerts", [])]

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

    async def _set_policy(self, **over: Any) -> None:
        """The controller's policy changed by `over` (on top of what it was made with), read on SIGHUP."""
        self._policy_over.update(over)
        self.ctrl.write_policy(policy_doc(**self._policy_over))
        self.ctrl.signal(signal.SIGHUP)

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
        if surplus or (expl.get("target_usd_h") or 0.0) < (expl.get("usd_h") or 0.0) - 1e-6:
            return "the planner has a surplus (scale-down delay running)"
        held = [r for m in expl.get("models") or [] for r in m.get("held_unproven") or []]
        if held:  # kept above the demand's need until proven: shed when that time ends, fault or not
            return f"the planner holds unproven replicas above the demand: {', '.join(held)}"
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

    def _serving_host(self) -> str:
        rep = self.ctrl.report()
        hosts = Counter(r["host"] for r in ready_replicas(rep) if r["host"] not in self.lost_hosts)
        return str(hosts.most_common(1)[0][0])
