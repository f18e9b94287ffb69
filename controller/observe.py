"""What the controller sees: per-model load and latency read from Prometheus.

PromQL instant queries give the current rate, ISL/OSL mix, p50/p99 TTFT and ITL, queue depth,
KV usage and per-replica `up`; a range query gives the request-rate history for the forecast.
Both vLLM spellings (`vllm:` and `vllm_`) and TensorRT-LLM (`trtllm_`, as trtllm-serve exports
them on /prometheus/metrics: tensorrt_llm/metrics/collector.py) are matched with `__name__`
regexes, so one query covers a mixed fleet. TRT-LLM has no inter-token histogram: its ITL is read
from `trtllm_time_per_output_token_seconds` (one mean per request, logged when it finishes).

Fail static: when Prometheus is unreachable, answers NaN, has no series for a model, or one of
the model's scrape targets is down, that model is `stale` with `None` (unknown) values and an
alert says why. The planner never scales a stale model down and never plans on invented numbers.

Time scale: in the lab the engines' simulated clock runs K times faster than wall time. Counters
are then K times higher per wall second, so rates are divided by K; histograms already hold
simulated seconds. History timestamps are mapped onto the simulated clock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from fleetplan.controller import evidence as ev

log = logging.getLogger(__name__)

# Labels that may carry the model name: `model` is written by the controller into the file_sd
# target labels (canonical name); `model_name` is what vLLM / TRT-LLM put on their own series.
MODEL_LABELS: tuple[str, ...] = ("model", "model_name")
# trtllm-serve labels every series model_name="undefined" (NVIDIA/TensorRT-LLM tensorrt_llm/serve/
# openai_server.py): no model name at all, so TRT-LLM replicas are known by the target's `model`.
UNSET_MODEL_NAMES = frozenset({"undefined"})
REPLICA_LABEL = "replica"  # file_sd label written by controller/routing.py ScrapeTarget

_REQ_SUCCESS = r"vllm[:_]request_success_total|trtllm_request_success_total"
_PROMPT_TOK = r"vllm[:_]prompt_tokens_total|trtllm_prompt_tokens_total"
_GEN_TOK = r"vllm[:_]generation_tokens_total|trtllm_generation_tokens_total"
_TTFT_BUCKET = r"(vllm[:_]|trtllm_)time_to_first_token_seconds_bucket"
# vLLM exports ITL under two names with identical labels (inter_token_latency is the newer one);
# rate() drops the name, so the two must not meet in one vector: prefer the newer, `or` the older.
_ITL_BUCKET = r"vllm[:_]inter_token_latency_seconds_bucket"
_ITL_BUCKET_OLD = r"(vllm[:_]|trtllm_)time_per_output_token_seconds_bucket"
_WAITING = r"vllm[:_]num_requests_waiting|trtllm_num_requests_waiting"
_RUNNING = r"vllm[:_]num_requests_running|trtllm_num_requests_running"
_KV_USAGE = r"vllm[:_](gpu_cache_usage_perc|kv_cache_usage_perc)|trtllm_kv_cache_utilization"


class PrometheusError(RuntimeError):
    """Prometheus unreachable or answered an error."""


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]  # (unix wall seconds, value)


class PromClient:
    """A small async Prometheus HTTP API client (instant and range queries)."""

    def __init__(self, base_url: str, *, timeout_s: float = 5.0, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers=headers)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> PromClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _get(self, path: str, params: Mapping[str, str]) -> Any:
        try:
            resp = await self._client.get(path, params=dict(params))
        except httpx.HTTPError as exc:
            raise PrometheusError(f"prometheus at {self.base_url} unreachable: {exc!r}") from exc
        try:
            body = resp.json()
        except ValueError as exc:
            raise PrometheusError(
                f"prometheus at {self.base_url} answered HTTP {resp.status_code} with non-JSON body"
            ) from exc
        if body.get("status") != "success":
            raise PrometheusError(
                f"prometheus at {self.base_url}: {body.get('errorType')}: {body.get('error')}"
            )
        return body["data"]

    async def query(self, expr: str, at_s: float | None = None) -> list[Sample]:
        params = {"query": expr}
        if at_s is not None:
            params["time"] = f"{at_s:.3f}"
        data = await self._get("/api/v1/query", params)
        if data.get("resultType") == "scalar":
            return [Sample({}, _num(data["result"][1]))]
        return [Sample(r.get("metric", {}), _num(r["value"][1])) for r in data.get("result", [])]

    async def query_range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[Series]:
        params = {"query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}", "step": f"{step_s:.3f}"}
        data = await self._get("/api/v1/query_range", params)
        return [
            Series(r.get("metric", {}), tuple((float(t), _num(v)) for t, v in r.get("values", [])))
            for r in data.get("result", [])
        ]


def _num(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True)
class ReplicaMetrics:
    """One scrape target (engine replica)."""

    replica_id: str
    model: str | None
    instance: str
    up: bool
    running: float | None = None
    waiting: float | None = None


@dataclass(frozen=True)
class ModelMetrics:
    """Everything observed for one model; None = unknown."""

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
        }


@dataclass(frozen=True)
class Snapshot:
    models: Mapping[str, ModelMetrics]
    replicas: Mapping[str, ReplicaMetrics]
    alerts: tuple[str, ...]
    prometheus_ok: bool
    wall_s: float
    now_s: float  # on the (possibly simulated) controller clock
    # length histograms per model and latency series per replica (controller/evidence.py); None: not read
    evidence: ev.Evidence | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "prometheus_ok": self.prometheus_ok,
            "wall_s": self.wall_s,
            "now_s": self.now_s,
            "alerts": list(self.alerts),
            "models": {m: mm.to_json() for m, mm in sorted(self.models.items())},
            "replicas": {
                r: {"model": rm.model, "instance": rm.instance, "up": rm.up, "running": rm.running,
                    "waiting": rm.waiting}
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


@dataclass
class Observer:
    """Reads Prometheus and returns a Snapshot; never raises on Prometheus failures."""

    client: PromClient
    config: ObserverConfig = field(default_factory=ObserverConfig)
    canonical: Callable[[str], str] = lambda name: name
    clock: Callable[[], float] = time.time  # wall clock (unix seconds)

    def _sel(self, name_re: str) -> str:
        extra = f",{self.config.extra_selector}" if self.config.extra_selector else ""
        return f'{{__name__=~"{name_re}"{extra}}}'

    def _by(self, *more: str) -> str:
        return ", ".join((*self.config.model_labels, *more))

    def _window(self) -> str:
        return f"{max(1, round(self.config.window_s))}s"

    def _model_of(self, labels: Mapping[str, str]) -> str | None:
        for key in self.config.model_labels:
            val = labels.get(key)
            if val and val not in UNSET_MODEL_NAMES:
                return self.canonical(val)
        return None

    def _group(self, samples: Iterable[Sample], combine: str = "sum") -> dict[str, float]:
        """Per canonical model; several label groups of one model are summed (or max-ed)."""
        out: dict[str, float] = {}
        nan_models: set[str] = set()
        for s in samples:
            model = self._model_of(s.labels)
            if model is None:
                continue
            if not math.isfinite(s.value):
                nan_models.add(model)
                continue
            if model in out:
                out[model] = out[model] + s.value if combine == "sum" else max(out[model], s.value)
            else:
                out[model] = s.value
        for m in nan_models:
            out.setdefault(m, math.nan)
        return out

    def queries(self) -> dict[str, str]:
        w = self._window()
        by = self._by()
        q: dict[str, str] = {
            "rate": self._arrival_rate_query(),
            "prompt": f"sum by ({by}) (rate({self._sel(_PROMPT_TOK)}[{w}]))",
            "gen": f"sum by ({by}) (rate({self._sel(_GEN_TOK)}[{w}]))",
            "waiting": f"sum by ({by}) ({self._sel(_WAITING)})",
            "running": f"sum by ({by}) ({self._sel(_RUNNING)})",
            "kv": f"avg by ({by}) ({self._sel(_KV_USAGE)})",
        }
        for name, buckets in (("ttft", (_TTFT_BUCKET,)), ("itl", (_ITL_BUCKET, _ITL_BUCKET_OLD))):
            agg = " or ".join(f"sum by ({self._by('le')}) (rate({self._sel(b)}[{w}]))" for b in buckets)
            q[f"{name}_p50"] = f"histogram_quantile(0.5, {agg})"
            q[f"{name}_p99"] = f"histogram_quantile(0.99, {agg})"
        extra = f",{self.config.extra_selector}" if self.config.extra_selector else ""
        q["up"] = f'up{{{REPLICA_LABEL}!=""{extra}}}'
        q["replica_running"] = f"sum by ({REPLICA_LABEL}) ({self._sel(_RUNNING)})"
        q["replica_waiting"] = f"sum by ({REPLICA_LABEL}) ({self._sel(_WAITING)})"
        return q

    def evidence_queries(self) -> dict[str, str]:
        """Length histograms per model, latency histograms and completions per replica (evidence.py)."""
        w, by = self._window(), self._by("le")
        rb = f"{REPLICA_LABEL}, le"
        return {
            "ev_prompt_len": f"sum by ({by}) (rate({self._sel(ev.PROMPT_LEN_BUCKET)}[{w}]))",
            "ev_gen_len": f"sum by ({by}) (rate({self._sel(ev.GEN_LEN_BUCKET)}[{w}]))",
            "ev_done": f"sum by ({REPLICA_LABEL}) (rate({self._sel(ev.REQ_SUCCESS)}[{w}]))",
            "ev_ttft": f"sum by ({rb}) (rate({self._sel(ev.TTFT_BUCKET)}[{w}]))",
            "ev_tpot": f"sum by ({rb}) (rate({self._sel(ev.TPOT_REQ_BUCKET)}[{w}]))",
        }

    async def _evidence(self, wall: float) -> ev.Evidence | None:
        """The evidence queries; a failure here leaves the evidence unknown, not the model stale."""
        queries = self.evidence_queries()
        try:
            names = list(queries)
            results = await asyncio.gather(*(self.client.query(queries[n], wall) for n in names))
        except PrometheusError as exc:
            log.warning("length/latency evidence unavailable: %s", exc)
            return None
        r = dict(zip(names, results, strict=True))
        return ev.collect(r["ev_prompt_len"], r["ev_gen_len"], r["ev_done"], r["ev_ttft"], r["ev_tpot"],
                          model_of=self._model_of, window_s=self.config.window_s,
                          time_scale=self.config.time_scale, replica_label=REPLICA_LABEL)

    def _arrival_rate_query(self) -> str:
        """Arrivals = completions + growth of the requests in the engine (running + waiting).

        Engines export no arrival counter, and the completion rate stops rising once a fleet
        saturates while the queue grows: e.g. 10 rps completed with a queue growing by 3 per second
        is an arrival rate of 13 rps, the number the planner must size for. A model whose queue
        gauges are missing falls back to the completion rate.
        """
        w, by = self._window(), self._by()
        done = f"sum by ({by}) (rate({self._sel(_REQ_SUCCESS)}[{w}]))"
        # one deriv() per gauge: deriv drops the name, and two names in one vector would clash
        growth = " + ".join(f"sum by ({by}) (deriv({self._sel(g)}[{w}]))" for g in (_WAITING, _RUNNING))
        return f"clamp_min({done} + {growth}, 0) or {done}"

    def history_query(self) -> str:
        # the rate window covers the whole step, so no request between two history points is lost
        w = f"{max(1, round(max(self.config.window_s, self.config.history_step_s)))}s"
        return f"sum by ({self._by()}) (rate({self._sel(_REQ_SUCCESS)}[{w}]))"

    async def snapshot(
        self,
        models: Iterable[str],
        *,
        now_s: float | None = None,
        with_history: bool = True,
        expected_replicas: Iterable[str] | None = None,
    ) -> Snapshot:
        """Observe `models` (plus any model seen in Prometheus). `now_s`: controller clock.

        `expected_replicas`: the replicas the controller runs; a down target outside this set
        (a replica being removed, not yet gone from file_sd) does not make its model stale.
        """
        expected = set(expected_replicas) if expected_replicas is not None else None
        wall = self.clock()
        now = wall if now_s is None else now_s
        wanted = [self.canonical(m) for m in models]
        k = self.config.time_scale
        queries = self.queries()
        try:
            names = list(queries)
            results = await asyncio.gather(*(self.client.query(queries[n], wall) for n in names))
            res = dict(zip(names, results, strict=True))
            history: list[Series] = []
            if with_history:
                history = await self.client.query_range(
                    self.history_query(), wall - self.config.history_s, wall, self.config.history_step_s
                )
        except PrometheusError as exc:
            alert = f"fail static: {exc}"
            log.warning("%s", alert)
            unknown = {m: ModelMetrics(model=m, stale=True, reasons=(str(exc),)) for m in wanted}
            return Snapshot(unknown, {}, (alert,), False, wall, now)

        evidence = await self._evidence(wall)
        replicas: dict[str, ReplicaMetrics] = {}
        running_by_rep = {s.labels.get(REPLICA_LABEL, ""): s.value for s in res["replica_running"]}
        waiting_by_rep = {s.labels.get(REPLICA_LABEL, ""): s.value for s in res["replica_waiting"]}
        for s in res["up"]:
            rid = s.labels.get(REPLICA_LABEL, "")
            if not rid:
                continue
            up = s.value == 1.0
            prev = replicas.get(rid)
            if prev is not None:
                up = up and prev.up
            replicas[rid] = ReplicaMetrics(
                replica_id=rid,
                model=self._model_of(s.labels),
                instance=s.labels.get("instance", ""),
                up=up,
                running=_finite(running_by_rep.get(rid)) if up else None,
                waiting=_finite(waiting_by_rep.get(rid)) if up else None,
            )

        rate = self._group(res["rate"])
        prompt = self._group(res["prompt"])
        gen = self._group(res["gen"])
        waiting = self._group(res["waiting"])
        running = self._group(res["running"])
        kv = self._group(res["kv"], combine="max")
        # several label groups of one model: the worst quantile is the conservative merge
        quant = {n: self._group(res[n], combine="max") for n in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}

        hist_by_model: dict[str, dict[float, float]] = {}
        for series in history:
            model = self._model_of(series.labels)
            if model is None:
                continue
            acc = hist_by_model.setdefault(model, {})
            for t, v in series.points:
                if math.isfinite(v):
                    acc[t] = acc.get(t, 0.0) + v

        seen = set(rate) | set(running) | {r.model for r in replicas.values() if r.model}
        all_models = list(dict.fromkeys([*wanted, *sorted(seen)]))
        alerts: list[str] = []
        out: dict[str, ModelMetrics] = {}
        for m in all_models:
            reasons: list[str] = []
            reps = [
                r for r in replicas.values()
                if r.model == m and (expected is None or r.replica_id in expected)
            ]
            up_n = sum(1 for r in reps if r.up)
            down_n = len(reps) - up_n
            r_wall = rate.get(m)
            if r_wall is None and up_n > 0 and down_n == 0:
                r_wall = 0.0  # targets up, no request ever finished: idle, not unknown
            if r_wall is None:
                reasons.append("no request-rate series in Prometheus (no replica scraped)")
            elif not math.isfinite(r_wall):
                reasons.append("request rate is NaN")
            if down_n and self.config.require_all_targets_up:
                down_ids = ", ".join(sorted(r.replica_id for r in reps if not r.up))
                reasons.append(f"{down_n} scrape target(s) down: {down_ids}")
            rate_rps = _finite(r_wall / k) if r_wall is not None else None
            r_raw = _finite(r_wall)
            isl = osl = None
            if r_raw is not None and r_raw > 0:
                p, g = _finite(prompt.get(m)), _finite(gen.get(m))
                isl = p / r_raw if p is not None else None
                osl = g / r_raw if g is not None else None

            def ms(key: str, model: str = m) -> float | None:
                v = _finite(quant[key].get(model))
                return v * 1000.0 if v is not None else None

            hist_pts = hist_by_model.get(m, {})
            hist = tuple(
                (now - max(0.0, wall - t) * k, v / k) for t, v in sorted(hist_pts.items())
            )
            stale = bool(reasons)
            mm = ModelMetrics(
                model=m,
                rate_rps=rate_rps,
                isl=isl,
                osl=osl,
                ttft_p50_ms=ms("ttft_p50"),
                ttft_p99_ms=ms("ttft_p99"),
                itl_p50_ms=ms("itl_p50"),
                itl_p99_ms=ms("itl_p99"),
                queue_depth=_finite(waiting.get(m)),
                running=_finite(running.get(m)),
                kv_usage=_finite(kv.get(m)),
                replicas_up=up_n,
                replicas_down=down_n,
                history=hist,
                stale=stale,
                reasons=tuple(reasons),
            )
            if stale:
                alerts.append(f"fail static for {m}: " + "; ".join(reasons))
                # never plan on partial numbers of a stale model
                mm = replace(mm, rate_rps=None, isl=None, osl=None)
            out[m] = mm
        return Snapshot(out, replicas, tuple(alerts), True, wall, now, evidence)


def to_observation(snapshot: Snapshot, models: Sequence[str] | None = None,
                   replicas: Sequence[Any] | None = None) -> Any:
    """The planner's Observation for `models` (default: every model in the snapshot).

    `replicas`: the fleet's fleetplan.planner.types.Replica list; with it, each model also carries its length
    quantiles and per-config evidence (controller/evidence.py), else only the per-model numbers."""
    from fleetplan.planner.types import ModelObservation, Observation

    names = list(models) if models is not None else list(snapshot.models)
    obs: dict[str, Any] = {}
    for m in names:
        mm = snapshot.models.get(m) or ModelMetrics(model=m, stale=True, reasons=("not observed",))
        me = ev.interpret(m, snapshot.evidence, replicas or (), snapshot.now_s, stale=mm.stale)
        for note in me.notes:
            log.info("evidence for %s: %s", m, note)
        obs[m] = ModelObservation(
            model=m,
            rate_rps=mm.rate_rps,
            isl=mm.isl,
            osl=mm.osl,
            ttft_p99_ms=mm.ttft_p99_ms,
            itl_p99_ms=mm.itl_p99_ms,
            history=mm.history,
            stale=mm.stale,
            isl_quantiles=me.isl_quantiles,
            osl_quantiles=me.osl_quantiles,
            configs=me.configs if replicas is not None else (),
        )
    return Observation(models=obs, alerts=tuple(snapshot.alerts))


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
