"""Which replica serves a request: least-loaded, round-robin, or prefix affinity (bounded-load
consistent hashing). Deterministic; no clock, no I/O. The replay (fleetplan.sim.des) and the
prefix-cache bench (bench/prefix_cache.py) call it.

- LEAST_LOADED (the replay's rule): the replica with the fewest requests in it (running +
  waiting), ties to the oldest (the first in the order given).
- ROUND_ROBIN: nginx's default for an upstream of equal weights (a counter over the replicas).
- AFFINITY: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
  Hashing with Bounded Loads", SODA 2018; what HAProxy's `hash-balance-factor` does): the key
  (a session id, or the prompt's first blocks: `affinity_key`) picks a point on a ring of
  `VNODES` points per replica, and the request goes to the first replica clockwise whose load
  is below ceil(c x (total load + 1) / replicas), c = `balance` (1.25: no replica more than 25 %
  above the mean). A replica's points depend only on its id, so adding or removing one replica
  moves only the keys next to its points. No key: least-loaded.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import struct
from collections.abc import Sequence
from enum import StrEnum


class RouteMode(StrEnum):
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    AFFINITY = "affinity"


VNODES = 64  # ring points per replica
DEFAULT_BALANCE = 1.25  # bounded-load factor c
AFFINITY_BLOCKS = 2  # prompt blocks that make the key when there is no session id


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def affinity_key(blocks: Sequence[int] | None, session: str | None = None, *, n_blocks: int = AFFINITY_BLOCKS) -> int | None:
    """The routing key of a request: its session id when it has one, else its first `n_blocks`
    prompt block hashes (chained hashes: the first blocks name a conversation's start; one block
    alone is often a system prompt every request shares). None: no key (route least-loaded)."""
    if session:
        return _h64(b"s" + session.encode())
    if not blocks:
        return None
    head = [int(b) & 0xFFFFFFFFFFFFFFFF for b in blocks[:n_blocks]]
    return _h64(b"b" + struct.pack(f"<{len(head)}Q", *head))


def least_loaded(loads: Sequence[int]) -> int:
    """Index of the smallest load, ties to the first (the oldest replica)."""
    best = 0
    for i in range(1, len(loads)):
        if loads[i] < loads[best]:
            best = i
    return best


class Router:
    """Picks replicas; holds the round-robin counter and the ring of the last replica set."""

    def __init__(self, mode: RouteMode | str = RouteMode.LEAST_LOADED, *, balance: float = DEFAULT_BALANCE,
                 vnodes: int = VNODES) -> None:
        self.mode = RouteMode(mode)
        if balance < 1.0:
            raise ValueError(f"balance must be >= 1, got {balance}")
        self.balance = balance
        self.vnodes = vnodes
        self._rr = 0
        self._ring_ids: tuple[str, ...] | None = None
        self._ring_points: list[int] = []
        self._ring_owner: list[str] = []
        self.spilled = 0  # affinity picks that left the key's own replica (load bound)

    def pick(self, replica_ids: Sequence[str], loads: Sequence[int], key: int | None = None) -> int:
        """Index into `replica_ids` (oldest first) for a request; `loads[i]`: requests in replica i."""
        n = len(replica_ids)
        if n == 0:
            raise ValueError("no replica to route to")
        if len(loads) != n:
            raise ValueError(f"{n} replicas but {len(loads)} loads")
        if n == 1:
            return 0
        if self.mode is RouteMode.ROUND_ROBIN:
            i = self._rr % n
            self._rr += 1
            return i
        if self.mode is RouteMode.LEAST_LOADED or key is None:
            return least_loaded(loads)
        return self._affinity(replica_ids, loads, key)

    def _ring(self, replica_ids: Sequence[str]) -> tuple[list[int], list[str]]:
        ids = tuple(replica_ids)
        if ids != self._ring_ids:
            pts = sorted((_h64(f"{rid}#{v}".encode()), rid) for rid in ids for v in range(self.vnodes))
            self._ring_points = [p for p, _ in pts]
            self._ring_owner = [r for _, r in pts]
            self._ring_ids = ids
        return self._ring_points, self._ring_owner

    def _affinity(self, replica_ids: Sequence[str], loads: Sequence[int], key: int) -> int:
        n = len(replica_ids)
        points, owner = self._ring(replica_ids)
        index = {rid: i for i, rid in enumerate(replica_ids)}
        bound = math.ceil(self.balance * (sum(loads) + 1) / n)
        start = bisect.bisect_left(points, key & 0xFFFFFFFFFFFFFFFF) % len(points)
        first = -1
        tried: set[str] = set()
        for k in range(len(points)):
            rid = owner[(start + k) % len(points)]
            if rid in tried:
                continue
            tried.add(rid)
            i = index[rid]
            if first < 0:
                first = i
            if loads[i] < bound:
                if i != first:
                    self.spilled += 1
                return i
            if len(tried) == n:
                break
        return least_loaded(loads)  # unreachable: some load is below ceil(c (total + 1) / n)


def pick(replica_ids: Sequence[str], loads: Sequence[int], key: int | None, mode: RouteMode | str,
         *, balance: float = DEFAULT_BALANCE) -> int:
    """One-off pick (builds the ring each call; hold a `Router` to route many requests). Round-robin
    needs a counter: use a Router."""
    if RouteMode(mode) is RouteMode.ROUND_ROBIN:
        raise ValueError("round-robin keeps a counter: use Router(RouteMode.ROUND_ROBIN).pick")
    return Router(mode, balance=balance).pick(replica_ids, loads, key)
