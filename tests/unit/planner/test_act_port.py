"""The act loop's steps (planner/act_port.py) through an in-memory port: what the daemon and the
replay both run, in the order they run it."""

from __future__ import annotations

from collections.abc import Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeVar

from fleetplan.planner import act_port, records
from fleetplan.planner.act import ActDecision, ActView, HostReport, Note, Phase, ReplicaRow
from fleetplan.planner.types import ActionKind, ReplicaState
from tests.unit.planner.test_act import NOW, action, host, reported, row, view

T = TypeVar("T")


class MemoryPort:
    """A port whose records are the reducer's in memory; it logs what the world is asked to do."""

    def __init__(self, rows: tuple[ReplicaRow, ...], hosts: tuple[HostReport, ...], inflight: list[float | None]):
        self.t = NOW
        self.recs = records.Records(replicas={r.replica_id: r for r in rows},
                                    known_ids=frozenset(r.replica_id for r in rows))
        self.hosts = {h.name: h for h in hosts}
        self.polls = list(inflight)
        self.calls: list[Any] = []

    def view(self) -> ActView:
        return view(*self.hosts.values(), rows=tuple(self.recs.replicas.values()))

    def apply(self, decision: ActDecision, cycle_id: int | None) -> None:
        self.recs = records.apply(self.recs, decision.effects, self.t, cycle_id=cycle_id).records
        self.calls.append("apply")

    def start_drain(self, replica_id: str) -> None:
        self.calls.append(("drain", replica_id))

    def now_s(self) -> float:
        return self.t

    def reports(self) -> Mapping[str, HostReport]:
        return self.hosts

    def replica(self, replica_id: str) -> ReplicaRow | None:
        return self.recs.replicas.get(replica_id)

    async def inflight(self, row: ReplicaRow) -> float | None:
        return self.polls.pop(0)

    async def sleep(self, delay_s: float) -> None:
        self.t += delay_s

    async def record(self, effects: Sequence[records.RecordEffect], cycle_id: int | None) -> list[Note]:
        step = records.apply(self.recs, effects, self.t, cycle_id=cycle_id)
        self.recs = step.records
        self.calls.append(("record", [type(e).__name__ for e in effects]))
        return step.notes()

    async def route(self) -> None:
        self.calls.append("route")

    async def publish(self, hosts: frozenset[str]) -> None:
        self.calls.append(("publish", sorted(hosts)))

    def exclusive(self) -> AbstractAsyncContextManager[object]:
        return nullcontext()


def run(step: Coroutine[Any, Any, T]) -> T:
    """Run a step on this port (its sleeps move the port's clock and return at once)."""
    try:
        step.send(None)
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]
    raise AssertionError("the step waited for something this port never gives")


def test_a_drain_is_recorded_before_routing_drops_it_and_is_started_after() -> None:
    serving, other = row("r00001"), row("r00002", gpus=(1,))
    port = MemoryPort((serving, other), (host("gpu-01", reported("r00001"), reported("r00002", gpus=(1,))),), [])
    d = run(act_port.execute(port, [action(ActionKind.DRAIN, "r00001", gpus=(0,), state=ReplicaState.READY)],
                             planned_on=None, cycle_id=4))
    assert d.drains == ("r00001",)
    assert port.calls == ["apply", "route", ("drain", "r00001")]  # still desired: nothing to publish
    assert port.recs.replicas["r00001"].phase == Phase.DRAINING
    # the cycle's drain counts for the brakes
    assert [p.direction.value for p in records.history(port.recs.log)] == ["down"]


def test_a_drain_waits_for_two_idle_polls_then_removes_the_replica_routes_and_publishes() -> None:
    draining = row("r00001", phase=Phase.DRAINING)
    port = MemoryPort((draining,), (host("gpu-01", reported("r00001")),), [3.0, 0.0, 0.0])
    done = run(act_port.drain(port, "r00001", deadline_s=120.0, settle_s=1.0, poll_s=0.5))
    assert done == records.Drained("r00001", False, 0.0, 120.0)
    assert port.t == NOW + 1.0 + 2 * 0.5  # settle, then three polls half a second apart
    assert port.calls == [("record", ["Drained"]), "route", ("publish", ["gpu-01"])]
    assert "r00001" not in port.recs.replicas


def test_a_prefill_replicas_drain_holds_its_last_kv_for_the_ttft_target() -> None:
    """A prefill replica with no request in flight still holds the KV caches of the last requests it
    handed over until the decode replicas pull them (within the TTFT target, for a request within
    the SLO): its drain ends that long after its first idle poll, not at the second poll."""
    from dataclasses import replace

    from fleetplan.planner.act import kv_hold_s
    from tests.unit.planner.planner_helpers import policy

    m = policy(models=("llama",), model_extra={"llama": {"slo": {"ttft_p99_ms": 4000, "itl_p99_ms": 80}}}).models[0]
    assert kv_hold_s(m, "prefill") == 4.0 and kv_hold_s(m, "decode") == 0.0 and kv_hold_s(m, "aggregated") == 0.0
    assert kv_hold_s(m, "prefill", time_scale=20.0) == 0.2  # the lab's wall clock
    draining = replace(row("r00001", phase=Phase.DRAINING), role="prefill")
    port = MemoryPort((draining,), (host("gpu-01", reported("r00001")),), [2.0] + [0.0] * 20)
    done = run(act_port.drain(port, "r00001", deadline_s=120.0, settle_s=1.0, poll_s=0.5,
                              hold_s=kv_hold_s(m, draining.role)))
    assert done == records.Drained("r00001", False, 0.0, 120.0)
    assert port.t == NOW + 1.0 + 0.5 + 4.0  # settle, a busy poll, then idle polls for the 4 s TTFT target


def test_a_drain_past_its_deadline_stops_with_the_requests_cut() -> None:
    draining = row("r00001", phase=Phase.DRAINING)
    port = MemoryPort((draining,), (host("gpu-01", reported("r00001")),), [5.0] * 10)
    done = run(act_port.drain(port, "r00001", deadline_s=2.0, settle_s=1.0, poll_s=0.5))
    assert done is not None and done.timed_out and done.last_inflight == 5.0
    assert "5 request(s) in flight cut" in done.reason


def test_a_replica_no_longer_draining_ends_its_drain_without_touching_it() -> None:
    port = MemoryPort((row("r00001"),), (host("gpu-01", reported("r00001")),), [])
    assert run(act_port.drain(port, "r00001", deadline_s=120.0, settle_s=1.0, poll_s=0.5)) is None
    assert port.calls == [] and port.t == NOW
