"""From the plan to the actions, in order, and make-before-break. Pure.

`actions` diffs the fleet against the placed plan: starts on free GPUs first, then engine builds
(on GPUs the plan leaves free, `placement.first_free`), drains and stops of what the plan does not
keep, and last the starts that need a leaving replica's GPUs (`Action.after_stop`).
`make_before_break` is the one make-before-break rule: a READY replica is not drained while its
model's replacement capacity is still starting, unless the READY capacity without it still covers
the model's required rate; a drain it lets go while replacements start is marked `covered` for the
act core (planner/act_execute.py), which defers every other drain while its model has a replica
starting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from fleetplan.models.names import GpuType
from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.counts import CountSolution
from fleetplan.planner.placement import Placement, first_free, safe_id
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import Action, ActionKind, ConfigKey, Fleet, HostInventory, Replica, ReplicaState

__all__ = ["actions", "make_before_break"]


class _Required(Protocol):
    @property
    def required_rps(self) -> float: ...


def _free_gpus(hosts: tuple[HostInventory, ...], replicas: tuple[Replica, ...], gpu: GpuType,
               tp: int, drained: frozenset[str]) -> tuple[str, tuple[int, ...]] | None:
    used: dict[str, set[int]] = {}
    for r in replicas:
        used.setdefault(r.host, set()).update(r.gpu_indices)
    for h in hosts:
        if h.gpu != gpu or not h.online or h.name in drained:
            continue
        spot = first_free(h.groups(), used.get(h.name, set()), tp)
        if spot is not None:
            return h.name, spot
    return None


def actions(
    fleet: Fleet,
    now_place: Placement,
    target_sol: CountSolution,
    needs_build: list[ConfigKey],
    policy: Policy,
    hosts: tuple[HostInventory, ...],
    drained: frozenset[str],
    ready: frozenset[ConfigKey],
    engine_hosts: Mapping[ConfigKey, frozenset[str]] | None = None,
    spread: Sequence[ConfigKey] = (),
) -> list[Action]:
    """`spread`: configs whose engine some hosts hold, built on one more host (not a holder)."""
    builds: list[Action] = []
    in_progress = {b.config() for b in fleet.builds if not b.ready}
    occupied = tuple(r for r in fleet.replicas if r.state != ReplicaState.STOPPED) + now_place.new
    holders = engine_hosts or {}
    for c in [*needs_build, *spread]:
        if c in in_progress:
            continue
        skip = drained | holders.get(c, frozenset())
        spot = _free_gpus(hosts, occupied, c.gpu, c.tp, skip)
        host, idx = spot if spot is not None else (None, ())
        if host is None:
            candidates = [h.name for h in hosts if h.gpu == c.gpu and h.online and h.name not in skip]
            host = candidates[0] if candidates else ""
        rep = Replica(safe_id(f"build_{c.model}_{c.engine.value}_{c.gpu.value}_tp{c.tp}_{c.precision.value}"), c,
                      host, idx, ReplicaState.STARTING, None, None)
        b_s = policy.build_s(c) or 0.0
        why = (f"target uses {c.label()}; engine not built (build ~{b_s:.0f} s)" if c not in holders else
               f"{c.label()} runs only where its engine is ({', '.join(sorted(holders[c]))}) and the target "
               f"fills those hosts: engine built on {host} too (build ~{b_s:.0f} s)")
        if spot is None:
            why += "; no free GPUs of that type now, build waits for GPUs"
        builds.append(Action(ActionKind.BUILD, rep, why))
        occupied = (*occupied, rep)

    online = {h.name for h in hosts if h.online}
    kept_ids = {id(r) for r in now_place.kept}
    removed_gpus: dict[str, set[int]] = {}
    for r in fleet.replicas:
        if id(r) not in kept_ids and r.state != ReplicaState.STOPPED:
            removed_gpus.setdefault(r.host, set()).update(r.gpu_indices)
    starts_free: list[Action] = []
    starts_after: list[Action] = []
    for r in now_place.new:
        why = f"start {r.config.label()} on {r.host} GPUs {list(r.gpu_indices)}"
        freed = removed_gpus.get(r.host)
        if freed and not freed.isdisjoint(r.gpu_indices):
            starts_after.append(Action(ActionKind.START, r, why + " (after the replica there stops)",
                                       after_stop=True, hosts=holders.get(r.config)))
        else:
            starts_free.append(Action(ActionKind.START, r, why, hosts=holders.get(r.config)))

    drains: list[Action] = []
    stops: list[Action] = []
    for r in sorted(fleet.replicas, key=lambda r: r.replica_id):
        if id(r) in kept_ids or r.state == ReplicaState.STOPPED:
            continue
        if r.state == ReplicaState.FAILED:
            stops.append(Action(ActionKind.STOP, r, "replica failed"))
            continue
        why = ("host drained for maintenance" if r.host in drained
               else "host offline" if r.host not in online
               else "not in the plan (surplus, replaced or invalid placement)")
        if r.state == ReplicaState.READY:
            drains.append(Action(ActionKind.DRAIN, r, why))
            stops.append(Action(ActionKind.STOP, r, why + "; after drain"))
        elif r.state == ReplicaState.DRAINING:
            stops.append(Action(ActionKind.STOP, r, "drain in progress; stop when drained"))
        else:
            stops.append(Action(ActionKind.STOP, r, why + " (not serving yet)"))
    # serving capacity first: starts on free GPUs, then engine builds, drains, stops, starts on freed GPUs
    return [*starts_free, *builds, *drains, *stops, *starts_after]


def make_before_break(
    actions: list[Action],
    fleet: Fleet,
    now_place: Placement,
    capacities: Mapping[ConfigKey, CapacityInfo],
    demands: Mapping[str, _Required],
    hosts: tuple[HostInventory, ...],
) -> tuple[list[Action], dict[str, int]]:
    """Never drain a READY replica while its model's replacement capacity is still starting (or its
    engine is still being built), unless the READY capacity without it still covers the model's
    required rate (demand x (1 + headroom)).

    A held replica gets no DRAIN/STOP this cycle (the next cycle decides again, with the
    replacements' progress in the fleet); a START waiting for the GPUs of a held replica is dropped
    too (it could not launch before that replica stops). Replacement capacity = STARTING replicas the
    plan keeps (not waiting for another replica's GPUs) + STARTs on free GPUs this cycle. When the
    only replacement needs the leaving replica's GPUs there is nothing to make first: the swap
    rolls, one replica out of service at a time (drained, stopped, its replacement started on its
    GPUs and READY) while the READY capacity without it is short of the required rate; without
    that, a full inventory swapping 3 vLLM replicas for TRT-LLM drained all three in one cycle.
    """
    online = {h.name for h in hosts if h.online}
    kept_ids = {id(r) for r in now_place.kept}
    live = [r for r in fleet.replicas if r.state != ReplicaState.STOPPED]

    def cap(c: ConfigKey) -> float:
        info = capacities.get(c)
        return info.max_rps if info is not None and math.isfinite(info.max_rps) else 0.0

    def overlaps(r: Replica, others: list[Replica]) -> bool:
        return any(o is not r and o.host == r.host and set(o.gpu_indices) & set(r.gpu_indices) for o in others)

    pending: set[str] = set()
    for r in live:
        if r.state == ReplicaState.STARTING and id(r) in kept_ids and not overlaps(
                r, [o for o in live if o.state != ReplicaState.STARTING]):
            pending.add(r.config.model)
    for a in actions:
        if a.kind is ActionKind.START and not a.after_stop:
            pending.add(a.replica.config.model)
        if a.kind is ActionKind.BUILD:  # the replacement waits for its engine: it is coming too
            pending.add(a.replica.config.model)
    pending.update(b.model for b in fleet.builds if not b.ready)
    # replacements that can only start on the GPUs of replicas leaving (a full inventory): the swap
    # rolls one replica at a time while READY capacity without it falls short of the required rate
    rolling = {a.replica.config.model for a in actions
               if a.kind is ActionKind.START and a.after_stop} - pending
    in_flight = {r.config.model for r in live if r.state == ReplicaState.DRAINING
                 or (r.state == ReplicaState.STARTING and id(r) in kept_ids)}
    ready_cap: dict[str, float] = {}
    for r in live:
        if r.state == ReplicaState.READY and r.host in online:
            ready_cap[r.config.model] = ready_cap.get(r.config.model, 0.0) + cap(r.config)
    held: list[Replica] = []
    covered: set[str] = set()  # drains the READY capacity left covers: no need to wait for anything
    leaving = sorted((a.replica for a in actions if a.kind is ActionKind.DRAIN
                      and a.replica.state == ReplicaState.READY and a.replica.host in online),
                     key=lambda r: (cap(r.config), r.replica_id))
    for r in leaving:
        m = r.config.model
        d = demands.get(m)
        need = d.required_rps if d is not None else 0.0
        short = ready_cap.get(m, 0.0) - cap(r.config) < need - 1e-9
        if not short:
            covered.add(r.replica_id)
        if m in pending and short:
            held.append(r)
        elif m in rolling and short and m in in_flight:
            held.append(r)  # one at a time: the previous one's replacement is not READY yet
        else:
            ready_cap[m] = ready_cap.get(m, 0.0) - cap(r.config)
            if m in rolling and short:
                in_flight.add(m)
    held_ids = {r.replica_id for r in held}
    out: list[Action] = []
    for a in actions:
        if a.kind in (ActionKind.DRAIN, ActionKind.STOP) and a.replica.replica_id in held_ids:
            continue
        if a.kind is ActionKind.DRAIN and a.replica.replica_id in covered:
            a = replace(a, covered=True)
        if a.kind is ActionKind.START and any(h.host == a.replica.host and set(h.gpu_indices)
                                               & set(a.replica.gpu_indices) for h in held):
            continue
        out.append(a)
    counts: dict[str, int] = {}
    for r in held:
        counts[r.config.model] = counts.get(r.config.model, 0) + 1
    return out, counts
