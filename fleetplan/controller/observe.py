"""What the controller sees: per-model load and latency read from Prometheus (the fetch).

PromQL instant queries give the current rate, ISL/OSL mix, p50/p99 TTFT and ITL, queue depth,
KV usage, per-replica `up` and how much of the rate window each target's samples cover; a range
query gives the request-rate history for the forecast. Both vLLM spellings (`vllm:` and `vllm_`)
and TensorRT-LLM (`trtllm_`, as trtllm-serve exports them on /prometheus/metrics:
tensorrt_llm/metrics/collector.py) are matched with `__name__` regexes, so one query covers a mixed
fleet. TRT-LLM has no inter-token histogram: its ITL is read from
`trtllm_time_per_output_token_seconds` (one mean per request, logged when it finishes).

This module does the I/O only: `Observer.fetch` returns the raw answers as plain data
(`fleetplan.planner.observation.Readings`), and the pure `interpret` there holds the fail-static
rules (a stale model, partial rate windows, a router that was down, the time scale) and builds the
per-model numbers. `Observer.snapshot` is fetch + the length/latency evidence (planner/evidence.py)
+ `fleetplan.planner.cycle.observe`, the replay's path from readings to what they mean.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from fleetplan.controller.prom_answer import PrometheusError, data_of, matrix_of, scalar_of, short, vector_of
from fleetplan.planner import clockstep
from fleetplan.planner import evidence as ev
from fleetplan.planner.arrivals import ArrivalRate, EngineSeries
from fleetplan.planner.cycle import Observed, observe
from fleetplan.planner.observation import (
    MODEL_LABELS,
    REPLICA_LABEL,
    UNSET_MODEL_NAMES,
    Interpreted,
    ModelMetrics,
    ObserveRules,
    Query,
    Readings,
    ReplicaMetrics,
    Sample,
    Series,
    group,
    model_of,
)
from fleetplan.planner.queries import (
    EVIDENCE_QUERIES,
    QUERIES,
    ROLE_LABEL,
    Arrivals,
    By,
    Description,
    EngineHistogram,
    EvidenceQuery,
    HistogramRate,
    Leg,
    Part,
    Quantile,
    Rate,
    Window,
    evidence_of,
)

log = logging.getLogger(__name__)
K = TypeVar("K", Query, EvidenceQuery)

# re-exported: the snapshot's parts are imported from here by the daemon, the CLI and the tests
__all__ = [
    "MODEL_LABELS",
    "REPLICA_LABEL",
    "UNSET_MODEL_NAMES",
    "ModelMetrics",
    "Observer",
    "ObserverConfig",
    "PromClient",
    "PrometheusError",
    "ReplicaMetrics",
    "Sample",
    "Series",
    "Snapshot",
    "render_snapshot",
    "to_observation",
]

_REQ_SUCCESS = r"vllm[:_]request_success_total|trtllm_request_success_total"
# when that counter started at 0: prometheus_client's `_created` series, which vLLM exports (trtllm-serve's
# multiprocess collector does not)
_REQ_SUCCESS_CREATED = r"vllm[:_]request_success_created"
_PROMPT_TOK = r"vllm[:_]prompt_tokens_total|trtllm_prompt_tokens_total"
_GEN_TOK = r"vllm[:_]generation_tokens_total|trtllm_generation_tokens_total"
_TTFT_BUCKET = r"vllm[:_]time_to_first_token_seconds_bucket|trtllm_time_to_first_token_seconds_bucket"
# vLLM exports ITL under two names with identical labels (inter_token_latency is the newer one);
# rate() drops the name, so the two must not meet in one vector: prefer the newer, `or` the older.
_ITL_BUCKET = r"vllm[:_]inter_token_latency_seconds_bucket"
_ITL_BUCKET_OLD = r"(vllm[:_]|trtllm_)time_per_output_token_seconds_bucket"
_WAITING = r"vllm[:_]num_requests_waiting|trtllm_num_requests_waiting"
_RUNNING = r"vllm[:_]num_requests_running|trtllm_num_requests_running"
_KV_USAGE = r"vllm[:_](gpu_cache_usage_perc|kv_cache_usage_perc)|trtllm_kv_cache_utilization"
# the prefix cache, in prompt tokens: vLLM v1's vllm:prefix_cache_queries / _hits
# (vllm/v1/metrics/loggers.py); TensorRT-LLM's prompt tokens and their cached part
# (tensorrt_llm/metrics/collector.py)
_PREFIX_QUERIES = r"vllm[:_]prefix_cache_queries_total|trtllm_prompt_tokens_total"
_PREFIX_HITS = r"vllm[:_]prefix_cache_hits_total|trtllm_prompt_cached_tokens_total"
# the evidence's histograms (planner/evidence.py): the requests' prompt and generated lengths, and
# each request's mean time per output token (TRT-LLM's only per-token latency)
_PROMPT_LEN_BUCKET = r"vllm[:_]request_prompt_tokens_bucket"
_GEN_LEN_BUCKET = r"vllm[:_]request_generation_tokens_bucket"
_TPOT_REQ_BUCKET = r"vllm[:_]request_time_per_output_token_seconds_bucket|trtllm_time_per_output_token_seconds_bucket"
# the engine series the queries read (planner/arrivals.py, planner/queries.py), by their metric names
_SERIES = {EngineSeries.REQUESTS_DONE: _REQ_SUCCESS, EngineSeries.RUNNING: _RUNNING, EngineSeries.WAITING: _WAITING,
           EngineSeries.PROMPT_TOKENS: _PROMPT_TOK, EngineSeries.GEN_TOKENS: _GEN_TOK,
           EngineSeries.KV_USAGE: _KV_USAGE, EngineSeries.PREFIX_QUERIES: _PREFIX_QUERIES,
           EngineSeries.PREFIX_HITS: _PREFIX_HITS}
# a histogram's bucket series, the preferred name first (`or`: one name per series in the vector)
# a per-model query's targets (planner/queries.py `Leg`): pool replicas carry a `role` label, targets
# without one serve whole requests (an absent label matches `!=`)
_LEG_MATCHER = {Leg.ALL: "", Leg.ENTRY: f',{ROLE_LABEL}!="decode"', Leg.EXIT: f',{ROLE_LABEL}!="prefill"'}

_HISTOGRAMS = {EngineHistogram.TTFT: (_TTFT_BUCKET,), EngineHistogram.ITL: (_ITL_BUCKET, _ITL_BUCKET_OLD),
               EngineHistogram.TPOT: (_TPOT_REQ_BUCKET,), EngineHistogram.PROMPT_LEN: (_PROMPT_LEN_BUCKET,),
               EngineHistogram.GEN_LEN: (_GEN_LEN_BUCKET,)}


def _part_of(bucket_re: str, part: Part) -> str:
    """The `part` series (`_bucket`, `_sum`, `_count`) of the histograms `bucket_re` names.

    >>> _part_of(_TTFT_BUCKET, Part.SUM)
    'vllm[:_]time_to_first_token_seconds_sum|trtllm_time_to_first_token_seconds_sum'
    >>> _part_of(_ITL_BUCKET_OLD, Part.COUNT)
    '(vllm[:_]|trtllm_)time_per_output_token_seconds_count'
    """
    return re.sub(r"_bucket(?=\||$)", f"_{part.value}", bucket_re)


class PromClient:
    """A small async Prometheus HTTP API client (instant and range queries).

    `deadline_s` bounds each request as a whole, the answer's body included (httpx's timeout is
    per read: an answer trickling a byte a second would never trip it); `timeout_s` stays httpx's
    connect/read timeout. An answer of the wrong shape is a PrometheusError (controller/prom_answer.py).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 5.0, token: str | None = None,
                 deadline_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.deadline_s = deadline_s
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers=headers)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> PromClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _where(self, expr: str, name: str) -> str:
        """How errors name the server and the query: `name` (the observation's) and the PromQL."""
        return f"prometheus at {self.base_url}, query {name + ' ' if name else ''}{short(expr)!r}"

    async def _get(self, path: str, params: Mapping[str, str], name: str) -> Mapping[str, Any]:
        where = self._where(params.get("query", ""), name)
        try:
            async with asyncio.timeout(self.deadline_s):
                resp = await self._client.get(path, params=dict(params))
        except TimeoutError:
            raise PrometheusError(f"{where}: no full answer within {self.deadline_s:g} s") from None
        except httpx.HTTPError as exc:
            raise PrometheusError(f"{where}: unreachable: {exc!r}") from exc
        try:
            body = resp.json()
        except ValueError as exc:
            raise PrometheusError(f"{where}: answered HTTP {resp.status_code} with a body that is not JSON") from exc
        return data_of(body, where)

    async def query(self, expr: str, at_s: float | None = None, *, name: str = "") -> list[Sample]:
        params = {"query": expr}
        if at_s is not None:
            params["time"] = f"{at_s:.3f}"
        data = await self._get("/api/v1/query", params, name)
        return vector_of(data, self._where(expr, name))

    async def time_s(self) -> float:
        """Prometheus's own clock: `time()` evaluated at its now (unix seconds)."""
        data = await self._get("/api/v1/query", {"query": "time()"}, "clock")
        return scalar_of(data, self._where("time()", "clock"))[1]

    async def query_range(self, expr: str, start_s: float, end_s: float, step_s: float, *,
                          name: str = "") -> list[Series]:
        params = {"query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}", "step": f"{step_s:.3f}"}
        data = await self._get("/api/v1/query_range", params, name)
        return matrix_of(data, self._where(expr, name))


