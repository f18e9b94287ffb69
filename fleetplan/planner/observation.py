"""What the Prometheus answers mean: the fail-static rules of observation. Pure.

controller/observe.py fetches (the PromQL text and the HTTP calls live there) and hands the raw
answers over as `Readings`; `interpret` turns them into per-model `ModelMetrics` and per-replica
`ReplicaMetrics`, the numbers the planner's `Observation` is built from. Everything here is decided
without a server, so the rules are unit-tested:

- **Prometheus unreachable or answering an error**: every model is stale, every value unknown.
- **A model is stale** (fail static: the planner never scales it DOWN) when its request rate is
  NaN or has no series, when one of its scrape targets is down, or when its rate window is not
  full (below). A stale model keeps the rate that was read, when there is one, as a LOWER BOUND:
  the targets that are up still served that much, so it may raise capacity (planner/core.py
  `_demands`), never lower it. isl/osl are left unknown (the policy's mix is used).
- **Partial windows are unknown, never 0 rps.** rate() over a window its samples do not cover
  under-reads: right after Prometheus (re)starts with empty data, or in a new replica's first
  window, the increase of a part of the window is divided by the whole window, and a target with a
  single sample has no rate at all (which used to read as an idle 0 rps). A target's window is
  full when its first sample in the window is at most 1.1 scrape intervals after the window's
  start, where Prometheus' own rate() extrapolates to the start (promql/functions.go
  extrapolatedRate); see `window_full`. The model's window is full when every target of it that
  is up has a full window.
- **A new replica has a rate from its first scrape.** Its counters started at 0 inside the window,
  and the engine says when: prometheus_client exports a `_created` series per counter, and vLLM's
  (`vllm:request_success_created`) is set as the engine finishes loading, seconds before its
  /health answers. Everything such a replica counted arrived inside the window, so its arrivals
  there are its counters' values (`window_arrivals`), known, not an under-read. Engines without
  `_created` (trtllm-serve's multiprocess collector, the simulated engines) are taken to start at
  their READY, the controller's record (`counters_start_s`). A target whose counters started
  before the window (Prometheus restarted, or scraped late) stays a lower bound.
- A model whose targets are all up and full but that completed no request is idle: 0 rps, known.

Time scale: in the lab the engines' simulated clock runs K times faster than wall time. Counters
are then K times higher per wall second, so rates are divided by K; histograms already hold
simulated seconds. History timestamps are mapped onto the simulated clock.

>>> rules = ObserveRules(window_s=60.0)
>>> def up(rid: str, first_s: float) -> dict[Query, tuple[Sample, ...]]:
...     labels = {"replica": rid, "model": "m"}
...     return {Query.UP: (Sample(labels, 1.0),), Query.UP_FIRST_S: (Sample(labels, first_s),),
...             Query.UP_LAST_S: (Sample(labels, 999.0),), Query.UP_SAMPLES: (Sample(labels, 1000.0 - first_s),)}
>>> full = Readings(1000.0, {**up("r1", 940.5), Query.RATE: (Sample({"model": "m"}, 4.0),)})
>>> interpret(full, ["m"], now_s=1000.0, rules=rules).models["m"].rate_rps   # known: may scale down
4.0
>>> restarted = Readings(1000.0, up("r1", 990.5))   # Prometheus came back 10 s ago: no rate yet
>>> m = interpret(restarted, ["m"], now_s=1000.0, rules=rules).models["m"]
>>> m.stale, m.rate_rps   # unknown, not an idle 0 rps
(True, None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from itertools import chain
from types import MappingProxyType
from typing import Any

import numpy as np

from fleetplan.planner.prefix import hit_rate_from_rates

# Labels that may carry the model name: `model` is written by the controller into the file_sd
# target labels (canonical name); `model_name` is what vLLM / TRT-LLM put on their own series.
MODEL_LABELS: tuple[str, ...] = ("model", "model_name")
# trtllm-serve labels every series model_name="undefined" (NVIDIA/TensorRT-LLM tensorrt_llm/serve/
# openai_server.py): no model name at all, so TRT-LLM replicas are known by the target's `model`.
UNSET_MODEL_NAMES = frozenset({"undefined"})
REPLICA_LABEL = "replica"  # file_sd label written by controller/routing.py ScrapeTarget

# Prometheus' rate() extrapolates to the window's start when the first sample is within 1.1 average
# scrape intervals of it (promql/functions.go extrapolatedRate); further away it under-reads
EXTRAPOLATION_THRESHOLD = 1.1


class Query(Enum):
    """The instant queries one observation asks (controller/observe.py writes the PromQL)."""

    RATE = "rate"  # arrivals per model (completions + queue growth), wall rps
    PROMPT = "prompt"  # prompt tokens per wall second, per model
    GEN = "gen"  # generated tokens per wall second, per model
    WAITING = "waiting"
    RUNNING = "running"
    KV = "kv"
    TTFT_P50 = "ttft_p50"  # seconds
    TTFT_P99 = "ttft_p99"
    ITL_P50 = "itl_p50"
    ITL_P99 = "itl_p99"
    UP = "up"  # one series per scrape target (file_sd `replica`, `model`)
    REPLICA_RUNNING = "replica_running"
    REPLICA_WAITING = "replica_waiting"
    # per scrape target, over the rate window: whether its samples cover it (see window_full)
    UP_FIRST_S = "up_first_s"  # unix time of its first sample in the window (to the query's step)
    UP_LAST_S = "up_last_s"  # unix time of its latest sample
    UP_SAMPLES = "up_samples"  # samples in the window
    # the highest completion rate over `peak_window_s` sub-windows within the rate window (bursts)
    PEAK_RATE = "peak_rate"
    # prompt tokens looked up in the prefix cache, and found there, per wall second (per model)
    PREFIX_QUERIES = "prefix_queries"
    PREFIX_HITS = "prefix_hits"
    # per scrape target: its arrival rate (as RATE, wall rps) and its completions counter's latest
    # value (requests completed since its process started): a replica started inside the window is
    # counted from them (see `interpret`, `window_arrivals`)
    REPLICA_RATE = "replica_rate"
    REPLICA_DONE = "replica_done"
    # per scrape target: when its request counters started at 0 (unix seconds), as the engine says:
    # the `_created` series of its completions counter (see `counters_start_s`)
    REPLICA_STARTED_S = "replica_started_s"


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]  # (unix wall seconds, value)


def _no_results() -> Mapping[Query, tuple[Sample, ...]]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Readings:
    """The raw answers of one observation, as fetched: plain data, no interpretation."""

    wall_s: float  # the evaluation time of every instant query (unix seconds)
    results: Mapping[Query, tuple[Sample, ...]] = field(default_factory=_no_results)
    history: tuple[Series, ...] = ()  # the request-rate range query (wall rps)
    error: str | None = None  # Prometheus unreachable or answered an error: nothing else is known


@dataclass(frozen=True)
class ObserveRules:
    window_s: float = 60.0  # rate()/histogram window, wall seconds
    time_scale: float = 1.0  # simulated seconds per wall second (lab)
    model_labels: tuple[str, ...] = MODEL_LABELS
    # models whose targets must all be up; a down target makes the model stale (fail static)
    require_all_targets_up: bool = True
    peak_window_s: float = 30.0  # the short window of Query.PEAK_RATE, wall seconds
    # the span of the request-rate history query and the rate window of its points (wall seconds);
    # None: unknown (every point is taken as it is)
    history_s: float | None = None
    history_window_s: float | None = None

    @property
    def window_step_s(self) -> float:
        """The resolution of the query that finds a target's first sample in the window.

        >>> ObserveRules(window_s=60.0).window_step_s, ObserveRules(window_s=5.0).window_step_s
        (3.0, 1.0)
        """
        return float(max(1, round(self.window_s / 20.0)))


@dataclass(frozen=True)
class ReplicaMetrics:
    """One scrape target (engine replica)."""

    replica_id: str
    model: str | None
    instance: str
    up: bool
    running: float | None = None
    waiting: float | None = None
    window_full: bool = False  # its samples cover the whole rate window (see window_full)
    last_s: float | None = None  # unix time of its latest sample (None: unknown)


@dataclass(frozen=True)
class ModelMetrics:
    """Everything observed for one model; None = unknown. `stale`: no scale-down on it; a stale
    model's `rate_rps`, when known, is a lower bound (what the targets that are up served)."""

    model: str
    rate_rps: float | None = None
    isl: float | None = None
    osl: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    queue_depth: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    replicas_up: int = 0
    replicas_down: int = 0
    history: tuple[tuple[float, float], ...] = ()
    stale: bool = True
    reasons: tuple[str, ...] = ()
    peak_rps: float | None = None  # the highest short-window rate in the window (simulated rps)
    peak_window_s: float = 30.0  # that short window (simulated seconds)
    prefix_hit_rate: float | None = None  # cached share of the prompt tokens (planner/prefix.py)
    history_window_s: float | None = None  # the window each history rate was read over (simulated s)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "rate_rps": self.rate_rps,
            "isl": self.isl,
            "osl": self.osl,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "itl_p50_ms": self.itl_p50_ms,
            "itl_p99_ms": self.itl_p99_ms,
            "queue_depth": self.queue_depth,
            "running": self.running,
            "kv_usage": self.kv_usage,
            "replicas_up": self.replicas_up,
            "replicas_down": self.replicas_down,
            "history_points": len(self.history),
            "stale": self.stale,
            "reasons": list(self.reasons),
            "peak_rps": self.peak_rps,
            "prefix_hit_rate": self.prefix_hit_rate,
        }


