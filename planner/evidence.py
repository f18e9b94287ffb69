"""What the fleet's own metrics say about the profiles: the request-length mix and per-config latency.

Two kinds of evidence feed the planner's mix-aware capacity and online correction (models/mix.py,
planner/correction.py), both read from Prometheus over the same window as the request rate:

- the LENGTH MIX per model: quantiles (fleetplan.models.mix.QUANTILE_LEVELS) of the engines' prompt and
  generation length histograms, `vllm:request_prompt_tokens` / `vllm:request_generation_tokens`
  (histograms with `build_1_2_5_buckets(max_model_len)` edges, vllm/v1/metrics/loggers.py).
  TensorRT-LLM's MetricsCollector (tensorrt_llm/metrics/collector.py) exports no per-request length
  histogram, only the token counters, so a TRT-LLM-only model keeps the means (isl/osl);
- per SERVING CONFIG (model, engine, GPU, TP, precision): the READY replicas that served the whole
  window, their request rate, TTFT p99 (`vllm:time_to_first_token_seconds`,
  `trtllm_time_to_first_token_seconds`), per-request ITL p99 (`vllm:request_time_per_output_token_seconds`:
  one observation per request, its mean inter-token time; NOT `vllm:inter_token_latency_seconds`, which
  has one observation per token gap; TRT-LLM's `trtllm_time_per_output_token_seconds` is per request)
  and the completions behind those quantiles. Prometheus knows replicas (the file_sd `replica` label
  written by controller/routing.py), the controller knows which config each replica runs: the
  per-replica bucket rates are fetched and summed per config here, then the quantile is taken.

The HTTP fetch lives in controller/observe.py; everything here is pure (`interpret` takes the fetched
samples, the fleet and the clock) so the rules are unit-tested: what counts as too few samples, which
replicas count, what a stale model gets (nothing).

Quantiles follow Prometheus' histogram_quantile (promql/quantile.go, bucketQuantile): linear
interpolation inside the bucket, the lowest bucket starting at 0, and the highest finite bound when
the rank falls in the +Inf bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from fleetplan.models.mix import QUANTILE_LEVELS
from fleetplan.planner.types import ConfigKey, ConfigObservation, Replica, ReplicaState

# metric names (regexes over __name__), both vLLM spellings where vLLM has them
PROMPT_LEN_BUCKET = r"vllm[:_]request_prompt_tokens_bucket"
GEN_LEN_BUCKET = r"vllm[:_]request_generation_tokens_bucket"
TTFT_BUCKET = r"vllm[:_]time_to_first_token_seconds_bucket|trtllm_time_to_first_token_seconds_bucket"
TPOT_REQ_BUCKET = r"vllm[:_]request_time_per_output_token_seconds_bucket|trtllm_time_per_output_token_seconds_bucket"
REQ_SUCCESS = r"vllm[:_]request_success_total|trtllm_request_success_total"

# decision rules
MIN_LENGTH_SAMPLES = 20.0  # requests in the window below which a length distribution is not trusted
MIN_P99_SAMPLES = 10.0  # observations below which a p99 is just the maximum of a handful: unknown
MIN_CONFIG_REQUESTS = 1.0  # a config that completed nothing in the window has no evidence

Buckets = tuple[tuple[float, float], ...]  # (upper bound `le`, cumulative count or rate); +Inf = math.inf


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) pairs; None where Prometheus gives NaN."""
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        return None
    merged: dict[float, float] = {}
    for le, c in buckets:
        if math.isnan(le) or not math.isfinite(c):
            continue
        merged[le] = merged.get(le, 0.0) + c
    pts = sorted(merged.items())
    if len(pts) < 2 or pts[-1][0] != math.inf:
        return None
    counts = [c for _, c in pts]
    for i in range(1, len(counts)):  # rate() can break monotonicity by a hair: Prometheus evens it out
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i in range(len(pts) - 1) if counts[i] >= rank), len(pts) - 1)
    if b == len(pts) - 1:
        return pts[-2][0]
    if b == 0 and pts[0][0] <= 0:
        return pts[0][0]
    start, end, count = 0.0, pts[b][0], counts[b]
    if b > 0:
        start = pts[b - 1][0]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count <= 0:
        return end
    return start + (end - start) * (rank / count)


