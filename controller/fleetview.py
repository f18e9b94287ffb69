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


def fleet_from(hosts: HostBook, store: StateStore, view: ActView, to_sim: Callable[[float], float],
               policy: Any, canonical: Callable[[str], str]) -> Fleet:
    inventory = []
    for host, st in sorted(hosts.statuses.items()):
        if st.gpu is None or st.gpu_count is None:
            continue
        inventory.append(HostInventory(host, st.gpu, st.gpu_count, st.nvlink_groups, hosts.online(host),
                                       act.held_gpus(view, host)))
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