def merge_history(old: Iterable[Series], new: Iterable[Series], since_s: float) -> tuple[Series, ...]:
    """Series of `old` extended by `new` (same labels; a point of `new` replaces the point of `old`
    at the same time), points before `since_s` dropped, series left empty dropped."""
    merged: dict[frozenset[tuple[str, str]], dict[float, float]] = {}
    labels: dict[frozenset[tuple[str, str]], Mapping[str, str]] = {}
    for s in (*old, *new):
        key = frozenset(s.labels.items())
        labels.setdefault(key, s.labels)
        merged.setdefault(key, {}).update((round(t, 3), v) for t, v in s.points)  # ms: as the query sent it
    out = []
    for key, points in merged.items():
        kept = tuple(sorted((t, v) for t, v in points.items() if t >= since_s))
        if kept:
            out.append(Series(labels[key], kept))
    return tuple(out)


@dataclass(frozen=True)
class Snapshot:
    models: Mapping[str, ModelMetrics]
    replicas: Mapping[str, ReplicaMetrics]
    alerts: tuple[str, ...]
    prometheus_ok: bool
    wall_s: float
    now_s: float  # on the (possibly simulated) controller clock
    # length histograms per model and latency series per replica (planner/evidence.py); None: not read
    evidence: ev.Evidence | None = None
    # Prometheus's clock stepped since the last observation by this many seconds (planner/clockstep.py:
    # the cycle takes no action); None: it did not
    clock_step_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "prometheus_ok": self.prometheus_ok,
            "wall_s": self.wall_s,
            "now_s": self.now_s,
            "alerts": list(self.alerts),
            "models": {m: mm.to_json() for m, mm in sorted(self.models.items())},
            "replicas": {
                r: {"model": rm.model, "instance": rm.instance, "up": rm.up, "running": rm.running,
                    "waiting": rm.waiting, "window_full": rm.window_full}
                for r, rm in sorted(self.replicas.items())
            },
        }


