"""Discrete-event simulation of a serving fleet on a simulated clock.

Requests from a trace reach READY replicas through a least-loaded router (fewest requests in the
replica: running + waiting; ties to the oldest replica). Each replica runs the simulator's ground
truth (fleetplan.sim.groundtruth: the step-time model and the continuous-batching rules of BatchCore). A
controller (fleetplan.sim.baselines) runs every `period_s` simulated seconds and sees only what production
sees: Prometheus-like windowed rates and histogram quantiles, scraped every `scrape_s` and visible
`scrape_delay_s` later, never the trace's future or the requests' true output lengths.

Each replica is a `fleetplan.sim.core.FastCore` (macro-stepped, see there).

Replica lifecycle: STARTING (launch; + TensorRT-LLM engine build when no built engine exists) ->
READY -> DRAINING (no new requests; stops when idle) -> STOPPED. GPU-hours count from the start
request to the stop, builds count the GPUs they occupy for their duration.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np

from fleetplan.planner import act
from fleetplan.planner.types import (
    Action,
    ActionKind,
    ConfigKey,
    ConfigObservation,
    EngineBuild,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    Replica,
    ReplicaState,
)
from fleetplan.sim.core import (
    ITL_BUCKETS_S,
    LENGTH_BUCKETS,
    LENGTH_QUANTILES,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    FastCore,
)
from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError
from fleetplan.sim.traces import Trace

# request status codes
PENDING, SERVED, REJECTED = 0, 1, 2


def _quantiles(a: Sequence[float], b: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """LENGTH_QUANTILES of the window's length histogram (increase from scrape a to b)."""
    d = [y - (a[j] if j < len(a) else 0.0) for j, y in enumerate(b)]
    if sum(d) <= 0:
        return ()
    out = []
    for q in LENGTH_QUANTILES:
        v = histogram_quantile(q, LENGTH_BUCKETS, d)
        if v is not None and math.isfinite(v):
            out.append((q, v))
    return tuple(out)


def histogram_quantile(q: float, edges: Sequence[float], counts: Sequence[float]) -> float | None:
    """Prometheus histogram_quantile over non-cumulative bucket counts (last = +Inf bucket)."""
    total = float(sum(counts))
    if total <= 0:
        return None
    rank = q * total
    cum = 0.0
    for i, c in enumerate(counts):
        if cum + c >= rank and c > 0:
            if i >= len(edges):
                return float(edges[-1])
            lo = 0.0 if i == 0 else float(edges[i - 1])
            hi = float(edges[i])
            return lo + (hi - lo) * (rank - cum) / c
        cum += c
    return float(edges[-1])


# ----------------------------------------------------------------------------------------------
# Controllers see this
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaLoad:
    running: float
    waiting: float
    kv_usage: float


@dataclass(frozen=True)
class ControllerView:
    t_s: float  # simulated seconds since the start of the trace
    epoch_s: float  # the same instant as epoch seconds (for the planner's schedules)
    observation: Observation
    fleet: Fleet
    replica_load: Mapping[str, ReplicaLoad]  # as last scraped, READY replicas only


@dataclass(frozen=True)
class Decision:
    """Either planner actions (fleetplan) or target replica counts per config (baselines)."""

    actions: tuple[Action, ...] = ()
    targets: Mapping[ConfigKey, int] | None = None
    note: str = ""


class Controller(Protocol):
    name: str
    period_s: float

    def decide(self, view: ControllerView) -> Decision: ...


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
    window_s: float = 60.0  # rate()/histogram window
    history_s: float = 3600.0
    history_step_s: float = 30.0
    timeline_s: float = 10.0  # resolution of the demand/capacity timeline
    demand_window_s: float = 60.0  # true demand for timeline / lag / unmet: trailing window
    warm_start: bool = True  # the fleet at t=0 is what the controller wants for the first window
    seed: int = 0
    macro_steps: bool = True
    # "arrivals": rate = (increase of request_success_total + increase of the running+waiting gauges)
    #   / window, i.e. arrivals by conservation, all from engine metrics (keeps seeing demand when
    #   the fleet is saturated); "completions": rate(request_success_total) alone, as
    #   controller/observe.py reads it today (saturates at the fleet's capacity under overload).
    rate_source: str = "arrivals"
    drain_timeout_s: float = 3600.0  # after the trace ends, in-flight requests get this long


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
    placement_conflicts: int = 0  # starts that waited for their GPUs to be released
    swap_cycles: int = 0  # decisions that drained READY replicas of a model while starting others
    deferred_actions: int = 0  # actions the act core deferred (GPUs still busy, start before stop)
    met: np.ndarray | None = None  # per arrived request (trace order): served within both SLOs

    @property
    def slo_attainment(self) -> float:
        return self.slo_met / self.arrived if self.arrived else 1.0


