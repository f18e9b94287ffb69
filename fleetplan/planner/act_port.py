"""The act loop's one port to the world, and the loop steps both worlds run through it.

`Port` is what the act loop needs from the world: the hosts' reports, the records (read, and
persisted through the records reducer, planner/records.py), publishing desired states, routing, a
replica's requests in flight, the time and waiting. The daemon implements it over SQLite, MQTT,
nginx and httpx (controller/executor.py `Executor`); the replay implements it in memory over the
simulated fleet (sim/control.py `ReplayControl`). The steps written here run unchanged in both:
the daemon awaits them under asyncio; the replay drives them with the simulated clock (a `sleep`
suspends the step until the simulation reaches its time).

`reconcile`: the records brought in line with the agents' reports (act.reconcile), before planning.
`execute`: a cycle's act step on the plan's allowed actions (act.execute), its records, publishes
and drains. `drain`: one replica's drain after the act core moved it to DRAINING and routing dropped it: wait
`settle_s`, then poll its requests in flight every `poll_s` (`act.drain_step`) until they reach 0 or
the deadline passes, then record the end (`records.Drained`), route, and publish the host's desired
state without it. A decode replica that is its model's last also waits for the requests its
model's prefill replicas hold (`act.drain_holders`: each takes a decode leg once prefilled). No
I/O here: every effect is a call into the port.

Worked example: a port whose replica drains in two polls (an in-memory port, as the tests use).

>>> from fleetplan.planner.act_types import ReplicaRow, Phase
>>> class Mem:
...     def __init__(self):
...         self.t, self.rows, self.log = 100.0, {"r1": ReplicaRow("r1", "h1", "m", "vllm", "h100", 1, "bf16",
...             (0,), 8000, "vllm", Phase.DRAINING, "planned", 0.0, 0.0, 90.0, 10.0)}, []
...     def now_s(self): return self.t
...     def reports(self): return {}
...     def replica(self, rid): return self.rows.get(rid)
...     async def inflight(self, row): return 0.0
...     async def sleep(self, delay_s): self.t += delay_s
...     async def record(self, effects, cycle_id): self.log.append(effects); self.rows.clear(); return []
...     async def route(self): self.log.append("route")
...     async def publish(self, hosts): self.log.append(sorted(hosts))
...     def exclusive(self): return Nothing()
>>> class Nothing:
...     async def __aenter__(self): return None
...     async def __aexit__(self, *exc): return None
>>> def run(step):  # nothing here waits for the world: the step ends at its first resumption
...     try:
...         step.send(None)
...     except StopIteration as end:
...         return end.value
>>> port = Mem()
>>> run(drain(port, "r1", deadline_s=120.0, settle_s=1.0, poll_s=0.5))
Drained(replica_id='r1', timed_out=False, last_inflight=0.0, deadline_s=120.0)
>>> port.t, port.log[1:]
(101.5, ['route', ['h1']])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from fleetplan.models.config_key import Role
from fleetplan.planner.act_drain import DrainProgress, DrainStep, drain_holders, drain_step
from fleetplan.planner.act_execute import execute as act_execute
from fleetplan.planner.act_reconcile import reconcile as act_reconcile
from fleetplan.planner.act_types import ActDecision, ActView, HostReport, Note, Phase, ReplicaRow
from fleetplan.planner.records import Drained, RecordEffect
from fleetplan.planner.types import Action

__all__ = ["Port", "drain", "execute", "reconcile"]


class Port(Protocol):
    """The world as the act loop sees it (see the module docstring)."""

    def view(self) -> ActView:
        """What the act core decides on: the hosts' last reports and the records, now."""
        ...

    def apply(self, decision: ActDecision, cycle_id: int | None) -> None:
        """Persist a decision's effects through the records reducer (one step), with its alerts."""
        ...

    def start_drain(self, replica_id: str) -> None:
        """Run `drain` for the replica (at most one drain per replica)."""
        ...

    def now_s(self) -> float:
        """The records' clock (wall seconds)."""
        ...

    def reports(self) -> Mapping[str, HostReport]:
        """The hosts' last reports."""
        ...

    def replica(self, replica_id: str) -> ReplicaRow | None:
        """The replica's record (None: none)."""
        ...

    def active_replicas(self) -> Sequence[ReplicaRow]:
        """The active replica records (desired or draining)."""
        ...

    async def inflight(self, row: ReplicaRow) -> float | None:
        """The replica's running + waiting requests (None: unknown)."""
        ...

    async def sleep(self, delay_s: float) -> None:
        """Resume after `delay_s` seconds of the records' clock."""
        ...

    async def record(self, effects: Sequence[RecordEffect], cycle_id: int | None) -> list[Note]:
        """Persist the effects through the records reducer (planner/records.py); the action-log
        entries written."""
        ...

    async def route(self) -> None:
        """Route to (and scrape) what the records and reports say serves (act.routes)."""
        ...

    async def publish(self, hosts: frozenset[str]) -> None:
        """Send these hosts their desired states as the records hold them."""
        ...

    def exclusive(self) -> AbstractAsyncContextManager[object]:
        """Held while a step outside the cycle changes the records (the cycle's lock)."""
        ...


