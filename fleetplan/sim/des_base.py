"""The replay's shared state: its replicas and builds and what every part of `FleetSim` reads and writes.

FleetSim is split by concern (`des.py` the event loop; `des_world.py` the world: replicas, hosts,
GPUs and builds starting, ready, draining, stopping; `des_executor.py` how a baseline's targets
become starts and drains; `des_meter.py` GPU-hours, timeline and SLO accounting); each part is a
mixin over `FleetSimBase`, which holds the state they share."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from fleetplan.models.config_key import Role
from fleetplan.planner import act
from fleetplan.planner.types import ConfigKey, HostInventory, ReplicaState
from fleetplan.sim.control import ReplayControl
from fleetplan.sim.core import FastCore
from fleetplan.sim.des_types import Controller, Environment, ReplicaLoad, SimSettings, TimelinePoint
from fleetplan.sim.promsim import Counters, PromSim
from fleetplan.sim.traces import Trace


class _SimReplica:
    __slots__ = ("config", "core", "counters", "gpus", "host", "inflight", "load", "mi", "pooled", "port", "rid", "seq",
                 "since", "state", "t_gpu", "t_ready", "t_start", "t_stop", "template", "version")

    def __init__(self, rid: str, config: ConfigKey, host: str, gpus: tuple[int, ...], core: FastCore,
                 t_start: float, seq: int, mi: int, port: int, template: str) -> None:
        self.mi = mi
        self.port = port
        self.template = template
        self.rid = rid
        self.config = config
        self.host = host
        self.gpus = gpus
        self.core = core
        self.state = ReplicaState.STARTING
        self.t_start = t_start
        self.t_gpu: float | None = t_start  # when it took its GPUs (None: still waiting for them)
        self.t_ready: float | None = None
        self.t_stop: float | None = None
        self.since = t_start
        self.load = 0
        self.version = 0
        self.seq = seq
        self.counters = Counters()  # what its /metrics exports
        self.inflight: set[int] = set()  # request indices submitted and not finished
        self.pooled = config.role is not Role.AGGREGATED  # a prefill or decode pool's (sim/disagg_proxy.py)


@dataclass
class _SimBuild:
    row: act.BuildRow
    config: ConfigKey
    done_t: float
    done: bool = False


class FleetSimBase:
    """The state FleetSim's parts share (set by `FleetSim.__init__`) and its event heap."""

    _P_STEP, _P_LIFE, _P_SCRAPE, _P_TICK = 0, 1, 2, 3

    trace: Trace
    ctl: Controller
    env: Environment
    host_by_name: dict[str, HostInventory]  # env.hosts by name
    s: SimSettings
    n: int
    arr_t: np.ndarray
    prompt: list[int]
    output: list[int]
    blocks: list[tuple[int, ...] | None]
    model_names: list[str]
    req_model: list[int]
    first_t: np.ndarray
    finish_t: np.ndarray
    status: np.ndarray
    owner: list[_SimReplica | None]
    duration_s: float
    replicas: list[_SimReplica]
    by_id: dict[str, _SimReplica]
    serving: list[list[_SimReplica]]  # what the router sends to, per model
    heap: list[tuple[float, int, int, str, object]]
    _seq: int
    replica_scrape_hist: list[tuple[float, dict[str, ReplicaLoad]]]
    sim_builds: dict[str, _SimBuild]
    build_gpu_s: dict[str, float]
    replica_starts: int
    n_builds: int
    decisions: int
    notes: list[str]
    conflicts: int
    _rid_seq: int
    _cut: int  # requests in flight on a replica stopped before they finished
    timeline: list[TimelinePoint]
    prom: PromSim
    control: ReplayControl | None

    # -- heap
    def _push(self, t: float, prio: int, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, prio, self._seq, kind, payload))