def parse_le(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        v = float(text)  # "+Inf" parses to inf
    except ValueError:
        return None
    return None if math.isnan(v) else v


@dataclass(frozen=True)
class ReplicaSeries:
    """One scrape target's series over the window (wall-clock rates, as Prometheus returns them)."""

    done_rps: float | None = None  # completions per wall second
    ttft: Buckets = ()  # cumulative bucket rates (seconds)
    tpot: Buckets = ()  # per-request time per output token (seconds)


def _empty_models() -> Mapping[str, Buckets]:
    return MappingProxyType({})


def _empty_replicas() -> Mapping[str, ReplicaSeries]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Evidence:
    """The raw per-model length histograms and per-replica series of one snapshot."""

    window_s: float  # wall seconds of the rate() window
    time_scale: float = 1.0  # simulated seconds per wall second (lab); histograms hold simulated seconds
    prompt_len: Mapping[str, Buckets] = field(default_factory=_empty_models)  # canonical model -> buckets
    gen_len: Mapping[str, Buckets] = field(default_factory=_empty_models)
    replicas: Mapping[str, ReplicaSeries] = field(default_factory=_empty_replicas)


@dataclass(frozen=True)
class ModelEvidence:
    isl_quantiles: tuple[tuple[float, float], ...] = ()
    osl_quantiles: tuple[tuple[float, float], ...] = ()
    configs: tuple[ConfigObservation, ...] = ()
    notes: tuple[str, ...] = ()  # why some evidence was left out


def length_quantiles(buckets: Buckets, window_s: float,
                     levels: Sequence[float] = QUANTILE_LEVELS) -> tuple[tuple[float, float], ...]:
    """((q, tokens), ...) at `levels`; () with fewer than MIN_LENGTH_SAMPLES requests in the window."""
    if not buckets:
        return ()
    total = max((r for le, r in buckets if le == math.inf), default=0.0)
    if not math.isfinite(total) or total * window_s < MIN_LENGTH_SAMPLES:
        return ()
    out: list[tuple[float, float]] = []
    last = 0.0
    for q in levels:
        v = histogram_quantile(q, buckets)
        if v is None or not math.isfinite(v):
            continue
        last = max(last, v)  # a quantile function never falls
        out.append((q, last))
    return tuple(out)


def _p99_ms(buckets: Buckets, window_s: float) -> float | None:
    total = max((r for le, r in buckets if le == math.inf), default=0.0)
    if not math.isfinite(total) or total * window_s < MIN_P99_SAMPLES:
        return None
    v = histogram_quantile(0.99, buckets)
    if v is None or not math.isfinite(v):
        return None
    lowest = min((le for le, _ in buckets if math.isfinite(le) and le > 0), default=None)
    if lowest is not None and v <= lowest:
        return None  # the histogram only says "below its first bucket": no evidence of the value
    return v * 1000.0


def _sum_buckets(parts: Iterable[Buckets]) -> Buckets:
    acc: dict[float, float] = {}
    for b in parts:
        for le, r in b:
            if math.isfinite(r):
                acc[le] = acc.get(le, 0.0) + r
    return tuple(sorted(acc.items()))


def serving_whole_window(r: Replica, now_s: float, window_sim_s: float) -> bool:
    """READY, and READY since before the window opened (unknown since: trusted)."""
    if r.state is not ReplicaState.READY:
        return False
    return r.since_s is None or r.since_s <= now_s - window_sim_s + 1e-9


def interpret(model: str, evidence: Evidence | None, replicas: Sequence[Replica], now_s: float, *,
              stale: bool) -> ModelEvidence:
    """The length mix and per-config observations of `model` (canonical name). Pure.

    Rules: a stale model gets nothing (never plan on partial numbers); a length distribution needs
    MIN_LENGTH_SAMPLES requests in the window; a config's evidence comes only from its READY replicas
    that were READY for the whole window and whose series Prometheus returned (a replica that joined
    mid-window would dilute the load per replica); a config with fewer than MIN_CONFIG_REQUESTS
    completions has none; a p99 over fewer than MIN_P99_SAMPLES observations is unknown (None), and so
    is a p99 inside the lowest bucket (e.g. a per-request ITL under vLLM's first 10 ms edge: the
    interpolated 9.9 ms would be a bucket artefact, not a measurement).
    Rates are divided by the time scale (simulated rps); completions are counts over the window.
    """
    if stale or evidence is None or evidence.window_s <= 0:
        return ModelEvidence()
    w = evidence.window_s
    k = evidence.time_scale if evidence.time_scale > 0 else 1.0
    notes: list[str] = []
    isl_q = length_quantiles(evidence.prompt_len.get(model, ()), w)
    osl_q = length_quantiles(evidence.gen_len.get(model, ()), w)

    by_config: dict[ConfigKey, list[ReplicaSeries]] = {}
    for r in sorted(replicas, key=lambda r: r.replica_id):
        if r.config.model != model:
            continue
        if not serving_whole_window(r, now_s, w * k):
            continue
        s = evidence.replicas.get(r.replica_id)
        if s is None or s.done_rps is None or not math.isfinite(s.done_rps):
            notes.append(f"{r.replica_id}: no series in Prometheus (not scraped yet?): left out of "
                         f"{r.config.label()}")
            continue
        by_config.setdefault(r.config, []).append(s)

    configs: list[ConfigObservation] = []
    for c, series in sorted(by_config.items()):
        done = sum(max(0.0, s.done_rps or 0.0) for s in series)
        requests = done * w
        if requests < MIN_CONFIG_REQUESTS:
            continue
        configs.append(ConfigObservation(
            c, len(series), done / k,
            _p99_ms(_sum_buckets(s.ttft for s in series), w),
            _p99_ms(_sum_buckets(s.tpot for s in series), w),
            requests))
    return ModelEvidence(isl_q, osl_q, tuple(configs), tuple(notes))


class _Sample(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def value(self) -> float: ...


def collect(prompt_len: Iterable[_Sample], gen_len: Iterable[_Sample], done: Iterable[_Sample],
            ttft: Iterable[_Sample], tpot: Iterable[_Sample], *, model_of: Callable[[Mapping[str, str]], str | None],
            window_s: float, time_scale: float = 1.0, replica_label: str = "replica") -> Evidence:
    """Evidence from the query results (observe.Sample-like: .labels, .value). Length buckets are
    grouped by canonical model (several label groups of one model summed), the rest by replica."""

    def by_model(samples: Iterable[_Sample]) -> dict[str, Buckets]:
        acc: dict[str, dict[float, float]] = {}
        for s in samples:
            m, le = model_of(s.labels), parse_le(s.labels.get("le"))
            if m is None or le is None or not math.isfinite(s.value):
                continue
            d = acc.setdefault(m, {})
            d[le] = d.get(le, 0.0) + s.value
        return {m: tuple(sorted(d.items())) for m, d in acc.items()}

    def by_replica(samples: Iterable[_Sample]) -> dict[str, Buckets]:
        acc: dict[str, dict[float, float]] = {}
        for s in samples:
            rid, le = s.labels.get(replica_label, ""), parse_le(s.labels.get("le"))
            if not rid or le is None or not math.isfinite(s.value):
                continue
            d = acc.setdefault(rid, {})
            d[le] = d.get(le, 0.0) + s.value
        return {r: tuple(sorted(d.items())) for r, d in acc.items()}

    done_by: dict[str, float] = {}
    for s in done:
        rid = s.labels.get(replica_label, "")
        if rid and math.isfinite(s.value):
            done_by[rid] = done_by.get(rid, 0.0) + s.value
    t, p = by_replica(ttft), by_replica(tpot)
    reps = {rid: ReplicaSeries(done_by.get(rid), t.get(rid, ()), p.get(rid, ()))
            for rid in sorted(set(done_by) | set(t) | set(p))}
    return Evidence(window_s, time_scale, MappingProxyType(by_model(prompt_len)),
                    MappingProxyType(by_model(gen_len)), MappingProxyType(reps))


def evidence_to_json(e: ModelEvidence) -> dict[str, Any]:
    """For the stored observation (what `fleetplan report --json` shows next to the plan)."""
    return {
        "isl_quantiles": [[q, v] for q, v in e.isl_quantiles],
        "osl_quantiles": [[q, v] for q, v in e.osl_quantiles],
        "configs": [{"config": c.config.label(), "ready_replicas": c.ready_replicas, "rate_rps": c.rate_rps,
                     "ttft_p99_ms": c.ttft_p99_ms, "itl_p99_ms": c.itl_p99_ms, "requests": c.requests}
                    for c in e.configs],
        "notes": list(e.notes),
    }


__all__ = [
    "Evidence",
    "ModelEvidence",
    "ReplicaSeries",
    "collect",
    "evidence_to_json",
    "histogram_quantile",
    "interpret",
    "length_quantiles",
    "parse_le",
    "serving_whole_window",
]
