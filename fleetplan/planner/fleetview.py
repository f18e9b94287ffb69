"""The planner's Fleet from the act core's view: hosts, replicas with their state, engine builds. Pure.

The daemon (controller/fleetview.py: the agents' statuses and the state store) and the replay
(sim/control.py: the simulated agents and the in-memory records) both build the `Fleet` the
planner sees here, from an `act.ActView`:

- inventory: every host that reported its GPUs, usable while online or offline for less than the
  grace (`usable`), with the GPUs held by builds and stopping engines (`act.held_gpus`);
- replicas: each active row; DRAINING rows are draining; otherwise the state the agent reports
  (an engine the agent is stopping serves nobody: STOPPED), STARTING until it reports;
- builds: the engines cached on the hosts (given by the adapter) and the builds in progress, each
  with its ETA from the policy's build time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from fleetplan.models.names import parse_gpu
from fleetplan.planner import act
from fleetplan.planner.host_grace import within_grace
from fleetplan.planner.types import ConfigKey, EngineBuild, Fleet, HostInventory, Replica, ReplicaState

__all__ = ["fleet_from_view", "usable"]


def usable(report: act.HostReport, now_s: float, grace_s: float) -> bool:
    """Online, or offline for less than the grace (an agent restart is not a lost host)."""
    return within_grace(report.online, report.offline_since_s, now_s=now_s, grace_s=grace_s)


def fleet_from_view(view: act.ActView, *, cached: Iterable[EngineBuild], to_sim: Callable[[float], float],
                    build_s: Callable[[ConfigKey], float | None],
                    gpu_counts: Mapping[str, int] | None = None) -> Fleet:
    """`to_sim`: the view's clock (wall) -> the planner's; `gpu_counts`: per host the GPU count to
    plan on when it differs from the report (the agreed inventory)."""
    grace = view.settings.host_offline_grace_s
    inventory = []
    for name, h in sorted(view.hosts.items()):
        if h.gpu is None or h.gpu_count is None:
            continue
        try:
            gpu = parse_gpu(h.gpu)
        except ValueError:
            continue
        count = gpu_counts.get(name, h.gpu_count) if gpu_counts is not None else h.gpu_count
        inventory.append(HostInventory(name, gpu, count, h.nvlink_groups, usable(h, view.now_s, grace),
                                       act.held_gpus(view, name)))
    rep = view.reported()
    replicas = []
    for row in view.replicas:
        state = ReplicaState.STARTING
        since = row.created_s
        if row.phase == act.Phase.DRAINING:
            state = ReplicaState.DRAINING
            since = row.drain_started_s or row.updated_s
        elif row.replica_id in rep:
            rs = rep[row.replica_id][1]
            state = rs.state
            since = rs.since_s or since
            if state == ReplicaState.DRAINING:  # the agent is stopping it: not serving
                state = ReplicaState.STOPPED
        replicas.append(Replica(row.replica_id, row.config, row.host, row.gpu_indices, state, row.port,
                                to_sim(since)))
    builds = list(cached)
    for b in view.builds:  # in progress: the planner must not order it again
        config = b.config
        seconds = build_s(config)
        eta = to_sim(b.created_s) + seconds if seconds is not None else None
        builds.append(EngineBuild(b.model, config.engine, config.gpu, b.tp, config.precision, b.host, False, eta))
    return Fleet(tuple(inventory), tuple(replicas), tuple(builds))