# ----------------------------------------------------------------------------------------------
# The simulation
# ----------------------------------------------------------------------------------------------


class _SimReplica:
    __slots__ = ("blocked", "cm", "config", "core", "gpus", "host", "load", "mi", "rid", "seq", "since", "state",
                 "t_gpu", "t_ready", "t_start", "t_stop", "version")

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
        self.blocked = False  # waiting for its GPUs to be released by a replica being stopped
        self.t_ready: float | None = None
        self.t_stop: float | None = None
        self.since = t_start
        self.load = 0
        self.version = 0
        self.seq = seq
        self.cm: _ConfigMetrics | None = None


@dataclass
class _ModelMetrics:
    completed: float = 0.0
    prompt_tokens: float = 0.0
    gen_tokens: float = 0.0
    ttft: list[float] = field(default_factory=lambda: [0.0] * (len(TTFT_BUCKETS_S) + 1))
    itl: list[float] = field(default_factory=lambda: [0.0] * (len(ITL_BUCKETS_S) + 1))
    plen: list[float] = field(default_factory=lambda: [0.0] * (len(LENGTH_BUCKETS) + 1))
    glen: list[float] = field(default_factory=lambda: [0.0] * (len(LENGTH_BUCKETS) + 1))


@dataclass
class _ConfigMetrics:
    """One config's series (the engines' per-replica series summed by config, as PromQL would)."""

    completed: float = 0.0
    ttft: list[float] = field(default_factory=lambda: [0.0] * (len(TTFT_BUCKETS_S) + 1))
    tpot: list[float] = field(default_factory=lambda: [0.0] * (len(TPOT_BUCKETS_S) + 1))


@dataclass(frozen=True)
class _Scrape:
    t: float
    in_system: float  # sum over the model's replicas of running + waiting (gauges)
    completed: float
    prompt_tokens: float
    gen_tokens: float
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    plen: tuple[float, ...] = ()
    glen: tuple[float, ...] = ()
    # per config: (READY replicas, completed, ttft buckets, tpot buckets)
    configs: tuple[tuple[ConfigKey, int, float, tuple[float, ...], tuple[float, ...]], ...] = ()