@dataclass(frozen=True)
class ObserverConfig:
    window_s: float = 60.0  # rate()/histogram window, wall seconds
    history_s: float = 3600.0  # range-query span for the forecast, wall seconds
    history_step_s: float = 30.0
    time_scale: float = 1.0
    model_labels: tuple[str, ...] = MODEL_LABELS
    # models whose targets must all be up; a down target makes the model stale (fail static)
    require_all_targets_up: bool = True
    extra_selector: str = ""  # e.g. 'job="engines"' to restrict all queries
    peak_window_s: float = 30.0  # bursts: the highest rate over sub-windows this long (>= 2 scrapes)
    length_window_s: float = 600.0  # the length mix's histograms: enough requests for a p99

    def rules(self) -> ObserveRules:
        return ObserveRules(window_s=self.window_s, time_scale=self.time_scale, model_labels=self.model_labels,
                            require_all_targets_up=self.require_all_targets_up, peak_window_s=self.peak_window_s,
                            history_s=self.history_s, history_window_s=max(self.window_s, self.history_step_s))


@dataclass
class Observer:
    """Reads Prometheus and returns a Snapshot; never raises on Prometheus failures."""

    client: PromClient
    config: ObserverConfig = field(default_factory=ObserverConfig)
    canonical: Callable[[str], str] = lambda name: name
    # the controller's clock (unix seconds): the time of an observation Prometheus did not date
    clock: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic
    # the whole observation (every query, the history, the evidence) ends within this many seconds
    # (each query within `client.deadline_s`); late: the cycle fails static, as on an unreachable one
    deadline_s: float = 30.0
    # Prometheus's clock (its `time()`, the time every query is evaluated at) against the monotonic
    # one: a step is alerted and makes the cycle take no action (planner/clockstep.py)
    step_tolerance_s: float = 2.0
    step_alert_hold_s: float = 600.0
    # the request-rate history already read: (query, step, series); each fetch asks Prometheus
    # only for the steps since (8 days at 300 s steps is ~2,300 points per model otherwise)
    _history: tuple[str, float, tuple[Series, ...]] | None = None
    _prom_clock: clockstep.ClockWatch = field(default_factory=clockstep.ClockWatch)
    prom_clock: clockstep.ClockVerdict = field(default_factory=clockstep.ClockVerdict)  # the last fetch's

    def _sel(self, name_re: str, leg: Leg = Leg.ALL) -> str:
        extra = f",{self.config.extra_selector}" if self.config.extra_selector else ""
        return f'{{__name__=~"{name_re}"{_LEG_MATCHER[leg]}{extra}}}'

    def _by(self, *more: str) -> str:
        return ", ".join((*self.config.model_labels, *more))

    def _window(self, window: Window = Window.RATE) -> str:
        """The range of a rate (whole seconds); the length window is at least the rate window."""
        s = self.config.window_s
        return f"{max(1, round(s if window is Window.RATE else max(self.config.length_window_s, s)))}s"

    def _model_of(self, labels: Mapping[str, str]) -> str | None:
        return model_of(labels, self.config.model_labels, self.canonical)

    def _group(self, samples: Iterable[Sample], combine: str = "sum") -> dict[str, float]:
        """Per canonical model; several label groups of one model are summed (or max-ed)."""
        return group(samples, self._model_of, take_max=combine == "max")

    def render(self, d: Description | HistogramRate) -> str:
        """A query's description (planner/queries.py) as PromQL.

        >>> from fleetplan.planner.queries import Agg, Latest
        >>> o = Observer(PromClient("http://p:9090"), ObserverConfig(window_s=60, model_labels=("model",)))
        >>> o.render(Latest(EngineSeries.KV_USAGE, agg=Agg.AVG)).replace(_KV_USAGE, "KV")
        'avg by (model) ({__name__=~"KV"})'
        >>> o.render(Rate(EngineSeries.GEN_TOKENS, By.REPLICA)).replace(_GEN_TOK, "GEN")
        'sum by (replica) (rate({__name__=~"GEN"}[60s]))'
        >>> o.render(HistogramRate(EngineHistogram.GEN_LEN, Part.SUM, window=Window.LENGTH, leg=Leg.EXIT))
        'sum by (model) (rate({__name__=~"vllm[:_]request_generation_tokens_sum",role!="prefill"}[600s]))'
        """
        if isinstance(d, Arrivals):  # per replica: the model's labels kept besides
            if d.by is By.REPLICA:
                return self._arrival_rate_query(d.rule, REPLICA_LABEL)
            return self._arrival_rate_query(d.rule, leg=d.leg)
        if isinstance(d, Quantile):
            return f"histogram_quantile({d.q:g}, {self.render(HistogramRate(d.histogram, leg=d.leg))})"
        leg = d.leg if d.by is By.MODEL else Leg.ALL  # a per-target query reads every target
        if isinstance(d, HistogramRate):  # `or`: one histogram name per series (rate() drops the name)
            le = ("le",) if d.part is Part.BUCKET else ()
            by = self._by(*le) if d.by is By.MODEL else ", ".join((REPLICA_LABEL, *le))
            return " or ".join(
                f"sum by ({by}) (rate({self._sel(_part_of(b, d.part), leg)}[{self._window(d.window)}]))"
                for b in _HISTOGRAMS[d.histogram])
        by = self._by() if d.by is By.MODEL else REPLICA_LABEL
        if isinstance(d, Rate):
            return f"sum by ({by}) (rate({self._sel(_SERIES[d.series], leg)}[{self._window(d.window)}]))"
        return f"{d.agg.value} by ({by}) ({self._sel(_SERIES[d.series], leg)})"

    def queries(self) -> dict[Query, str]:
        w = self._window()
        by = self._by()
        q: dict[Query, str] = {name: self.render(d) for name, d in QUERIES.items()}
        # bursts (planner/core.py burst floor): the highest completion rate over short sub-windows
        pw = max(1, round(self.config.peak_window_s))
        q[Query.PEAK_RATE] = (f"max_over_time((sum by ({by}) (rate({self._sel(_REQ_SUCCESS, Leg.ENTRY)}[{pw}s])))"
                              f"[{w}:{max(1, pw // 2)}s])")
        extra = f",{self.config.extra_selector}" if self.config.extra_selector else ""
        up = f'up{{{REPLICA_LABEL}!=""{extra}}}'
        q[Query.UP] = up
        # a replica whose counters started inside the window is counted whole (planner/observation.py)
        q[Query.REPLICA_STARTED_S] = f"min by ({REPLICA_LABEL}) ({self._sel(_REQ_SUCCESS_CREATED)})"
        # how much of the window each target's samples cover (planner/observation.py window_full).
        # The first sample in the window: a subquery of the samples' own timestamps, each step
        # looking back only one step (else the 5 min lookback would find a sample from before a
        # gap, e.g. before Prometheus restarted, that the rate window does not hold)
        rules = self.config.rules()
        step_ms = round(rules.window_step_s * 1000)
        win_ms = round(self.config.window_s * 1000)
        q[Query.UP_FIRST_S] = (f"min_over_time((timestamp({up}) >= time() - {rules.window_step_s:g})"
                               f"[{win_ms}ms:{step_ms}ms])")
        q[Query.UP_LAST_S] = f"timestamp({up})"
        q[Query.UP_SAMPLES] = f"count_over_time({up}[{win_ms}ms])"
        return q

    def evidence_queries(self) -> dict[EvidenceQuery, str]:
        """Length histograms per model, latency histograms and completions per replica (planner/queries.py
        `EVIDENCE_QUERIES`, read by planner/evidence.py)."""
        return {q: self.render(d) for q, d in EVIDENCE_QUERIES.items()}

    async def _evidence(self, wall: float) -> ev.Evidence | None:
        """The evidence queries; a failure here leaves the evidence unknown, not the model stale."""
        try:
            answers = await self._query_all(self.evidence_queries(), wall)
        except PrometheusError as exc:
            log.warning("length/latency evidence unavailable: %s", exc)
            return None
        return evidence_of(answers, model_of=self._model_of, window_s=self.config.window_s,
                           length_window_s=max(self.config.length_window_s, self.config.window_s),
                           time_scale=self.config.time_scale, replica_label=REPLICA_LABEL)

    async def _query_all(self, queries: Mapping[K, str], at_s: float,
                         pending: list[str] | None = None) -> dict[K, list[Sample]]:
        """Every query at `at_s`, concurrently; the first failure cancels the others and is raised,
        naming the query. `pending`, when given, is left holding the names of the queries still
        unanswered when this ends early (a deadline: the alert names them)."""

        def name(n: Query | EvidenceQuery) -> str:
            return n.value if isinstance(n, Query) else f"evidence {n.value}"

        tasks = {n: asyncio.ensure_future(self.client.query(q, at_s, name=name(n))) for n, q in queries.items()}
        if pending is not None:
            pending[:] = [name(n) for n in tasks]
        try:
            await asyncio.gather(*tasks.values())
        finally:
            if pending is not None:
                pending[:] = [name(n) for n, t in tasks.items() if not t.done() or t.cancelled()]
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {n: t.result() for n, t in tasks.items()}

    def _arrival_rate_query(self, rule: ArrivalRate, *more: str, leg: Leg = Leg.ALL) -> str:
        """Arrivals (planner/arrivals.py: completions + growth of the requests in the engine) as
        PromQL; a model whose queue gauges are missing falls back to the completion rate. `more`:
        labels to keep besides the model's (per replica: `replica`); `leg`: the targets read.
        """
        w, by = self._window(), self._by(*more)
        done = f"sum by ({by}) (rate({self._sel(_SERIES[rule.completions], leg)}[{w}]))"
        # one deriv() per gauge: deriv drops the name, and two names in one vector would clash
        growth = " + ".join(f"sum by ({by}) (deriv({self._sel(_SERIES[g], leg)}[{w}]))" for g in rule.in_engine)
        return f"clamp_min({done} + {growth}, {rule.floor_rps:g}) or {done}"

    def history_query(self) -> str:
        # the rate window covers the whole step, so no request between two history points is lost
        w = f"{max(1, round(max(self.config.window_s, self.config.history_step_s)))}s"
        return f"sum by ({self._by()}) (rate({self._sel(_REQ_SUCCESS, Leg.ENTRY)}[{w}]))"

    async def fetch(self, *, with_history: bool = True, deadline: float | None = None) -> Readings:
        """Every query of one observation, evaluated at Prometheus's own time (its `time()`: a step
        of the controller's clock does not move the windows read); the raw answers, no rules.
        `deadline`: on the event loop's clock (default: `deadline_s` from now). A Prometheus
        failure, a late or a wrong-shaped answer is returned as `Readings.error`, not raised."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s if deadline is None else deadline
        wall = self.clock()
        self.prom_clock = clockstep.ClockVerdict()
        pending = ["clock"]  # the queries not answered yet: a deadline's alert names them
        try:
            async with asyncio.timeout_at(deadline):
                wall = await self.client.time_s()
                self._watch_prom_clock(wall)
                queries = self.queries()
                results = await self._query_all(queries, wall, pending)
                history: tuple[Series, ...] = ()
                if with_history:
                    pending[:] = ["history"]
                    history = await self._history_until(wall)
        except TimeoutError:
            return Readings(wall, error=f"prometheus at {self.client.base_url}, query {', '.join(pending)}: no full "
                                        f"answer before the observation's deadline ({self.deadline_s:g} s)")
        except PrometheusError as exc:
            return Readings(wall, error=str(exc))
        return Readings(wall, {n: tuple(r) for n, r in results.items()}, tuple(history))

    def _watch_prom_clock(self, prom_s: float) -> None:
        """Prometheus's clock against the monotonic one: a step forgets the history read."""
        self._prom_clock, verdict = clockstep.watch(
            self._prom_clock, clockstep.ClockReading(prom_s, self.mono()), name=clockstep.WhichClock.PROMETHEUS.value,
            tolerance_s=self.step_tolerance_s + self.client.deadline_s, alert_hold_s=self.step_alert_hold_s)
        self.prom_clock = verdict
        if verdict.stepped_s is not None:
            log.warning("%s", verdict.alert)
            self._history = None

    def forget_history(self) -> None:
        """The next fetch reads the request-rate history afresh (the controller's clock stepped)."""
        self._history = None

    async def _history_until(self, wall: float) -> tuple[Series, ...]:
        """The rate history over `history_s` up to `wall`, at `history_step_s`: what was read before
        plus the steps since (the last step read is read again: its window may have grown); read
        afresh when what was read does not fit the span (planner/clockstep.py history_from)."""
        query, step, start = self.history_query(), self.config.history_step_s, wall - self.config.history_s
        if not clockstep.range_makes_sense(start, wall):
            raise PrometheusError(f"prometheus at {self.client.base_url}: history range [{start}, {wall}] "
                                  "makes no sense")
        old = self._history
        if old is not None and old[0] == query and old[1] == step:
            last = max((pt[0] for s in old[2] for pt in s.points[-1:]), default=None)
            since = clockstep.history_from(last, start, wall)
            if since is not None:
                new = await self._range(query, since, wall, step)
                merged = merge_history(old[2], new, start)
                self._history = (query, step, merged)
                return merged
        fresh = tuple(await self._range(query, start, wall, step))
        self._history = (query, step, fresh)
        return fresh

    async def _range(self, query: str, start_s: float, end_s: float, step_s: float) -> list[Series]:
        return await self.client.query_range(query, start_s, end_s, step_s, name="history")

    async def snapshot(
        self,
        models: Iterable[str],
        *,
        now_s: float | None = None,
        with_history: bool = True,
        expected_replicas: Collection[str] | None = None,
        serving: Mapping[str, str] | None = None,
        router_down: bool = False,
        ready_wall_s: Mapping[str, float] | None = None,
    ) -> Snapshot:
        """Observe `models` (plus any model seen in Prometheus). `now_s`: controller clock.

        `expected_replicas`: the replicas the controller runs; a down target outside this set
        (a replica being removed, not yet gone from file_sd) does not make its model stale.
        `serving`: replica id -> model of the replicas nginx sends requests to (planner/observation.py).
        `ready_wall_s`: replica id -> when it became ready (unix seconds: planner/act_drain.py
        `ready_since`, from the agents' reports and the state store's records).
        """
        deadline = asyncio.get_running_loop().time() + self.deadline_s  # the whole observation's
        readings = await self.fetch(with_history=with_history, deadline=deadline)
        now = readings.wall_s if now_s is None else now_s
        step = self.prom_clock
        evidence = None
        if readings.error is not None:
            log.warning("fail static: %s", readings.error)
        else:
            try:
                async with asyncio.timeout_at(deadline):
                    evidence = await self._evidence(readings.wall_s)
            except TimeoutError:
                log.warning("length/latency evidence unavailable: not read within the observation's %g s",
                            self.deadline_s)
        # what the readings mean: the replay's path (planner/cycle.py `observe`)
        observed = observe(readings, evidence, models, now_s=now, rules=self.config.rules(), canonical=self.canonical,
                           expected_replicas=expected_replicas, serving=serving, ready_wall_s=ready_wall_s,
                           router_down=router_down)
        view = observed.interpreted
        alerts = (*view.alerts, step.alert) if step.alert is not None else view.alerts
        if readings.error is not None:
            return Snapshot(view.models, view.replicas, alerts, False, readings.wall_s, now)
        return Snapshot(view.models, view.replicas, alerts, view.prometheus_ok, readings.wall_s, now,
                        observed.evidence, clock_step_s=step.stepped_s)


