"""Replica choice: least-loaded (ties to the oldest), round-robin, bounded-load consistent hashing."""

from __future__ import annotations

import math

import pytest

from fleetplan.sim.router import RouteMode, Router, affinity_key, least_loaded, pick

IDS = [f"r{i}" for i in range(8)]


def test_least_loaded_ties_to_the_oldest() -> None:
    assert least_loaded([3, 1, 1, 2]) == 1
    assert pick(IDS[:4], [0, 0, 0, 0], None, RouteMode.LEAST_LOADED) == 0
    assert pick(IDS[:4], [2, 2, 1, 1], 12345, RouteMode.LEAST_LOADED) == 2  # the key is ignored


def test_round_robin_cycles() -> None:
    r = Router(RouteMode.ROUND_ROBIN)
    assert [r.pick(IDS[:3], [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="counter"):
        pick(IDS[:3], [0, 0, 0], None, RouteMode.ROUND_ROBIN)


def test_affinity_is_sticky_and_spreads_keys() -> None:
    r = Router(RouteMode.AFFINITY)
    loads = [0] * 8
    keys = [affinity_key((0, 1000 + k)) for k in range(400)]
    first = [r.pick(IDS, loads, k) for k in keys]
    assert first == [r.pick(IDS, loads, k) for k in keys]  # same key, same replica
    counts = [first.count(i) for i in range(8)]
    assert min(counts) > 20 and max(counts) < 90  # 64 points per replica: roughly even
    assert r.pick(IDS, loads, None) == 0  # no key: least-loaded


def test_affinity_load_bound() -> None:
    r = Router(RouteMode.AFFINITY, balance=1.25)
    loads = [0] * 8
    for _k in range(2000):  # every request has the same key (a shared system prompt only)
        i = r.pick(IDS, loads, affinity_key((7,)))
        assert loads[i] < math.ceil(1.25 * (sum(loads) + 1) / 8)
        loads[i] += 1
    assert max(loads) <= math.ceil(1.25 * 2000 / 8) and r.spilled > 0


def test_affinity_is_consistent_when_a_replica_leaves() -> None:
    r = Router(RouteMode.AFFINITY)
    keys = [affinity_key(None, f"session-{k}") for k in range(500)]
    before = [IDS[r.pick(IDS, [0] * 8, k)] for k in keys]
    gone = "r3"
    rest = [x for x in IDS if x != gone]
    after = [rest[r.pick(rest, [0] * 7, k)] for k in keys]
    moved = sum(1 for b, a in zip(before, after, strict=True) if b != a)
    assert moved == before.count(gone)  # only the departed replica's keys move


def test_affinity_key() -> None:
    assert affinity_key(None) is None and affinity_key(()) is None
    assert affinity_key((1, 2, 3)) == affinity_key((1, 2, 4))  # the first two blocks
    assert affinity_key((1, 2)) != affinity_key((1, 3))
    assert affinity_key((1, 2), "s") == affinity_key(None, "s")  # a session id wins
    with pytest.raises(ValueError):
        Router(RouteMode.AFFINITY, balance=0.9)