class FleetSim:
    """One policy on one trace. `run()` returns a SimResult."""

    _P_STEP, _P_LIFE, _P_SCRAPE, _P_TICK = 0, 1, 2, 3

    def __init__(self, trace: Trace, controller: Controller, env: Environment,
                 settings: SimSettings | None = None, *, default_model: str | None = None) -> None:
        self.trace = trace
        self.ctl = controller
        self.env = env
        self.s = settings or SimSettings()
        reqs = trace.requests
        self.n = len(reqs)
        self.arr_t = np.array([r.t_s for r in reqs], dtype=float)
        self.prompt = [r.prompt_tokens for r in reqs]
        self.output = [r.output_tokens for r in reqs]
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
        self.by_model_ready: list[list[_SimReplica]] = [[] for _ in self.model_names]
        self.heap: list[tuple[float, int, int, str, object]] = []
        self._seq = 0
        self.metrics = [_ModelMetrics() for _ in self.model_names]
        self.config_metrics: dict[ConfigKey, _ConfigMetrics] = {}
        self.scrapes: list[list[_Scrape]] = [[] for _ in self.model_names]
        self.rate_hist: list[list[tuple[float, float]]] = [[] for _ in self.model_names]
        self.replica_scrape: dict[str, ReplicaLoad] = {}
        self.replica_scrape_hist: list[tuple[float, dict[str, ReplicaLoad]]] = []
        self.builds: dict[ConfigKey, EngineBuild] = {}
        self.build_gpu_s: dict[str, float] = {}
        self.replica_starts = 0
        self.n_builds = 0
        self.decisions = 0
        self.notes: list[str] = []
        self.conflicts = 0
        self.swap_cycles = 0
        self.deferred = 0  # actions the act core deferred (busy GPUs, start before stop)
        self.ttft_overhead = 0.0
        self._rid_seq = 0
        self.timeline: list[TimelinePoint] = []

    # -- heap
    def _push(self, t: float, prio: int, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, prio, self._seq, kind, payload))

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
        if any(r.rid == rid and r.state != ReplicaState.STOPPED for r in self.replicas):
            rid = f"{rid}#{self._rid_seq}"
        used = {(r.host, g) for r in self.replicas if r.state != ReplicaState.STOPPED for g in r.gpus}
        busy = any((host, g) in used for g in gpus)
        rep = _SimReplica(rid, config, host, gpus, core, t, self._rid_seq, self.model_names.index(config.model))
        rep.cm = self.config_metrics.setdefault(config, _ConfigMetrics())
        self.replicas.append(rep)
        self.replica_starts += 1
        if instant:
            self._ready(rep, t)
            return rep
        if busy:
            # the agent launches it once the replica holding those GPUs has stopped
            rep.blocked = True
            rep.t_gpu = None
            self.conflicts += 1
            return rep
        self._launch(rep, t)
        return rep

    def _launch(self, rep: _SimReplica, t: float) -> None:
        config = rep.config
        rep.blocked = False
        rep.t_gpu = t
        delay = self.env.startup_s(config)
        if self.env.build_s(config) is not None and not self._built(config):
            b = self.builds.get(config)
            if b is not None and b.eta_s is not None:
                delay += max(0.0, b.eta_s - self.env.epoch0_s - t)
            else:
                delay += self.env.build_s(config) or 0.0
        self._push(t + delay, self._P_LIFE, "ready", (rep, rep.version))

    def _built(self, config: ConfigKey) -> bool:
        if config in self.env.cached:
            return True
        b = self.builds.get(config)
        return b is not None and b.ready

    def _ready(self, rep: _SimReplica, t: float) -> None:
        if rep.state != ReplicaState.STARTING:
            return
        rep.state = ReplicaState.READY
        rep.t_ready = t
        rep.since = t
        self.by_model_ready[self.model_names.index(rep.config.model)].append(rep)

    def _drain(self, rep: _SimReplica, t: float) -> None:
        if rep.state == ReplicaState.STARTING:
            rep.version += 1  # cancels its pending "ready"
            self._stop(rep, t)
            return
        if rep.state != ReplicaState.READY:
            return
        rep.state = ReplicaState.DRAINING
        rep.since = t
        lst = self.by_model_ready[self.model_names.index(rep.config.model)]
        lst.remove(rep)
        if rep.load == 0:
            self._stop(rep, t)

    def _stop(self, rep: _SimReplica, t: float) -> None:
        if rep.state == ReplicaState.READY:
            self.by_model_ready[self.model_names.index(rep.config.model)].remove(rep)
        rep.state = ReplicaState.STOPPED
        rep.t_stop = t
        rep.since = t
        for w in self.replicas:
            if w.blocked and w.state == ReplicaState.STARTING:
                held = {(r.host, g) for r in self.replicas
                        if r.state != ReplicaState.STOPPED and not r.blocked for g in r.gpus}
                if not any((w.host, g) in held for g in w.gpus):
                    self._launch(w, t)

    def _free_slot(self, config: ConfigKey) -> tuple[str, tuple[int, ...]] | None:
        used: dict[str, set[int]] = {}
        for r in self.replicas:
            if r.state != ReplicaState.STOPPED:
                used.setdefault(r.host, set()).update(r.gpus)
        for h in self.env.hosts:
            if h.gpu != config.gpu or not h.online:
                continue
            u = used.get(h.name, set())
            for group in h.groups():
                free = [g for g in group if g not in u]
                if len(free) >= config.tp:
                    return h.name, tuple(free[: config.tp])
        return None

    # -- controller interface
    def _fleet(self, t: float) -> Fleet:
        e0 = self.env.epoch0_s
        reps = tuple(
            Replica(r.rid, r.config, r.host, r.gpus, r.state, None, e0 + r.since)
            for r in self.replicas if r.state != ReplicaState.STOPPED
        )
        builds = [EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, None, True, None)
                  for c in sorted(self.env.cached)]
        builds += [b for c, b in sorted(self.builds.items()) if c not in self.env.cached]
        return Fleet(hosts=self.env.hosts, replicas=reps, builds=tuple(builds))

    def _visible(self, mi: int, t: float) -> list[_Scrape]:
        sc = self.scrapes[mi]
        cut = t - self.s.scrape_delay_s
        # scrapes are appended in time order
        hi = len(sc)
        while hi > 0 and sc[hi - 1].t > cut:
            hi -= 1
        return sc[:hi]

    def _window(self, sc: list[_Scrape], w: float) -> tuple[_Scrape, _Scrape] | None:
        if len(sc) < 2:
            return None
        last = sc[-1]
        first = None
        for j in range(len(sc) - 2, -1, -1):
            if sc[j].t < last.t - w - 1e-9:
                break
            first = sc[j]
        if first is None:
            return None
        return first, last

    def _rate(self, a: _Scrape, b: _Scrape) -> float:
        done = b.completed - a.completed
        if self.s.rate_source == "arrivals":
            done += b.in_system - a.in_system
        return max(0.0, done / (b.t - a.t))

    def observation(self, t: float) -> Observation:
        out: dict[str, ModelObservation] = {}
        for mi, m in enumerate(self.model_names):
            sc = self._visible(mi, t)
            win = self._window(sc, self.s.window_s)
            if win is None:
                out[m] = ModelObservation(model=m, stale=True)
                continue
            a, b = win
            rate = self._rate(a, b)
            isl = osl = None
            if b.completed > a.completed:
                isl = (b.prompt_tokens - a.prompt_tokens) / (b.completed - a.completed)
                osl = (b.gen_tokens - a.gen_tokens) / (b.completed - a.completed)
            dtt = [y - x for x, y in zip(a.ttft, b.ttft, strict=True)]
            dit = [y - x for x, y in zip(a.itl, b.itl, strict=True)]
            tq = histogram_quantile(0.99, TTFT_BUCKETS_S, dtt)
            iq = histogram_quantile(0.99, ITL_BUCKETS_S, dit)
            cut = t - self.s.scrape_delay_s
            lo = cut - self.s.history_s
            hist = self.rate_hist[mi]
            pts: list[tuple[float, float]] = []
            last_t = -math.inf
            for ts, v in hist:
                if ts < lo or ts > cut:
                    continue
                if ts - last_t >= self.s.history_step_s - 1e-9:
                    pts.append((self.env.epoch0_s + ts, v))
                    last_t = ts
            out[m] = ModelObservation(
                model=m, rate_rps=rate, isl=isl, osl=osl,
                ttft_p99_ms=tq * 1000.0 if tq is not None else None,
                itl_p99_ms=iq * 1000.0 if iq is not None else None,
                history=tuple(pts), stale=False,
                isl_quantiles=_quantiles(a.plen, b.plen), osl_quantiles=_quantiles(a.glen, b.glen),
                configs=self._config_observations(a, b), peak_rps=self._peak_rate(sc, b.t - self.s.window_s),
                peak_window_s=self.s.scrape_s,
            )
        return Observation(models=out)

    def _config_observations(self, a: _Scrape, b: _Scrape) -> tuple[ConfigObservation, ...]:
        """Per config over the window: READY replicas at its end, arrival-free completion rate, the
        TTFT and per-request TPOT p99 from the config's histograms."""
        before = {c[0]: c for c in a.configs}
        out = []
        dt = b.t - a.t
        for c, ready, done, ttft, tpot in b.configs:
            prev = before.get(c)
            d_done = done - (prev[2] if prev else 0.0)
            if ready < 1 or d_done <= 0 or dt <= 0:
                continue
            d_ttft = [y - (prev[3][j] if prev else 0.0) for j, y in enumerate(ttft)]
            d_tpot = [y - (prev[4][j] if prev else 0.0) for j, y in enumerate(tpot)]
            tq = histogram_quantile(0.99, TTFT_BUCKETS_S, d_ttft)
            iq = histogram_quantile(0.99, TPOT_BUCKETS_S, d_tpot)
            out.append(ConfigObservation(c, ready, d_done / dt, tq * 1000.0 if tq is not None else None,
                                         iq * 1000.0 if iq is not None else None, d_done))
        return tuple(out)

    def _peak_rate(self, sc: list[_Scrape], since: float) -> float | None:
        """The highest rate between two consecutive scrapes after `since` (a short-window peak)."""
        best: float | None = None
        for x, y in itertools.pairwise(sc):
            if x.t >= since - 1e-9 and y.t > x.t:
                r = self._rate(x, y)
                best = r if best is None else max(best, r)
        return best

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
        in_sys = [0.0] * len(self.model_names)
        for r in self.replicas:
            if r.state in (ReplicaState.READY, ReplicaState.DRAINING):
                in_sys[r.mi] += r.core.num_running + r.core.num_waiting
        ready: dict[ConfigKey, int] = {}
        for r in self.replicas:
            if r.state == ReplicaState.READY:
                ready[r.config] = ready.get(r.config, 0) + 1
        per_model: list[list[tuple[ConfigKey, int, float, tuple[float, ...], tuple[float, ...]]]] = [
            [] for _ in self.model_names]
        for c, cmx in sorted(self.config_metrics.items()):
            per_model[self.model_names.index(c.model)].append(
                (c, ready.get(c, 0), cmx.completed, tuple(cmx.ttft), tuple(cmx.tpot)))
        for mi, mm in enumerate(self.metrics):
            self.scrapes[mi].append(_Scrape(t, in_sys[mi], mm.completed, mm.prompt_tokens, mm.gen_tokens,
                                            tuple(mm.ttft), tuple(mm.itl), tuple(mm.plen), tuple(mm.glen),
                                            tuple(per_model[mi])))
            win = self._window(self.scrapes[mi], self.s.window_s)
            if win is not None:
                hist = self.rate_hist[mi]
                hist.append((t, self._rate(*win)))
                if len(hist) > 64 and hist[0][0] < t - self.s.history_s - 2 * self.s.window_s:
                    cut = t - self.s.history_s - self.s.window_s
                    del hist[: next(j for j, x in enumerate(hist) if x[0] >= cut)]
            # keep memory bounded: drop scrapes older than the history span + window
            sc = self.scrapes[mi]
            if len(sc) > 64 and sc[0].t < t - self.s.window_s - 4 * self.s.scrape_s:
                keep_from = next(j for j, x in enumerate(sc) if x.t >= t - self.s.window_s - 4 * self.s.scrape_s)
                del sc[:keep_from]
        loads = {r.rid: ReplicaLoad(float(r.core.num_running), float(r.core.num_waiting), r.core.kv_usage)
                 for r in self.replicas if r.state == ReplicaState.READY}
        self.replica_scrape_hist.append((t, loads))
        if len(self.replica_scrape_hist) > 16:
            del self.replica_scrape_hist[:-16]

    def _apply(self, t: float, decision: Decision) -> None:
        """The controller's actions go through the shipped act core (planner/act.py), as in the
        daemon: starts only on free GPUs, make-before-break, never-served replicas removed at once.
        Baselines that set `targets` are applied directly (they model other controllers)."""
        if decision.actions:
            self._act(t, decision.actions)
        if decision.targets is not None:
            self._reconcile(t, decision.targets)

    def _act_view(self, t: float) -> act.ActView:
        rows: list[act.ReplicaRow] = []
        reported: dict[str, list[act.ReportedReplica]] = {}
        for r in self.replicas:
            if r.state == ReplicaState.STOPPED:
                continue
            c = r.config
            port = 8000 + min(r.gpus)  # the simulator has no ports: unique per host while GPUs are
            ready_s = r.t_ready if r.state in (ReplicaState.READY, ReplicaState.DRAINING) else None
            rows.append(act.ReplicaRow(
                r.rid, r.host, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value, r.gpus, port,
                c.engine.value, act.Phase.DRAINING if r.state == ReplicaState.DRAINING else act.Phase.DESIRED,
                "planned", r.t_start, r.since, r.since if r.state == ReplicaState.DRAINING else None, ready_s))
            reported.setdefault(r.host, []).append(act.ReportedReplica(
                r.rid, r.state, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value, r.gpus, port))
        hosts = {h.name: act.HostReport(h.name, h.online, h.gpu.value, h.gpu_count, h.nvlink_groups, None, (),
                                        (), tuple(reported.get(h.name, ())))
                 for h in self.env.hosts}
        return act.ActView(t, hosts, tuple(rows), (), {}, frozenset(r.rid for r in self.replicas),
                           connected_since_s=-math.inf)

    def _act(self, t: float, actions: Sequence[Action]) -> None:
        decision = act.execute(self._act_view(t), actions)
        by_id = {r.rid: r for r in self.replicas if r.state != ReplicaState.STOPPED}
        started: set[str] = set()
        for eff in decision.effects:
            if isinstance(eff, act.NewReplica):
                row = eff.row
                config = row.config
                self._start_replica(t, None, config, row.host, row.gpu_indices)
                started.add(row.model)
            elif isinstance(eff, act.NewBuild):
                self._build(t, eff.row)
            elif isinstance(eff, act.SetPhase):
                r = by_id.get(eff.replica_id)
                if r is not None:
                    if eff.phase == act.Phase.DRAINING and r.config.model in started:
                        self.swap_cycles += 1  # (the act core defers these: make-before-break)
                    self._drain(r, t)
            elif isinstance(eff, act.Record) and eff.note.status == act.ActionStatus.DEFERRED:
                self.deferred += 1

    def _build(self, t: float, row: act.BuildRow) -> None:
        c = row.config
        if self._built(c) or (c in self.builds and not self.builds[c].ready):
            return
        bs = self.env.build_s(c) or 0.0
        self.builds[c] = EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, row.host, False,
                                     self.env.epoch0_s + t + bs)
        self.n_builds += 1
        self.build_gpu_s[c.gpu.value] = self.build_gpu_s.get(c.gpu.value, 0.0) + bs * max(
            1, len(row.gpu_indices) or c.tp)
        self._push(t + bs, self._P_LIFE, "built", c)

    def _reconcile(self, t: float, targets: Mapping[ConfigKey, int]) -> None:
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
            if r.state == ReplicaState.STOPPED or r.blocked:
                continue
            gpus += len(r.gpus)
            if r.state == ReplicaState.READY:
                per[r.config] = per.get(r.config, 0) + 1
                ready += len(r.gpus)
        for b in self.builds.values():
            if not b.ready:
                gpus += b.tp
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
        k = 1
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
        len_edges = LENGTH_BUCKETS
        metrics = self.metrics
        req_model = self.req_model
        first_t = self.first_t
        finish_t = self.finish_t
        status = self.status
        owner = self.owner
        prompt = self.prompt
        output = self.output
        ready_lists = self.by_model_ready
        overheads: dict[int, float] = {}
        heappush, heappop = heapq.heappush, heapq.heappop
        outstanding = 0
        rep: _SimReplica
        version: int
        while True:
            ta = arr_t[i] if i < n else math.inf
            th = heap[0][0] if heap else math.inf
            if ta == math.inf and (th == math.inf or (outstanding == 0 and th > end_s)):
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
                    mm = metrics[rep.mi]
                    if cnt:
                        mm.itl[bisect.bisect_left(itl_edges, gap)] += cnt
                    oh = overheads.get(id(rep.core))
                    if oh is None:
                        oh = rep.core.params.factors.ttft_overhead_s
                        overheads[id(rep.core)] = oh
                    cm = rep.cm
                    assert cm is not None
                    for idx in firsts:
                        first_t[idx] = t
                        tt = t - arr_t[idx] + oh
                        b = bisect.bisect_left(ttft_edges, tt)
                        mm.ttft[b] += 1
                        cm.ttft[b] += 1
                    for idx in fins:
                        finish_t[idx] = t
                        status[idx] = SERVED
                        mm.completed += 1
                        mm.prompt_tokens += prompt[idx]
                        mm.gen_tokens += output[idx]
                        mm.plen[bisect.bisect_left(len_edges, prompt[idx])] += 1
                        mm.glen[bisect.bisect_left(len_edges, output[idx])] += 1
                        cm.completed += 1
                        if output[idx] >= 2:
                            cm.tpot[bisect.bisect_left(itl_edges, (t - first_t[idx]) / (output[idx] - 1))] += 1
                        outstanding -= 1
                    rep.load -= len(fins)
                    te = rep.core.begin(t)
                    if te is not None:
                        rep.version += 1
                        self._seq += 1
                        heappush(heap, (te, 0, self._seq, "step", (rep, rep.version)))
                    elif rep.state == ReplicaState.DRAINING and rep.load == 0:
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
                elif kind == "built":
                    c = payload
                    assert isinstance(c, ConfigKey)
                    b0 = self.builds[c]
                    self.builds[c] = EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, b0.host, True, None)
                continue
            # an arrival
            t = ta
            idx = i
            i += 1
            reps = ready_lists[req_model[idx]]
            if not reps:
                status[idx] = REJECTED
                continue
            rep = reps[0]
            best = rep.load
            for r in reps:
                if r.load < best:
                    rep, best = r, r.load
            core = rep.core
            try:
                core.submit(idx, prompt[idx], output[idx])
            except RequestTooLongError:
                status[idx] = REJECTED
                continue
            owner[idx] = rep
            rep.load += 1
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
        for _ in range(32):
            view = ControllerView(0.0, self.env.epoch0_s, obs, self._fleet(0.0), {})
            d = self.ctl.decide(view)
            starts = [a for a in d.actions if a.kind is ActionKind.START]
            if d.targets is not None:
                for c, want in sorted(d.targets.items()):
                    have = sum(1 for r in self.replicas if r.config == c and r.state == ReplicaState.READY)
                    for _ in range(max(0, want - have)):
                        slot = self._free_slot(c)
                        if slot is None:
                            break
                        self._start_replica(0.0, None, c, slot[0], slot[1], instant=True)
                break
            live_ids = {r.rid for r in self.replicas if r.state != ReplicaState.STOPPED}
            new = [a for a in starts if a.replica.replica_id not in live_ids]
            if not new:
                break
            for a in new:
                c = a.replica.config
                if self.env.build_s(c) is not None and not self._built(c):
                    continue  # a replica that needs an engine build cannot be warm
                self._start_replica(0.0, a.replica.replica_id, c, a.replica.host, a.replica.gpu_indices,
                                    instant=True)
        self.replica_starts = 0  # warm replicas are not counted as starts
        # a controller with a reset() forgets the warm-start decision (fleetplan's PlannerState);
        # hpa keeps it as its scale-down stabilisation history, as a long-running HPA would have
        if hasattr(self.ctl, "reset"):
            self.ctl.reset()

    def _true_observation(self, t0: float, w: float) -> Observation:
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
        view = ControllerView(t, self.env.epoch0_s + t, self.observation(t), self._fleet(t), self._replica_loads(t))
        d = self.ctl.decide(view)
        self.decisions += 1
        if d.note and len(self.notes) < 50:
            self.notes.append(f"t={t:.0f}s: {d.note}")
        self._apply(t, d)

    def _result(self, end_s: float) -> SimResult:
        gpu_s: dict[str, float] = {}
        for r in self.replicas:
            if r.t_gpu is None:
                continue
            stop = end_s if r.t_stop is None else min(r.t_stop, end_s)
            dur = max(0.0, stop - max(0.0, r.t_gpu))
            gpu_s[r.config.gpu.value] = gpu_s.get(r.config.gpu.value, 0.0) + dur * len(r.gpus)
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
            notes=tuple(self.notes),
            placement_conflicts=self.conflicts,
            swap_cycles=self.swap_cycles, deferred_actions=self.deferred,
        )