def to_observation(snapshot: Snapshot, models: Sequence[str] | None = None,
                   replicas: Sequence[Any] | None = None) -> Any:
    """The planner's Observation for `models` (default: every model in the snapshot), by the pure
    `fleetplan.planner.cycle.Observed.for_fleet` (the replay's too).

    `replicas`: the fleet's fleetplan.planner.types.Replica list; with it, each model also carries its length
    quantiles and per-config evidence (planner/evidence.py), else only the per-model numbers."""
    names = tuple(models) if models is not None else tuple(snapshot.models)
    view = Interpreted(snapshot.models, snapshot.replicas, snapshot.alerts, snapshot.prometheus_ok)
    obs, notes = Observed(view, snapshot.evidence, names, snapshot.now_s).for_fleet(replicas)
    for note in notes:
        log.info("%s", note)
    return obs


def render_snapshot(snap: Snapshot) -> str:
    """The on-call table printed by `fleetplan observe`."""

    def f(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    lines = [
        f"{'model':<24} {'rps':>8} {'ISL':>7} {'OSL':>7} {'TTFT p50/p99 ms':>17} "
        f"{'ITL p50/p99 ms':>15} {'queue':>6} {'kv':>5} {'up':>5}  state"
    ]
    for m, mm in sorted(snap.models.items()):
        ttft = f"{f(mm.ttft_p50_ms, '{:.0f}')}/{f(mm.ttft_p99_ms, '{:.0f}')}"
        itl = f"{f(mm.itl_p50_ms, '{:.1f}')}/{f(mm.itl_p99_ms, '{:.1f}')}"
        upn = f"{mm.replicas_up}/{mm.replicas_up + mm.replicas_down}"
        state = "STALE" if mm.stale else "ok"
        lines.append(
            f"{m:<24} {f(mm.rate_rps, '{:.3f}'):>8} {f(mm.isl, '{:.0f}'):>7} {f(mm.osl, '{:.0f}'):>7} "
            f"{ttft:>17} {itl:>15} {f(mm.queue_depth, '{:.0f}'):>6} {f(mm.kv_usage, '{:.2f}'):>5} {upn:>5}  {state}"
        )
    if not snap.models:
        lines.append("(no models seen)")
    for a in snap.alerts:
        lines.append(f"ALERT: {a}")
    return "\n".join(lines)
