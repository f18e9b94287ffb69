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
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fleetplan.planner.observation import ObserveRules
from fleetplan.planner.types import Observation, ReplicaState
from fleetplan.sim.control import ControlSettings, FleetplanController, ReplayControl
from fleetplan.sim.core import ITL_BUCKETS_S, LENGTH_BUCKETS, TPOT_BUCKETS_S, TTFT_BUCKETS_S
from fleetplan.sim.des_base import _SimBuild, _SimReplica
from fleetplan.sim.des_executor import BaselineExecutor
from fleetplan.sim.des_meter import FleetMeter
from fleetplan.sim.des_types import (
    PENDING,
    REJECTED,
    SERVED,
    Baseline,
    Controller,
    ControllerView,
    Decision,
    Environment,
    ReplicaLoad,
    SimResult,
    SimSettings,
    TimelinePoint,
)
from fleetplan.sim.groundtruth import RequestTooLongError
from fleetplan.sim.promsim import PromSim
from fleetplan.sim.router import RouteMode, Router, affinity_key
from fleetplan.sim.traces import Trace

__all__ = [
    "PENDING", "REJECTED", "SERVED", "Baseline", "Controller", "ControllerView", "Decision", "Environment",
    "FleetSim", "ReplicaLoad", "SimResult", "SimSettings", "TimelinePoint",
]


def _elements(a: np.ndarray) -> memoryview[Any]:
    """A view of a 1-d numpy array whose elements read as Python floats (ints) and write through."""
    return memoryview(a)  # type: ignore[arg-type]  # numpy's stubs do not declare the buffer protocol


class FleetSim(BaselineExecutor, FleetMeter):
    """One policy on one trace. `run()` returns a SimResult."""

    def __init__(self, trace: Trace, controller: Controller, env: Environment,
                 settings: SimSettings | None = None, *, default_model: str | None = None,
                 control: ControlSettings | None = None) -> None:
        self.trace = trace
        self.ctl = controller
        self.env = env
        self.host_by_name = {h.name: h for h in env.hosts}
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
                            length_window_s=self.s.length_window_s, offsets=self.s.scrape_offsets)
        self._init_pools()
        self.control: ReplayControl | None = None
        if isinstance(controller, FleetplanController):
            self.control = ReplayControl(
                controller, self, epoch0_s=env.epoch0_s, settings=control,
                rules=ObserveRules(window_s=self.s.window_s, peak_window_s=self.s.peak_window_s,
                                   history_s=self.s.history_s,
                                   history_window_s=max(self.s.window_s, self.s.history_step_s)))

    # -- main loop
    def run(self) -> SimResult:
        s = self.s
        n = self.n
        # the per-request arrays read and written through memoryviews: an element is a Python float (int),
        # not a numpy scalar, so the clock, the heap's keys and the engines' step times stay plain floats
        # (the same values; a numpy scalar costs several times a float in every comparison and operation)
        arr_t = _elements(self.arr_t)
        heap = self.heap
        end_s = self.duration_s
        t = 0.0
        if s.warm_start:
            self._warm_start()
        k = 0
        slots = max(1, s.scrape_offsets)
        while k * s.scrape_s / slots <= end_s:
            self._push(k * s.scrape_s / slots, self._P_SCRAPE, "scrape", k % slots)
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
        first_t = _elements(self.first_t)
        finish_t = _elements(self.finish_t)
        status = _elements(self.status)
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
        bisect_left = bisect.bisect_left
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
                    rep, version = payload  # type: ignore[misc]  # a step's payload (cast() costs a call per step)
                    if version != rep.version:
                        continue
                    if rep.pooled:  # a prefill or decode pool's replica (sim/disagg_proxy.py)
                        outstanding -= self._pool_step(rep, t)
                        continue
                    firsts, fins, gap, cnt = rep.core.end()
                    cn = rep.counters
                    if cnt:
                        cn.itl[bisect_left(itl_edges, gap)] += cnt
                    oh = overheads.get(id(rep.core))
                    if oh is None:
                        oh = rep.core.params.factors.ttft_overhead_s
                        overheads[id(rep.core)] = oh
                    for idx in firsts:
                        first_t[idx] = t
                        tt = t - arr_t[idx] + oh
                        cn.ttft[bisect_left(ttft_edges, tt)] += 1
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
                        cn.prompt_len[bisect_left(len_edges, p)] += 1
                        cn.gen_len[bisect_left(len_edges, o)] += 1
                        cn.sums[2] += p
                        cn.sums[3] += o
                        if o >= 2:
                            tp = (t - first_t[idx]) / (o - 1)
                            cn.tpot[bisect_left(tpot_edges, tp)] += 1
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
                    self._scrape(t, cast(int, payload))
                elif kind == "timeline":
                    lo = t - s.demand_window_s
                    a = int(np.searchsorted(self.arr_t, max(0.0, lo), side="left"))
                    b = int(np.searchsorted(self.arr_t, t, side="right"))
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
                core.submit(idx, prompt[idx], 1 if rep.pooled else output[idx], blocks[idx])
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
        if self.control is not None:
            obs = self._preroll_observation()

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
        self._warm_baseline()

    def _preroll_observation(self) -> Observation:
        """What the daemon reads at t = 0 had the first window's traffic come one window earlier:
        a pre-roll Prometheus (its own, so the replay's readings after t = 0 are untouched) holds a
        stand-in target per model that served those requests, and the observation comes from its
        readings through the cycle's own path (planner/cycle.py `observe`)."""
        s = self.s
        w = s.window_s
        pre = PromSim(window_s=w, scrape_s=s.scrape_s, delay_s=s.scrape_delay_s, history_s=s.history_s,
                      history_step_s=s.history_step_s, peak_window_s=s.peak_window_s,
                      epoch0_s=self.env.epoch0_s, length_window_s=s.length_window_s)
        b = int(np.searchsorted(self.arr_t, w, side="left"))
        per_model: list[list[tuple[float, int, int]]] = [[] for _ in self.model_names]
        for j in range(b):
            per_model[self.req_model[j]].append((float(self.arr_t[j]) - w, int(self.prompt[j]), int(self.output[j])))
        for mi, m in enumerate(self.model_names):  # scraped from before the window, as a target that ran
            pre.preroll(m, per_model[mi], start_s=-2 * w, end_s=0.0)
        assert self.control is not None
        return self.control.observe_warm(pre.readings(0.0))

    def _tick(self, t: float) -> None:
        self.decisions += 1
        if self.control is not None:
            self.control.cycle(t, self.prom.readings(t), self.prom.evidence(t))
            return
        self._decide_baseline(t)