@dataclass(frozen=True)
class Interpreted:
    """What one observation says, before the evidence (planner/evidence.py) is added."""

    models: Mapping[str, ModelMetrics]
    replicas: Mapping[str, ReplicaMetrics]
    alerts: tuple[str, ...]
    prometheus_ok: bool


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def window_full(first_s: float | None, last_s: float | None, samples: float | None, *, eval_s: float,
                window_s: float, step_s: float) -> bool:
    """Whether a target's samples cover the rate window (eval_s - window_s, eval_s] well enough that
    rate() does not under-read: its first sample in the window is at most 1.1 scrape intervals
    (estimated from the samples themselves) after the window's start, where rate() extrapolates to
    the start. `first_s` is found by a subquery of resolution `step_s`: with samples denser than
    that it can be up to one step late, so up to `step_s` counts as covered too (an under-read of at
    most step_s / window_s). Fewer than 2 samples or an unknown value: not full.

    >>> w = dict(eval_s=1000.0, window_s=60.0, step_s=3.0)
    >>> window_full(941.0, 1000.0, 60, **w)   # scraped every second for the whole window
    True
    >>> window_full(955.0, 995.0, 3, **w)     # every 20 s: the first sample is 15 s in, still full
    True
    >>> window_full(990.0, 1000.0, 11, **w)   # Prometheus (re)started 10 s ago: not full
    False
    >>> window_full(999.0, 999.0, 1, **w)     # a new target, one sample: no rate at all
    False
    """
    if first_s is None or last_s is None or samples is None or not samples >= 2:
        return False
    if not (math.isfinite(first_s) and math.isfinite(last_s)) or last_s < first_s:
        return False
    interval_s = (last_s - first_s) / (samples - 1)
    return first_s - (eval_s - window_s) <= max(EXTRAPOLATION_THRESHOLD * interval_s, step_s)


