"""The planner's Fleet (hosts, replicas, engine builds) from the agents' reports and the state
store: what runs where, in which state since when, and which engine builds exist or are under way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetplan.controller.hosts import HostBook
from fleetplan.controller.state import Phase, StateStore
from fleetplan.planner import act
from fleetplan.planner.act import ActView
from fleetplan.planner.types import EngineBuild, Fleet, HostInventory, Replica, ReplicaState

_INVENTORY: dict[int, tuple[Any, dict[str, tuple[str, int, tuple[tuple[int, ...], ...]]]]] = {}


def policy_inventory(policy: Any) -> dict[str, tuple[str, int, tuple[tuple[int, ...], ...]]]:
    """The policy's `hosts:` as host -> (gpu, gpu_count, nvlink_groups), what a host status may not
    exceed (controller/hosts.py `agree`); one dict per loaded policy."""
    if policy is None:
        return {}
    cached = _INVENTORY.get(id(policy))
    if cached is not None and cached[0] is policy:
        return cached[1]
    inv = {h.name: (str(getattr(h.gpu, "value", h.gpu)), int(h.gpu_count), tuple(tuple(g) for g in h.nvlink_groups))
           for h in getattr(policy, "hosts", ())}
    _INVENTORY.clear()
    _INVENTORY[id(policy)] = (policy, inv)
    return inv


def fleet_from(hosts: HostBook, store: StateStore, view: ActView, to_sim: Callable[[float], float],
               policy: Any, canonical: Callable[[str], str]) -> Fleet:
    inventory = []
    agreed = hosts.reports()  # a status claiming more GPUs than the policy's inventory is cut to it
    for host, st in sorted(hosts.statuses.items()):
        if st.gpu is None or st.gpu_count is None:
            continue
        r = agreed.get(host)
        count = r.gpu_count if r is not None and r.gpu_count is not None else st.gpu_count
        groups = r.nvlink_groups if r is not None else tuple(tuple(g) for g in st.nvlink_groups)
        inventory.append(HostInventory(host, st.gpu, count, groups, hosts.online(host), act.held_gpus(view, host)))
    rep = hosts.reported()
    replicas = []
    for row in store.active_replicas():
        state = ReplicaState.STARTING
        since = row.created_s
        if row.phase == Phase.DRAINING:
            state = ReplicaState.DRAINING
            since = row.drain_started_s or row.updated_s
        elif row.replica_id in rep:
            rs = rep[row.replica_id][1]
            state = ReplicaState(rs.state.value)
            if state == ReplicaState.DRAINING:  # agent stopping it: not serving
                state = ReplicaState.STOPPED
            since = rs.since_s or since
        replicas.append(Replica(row.replica_id, row.config, row.host, row.gpu_indices, state, row.port, to_sim(since)))
    builds = []
    for host, st in hosts.statuses.items():
        for ce in st.engines_cached:
            builds.append(EngineBuild(canonical(ce.model), ce.engine, ce.gpu, ce.tp, ce.precision, host, True, None))
    for b in store.builds((Phase.DESIRED,)):  # in progress: the planner must not order it again
        config = b.config
        build_s = policy.build_s(config)
        eta = to_sim(b.created_s) + build_s if build_s is not None else None
        builds.append(EngineBuild(b.model, config.engine, config.gpu, b.tp, config.precision, b.host, False, eta))
    return Fleet(tuple(inventory), tuple(replicas), tuple(builds))
