"""The replay's types: what it is given (the world, its settings, the baselines' view and decisions)
and what it returns (SimResult and its timeline)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fleetplan.models.config_key import Role
from fleetplan.models.disagg import IB_NDR_400G, KvLink
from fleetplan.planner.types import ConfigKey, Fleet, HostInventory
from fleetplan.sim.control import FleetplanController
from fleetplan.sim.groundtruth import EngineParams
from fleetplan.sim.router import RouteMode
from fleetplan.sim.slo_periods import MissMinutes, PeriodJudgement

# request status codes
PENDING, SERVED, REJECTED = 0, 1, 2


@dataclass(frozen=True)
class ReplicaLoad:
    running: float
    waiting: float
    kv_usage: float


@dataclass(frozen=True)
class ControllerView:
    t_s: float  # simulated seconds since the start of the trace
    epoch_s: float  # the same instant as epoch seconds (for the planner's schedules)
    fleet: Fleet
    replica_load: Mapping[str, ReplicaLoad]  # as last scraped, READY replicas only


@dataclass(frozen=True)
class Decision:
    """A baseline's target replica counts per config (they model other controllers; fleetplan runs
    the daemon's own decision path, fleetplan.sim.control)."""

    targets: Mapping[ConfigKey, int] | None = None
    note: str = ""


class Baseline(Protocol):
    name: str
    period_s: float

    def decide(self, view: ControllerView) -> Decision: ...


Controller = Baseline | FleetplanController


@dataclass(frozen=True)
class Environment:
    """What the simulated world is made of (from the policy file)."""

    hosts: tuple[HostInventory, ...]
    price_usd_h: Mapping[str, float]  # GPU type value -> $/GPU-hour
    params_for: Callable[[ConfigKey], EngineParams]  # ground-truth engine of a config
    startup_s: Callable[[ConfigKey], float]
    build_s: Callable[[ConfigKey], float | None]  # None: no build step for this engine
    cached: frozenset[ConfigKey]  # configs whose engine build exists at t = 0
    ttft_slo_ms: Mapping[str, float]  # per model
    itl_slo_ms: Mapping[str, float]
    # per model: the SLO's objective and rolling period (the replay is judged window by window on
    # them: sim/slo_periods.py); a model left out: 0.99 over an hour
    slo_objective: Mapping[str, float] = field(default_factory=dict)
    slo_period_s: Mapping[str, float] = field(default_factory=dict)
    epoch0_s: float = 1_767_571_200.0  # 2026-01-05 00:00 UTC (a Monday) = simulated t 0


@dataclass(frozen=True)
class SimSettings:
    scrape_s: float = 15.0
    scrape_delay_s: float = 5.0  # a scrape becomes visible this long after it is taken
    # each target is scraped at its own offset within the interval, one of this many (Prometheus
    # offsets a target by a hash of its labels: scrape/target.go); 1: every target at once, on the
    # cycles' grid (the default while the difference is open: docs/decisions/0007)
    scrape_offsets: int = 1
    # the observation windows: the daemon's defaults (controller/settings.py; `fleetplan evaluate
    # --controller-config` takes them from the daemon's own config: fleetplan/harness/replay_settings.py)
    window_s: float = 60.0  # rate()/histogram window
    history_s: float = 86400.0
    history_step_s: float = 30.0
    timeline_s: float = 10.0  # resolution of the demand/capacity timeline
    demand_window_s: float = 60.0  # true demand for timeline / lag / unmet: trailing window
    warm_start: bool = True  # the fleet at t=0 is what the controller wants for the first window
    seed: int = 0
    macro_steps: bool = True
    peak_window_s: float = 30.0  # the Observer's burst sub-window (controller ObserverConfig.peak_window_s)
    length_window_s: float = 600.0  # the length histograms' window (ObserverConfig.length_window_s)
    # the engines' prefix caches hold the trace's shared prompt blocks (hash_ids; vLLM's automatic
    # prefix caching is on by default); False: every prompt computed in full
    prefix_cache: bool = True
    routing: RouteMode = RouteMode.LEAST_LOADED  # how the router spreads requests over replicas
    drain_timeout_s: float = 3600.0  # after the trace ends, in-flight requests get this long
    # the hosts share one engine cache directory (NFS and the like): a finished build is held by every
    # host of its GPU type, as their agents find its manifest (controller/agent.py `_scan_engine_cache`);
    # False: only the host that built it holds it
    shared_engine_cache: bool = False
    # the link a KV cache takes between a prefill and a decode replica on different hosts (one
    # host: its NVLink or PCIe, models.disagg.host_link); default one 400 Gb/s NIC per GPU (DGX H100)
    kv_network_link: KvLink = IB_NDR_400G


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelinePoint:
    t_s: float
    demand_rps: float  # true arrivals over the trailing demand window
    ready: tuple[tuple[ConfigKey, int], ...]  # READY replicas per config
    ready_gpus: int
    gpus: int  # all GPUs held (starting, ready, draining, building)


@dataclass(frozen=True)
class SimResult:
    policy: str
    duration_s: float
    arrived: int
    served: int
    rejected: int  # no READY replica, or a request too long for the engine
    unfinished: int  # still in flight when the drain timeout ended the run
    slo_met: int
    gpu_hours: float
    build_gpu_hours: float
    cost_usd: float
    ttft_ms: np.ndarray  # per served request
    itl_ms: np.ndarray  # per served request with >= 2 output tokens (mean inter-token time)
    replica_starts: int
    builds: int
    timeline: tuple[TimelinePoint, ...]
    decisions: int
    notes: tuple[str, ...] = ()
    # starts the agent would refuse: their GPUs in use, or their engine not on that host (a bug if > 0)
    placement_conflicts: int = 0
    swap_cycles: int = 0  # decisions that drained READY replicas of a model while starting others
    deferred_actions: int = 0  # actions the act core deferred (GPUs still busy, start before stop)
    drain_timeouts: int = 0  # drains stopped at their deadline (their requests in flight cut)
    prefix_hit_rate: float | None = None  # prompt tokens found in a prefix cache / looked up (all replicas)
    gpu_hours_by_config: tuple[tuple[ConfigKey, float], ...] = ()  # replicas' GPU-hours (builds apart)
    met: np.ndarray | None = None  # per arrived request (trace order): served within both SLOs
    build_windows: tuple[tuple[float, float, ConfigKey], ...] = ()  # engine builds: (start_s, done_s, config)
    judged: PeriodJudgement | None = None  # the SLO over every rolling period (None: not judged)
    # replicas' GPU-hours per role (aggregated, and the prefill and decode pools; builds apart)
    gpu_hours_by_role: tuple[tuple[Role, float], ...] = ()
    misses: MissMinutes | None = None  # where the misses fell (sim/slo_periods.py; None: not counted)

    @property
    def slo_attainment(self) -> float:
        """The share of the whole trace's requests served within the SLO."""
        return self.slo_met / self.arrived if self.arrived else 1.0

    def serves_slo(self, objective: float) -> bool:
        """Whether the replay serves the SLO as the policy writes it: every rolling period of every
        model at its objective (`judged`); a result not judged: the whole trace's share >= `objective`."""
        return self.judged.met if self.judged is not None else self.slo_attainment >= objective