def model_of(labels: Mapping[str, str], model_labels: Iterable[str] = MODEL_LABELS,
             canonical: Callable[[str], str] = str) -> str | None:
    """The canonical model a series belongs to: the first model label that names one.

    >>> model_of({"model_name": "undefined", "model": "Llama"}, canonical=str.lower)
    'llama'
    >>> model_of({"model_name": "undefined"}) is None   # trtllm-serve's placeholder is no model
    True
    """
    for key in model_labels:
        val = labels.get(key)
        if val and val not in UNSET_MODEL_NAMES:
            return canonical(val)
    return None


def group(samples: Iterable[Sample], model: Callable[[Mapping[str, str]], str | None],
          *, take_max: bool = False) -> dict[str, float]:
    """Per canonical model; several label groups of one model are summed (or the max taken). A
    model with a NaN group and no finite one maps to NaN."""
    out: dict[str, float] = {}
    nan_models: set[str] = set()
    for s in samples:
        m = model(s.labels)
        if m is None:
            continue
        if not math.isfinite(s.value):
            nan_models.add(m)
            continue
        if m in out:
            out[m] = max(out[m], s.value) if take_max else out[m] + s.value
        else:
            out[m] = s.value
    for m in nan_models:
        out.setdefault(m, math.nan)
    return out


