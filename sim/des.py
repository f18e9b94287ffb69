"""Discrete-event simulation of a serving fleet on a simulated clock: the replay.

Requests from a trace reach the replicas the router serves through a least-loaded pick (fewest
requests in the replica: running + waiting; ties to the oldest replica). Each replica runs the
simulator's ground truth (fleetplan.sim.groundtruth) on a `fleetplan.sim.core.FastCore`.

fleetplan runs here as the daemon runs: every `cycle_s` the daemon's own decision path
(fleetplan.sim.control: act.reconcile, planner.cycle.observe and decide, act.execute, act.routes,
drains by act.drain_step) on the raw readings of the replay's Prometheus (fleetplan.sim.promsim:
the engines' counters, gauges and histograms scraped every `scrape_s`, visible `scrape_delay_s`
later). Only I/O is simulated: the scrapes, the agents starting and stopping engines and builds,
the router. Baselines (fleetplan.sim.baselines) model other controllers: target counts per config.

Replica lifecycle: STARTING (launch; + TensorRT-LLM engine build when no built engine exists) ->
READY -> DRAINING (no new requests) -> STOPPED. GPU-hours count from the start request to the
stop, builds count the GPUs they occupy for their duration.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from fleetplan.planner import act
from fleetplan.planner.observation import ObserveRules
from fleetplan.planner.placement import first_free
from fleetplan.planner.types import (
    ConfigKey,
    EngineBuild,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    Replica,
    ReplicaState,
)
from fleetplan.sim.control import ControlSettings, FleetplanController, ReplayControl
from fleetplan.sim.core import ITL_BUCKETS_S, LENGTH_BUCKETS, TPOT_BUCKETS_S, TTFT_BUCKETS_S, FastCore
from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError
from fleetplan.sim.promsim import Counters, PromSim
from fleetplan.sim.router import RouteMode, Router, affinity_key
from fleetplan.sim.traces import Trace

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
    epoch0_s: float = 1_767_571_200.0  # 2026-01-05 00:00 UTC (a Monday) = simulated t 0


@dataclass(frozen=True)
class SimSettings:
    scrape_s: float = 15.0
    scrape_delay_s: float = 5.0  # a scrape becomes visible this long after it is taken
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

    @property
    def slo_attainment(self) -> float:
        return self.slo_met / self.arrived if self.arrived else 1.0


# ----------------------------------------------------------------------------------------------
# The simulation
# ----------------------------------------------------------------------------------------------


class _SimReplica:
    __slots__ = ("config", "core", "counters", "gpus", "host", "inflight", "load", "mi", "rid", "seq",
                 "since", "state", "t_gpu", "t_ready", "t_start", "t_stop", "version")

    def __init__(self, rid: str, config: ConfigKey, host: str, gpus: tuple[int, ...], core: FastCore,
                 t_start: float, seq: int, mi: int) -> None:
        self.mi = mi
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


@dataclass
class _SimBuild:
    row: act.BuildRow
    config: ConfigKey
    done_t: float
    done: bool = False


class FleetSim:
    """One policy on one trace. `run()` returns a SimResult."""

    _P_STEP, _P_LIFE, _P_SCRAPE, _P_TICK = 0, 1, 2, 3

    def __init__(self, trace: Trace, controller: Controller, env: Environment,
                 settings: SimSettings | None = None, *, default_model: str | None = None,
                 control: ControlSettings | None = None) -> None:
        self.trace = trace
        self.ctl = controller
        self.env = env
        self.s = settings or SimSettings()
        reqs = trace.requests
        self.n = len(reqs)
        self.arr_t = np.array([r.t_s for r in reqs], dtype=float)
        self.prompt = [r.prompt_tokens for r in reqs]
        self.output = [r.output_tokens for r in reqs]
        self.blocks = [r.blocks for r in reqs] if self.s.prefix_cache else [None] * len(reqs)
        models = [r.model or default_model for r in reqs]
        if any(m is None for m in models):
            raise ValueError("the trace has requests without a model and no default model was given")
        self.model_names: list[str] = sorted({m for m in models if m is not None})
        mindex = {m: i for i, m in enumerate(self.model_names)}
        self.req_model = [mindex[m] for m in models if m is not None]
        self.first_t = np.full(self.n, np.nan)
        self.finish_t = np.full(self.n, np.nan)
        self.status = np.zeros(self.n, dtype=np.int8)
        self.owner: list[_SimReplica | None] = [None] * self.n
        self.duration_s = float(self.arr_t[-1]) if self.n else 0.0
        self.replicas: list[_SimReplica] = []
        self.by_id: dict[str, _SimReplica] = {}
        self.serving: list[list[_SimReplica]] = [[] for _ in self.model_names]  # what the router sends to
        self.heap: list[tuple[float, int, int, str, object]] = []
        self._seq = 0
        self.replica_scrape_hist: list[tuple[float, dict[str, ReplicaLoad]]] = []
        self.sim_builds: dict[str, _SimBuild] = {}
        self.build_gpu_s: dict[str, float] = {}
        self.replica_starts = 0
        self.n_builds = 0
        self.decisions = 0
        self.notes: list[str] = []
        self.conflicts = 0
        self._rid_seq = 0
        self._cut = 0  # requests in flight on a replica stopped before they finished
        self.timeline: list[TimelinePoint] = []
        self.prom = PromSim(window_s=self.s.window_s, scrape_s=self.s.scrape_s, delay_s=self.s.scrape_delay_s,
                            history_s=self.s.history_s, history_step_s=self.s.history_step_s,
                            peak_window_s=self.s.peak_window_s, epoch0_s=env.epoch0_s,
                            length_window_s=self.s.length_window_s)
        self.control: ReplayControl | None = None
        if isinstance(controller, FleetplanController):
            self.control = ReplayControl(
                controller, self, epoch0_s=env.epoch0_s, settings=control,
                rules=ObserveRules(window_s=self.s.window_s, peak_window_s=self.s.peak_window_s,
                                   history_s=self.s.history_s,
                                   history_window_s=max(self.s.window_s, self.s.history_step_s)))

    # -- heap
    def _push(self, t: float, prio: int, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, prio, self._seq, kind, payload))

    # -- the engines (fleetplan.sim.control.EnginePort)
    def launch(self, row: act.ReplicaRow, t_s: float) -> None:
        c = row.config
        if self.env.build_s(c) is not None and c not in self.env.cached and not any(
                b.config == c and (b.row.host == row.host or (b.done and self.s.shared_engine_cache))
                for b in self.sim_builds.values()):
            # an agent refuses a replica of an engine it neither holds nor is building
            # (protocol.check_desired); the planner places such configs where their engine is
            self.conflicts += 1
            self.notes.append(f"t={t_s:.0f}s: start of {row.replica_id} refused: {row.host} holds no "
                              f"{c.label()} engine")
            return
        self._start_replica(t_s, row.replica_id, c, row.host, row.gpu_indices)

    def stop(self, replica_id: str, t_s: float) -> None:
        rep = self.by_id.get(replica_id)
        if rep is not None and rep.state != ReplicaState.STOPPED:
            rep.version += 1  # cancels a pending "ready" and its next step
            self._stop(rep, t_s)

    def build(self, row: act.BuildRow, t_s: float) -> None:
        c = row.config
        bs = self.env.build_s(c) or 0.0
        self.sim_builds[row.build_id] = _SimBuild(row, c, t_s + bs)
        self.n_builds += 1
        self.build_gpu_s[c.gpu.value] = self.build_gpu_s.get(c.gpu.value, 0.0) + bs * max(
            1, len(row.gpu_indices) or c.tp)
        self._push(t_s + bs, self._P_LIFE, "built", row.build_id)

    def reports(self, t_s: float) -> dict[str, act.HostReport]:
        per_host: dict[str, list[act.ReportedReplica]] = {}
        for r in self.replicas:
            if r.state == ReplicaState.STOPPED:
                continue
            c = r.config
            state = ReplicaState.READY if r.state in (ReplicaState.READY, ReplicaState.DRAINING) else r.state
            per_host.setdefault(r.host, []).append(act.ReportedReplica(
                r.rid, state, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value, r.gpus,
                8000 + min(r.gpus), since_s=self.env.epoch0_s + (r.t_ready if r.t_ready is not None else r.t_start)))
        builds: dict[str, list[act.ReportedBuild]] = {}
        for bid, b in self.sim_builds.items():
            bstate = act.BuildState.DONE if b.done else act.BuildState.RUNNING
            builds.setdefault(b.row.host, []).append(act.ReportedBuild(bid, bstate, b.row.gpu_indices))
        return {h.name: act.HostReport(h.name, h.online, h.gpu.value, h.gpu_count, h.nvlink_groups, None, (), (),
                                       tuple(per_host.get(h.name, ())), tuple(builds.get(h.name, ())))
                for h in self.env.hosts}

    def cached(self) -> list[EngineBuild]:
        out = [EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, None, True, None)
               for c in sorted(self.env.cached)]
        # an engine per host that holds it, as each agent reports its own: the host that built it; with a
        # shared cache, every host of its GPU type
        done = sorted({(b.config, host) for b in self.sim_builds.values()
                       if b.done and b.config not in self.env.cached for host in self._holders(b)})
        out += [EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, host, True, None) for c, host in done]
        return out

    def _holders(self, b: _SimBuild) -> list[str]:
        if not self.s.shared_engine_cache:
            return [b.row.host]
        return [h.name for h in self.env.hosts if h.gpu == b.config.gpu]

    def inflight(self, replica_id: str) -> float | None:
        rep = self.by_id.get(replica_id)
        if rep is None or rep.state == ReplicaState.STOPPED:
            return None
        return float(rep.core.num_running + rep.core.num_waiting)

    def route(self, serving: Mapping[str, tuple[str, ...]], scraped: Sequence[str], t_s: float) -> None:
        for mi, m in enumerate(self.model_names):
            reps = [self.by_id[rid] for rid in serving.get(m, ()) if rid in self.by_id]
            for r in self.serving[mi]:
                if r.state == ReplicaState.READY and r not in reps:
                    r.state = ReplicaState.DRAINING  # out of the upstream: its last requests finish
                    r.since = t_s
            self.serving[mi] = sorted((r for r in reps if r.state == ReplicaState.READY), key=lambda r: r.seq)
        self.prom.set_targets((rid, self.by_id[rid].config.model) for rid in scraped if rid in self.by_id)

    def later(self, t_s: float, fn: Callable[[float], None]) -> None:
        self._push(t_s, self._P_LIFE, "call", fn)

    # -- replicas
    def _start_replica(self, t: float, rid: str | None, config: ConfigKey, host: str, gpus: tuple[int, ...],
                       *, instant: bool = False) -> _SimReplica | None:
        if config.model not in self.model_names:
            self.notes.append(f"start of {config.label()} ignored: model not in the trace")
            return None
        params = self.env.params_for(config)
        self._rid_seq += 1
        core = FastCore(params, seed=self.s.seed * 100003 + self._rid_seq, macro=self.s.macro_steps)
        rid = rid or f"r{self._rid_seq}-{config.engine.value}-{config.gpu.value}x{config.tp}"
        used = {(r.host, g) for r in self.replicas if r.state != ReplicaState.STOPPED for g in r.gpus}
        if any((host, g) in used for g in gpus):
            # the agent refuses a desired state that double-books GPUs (protocol.check_desired); the
            # act core never asks for it, so this is a bug to see, not a case to schedule around
            self.conflicts += 1
            self.notes.append(f"t={t:.0f}s: start of {rid} refused: GPUs {list(gpus)} of {host} are in use")
            return None
        rep = _SimReplica(rid, config, host, gpus, core, t, self._rid_seq, self.model_names.index(config.model))
        self.replicas.append(rep)
        self.by_id[rid] = rep
        self.replica_starts += 1
        if instant:
            self._ready(rep, t)
            return rep
        self._launch(rep, t)
        return rep

    def _launch(self, rep: _SimReplica, t: float) -> None:
        config = rep.config
        rep.t_gpu = t
        delay = self.env.startup_s(config)
        if self.env.build_s(config) is not None and not self._built(config):
            b = self._build_of(config)
            if b is not None:  # the agent waits for the engine the build is making
                delay += max(0.0, b.done_t - t)
            else:
                delay += self.env.build_s(config) or 0.0
        self._push(t + delay, self._P_LIFE, "ready", (rep, rep.version))

    def _build_of(self, config: ConfigKey) -> _SimBuild | None:
        """The config's engine build: a finished one, else the one finishing first (None: none)."""
        return min((b for b in self.sim_builds.values() if b.config == config),
                   key=lambda b: (not b.done, b.done_t), default=None)

    def _built(self, config: ConfigKey) -> bool:
        if config in self.env.cached:
            return True
        b = self._build_of(config)
        return b is not None and b.done

    def _ready(self, rep: _SimReplica, t: float) -> None:
        if rep.state != ReplicaState.STARTING:
            return
        rep.state = ReplicaState.READY
        rep.t_ready = t
        rep.since = t
        if self.control is not None:
            self.control.update_routing(t)  # the agent's status: routed at once (daemon._on_status)
        else:
            self.serving[rep.mi].append(rep)

    def _drain(self, rep: _SimReplica, t: float) -> None:
        """Baselines: out of the router; stops once idle."""
        if rep.state == ReplicaState.STARTING:
            rep.version += 1  # cancels its pending "ready"
            self._stop(rep, t)
            return
        if rep.state != ReplicaState.READY:
            return
        rep.state = ReplicaState.DRAINING
        rep.since = t
        self.serving[rep.mi].remove(rep)
        if rep.load == 0:
            self._stop(rep, t)

    def _stop(self, rep: _SimReplica, t: float) -> None:
        if rep in self.serving[rep.mi]:
            self.serving[rep.mi].remove(rep)
        rep.state = ReplicaState.STOPPED
        rep.t_stop = t
        rep.since = t
        for idx in rep.inflight:  # cut: the engine stopped with them in flight
            if self.status[idx] == PENDING:
                self.status[idx] = REJECTED
                self._cut += 1
        rep.inflight.clear()
        rep.load = 0

    def _free_slot(self, config: ConfigKey) -> tuple[str, tuple[int, ...]] | None:
        used: dict[str, set[int]] = {}
        for r in self.replicas:
            if r.state != ReplicaState.STOPPED:
                used.setdefault(r.host, set()).update(r.gpus)
        for h in self.env.hosts:
            if h.gpu != config.gpu or not h.online:
                continue
            spot = first_free(h.groups(), used.get(h.name, set()), config.tp)
            if spot is not None:
                return h.name, spot
        return None

    # -- baselines' view
    def _fleet(self, t: float) -> Fleet:
        e0 = self.env.epoch0_s
        reps = tuple(
            Replica(r.rid, r.config, r.host, r.gpus, r.state, None, e0 + r.since)
            for r in self.replicas if r.state != ReplicaState.STOPPED
        )
        return Fleet(hosts=self.env.hosts, replicas=reps, builds=tuple(self.cached()))

    def _replica_loads(self, t: float) -> Mapping[str, ReplicaLoad]:
        cut = t - self.s.scrape_delay_s
        best: Mapping[str, ReplicaLoad] = {}
        for ts, loads in self.replica_scrape_hist:
            if ts <= cut:
                best = loads
            else:
                break
        return best

    def _scrape(self, t: float) -> None:
        for r in self.replicas:
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING):
                r.counters.prefix_queries = float(r.core.prefix_queries_tokens)
                r.counters.prefix_hits = float(r.core.prefix_hit_tokens)
        if self.control is not None:
            self.prom.scrape(t, {r.rid: (r.counters, float(r.core.num_running), float(r.core.num_waiting),
                                         r.core.kv_usage)
                                 for r in self.replicas if r.state in (ReplicaState.READY, ReplicaState.DRAINING)})
        else:
            loads = {r.rid: ReplicaLoad(float(r.core.num_running), float(r.core.num_waiting), r.core.kv_usage)
                     for r in self.replicas if r.state == ReplicaState.READY}
            self.replica_scrape_hist.append((t, loads))
            if len(self.replica_scrape_hist) > 16:
                del self.replica_scrape_hist[:-16]

    def _reconcile(self, t: float, targets: Mapping[ConfigKey, int]) -> None:
        """A baseline's targets, carried out directly (they model other controllers)."""
        live: dict[ConfigKey, list[_SimReplica]] = {}
        for r in self.replicas:
            if r.state in (ReplicaState.STARTING, ReplicaState.READY):
                live.setdefault(r.config, []).append(r)
        for c in sorted(set(live) | set(targets)):
            have = live.get(c, [])
            want = max(0, targets.get(c, 0))
            if len(have) < want:
                for _ in range(want - len(have)):
                    slot = self._free_slot(c)
                    if slot is None:
                        self.notes.append(f"t={t:.0f}s: no free GPUs for {c.label()}")
                        break
                    self._start_replica(t, None, c, slot[0], slot[1])
            elif len(have) > want:
                # cancel starting replicas first (newest first), then the least-loaded ready ones
                order = sorted(have, key=lambda r: (r.state == ReplicaState.READY, r.load, -r.seq))
                for r in order[: len(have) - want]:
                    self._drain(r, t)

    # -- timeline
    def _record_timeline(self, t: float, demand: float) -> None:
        per: dict[ConfigKey, int] = {}
        ready = 0
        gpus = 0
        for r in self.replicas:
            if r.state == ReplicaState.STOPPED:
                continue
            gpus += len(r.gpus)
            if r.state == ReplicaState.READY:
                per[r.config] = per.get(r.config, 0) + 1
                ready += len(r.gpus)
        for b in self.sim_builds.values():
            if not b.done:
                gpus += len(b.row.gpu_indices) or b.config.tp
        self.timeline.append(TimelinePoint(t, demand, tuple(sorted(per.items())), ready, gpus))

    # -- main loop
    def run(self) -> SimResult:
        s = self.s
        n = self.n
        arr_t = self.arr_t
        heap = self.heap
        end_s = self.duration_s
        t = 0.0
        if s.warm_start:
            self._warm_start()
        k = 0
        while k * s.scrape_s <= end_s:
            self._push(k * s.scrape_s, self._P_SCRAPE, "scrape", None)
            k += 1
        period = self.ctl.period_s
        if self.control is not None and self.control.s.cycle_s is not None:
            period = self.control.s.cycle_s  # the daemon's config overrides the policy's period
        k = 1 if s.warm_start else 0  # a cold start plans at t = 0, as a daemon started with the traffic
        while k * period <= end_s:
            self._push(k * period, self._P_TICK, "tick", None)
            k += 1
        k = 1
        while k * s.timeline_s <= end_s:
            self._push(k * s.timeline_s, self._P_SCRAPE, "timeline", None)
            k += 1
        hard_end = end_s + s.drain_timeout_s
        i = 0
        ttft_edges = TTFT_BUCKETS_S
        itl_edges = ITL_BUCKETS_S
        tpot_edges = TPOT_BUCKETS_S
        len_edges = LENGTH_BUCKETS
        req_model = self.req_model
        first_t = self.first_t
        finish_t = self.finish_t
        status = self.status
        owner = self.owner
        prompt = self.prompt
        output = self.output
        serving = self.serving
        baseline = self.control is None
        blocks = self.blocks
        # one router per model (it keeps its ring and counter); least-loaded is the inline fast path
        routers = (None if s.routing == RouteMode.LEAST_LOADED
                   else [Router(s.routing) for _ in self.model_names])
        overheads: dict[int, float] = {}
        heappush, heappop = heapq.heappush, heapq.heappop
        outstanding = 0
        rep: _SimReplica
        version: int
        while True:
            ta = arr_t[i] if i < n else math.inf
            th = heap[0][0] if heap else math.inf
            if ta == math.inf and (th == math.inf or (outstanding - self._cut <= 0 and th > end_s)):
                break
            if th <= ta:
                t, _prio, _seq, kind, payload = heappop(heap)
                if t > hard_end:
                    break
                if kind == "step":
                    rep, version = cast(tuple[_SimReplica, int], payload)
                    if version != rep.version:
                        continue
                    firsts, fins, gap, cnt = rep.core.end()
                    cn = rep.counters
                    if cnt:
                        cn.itl[bisect.bisect_left(itl_edges, gap)] += cnt
                    oh = overheads.get(id(rep.core))
                    if oh is None:
                        oh = rep.core.params.factors.ttft_overhead_s
                        overheads[id(rep.core)] = oh
                    for idx in firsts:
                        first_t[idx] = t
                        tt = t - arr_t[idx] + oh
                        cn.ttft[bisect.bisect_left(ttft_edges, tt)] += 1
                        cn.sums[0] += tt
                    for idx in fins:
                        finish_t[idx] = t
                        if status[idx] != PENDING:
                            continue
                        status[idx] = SERVED
                        rep.inflight.discard(idx)
                        p, o = prompt[idx], output[idx]
                        cn.completed += 1
                        cn.prompt_tokens += p
                        cn.gen_tokens += o
                        cn.prompt_len[bisect.bisect_left(len_edges, p)] += 1
                        cn.gen_len[bisect.bisect_left(len_edges, o)] += 1
                        cn.sums[2] += p
                        cn.sums[3] += o
                        if o >= 2:
                            tp = (t - first_t[idx]) / (o - 1)
                            cn.tpot[bisect.bisect_left(tpot_edges, tp)] += 1
                            cn.sums[1] += tp
                        outstanding -= 1
                    rep.load -= len(fins)
                    te = rep.core.begin(t)
                    if te is not None:
                        rep.version += 1
                        self._seq += 1
                        heappush(heap, (te, 0, self._seq, "step", (rep, rep.version)))
                    elif baseline and rep.state == ReplicaState.DRAINING and rep.load == 0:
                        self._stop(rep, t)
                elif kind == "scrape":
                    self._scrape(t)
                elif kind == "timeline":
                    lo = t - s.demand_window_s
                    a = int(np.searchsorted(arr_t, max(0.0, lo), side="left"))
                    b = int(np.searchsorted(arr_t, t, side="right"))
                    span = min(s.demand_window_s, t) if t > 0 else s.demand_window_s
                    self._record_timeline(t, (b - a) / span if span > 0 else 0.0)
                elif kind == "tick":
                    self._tick(t)
                elif kind == "ready":
                    rep, version = cast(tuple[_SimReplica, int], payload)
                    if version == rep.version:
                        self._ready(rep, t)
                elif kind == "call":
                    cast(Callable[[float], None], payload)(t)
                elif kind == "built":
                    sb = self.sim_builds.get(cast(str, payload))
                    if sb is not None:
                        sb.done = True
                continue
            # an arrival
            t = ta
            idx = i
            i += 1
            reps = serving[req_model[idx]]
            if not reps:
                status[idx] = REJECTED
                continue
            if routers is None:
                rep = reps[0]
                best = rep.load
                for r in reps:
                    if r.load < best:
                        rep, best = r, r.load
            else:
                router = routers[req_model[idx]]
                rep = reps[router.pick([r.rid for r in reps], [r.load for r in reps], affinity_key(blocks[idx]))]
            core = rep.core
            try:
                core.submit(idx, prompt[idx], output[idx], blocks[idx])
            except RequestTooLongError:
                status[idx] = REJECTED
                continue
            owner[idx] = rep
            rep.load += 1
            rep.inflight.add(idx)
            outstanding += 1
            if core.busy:
                if core._k > 0 and core.t_end > t:
                    te_old = core.t_end
                    te = core.split(t)
                    if te < te_old:
                        rep.version += 1
                        self._seq += 1
                        heappush(heap, (te, 0, self._seq, "step", (rep, rep.version)))
            else:
                te2 = core.begin(t)
                if te2 is not None:
                    rep.version += 1
                    self._seq += 1
                    heappush(heap, (te2, 0, self._seq, "step", (rep, rep.version)))
        return self._result(end_s)

    def _warm_start(self) -> None:
        """Before t=0 the controller has watched the first window's traffic and its fleet is READY."""
        obs = self._true_observation(0.0, self.s.window_s)
        if self.control is not None:
            def ready(rid: str) -> None:
                rep = self.by_id.get(rid)
                if rep is not None and (self.env.build_s(rep.config) is None or self._built(rep.config)):
                    rep.version += 1  # its launch's "ready" event is not needed
                    self._ready(rep, 0.0)
            self.control.warm(obs, ready)
            for r in self.replicas:  # warm replicas took their GPUs before t = 0
                r.t_start = 0.0
            self.replica_starts = 0
            return
        ctl = cast(Baseline, self.ctl)
        d = ctl.decide(ControllerView(0.0, self.env.epoch0_s, self._fleet(0.0), {}))
        if d.targets is not None:
            for c, want in sorted(d.targets.items()):
                for _ in range(max(0, want)):
                    slot = self._free_slot(c)
                    if slot is None:
                        break
                    self._start_replica(0.0, None, c, slot[0], slot[1], instant=True)
        self.replica_starts = 0  # warm replicas are not counted as starts

    def _true_observation(self, t0: float, w: float) -> Observation:
        """The warm start's knowledge: the first window's true rate and mean lengths."""
        out: dict[str, ModelObservation] = {}
        a = int(np.searchsorted(self.arr_t, t0, side="left"))
        b = int(np.searchsorted(self.arr_t, t0 + w, side="left"))
        for mi, m in enumerate(self.model_names):
            ids = [j for j in range(a, b) if self.req_model[j] == mi]
            if not ids:
                out[m] = ModelObservation(model=m, rate_rps=0.0)
                continue
            out[m] = ModelObservation(
                model=m, rate_rps=len(ids) / w,
                isl=sum(self.prompt[j] for j in ids) / len(ids),
                osl=sum(self.output[j] for j in ids) / len(ids),
            )
        return Observation(models=out)

    def _tick(self, t: float) -> None:
        self.decisions += 1
        if self.control is not None:
            self.control.cycle(t, self.prom.readings(t), self.prom.evidence(t))
            return
        ctl = cast(Baseline, self.ctl)
        d = ctl.decide(ControllerView(t, self.env.epoch0_s + t, self._fleet(t), self._replica_loads(t)))
        if d.note and len(self.notes) < 50:
            self.notes.append(f"t={t:.0f}s: {d.note}")
        if d.targets is not None:
            self._reconcile(t, d.targets)

    def _result(self, end_s: float) -> SimResult:
        gpu_s: dict[str, float] = {}
        by_config: dict[ConfigKey, float] = {}
        for r in self.replicas:
            if r.t_gpu is None:
                continue
            stop = end_s if r.t_stop is None else min(r.t_stop, end_s)
            dur = max(0.0, stop - max(0.0, r.t_gpu))
            gpu_s[r.config.gpu.value] = gpu_s.get(r.config.gpu.value, 0.0) + dur * len(r.gpus)
            by_config[r.config] = by_config.get(r.config, 0.0) + dur * len(r.gpus) / 3600.0
        build_s = sum(self.build_gpu_s.values())
        gpu_hours = (sum(gpu_s.values()) + build_s) / 3600.0
        cost = 0.0
        for g, sec in list(gpu_s.items()) + list(self.build_gpu_s.items()):
            cost += sec / 3600.0 * self.env.price_usd_h.get(g, 0.0)
        served = self.status == SERVED
        ttft_s = np.zeros(self.n)
        itl_s = np.zeros(self.n)
        oh = np.zeros(self.n)
        for j in np.nonzero(served)[0]:
            rep = self.owner[j]
            assert rep is not None
            oh[j] = rep.core.params.factors.ttft_overhead_s
        ttft_s[served] = self.first_t[served] - self.arr_t[served] + oh[served]
        outs = np.array(self.output, dtype=float)
        multi = served & (outs > 1)
        itl_s[multi] = (self.finish_t[multi] - self.first_t[multi]) / (outs[multi] - 1)
        ttft_slo = np.array([self.env.ttft_slo_ms[self.model_names[m]] for m in self.req_model]) / 1000.0
        itl_slo = np.array([self.env.itl_slo_ms[self.model_names[m]] for m in self.req_model]) / 1000.0
        ok = served & (ttft_s <= ttft_slo) & (itl_s <= itl_slo)
        c = self.control
        queried = sum(r.core.prefix_queries_tokens for r in self.replicas)
        hits = sum(r.core.prefix_hit_tokens for r in self.replicas)
        return SimResult(
            policy=self.ctl.name,
            duration_s=end_s,
            arrived=self.n,
            served=int(served.sum()),
            rejected=int((self.status == REJECTED).sum()),
            unfinished=int((self.status == PENDING).sum()),
            slo_met=int(ok.sum()),
            met=ok,
            gpu_hours=gpu_hours,
            build_gpu_hours=build_s / 3600.0,
            cost_usd=cost,
            ttft_ms=ttft_s[served] * 1000.0,
            itl_ms=itl_s[multi] * 1000.0,
            replica_starts=self.replica_starts,
            builds=self.n_builds,
            timeline=tuple(self.timeline),
            decisions=self.decisions,
            notes=tuple(self.notes + (c.notes if c is not None else [])),
            placement_conflicts=self.conflicts,
            swap_cycles=c.swap_cycles if c is not None else 0,
            deferred_actions=c.deferred if c is not None else 0,
            drain_timeouts=c.drain_timeouts if c is not None else 0,
            gpu_hours_by_config=tuple(sorted(by_config.items())),
            prefix_hit_rate=hits / queried if queried > 0 else None,
        )