def reconcile(port: Port) -> ActDecision:
    """Bring the records in line with what the agents report (act.reconcile on the port's view),
    recorded; the caller publishes `publish` when it can (the daemon: once connected)."""
    d = act_reconcile(port.view())
    port.apply(d, None)
    return d


async def execute(port: Port, actions: Sequence[Action], *, planned_on: ActView | None,
                  cycle_id: int | None) -> ActDecision:
    """One cycle's act step: the act core's effects of the plan's allowed `actions` on the port's
    view now (`planned_on`: the view the plan was made from), recorded, the desired states they
    change published, and the drains started once routing excludes them."""
    d = act_execute(port.view(), actions, planned_on=planned_on)
    port.apply(d, cycle_id)
    hosts = d.publish_first | d.publish
    if hosts:
        await port.publish(hosts)
    if d.drains:
        await port.route()  # out of the upstream before waiting
        for rid in d.drains:
            port.start_drain(rid)
    return d


async def _inflight(port: Port, row: ReplicaRow) -> float | None:
    """The requests in flight that hold `row`'s drain: its own, and those of its `drain_holders`
    (None: one of them unknown)."""
    total = await port.inflight(row)
    if total is None:
        return None
    holders = drain_holders(port.active_replicas(), port.reports(), row) if row.role == Role.DECODE.value else ()
    for rid in holders:
        other = port.replica(rid)
        n = await port.inflight(other) if other is not None else 0.0
        if n is None:
            return None
        total += n
    return total


async def drain(port: Port, replica_id: str, *, deadline_s: float, settle_s: float,
                poll_s: float, hold_s: float = 0.0) -> Drained | None:
    """Drain one replica (see the module docstring); its end, or None when it was not draining (or
    stopped draining by other means while it waited). `hold_s`: how long it stays up after its
    last request (`act_drain.kv_hold_s`: a prefill replica's KV waits for the decode side)."""
    row = port.replica(replica_id)
    if row is None or row.phase != Phase.DRAINING:
        return None
    progress = DrainProgress(row.drain_started_s or port.now_s())
    await port.sleep(settle_s)
    while True:
        row = port.replica(replica_id)
        if row is None or row.phase != Phase.DRAINING:
            return None
        step, progress = drain_step(progress, await _inflight(port, row), port.now_s(), deadline_s, hold_s)
        if step != DrainStep.WAIT:
            break
        await port.sleep(poll_s)
    done = Drained(replica_id, step == DrainStep.TIMEOUT, progress.last_inflight, deadline_s)
    async with port.exclusive():
        await port.record([done], None)
        await port.route()  # out of the upstream before the engine stops
        await port.publish(frozenset({row.host}))
    return done