def _per_replica(samples: Iterable[Sample]) -> dict[str, float]:
    return {s.labels.get(REPLICA_LABEL, ""): s.value for s in samples}


def _replicas(readings: Readings, rules: ObserveRules,
              model: Callable[[Mapping[str, str]], str | None]) -> dict[str, ReplicaMetrics]:
    res = readings.results
    running = _per_replica(res.get(Query.REPLICA_RUNNING, ()))
    waiting = _per_replica(res.get(Query.REPLICA_WAITING, ()))
    first = _per_replica(res.get(Query.UP_FIRST_S, ()))
    last = _per_replica(res.get(Query.UP_LAST_S, ()))
    count = _per_replica(res.get(Query.UP_SAMPLES, ()))
    out: dict[str, ReplicaMetrics] = {}
    for s in res.get(Query.UP, ()):
        rid = s.labels.get(REPLICA_LABEL, "")
        if not rid:
            continue
        up = s.value == 1.0
        full = window_full(first.get(rid), last.get(rid), count.get(rid), eval_s=readings.wall_s,
                           window_s=rules.window_s, step_s=rules.window_step_s)
        prev = out.get(rid)
        if prev is not None:  # two targets with one replica id: the worse of the two
            up, full = up and prev.up, full and prev.window_full
        out[rid] = ReplicaMetrics(
            replica_id=rid,
            model=model(s.labels),
            instance=s.labels.get("instance", ""),
            up=up,
            running=finite(running.get(rid)) if up else None,
            waiting=finite(waiting.get(rid)) if up else None,
            window_full=full,
            last_s=finite(last.get(rid)),
        )
    return out


