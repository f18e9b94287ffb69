"""Stage 2: put each replica's TP group on GPUs of one host and one NVLink group.

Running replicas that the counts keep stay where they are (same host, same GPU indices, same id).
New replicas are packed best-fit-decreasing over NVLink groups (segments), bucketed by free GPU
count, so 1000 hosts place in milliseconds. For TP sizes that divide each other (1, 2, 4, 8),
best-fit-decreasing from an empty fleet is optimal: the slot constraints of stage 1 are then
exactly the feasible counts (tests compare it with a per-host CP-SAT model). Kept replicas can
fragment groups; a replica that does not fit is retried on GPUs freed by replicas being removed,
then by a local repair (move a few smaller kept replicas), then by repacking the GPU type from
scratch, and only then returned as unplaced (the caller tightens stage 1 and re-solves).

Disaggregated pools (`ConfigKey.role`): a family's new replicas (one model, engine, GPU type and
precision: `disagg_counts.family_of`) are placed so that prefill replicas share a host with a
decode replica of their family, whose KV then moves over the host's own link, greedily: the
family's decode replicas go first, each on the emptiest NVLink group (on a host that holds the
family's prefill replicas and no decode replica first, the most of them first), then its prefill
replicas on the hosts that hold a decode replica and have room, the fewest of the family's prefill
replicas first; the rest are placed as any replica (their KV moves over the network). Kept
replicas stay and count as partners. Pairing is a preference as spreading is: when it leaves
anything unplaced, the plain best fit places the replicas. Configs without pools take none of
these steps (no pairing state is built for them). `paired_prefill` counts the pairs placed.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from fleetplan.models.config_key import Role
from fleetplan.models.names import GpuType
from fleetplan.planner.disagg_counts import FamilyKey, family_of
from fleetplan.planner.types import ConfigKey, HostInventory, Replica, ReplicaState

LIVE_STATES = (ReplicaState.STARTING, ReplicaState.READY)
# Spreading looks at this many segments per free-count bucket for a host without the model, so that
# a model with thousands of replicas still places in linear time (a bucket's first segments are the
# model's own hosts only while it fills them: taken segments leave their bucket).
SPREAD_SCAN = 256


@dataclass(frozen=True)
class Placement:
    replicas: tuple[Replica, ...]  # kept + new, sorted by (host, first GPU)
    kept: tuple[Replica, ...]
    new: tuple[Replica, ...]
    removed: tuple[Replica, ...]  # live replicas of the current fleet not in the plan
    unplaced: Mapping[ConfigKey, int]


def first_free(groups: Sequence[Sequence[int]], busy: Collection[int], tp: int) -> tuple[int, ...] | None:
    """The one free-GPU rule outside the solver: the first `tp` GPUs not `busy` inside one NVLink
    group, groups in order (the planner's build spots, the act core's moved starts, the replay's
    baselines all ask it).

    >>> first_free(((0, 1, 2, 3), (4, 5, 6, 7)), {0, 1, 4}, 2)
    (2, 3)
    >>> first_free(((0, 1), (2, 3)), {0, 2}, 2) is None  # two free GPUs, but not in one group
    True
    """
    for g in groups:
        free = [i for i in g if i not in busy]
        if len(free) >= tp:
            return tuple(free[:tp])
    return None


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def safe_id(raw: str) -> str:
    """An id the agent protocol accepts ([A-Za-z0-9][A-Za-z0-9_-]{0,63}); long ones get a hash suffix."""
    text = _UNSAFE.sub("-", raw).lstrip("-_") or "x"
    if len(text) <= 64:
        return text
    return text[:51].rstrip("-_") + "_" + hashlib.sha1(raw.encode()).hexdigest()[:12]


def new_replica_id(config: ConfigKey, host: str, gpu_indices: Sequence[int]) -> str:
    gpus = "-".join(map(str, gpu_indices))
    return safe_id(f"{config.model}_{config.engine.value}_tp{config.tp}_{host}_g{gpus}")


class _Segments:
    """Free GPUs per (host, NVLink group) of one GPU type, bucketed by free count (best fit)."""

    def __init__(self, segs: list[tuple[str, list[int]]]) -> None:
        self.segs = segs  # (host, sorted free GPU indices)
        self.of_host: dict[str, list[int]] = {}  # host -> its segments (for `take(only=...)`)
        for i, (host, _) in enumerate(segs):
            self.of_host.setdefault(host, []).append(i)
        self.buckets: dict[int, list[int]] = {}  # free count -> heap of segment indices (may be stale)
        self.members: dict[int, dict[int, None]] = {}  # free count -> the segments with it (ordered set)
        for i, (_, free) in enumerate(segs):
            self._push(i, len(free))
        self.max_free = max((len(f) for _, f in segs), default=0)

    def _push(self, i: int, k: int) -> None:
        if k > 0:
            heapq.heappush(self.buckets.setdefault(k, []), i)
            self.members.setdefault(k, {})[i] = None

    def take(self, tp: int, avoid: Collection[str] = (), only: Collection[str] | None = None,
             largest: bool = False) -> tuple[str, tuple[int, ...]] | None:
        """`tp` GPUs of one segment: the best fit on a host not in `avoid` (hosts that already run
        the model), else the best fit anywhere; with `only`, on one of those hosts (the hosts that
        hold the config's built engine). `largest`: the segment with the most free GPUs instead of
        the best fit (a decode replica leaves room for prefill partners beside it)."""
        if only is not None:
            # best fit among those hosts' segments, a host not in `avoid` first (O(their segments))
            fits = [(host in avoid, -len(self.segs[i][1]) if largest else len(self.segs[i][1]), i)
                    for host in only for i in self.of_host.get(host, ()) if len(self.segs[i][1]) >= tp]
            return self._cut(min(fits)[2], tp) if fits else None
        sizes = range(self.max_free, tp - 1, -1) if largest else range(tp, self.max_free + 1)
        if avoid:
            segs, members = self.segs, self.members
            for k in sizes:
                bucket = members.get(k)
                if bucket:
                    for i in islice(bucket, SPREAD_SCAN):
                        if segs[i][0] not in avoid:
                            return self._cut(i, tp)  # its heap entry is stale from now on
        if largest:
            for k in sizes:
                bucket = self.members.get(k)
                if bucket:
                    return self._cut(next(iter(bucket)), tp)
            return None
        for k in range(tp, self.max_free + 1):
            heap = self.buckets.get(k)
            while heap:
                i = heapq.heappop(heap)
                if len(self.segs[i][1]) == k:  # else a stale entry
                    return self._cut(i, tp)
        return None

    def _cut(self, i: int, tp: int) -> tuple[str, tuple[int, ...]]:
        host, free = self.segs[i]
        del self.members[len(free)][i]
        got = tuple(free[:tp])
        del free[:tp]
        self._push(i, len(free))
        return host, got


def _segments_for(hosts: Sequence[HostInventory], used: Mapping[str, set[int]]) -> list[tuple[str, list[int]]]:
    segs: list[tuple[str, list[int]]] = []
    for h in sorted(hosts, key=lambda h: h.name):
        taken = used.get(h.name, set())
        for g in h.groups():
            free = sorted(i for i in g if i not in taken and 0 <= i < h.gpu_count)
            if free:
                segs.append((h.name, free))
    return segs


def _keep_order(r: Replica) -> tuple[int, float, str]:
    ready_first = 0 if r.state == ReplicaState.READY else 1
    return (ready_first, r.since_s if r.since_s is not None else float("inf"), r.replica_id)


def _valid_location(r: Replica, host: HostInventory | None) -> bool:
    if host is None or not host.online or host.gpu != r.config.gpu:
        return False
    if len(r.gpu_indices) != r.config.tp or len(set(r.gpu_indices)) != len(r.gpu_indices):
        return False
    return any(set(r.gpu_indices) <= set(g) for g in host.groups())


def place(
    counts: Mapping[ConfigKey, int],
    hosts: Sequence[HostInventory],
    current: Sequence[Replica] = (),
    unusable_hosts: frozenset[str] = frozenset(),
    engine_hosts: Mapping[ConfigKey, Collection[str]] | None = None,
) -> Placement:
    """Place `counts` replicas; keep live current replicas in place where the counts allow.
    `engine_hosts`: configs whose built engine only some hosts hold; their new replicas go there
    only (an agent refuses a replica of an engine it does not hold). Such configs place first."""
    only = engine_hosts or {}
    usable = [h for h in hosts if h.online and h.name not in unusable_hosts]
    by_name = {h.name: h for h in usable}
    remaining = {c: n for c, n in counts.items() if n > 0}

    used: dict[str, set[int]] = {}
    kept: list[Replica] = []
    removed: list[Replica] = []
    live = sorted((r for r in current if r.state in LIVE_STATES), key=_keep_order)
    for r in live:
        host = by_name.get(r.host)
        taken = used.setdefault(r.host, set())
        if (remaining.get(r.config, 0) > 0 and _valid_location(r, host)
                and not (set(r.gpu_indices) & taken)):
            remaining[r.config] -= 1
            taken.update(r.gpu_indices)
            kept.append(r)
        else:
            removed.append(r)
    for h in usable:  # builds and engines still stopping: never for new replicas
        if h.held_gpus:
            used.setdefault(h.name, set()).update(h.held_gpus)
    # GPUs still held by replicas that are being removed (draining/stopping) are used only as a
    # second resort, so that new replicas can start before the old ones stop.
    held: dict[str, set[int]] = {h: set(s) for h, s in used.items()}
    kept_ids = {id(r) for r in kept}
    for r in current:
        if r.state in (ReplicaState.DRAINING, *LIVE_STATES) and id(r) not in kept_ids:
            held.setdefault(r.host, set()).update(r.gpu_indices)

    todo = sorted(((c, k) for c, k in remaining.items() if k > 0),
                  key=lambda ck: (ck[0] not in only, -ck[0].tp, ck[0]))
    new: list[Replica] = []
    unplaced: dict[ConfigKey, int] = {}
    gpus_of = sorted({c.gpu for c, _ in todo})
    for gpu in gpus_of:
        ghosts = [h for h in usable if h.gpu == gpu]
        items = [(c, k) for c, k in todo if c.gpu == gpu]
        placed: list[Replica] = []
        left = _pack(items, _segments_for(ghosts, held), placed, spread_from=[*kept, *new], only=only,
                     paired_with=kept)
        if left:
            # second pass: GPUs of replicas being removed become usable (start after their stop)
            taken_now: dict[str, set[int]] = {h: set(s) for h, s in used.items()}
            for r in placed:
                taken_now.setdefault(r.host, set()).update(r.gpu_indices)
            left = _pack(left, _segments_for(ghosts, taken_now), placed, only=only, paired_with=[*kept, *placed])
        if left:
            # third pass: local repair: move a few small kept replicas out of the way
            taken_now = {h: set(s) for h, s in used.items()}
            for r in placed:
                taken_now.setdefault(r.host, set()).update(r.gpu_indices)
            fixed = _repair(left, ghosts, taken_now, [r for r in kept if r.config.gpu == gpu], only)
            if fixed is not None:
                moved_new, evicted = fixed
                placed += moved_new
                gone = {id(r) for r in evicted}
                kept = [r for r in kept if id(r) not in gone]
                removed += evicted
                left = []
        if left:
            # fourth pass: kept replicas fragment the groups; repack this GPU type from scratch
            # (exact for TP sizes dividing each other) and keep whatever lands where it already is
            all_items = sorted(((c, k) for c, k in counts.items() if k > 0 and c.gpu == gpu),
                               key=lambda ck: (ck[0] not in only, -ck[0].tp, ck[0]))
            fresh: list[Replica] = []
            held_only = {h.name: set(h.held_gpus) for h in ghosts if h.held_gpus}
            if not _pack(all_items, _segments_for(ghosts, held_only), fresh, only=only):
                where = {(r.config, r.host, r.gpu_indices): r for r in live if r.config.gpu == gpu}
                old_kept = [r for r in kept if r.config.gpu == gpu]
                kept = [r for r in kept if r.config.gpu != gpu]
                placed = []
                for r in fresh:
                    same = where.pop((r.config, r.host, r.gpu_indices), None)
                    if same is not None:
                        kept.append(same)
                    else:
                        placed.append(r)
                now_kept = {id(r) for r in kept}
                removed += [r for r in old_kept if id(r) not in now_kept]
                left = []
        new += placed
        for c, k in left:
            unplaced[c] = k
    kept.sort(key=_keep_order)
    allr = sorted([*kept, *new], key=lambda r: (r.host, r.gpu_indices, r.replica_id))
    return Placement(tuple(allr), tuple(kept), tuple(sorted(new, key=lambda r: r.replica_id)),
                     tuple(removed), unplaced)


def _repair(
    items: Sequence[tuple[ConfigKey, int]],
    hosts: Sequence[HostInventory],
    taken: Mapping[str, set[int]],
    movable: Sequence[Replica],
    only: Mapping[ConfigKey, Collection[str]] | None = None,
) -> tuple[list[Replica], list[Replica]] | None:
    """Place `items` by evicting the fewest GPUs' worth of strictly smaller kept replicas from one
    NVLink group each time, then re-placing the evicted ones the same way (sizes strictly decrease,
    so this ends). Returns (new replicas, evicted replicas), or None when it cannot place them all.
    Simulated on copies: nothing changes unless everything fits."""
    busy = {h: set(s) for h, s in taken.items()}
    segs = [(h.name, tuple(g)) for h in sorted(hosts, key=lambda h: h.name) for g in h.groups() if g]
    mov: dict[str, dict[int, Replica]] = {}
    for r in movable:
        mov.setdefault(r.host, {})[id(r)] = r
    queue: list[ConfigKey] = sorted((c for c, k in items for _ in range(k)), key=lambda c: (-c.tp, c))
    placed: list[Replica] = []
    evicted: list[Replica] = []
    steps = 0
    while queue:
        steps += 1
        if steps > 10_000:
            return None
        c = queue.pop(0)
        allowed = (only or {}).get(c)
        best_fit: tuple[int, int] | None = None  # (free count, segment index)
        for si, (host, group) in enumerate(segs):
            if allowed is not None and host not in allowed:
                continue
            free = sum(1 for i in group if i not in busy.get(host, ()))
            if free >= c.tp and (best_fit is None or free < best_fit[0]):
                best_fit = (free, si)
        if best_fit is None:
            best: tuple[int, int, list[Replica]] | None = None  # (GPUs moved, segment, replicas)
            for si, (host, group) in enumerate(segs):
                if len(group) < c.tp or (allowed is not None and host not in allowed):
                    continue
                gset = set(group)
                free = sum(1 for i in group if i not in busy.get(host, ()))
                occ = sorted((r for r in mov.get(host, {}).values() if set(r.gpu_indices) <= gset
                              and r.config.tp < c.tp), key=lambda r: (r.config.tp, r.replica_id))
                chosen: list[Replica] = []
                for r in occ:
                    if free >= c.tp:
                        break
                    chosen.append(r)
                    free += r.config.tp
                if free >= c.tp:
                    cost = sum(r.config.tp for r in chosen)
                    if best is None or cost < best[0]:
                        best = (cost, si, chosen)
            if best is None:
                return None
            _, si, chosen = best
            host = segs[si][0]
            for r in chosen:
                del mov[host][id(r)]
                busy[host] -= set(r.gpu_indices)
                evicted.append(r)
                queue.append(r.config)
            queue.sort(key=lambda c: (-c.tp, c))
            best_fit = (0, si)
        host, group = segs[best_fit[1]]
        idx = tuple(i for i in group if i not in busy.get(host, ()))[: c.tp]
        busy.setdefault(host, set()).update(idx)
        placed.append(Replica(new_replica_id(c, host, idx), c, host, idx, ReplicaState.STARTING, None, None))
    # an evicted replica re-placed exactly where it was is not moved at all
    back = {(r.config, r.host, r.gpu_indices): r for r in evicted}
    out: list[Replica] = []
    for r in placed:
        if back.pop((r.config, r.host, r.gpu_indices), None) is None:
            out.append(r)
    return out, list(back.values())


def _pack(items: Sequence[tuple[ConfigKey, int]], segs: list[tuple[str, list[int]]], out: list[Replica],
          spread_from: Sequence[Replica] | None = None,
          only: Mapping[ConfigKey, Collection[str]] | None = None,
          paired_with: Sequence[Replica] = ()) -> list[tuple[ConfigKey, int]]:
    """Best-fit-decreasing of `items` into the free GPUs `segs` (_segments_for), appending to `out`; returns what did not fit.

    With `spread_from` (the replicas already placed), a model's new replica goes to a host that
    runs none of that model's replicas yet when one has room, so that one lost host does not take
    all of a model's serving capacity. Spreading can fragment NVLink groups, so it is only a
    preference: when the spread packing leaves anything unplaced, the plain best fit is used.
    Example: 3 hosts of 8 GPUs, 2 TP4 replicas of one model: best fit puts both on the first host;
    spread puts them on two hosts.

    Where `items` hold pool configs, their replicas pair (the module docstring) with each other and
    with the pool replicas of `paired_with` (those already on the hosts); pairing is a preference
    too: spread and paired, else paired, else the plain best fit (in the order of `items`)."""
    pairs = _Pairs(paired_with) if any(c.role is not Role.AGGREGATED for c, _ in items) else None
    ordered = _decode_first(items) if pairs is not None else items
    if spread_from is not None:
        trial: list[Replica] = []
        if not _pack_into(ordered, _Segments([(h, list(free)) for h, free in segs]), trial,
                          _hosts_by_model(spread_from), only, pairs.copy() if pairs is not None else None):
            out += trial
            return []
    if pairs is not None:
        trial = []
        if not _pack_into(ordered, _Segments([(h, list(free)) for h, free in segs]), trial, None, only, pairs):
            out += trial
            return []
    return _pack_into(items, _Segments(segs), out, None, only)


def _hosts_by_model(replicas: Sequence[Replica]) -> dict[str, set[str]]:
    by_model: dict[str, set[str]] = {}
    for r in replicas:
        by_model.setdefault(r.config.model, set()).add(r.host)
    return by_model


def _decode_first(items: Sequence[tuple[ConfigKey, int]]) -> list[tuple[ConfigKey, int]]:
    """`items` with each pool family's decode configs moved just before its first prefill config
    (a prefill replica pairs with a decode replica placed before it), the order otherwise kept."""
    decode: dict[FamilyKey, list[tuple[ConfigKey, int]]] = {}
    for c, k in items:
        f = family_of(c)
        if f is not None and c.role is Role.DECODE:
            decode.setdefault(f, []).append((c, k))
    out: list[tuple[ConfigKey, int]] = []
    for c, k in items:
        f = family_of(c)
        if f is not None and f in decode:
            out += decode.pop(f)
        if c.role is not Role.DECODE:
            out.append((c, k))
    return out


class _Pairs:
    """Per pool family and role, its replicas per host (those kept and those placed so far)."""

    def __init__(self, replicas: Iterable[Replica] = ()) -> None:
        self.on: dict[tuple[FamilyKey, Role], dict[str, int]] = {}
        for r in replicas:
            f = family_of(r.config)
            if f is not None:
                self.add(f, r.config.role, r.host)

    def copy(self) -> _Pairs:
        other = _Pairs()
        other.on = {k: dict(v) for k, v in self.on.items()}
        return other

    def add(self, f: FamilyKey, role: Role, host: str) -> None:
        on = self.on.setdefault((f, role), {})
        on[host] = on.get(host, 0) + 1

    def partners(self, f: FamilyKey, role: Role, allowed: Collection[str] | None) -> list[tuple[int, str]]:
        """A heap of the hosts where a replica of `role` pairs: for a prefill replica those with a
        decode replica of the family, the fewest of its prefill replicas first; for a decode
        replica those with its prefill replicas and no decode replica, the most of them first."""
        pre = self.on.get((f, Role.PREFILL), {})
        dec = self.on.get((f, Role.DECODE), {})
        if role is Role.PREFILL:
            heap = [(pre.get(h, 0), h) for h in dec if allowed is None or h in allowed]
        else:
            heap = [(-n, h) for h, n in pre.items() if h not in dec and (allowed is None or h in allowed)]
        heapq.heapify(heap)
        return heap


def _take_paired(segs: _Segments, heap: list[tuple[int, str]], c: ConfigKey) -> tuple[str, tuple[int, ...]] | None:
    """`c.tp` GPUs on the first host of `heap` (`_Pairs.partners`) with room; hosts without room
    leave the heap (for this config: room only shrinks), a prefill replica's host goes back with one more."""
    while heap:
        n, host = heapq.heappop(heap)
        spot = segs.take(c.tp, only=(host,))  # the best fit among that host's segments
        if spot is not None:
            if c.role is Role.PREFILL:
                heapq.heappush(heap, (n + 1, host))
            return spot
    return None


def _pack_into(items: Sequence[tuple[ConfigKey, int]], segs: _Segments, out: list[Replica],
               model_hosts: dict[str, set[str]] | None,
               only: Mapping[ConfigKey, Collection[str]] | None = None,
               pairs: _Pairs | None = None) -> list[tuple[ConfigKey, int]]:
    left: list[tuple[ConfigKey, int]] = []
    for c, k in items:
        missing = 0
        avoid: set[str] | None = model_hosts.setdefault(c.model, set()) if model_hosts is not None else None
        allowed = (only or {}).get(c)
        f = family_of(c) if pairs is not None else None
        heap = pairs.partners(f, c.role, allowed) if pairs is not None and f is not None else None
        for _ in range(k):
            spot = _take_paired(segs, heap, c) if heap else None
            if spot is None:
                spot = segs.take(c.tp, avoid or (), allowed, largest=pairs is not None and c.role is Role.DECODE)
            if spot is None:
                missing += 1
                continue
            host, idx = spot
            if avoid is not None:
                avoid.add(host)
            if pairs is not None and f is not None:
                pairs.add(f, c.role, host)
            out.append(Replica(new_replica_id(c, host, idx), c, host, idx, ReplicaState.STARTING, None, None))
        if missing:
            left.append((c, missing))
    return left


def paired_prefill(replicas: Sequence[Replica]) -> dict[str, int]:
    """Per model with prefill replicas in `replicas`, how many share a host with a decode replica of
    their family (their KV moves over the host's own link; the others' over the network).

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> p = ConfigKey("m", Engine.VLLM, GpuType.H100, 1, Precision.BF16, Role.PREFILL)
    >>> d = ConfigKey("m", Engine.VLLM, GpuType.H100, 1, Precision.BF16, Role.DECODE)
    >>> rs = [Replica(f"r{i}", c, h, (i,), ReplicaState.READY) for i, (c, h) in
    ...       enumerate([(d, "h0"), (p, "h0"), (p, "h0"), (p, "h1")])]
    >>> paired_prefill(rs)
    {'m': 2}
    """
    decode = {(family_of(r.config), r.host) for r in replicas if r.config.role is Role.DECODE}
    out: dict[str, int] = {}
    for r in replicas:
        if r.config.role is Role.PREFILL:
            out[r.config.model] = out.get(r.config.model, 0) + ((family_of(r.config), r.host) in decode)
    return out


def slots_by_gpu(hosts: Sequence[HostInventory], tp_sizes: Sequence[int],
                 unusable_hosts: frozenset[str] = frozenset()) -> dict[GpuType, dict[int, int]]:
    """TP groups of each size that fit per GPU type (stage 1's inventory), from NVLink groups."""
    shapes: dict[tuple[GpuType, tuple[int, ...]], int] = {}  # hosts per (type, group sizes): a fleet has few
    for h in hosts:
        if h.online and h.name not in unusable_hosts:
            shape = (h.gpu, tuple(len(g) for g in h.groups()))
            shapes[shape] = shapes.get(shape, 0) + 1
    out: dict[GpuType, dict[int, int]] = {}
    for (gpu, sizes), n in shapes.items():
        d = out.setdefault(gpu, {})
        for t in tp_sizes:
            d[t] = d.get(t, 0) + n * sum(size // t for size in sizes)
    return out
