"""The report API's pieces without a server: the plan page's decision window reads only what is
new, /metrics renders at most once per max age and scrapes share a render, a reader waits for the
render in flight and never starts one, the read gate admits up to its limit and paces the rest."""

from __future__ import annotations

import asyncio
import doctest
import threading
from typing import Any

import pytest

from fleetplan.controller import report_gate
from fleetplan.controller.report_gate import READ_BURST, ReadGate
from fleetplan.controller.report_snapshot import (
    DecisionWindow,
    Exposition,
    Gathered,
    Rendered,
    ReportSnapshot,
    render,
)
from fleetplan.controller.state import StateStore


def record(cid: int, now_s: float) -> dict[str, Any]:
    return {"cycle_id": cid, "decision_id": f"d{cid}", "now_s": now_s,
            "models": {"m": {"observed_rps": float(cid), "capacity_rps": 2.0 * cid}}}


def test_the_decision_window_reads_only_new_records_and_forgets_old_ones() -> None:
    wall = [1000.0]
    store = StateStore(":memory:", clock=lambda: wall[0])
    window = DecisionWindow()
    for cid in range(1, 4):
        wall[0] = 1000.0 + cid
        store.save_decision(record(cid, wall[0]))
    rows = window.update(store, since_wall_s=0.0)
    assert [r["cycle_id"] for r in rows] == [1, 2, 3] and window.read == 3
    wall[0] = 1010.0
    store.save_decision(record(4, wall[0]))
    rows = window.update(store, since_wall_s=0.0)
    assert [r["cycle_id"] for r in rows] == [1, 2, 3, 4]
    assert window.read == 3 + 2  # the newest it held (read again: created at or after) and the new one
    rows = window.update(store, since_wall_s=1002.5)  # the window moved past cycles 1 and 2
    assert [r["cycle_id"] for r in rows] == [3, 4]
    store.close()


async def test_metrics_render_once_per_max_age_and_scrapes_share_a_render() -> None:
    now = [0.0]
    calls = []
    gate = threading.Event()

    def expose() -> bytes:
        gate.wait(10)
        calls.append(1)
        return f"x {len(calls)}\n".encode()

    exp = Exposition(expose, max_age_s=1.0, clock=lambda: now[0])
    scrapes = [asyncio.create_task(exp.get()) for _ in range(50)]
    await asyncio.sleep(0)
    gate.set()
    assert set(await asyncio.gather(*scrapes)) == {b"x 1\n"} and exp.renders == 1
    now[0] = 0.9
    assert await exp.get() == b"x 1\n" and exp.renders == 1
    now[0] = 1.5
    assert await exp.get() == b"x 2\n" and exp.renders == 2


class _Source:
    time_scale = 1.0

    def __init__(self) -> None:
        self.store = StateStore(":memory:")
        self.metrics = type("M", (), {"render": staticmethod(lambda: b"")})()
        self.cycle = 0

    def report(self) -> dict[str, Any]:
        return {"cycle_id": self.cycle, "now_s": 1.0, "generated_s": 1.0, "plan": None}

    def wall(self) -> float:
        return 1.0


async def test_readers_wait_for_the_render_in_flight_and_never_gather() -> None:
    release = threading.Event()

    def held(g: Gathered) -> Rendered:
        release.wait(10)
        return render(g)

    src = _Source()
    snap = ReportSnapshot(held)
    snap.refresh(src)
    assert snap.gathers == 0  # not serving yet: nothing gathered
    snap.serve(src)
    src.cycle = 7
    snap.refresh(src)  # a cycle ended while the first render is held
    readers = [asyncio.create_task(snap.latest()) for _ in range(100)]
    await asyncio.sleep(0)  # each reader runs to its wait
    assert snap.waiting == 100 and snap.gathers == 2
    release.set()
    got = await asyncio.gather(*readers)
    assert {r.cycle_id for r in got if r is not None} == {7} and len(got) == 100
    assert snap.gathers == 2 and snap.renders <= 2
    src.store.close()


async def test_a_gather_that_fails_keeps_the_last_snapshot() -> None:
    src = _Source()
    snap = ReportSnapshot()
    snap.serve(src)
    first = await snap.latest()
    assert first is not None and first.cycle_id == 0

    def broken() -> dict[str, Any]:
        raise RuntimeError("store gone")

    src.report = broken  # type: ignore[method-assign]
    snap.refresh(src)
    assert await snap.latest() is first and snap.gathers == 1
    src.store.close()


def test_the_read_gate_admits_up_to_its_limit_and_paces_at_its_rate() -> None:
    assert doctest.testmod(report_gate).failed == 0
    gate = ReadGate(limit=3, rate_rps=20.0)
    assert [gate.admit() for _ in range(4)] == [True, True, True, False] and gate.inflight == 3
    gate.release()
    assert gate.admit() and not gate.admit()
    # 1,000 reads asking at the same instant: the last is answered (1000 - burst - 1) / rate later
    paced = ReadGate(limit=10_000, rate_rps=50.0)
    delays = [paced.delay_s(100.0) for _ in range(1000)]
    assert delays == sorted(delays) and delays[READ_BURST] == 0.0
    assert delays[-1] == pytest.approx((1000 - READ_BURST - 1) / 50.0)
    with pytest.raises(ValueError, match="limit 0"):
        ReadGate(limit=0, rate_rps=1.0)