def _history(readings: Readings, rules: ObserveRules, now_s: float,
             model: Callable[[Mapping[str, str]], str | None]) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per model, (controller-clock time, simulated rps), oldest first."""
    by_model: dict[str, dict[float, float]] = {}
    series_of: dict[str, list[Series]] = {}
    for series in readings.history:
        m = model(series.labels)
        if m is not None:
            series_of.setdefault(m, []).append(series)
    k = rules.time_scale
    out = {}
    for m, parts in series_of.items():
        if len(parts) == 1:  # one series (the usual): its points in one numpy pass where they are in order
            fast = _one_series(parts[0].points, readings.wall_s, rules, now_s)
            if fast is not None:
                out[m] = fast
                continue
        acc = by_model.setdefault(m, {})
        for series in parts:
            for t, v in series.points:
                if math.isfinite(v):
                    acc[t] = acc.get(t, 0.0) + v
        ordered = sorted(acc.items())
        if ordered and rules.history_s is not None and rules.history_window_s is not None:
            # a series that begins inside the queried span (a new model, Prometheus' data starting):
            # its first points' windows reach back before its first sample, and rate() divides what
            # it saw by the whole window - an under-read a forecast would take for a climb
            first = ordered[0][0]
            if first > readings.wall_s - rules.history_s + rules.history_window_s:
                ordered = [(t, v) for t, v in ordered if t >= first + rules.history_window_s]
        out[m] = tuple((now_s - max(0.0, readings.wall_s - t) * k, v / k) for t, v in ordered)
    return out


def _one_series(points: tuple[tuple[float, float], ...], wall_s: float, rules: ObserveRules,
                now_s: float) -> tuple[tuple[float, float], ...] | None:
    """`_history` of a model with one series, the same floats in numpy (a day at 30 s steps is 2,880
    points per cycle); None where its times are not finite and strictly increasing (the general path)."""
    raw = np.fromiter(chain.from_iterable(points), dtype=float, count=2 * len(points))
    t, v = raw[0::2], raw[1::2]
    keep = np.isfinite(v)
    t, v = t[keep], 0.0 + v[keep]  # 0.0 + v: what the general path's sum starts from
    if not (np.isfinite(t).all() and (t[1:] > t[:-1]).all()):
        return None
    if len(t) and rules.history_s is not None and rules.history_window_s is not None:
        first = float(t[0])
        if first > wall_s - rules.history_s + rules.history_window_s:
            later = t >= first + rules.history_window_s
            t, v = t[later], v[later]
    age = wall_s - t
    k = rules.time_scale
    return tuple(zip((now_s - np.where(age > 0.0, age, 0.0) * k).tolist(), (v / k).tolist(), strict=True))


def counters_start_s(created_s: float | None, ready_s: float | None) -> float | None:
    """When a replica's request counters were at 0 (unix seconds; None: unknown).

    The engine's own word first: the `_created` timestamp of its completions counter (vLLM: set as
    the engine finishes loading, before /health answers; its counters are created at 0 then).
    Engines that export no `_created` (trtllm-serve, the simulated engines): when it became ready,
    as the controller recorded it (its process served nothing before). The engine's time wins over
    the record: a record can be newer than the counters (an engine adopted by a restarted agent
    keeps counting from its own start).

    >>> counters_start_s(970.0, 975.0), counters_start_s(None, 975.0), counters_start_s(math.nan, None)
    (970.0, 975.0, None)
    """
    created = finite(created_s)
    return created if created is not None else finite(ready_s)


def window_arrivals(done: float | None, running: float | None, waiting: float | None, *, start_s: float,
                    last_s: float | None, eval_s: float, others_last_s: float | None = None) -> float | None:
    """A replica's arrivals over its part of the rate window, when its counters started at 0 inside
    the window (`start_s`, see `counters_start_s`): the requests it received by its last scrape
    (`last_s`): completed (its success counter) plus running and waiting, extrapolated to `eval_s`
    at their own rate since `start_s`, as rate() extrapolates every other target to the window's
    end. None: no counter, no scrape after the start, or the last scrape covering less than half of
    its time in the window (the extrapolation would be most of the count). Missing gauges count 0,
    as the arrival rate query falls back to completions without them.

    One case needs no extrapolation of its own: a replica scraped only at its start (or before)
    when that start is at or after the last scrape of every other target of its model
    (`others_last_s`). The spans the others' samples cover then hold none of its serving time, so
    every request of those spans reached them, and rate() extrapolates their rate to the window's
    end as it does for any target: the replica counts what it held at its start (0 requests, or the
    few that arrived that instant). Why: a TensorRT-LLM replica (45 s startup) started at one cycle is
    READY at a scrape that reads it at 0, 15 s before the next cycle, and that cycle was fail-static
    after every start (benchmark-fitted mooncake: 20 of 59). Prometheus spreads its targets' scrapes
    over the interval (a per-target offset), so in a real fleet a replica's start often falls
    before another target's last scrape: then the others' spans hold part of its serving time and
    the reading stays a lower bound, as before.

    >>> window_arrivals(40.0, 3.0, 1.0, start_s=960.0, last_s=980.0, eval_s=1000.0)  # 44 in 20 s, 40 s
    88.0
    >>> window_arrivals(40.0, 3.0, 1.0, start_s=960.0, last_s=965.0, eval_s=1000.0) is None  # 5 s of 40
    True
    >>> window_arrivals(0.0, 0.0, 0.0, start_s=985.0, last_s=985.0, eval_s=1000.0, others_last_s=985.0)
    0.0
    >>> window_arrivals(0.0, 0.0, 0.0, start_s=985.0, last_s=985.0, eval_s=1000.0, others_last_s=990.0) is None
    True
    """
    if done is None or not math.isfinite(done) or done < 0 or last_s is None or not math.isfinite(last_s):
        return None
    seen_s = last_s - start_s
    n = done + (finite(running) or 0.0) + (finite(waiting) or 0.0)
    if seen_s <= 0 and others_last_s is not None and start_s >= others_last_s:
        return n  # the others' spans end before it served: nothing of theirs is its, nothing of its is missed
    if not seen_s > 0 or eval_s - last_s > seen_s:
        return None
    return n * (max(eval_s, last_s) - start_s) / seen_s


def interpret(readings: Readings, models: Iterable[str], *, now_s: float, rules: ObserveRules,
              canonical: Callable[[str], str] = str,
              expected_replicas: Collection[str] | None = None,
              serving: Mapping[str, str] | None = None, router_down: bool = False,
              ready_wall_s: Mapping[str, float] | None = None) -> Interpreted:
    """Observe `models` (plus any model seen in the readings). `now_s`: the controller clock.

    `expected_replicas`: the replicas the controller runs; a down target outside this set (a
    replica being removed, not yet gone from file_sd) does not make its model stale, nor does its
    window. `serving`: replica id -> model of the replicas that serve requests (READY); one that
    Prometheus does not scrape yet (file_sd picks a new target up seconds later) serves requests
    nobody counts, so its model's rate is a lower bound: stale (found by replaying the lab: the
    under-read drained a replica the load still needed). `router_down`: the router is down (or was
    within the rate window): requests never reach the engines, so every rate is a lower bound (the
    fault suite saw a killed nginx read as a drop in demand and drain a replica). `ready_wall_s`:
    replica id -> when it became ready (unix wall seconds: the act core's `ready_since`), for engines
    that do not say when their counters started (`counters_start_s`). A replica whose counters
    started at 0 inside the rate window and whose samples do not cover it (a new replica, the window
    partial) is counted from that start instead of making its model stale: its arrivals since then
    (`window_arrivals`) replace what rate() reads of it, which is nothing with one sample and an
    under-read when its first scrape came late. Why: with the daemon's defaults every start made
    its model fail-static for a window, a third of the cycles of a fleet that scales
    (benchmark-fitted mooncake: 19 of 60), and a fail-static model neither forecasts nor scales
    down. A Prometheus restart leaves the window partial for replicas ready long before: those
    stay a lower bound, as before."""
    wanted = [canonical(m) for m in models]
    if readings.error is not None:
        unknown = {m: ModelMetrics(model=m, stale=True, reasons=(readings.error,)) for m in wanted}
        return Interpreted(unknown, {}, (f"fail static: {readings.error}",), False)

    def model(labels: Mapping[str, str]) -> str | None:
        return model_of(labels, rules.model_labels, canonical)

    res = readings.results
    replicas = _replicas(readings, rules, model)
    rate = group(res.get(Query.RATE, ()), model)
    prompt = group(res.get(Query.PROMPT, ()), model)
    gen = group(res.get(Query.GEN, ()), model)
    waiting = group(res.get(Query.WAITING, ()), model)
    running = group(res.get(Query.RUNNING, ()), model)
    kv = group(res.get(Query.KV, ()), model, take_max=True)
    peak = group(res.get(Query.PEAK_RATE, ()), model)
    replica_rate = _per_replica(res.get(Query.REPLICA_RATE, ()))
    replica_done = _per_replica(res.get(Query.REPLICA_DONE, ()))
    started = _per_replica(res.get(Query.REPLICA_STARTED_S, ()))
    pq = group(res.get(Query.PREFIX_QUERIES, ()), model)
    ph = group(res.get(Query.PREFIX_HITS, ()), model)
    # several label groups of one model: the worst quantile is the conservative merge
    quant = {q: group(res.get(q, ()), model, take_max=True)
             for q in (Query.TTFT_P50, Query.TTFT_P99, Query.ITL_P50, Query.ITL_P99)}
    history = _history(readings, rules, now_s, model)

    seen = set(rate) | set(running) | {r.model for r in replicas.values() if r.model}
    alerts: list[str] = []
    out: dict[str, ModelMetrics] = {}
    for m in dict.fromkeys([*wanted, *sorted(seen)]):
        reps = [r for r in replicas.values()
                if r.model == m and (expected_replicas is None or r.replica_id in expected_replicas)]
        up_n = sum(1 for r in reps if r.up)
        down_n = len(reps) - up_n
        partial = sorted(r.replica_id for r in reps if r.up and not r.window_full)
        exact: dict[str, float] = {}  # counters started inside the window: their arrivals since then
        for r in reps:
            start = counters_start_s(started.get(r.replica_id), (ready_wall_s or {}).get(r.replica_id))
            if r.replica_id in partial and start is not None and start > readings.wall_s - rules.window_s:
                others = [o.last_s for o in reps if o is not r and o.up and o.last_s is not None]
                n = window_arrivals(replica_done.get(r.replica_id), r.running, r.waiting, start_s=start,
                                    last_s=r.last_s, eval_s=readings.wall_s,
                                    others_last_s=max(others) if others else None)
                if n is not None:
                    exact[r.replica_id] = n
        partial = [rid for rid in partial if rid not in exact]
        reasons: list[str] = []
        r_read = r_wall = rate.get(m)
        if exact and (r_wall is None or math.isfinite(r_wall)):
            # what rate() read of them is replaced by their count since they started (window_arrivals)
            read = sum(finite(replica_rate.get(rid)) or 0.0 for rid in exact)
            r_wall = max(0.0, (r_wall or 0.0) - read) + sum(exact.values()) / rules.window_s
        if r_wall is None and up_n > 0 and down_n == 0 and not partial:
            r_wall = 0.0  # targets up for the whole window, no request finished: idle, not unknown
        if r_wall is None:
            reasons.append("no request-rate series in Prometheus (no replica scraped for a whole window)")
        elif not math.isfinite(r_wall):
            reasons.append("request rate is NaN")
        if down_n and rules.require_all_targets_up:
            down_ids = ", ".join(sorted(r.replica_id for r in reps if not r.up))
            reasons.append(f"{down_n} scrape target(s) down: {down_ids}")
        if router_down:
            reasons.append("the router is down or was within the rate window: requests did not reach the engines")
        unscraped = sorted(rid for rid, sm in (serving or {}).items() if canonical(sm) == m and rid not in replicas)
        if unscraped:
            reasons.append("serving but not scraped yet (its requests are not counted): " + ", ".join(unscraped))
        if partial:
            # a rate over a window its samples do not cover under-reads: not evidence for a scale-down
            reasons.append(f"rate window ({rules.window_s:g} s) not yet covered by the samples of "
                           + ", ".join(partial) + " (Prometheus restarted, or a new replica not yet countable from its start)")
        k = rules.time_scale
        r_raw = finite(r_wall)
        r_tok = finite(r_read)  # the token rates were read as the request rate was, by rate()
        isl = osl = None
        if r_tok is not None and r_tok > 0:
            p, g = finite(prompt.get(m)), finite(gen.get(m))
            isl = p / r_tok if p is not None else None
            osl = g / r_tok if g is not None else None

        def ms(q: Query, model_name: str = m) -> float | None:
            v = finite(quant[q].get(model_name))
            return v * 1000.0 if v is not None else None

        p_raw = finite(peak.get(m))
        mm = ModelMetrics(
            model=m,
            rate_rps=r_raw / k if r_raw is not None else None,
            peak_rps=p_raw / k if p_raw is not None and p_raw >= 0 else None,
            peak_window_s=rules.peak_window_s * k,
            history_window_s=rules.history_window_s * k if rules.history_window_s is not None else None,
            prefix_hit_rate=hit_rate_from_rates(finite(pq.get(m)), finite(ph.get(m)), rules.window_s),
            isl=isl,
            osl=osl,
            ttft_p50_ms=ms(Query.TTFT_P50),
            ttft_p99_ms=ms(Query.TTFT_P99),
            itl_p50_ms=ms(Query.ITL_P50),
            itl_p99_ms=ms(Query.ITL_P99),
            queue_depth=finite(waiting.get(m)),
            running=finite(running.get(m)),
            kv_usage=finite(kv.get(m)),
            replicas_up=up_n,
            replicas_down=down_n,
            history=history.get(m, ()),
            stale=bool(reasons),
            reasons=tuple(reasons),
        )
        if mm.stale:
            alerts.append(f"fail static for {m}: " + "; ".join(reasons))
            # the rate stays, as a lower bound (it can raise capacity, planner/core.py); the length
            # means of a partial reading are not planned on
            mm = replace(mm, isl=None, osl=None)
        out[m] = mm
    return Interpreted(out, replicas, tuple(alerts), True)


__all__ = [
    "MODEL_LABELS",
    "REPLICA_LABEL",
    "UNSET_MODEL_NAMES",
    "Interpreted",
    "ModelMetrics",
    "ObserveRules",
    "Query",
    "Readings",
    "ReplicaMetrics",
    "Sample",
    "Series",
    "counters_start_s",
    "finite",
    "group",
    "interpret",
    "model_of",
    "window_arrivals",
    "window_full",
]
