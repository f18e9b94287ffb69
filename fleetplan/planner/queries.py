"""The observation's instant queries, described once: which engine series each reads and how it
aggregates them. controller/observe.py renders each description to PromQL; the replay's
Prometheus (sim/promsim.py) evaluates the same description on its scrapes. Pure.

A description is one of:

- `Latest(series, by, agg)`: `agg by (by) (series)`, each target's latest sample (a gauge, or a
  counter's value);
- `Rate(series, by)`: `sum by (by) (rate(series[window]))`, a counter's increase per second over
  the rate window;
- `Arrivals(by, rule)`: the arrival rate (planner/arrivals.py): completions + the growth of the
  requests in the engine;
- `Quantile(q, histogram)`: `histogram_quantile(q, sum by (model, le) (rate(bucket[window])))`.

`by` is the model (its labels) or the scrape target (`replica`). A per-model query reads the
targets of a `Leg`: all of them, or where requests enter (aggregated replicas and a disaggregated
model's prefill pool: arrivals, prompts) or leave (aggregated and decode replicas: outputs, token
gaps), so a request served by two pools is counted once (the targets' `role` label, written for
pool replicas only). The queries not described here
read the scrape targets themselves (`up`, the window's coverage, when the counters started) or a
range (bursts, the history): observe.py writes their PromQL and promsim.py computes them.

The evidence queries (`EVIDENCE_QUERIES`, keyed by `EvidenceQuery`: what planner/evidence.py
reads) are `Rate`s and `HistogramRate(histogram, part, by, window)`s: `sum by (by[, le])
(rate(histogram_part[window]))`, a histogram's bucket (`le` kept), `_sum` or `_count` rates. The
window is the rate window or the length mix's longer one (`Window`). `evidence_of` turns the
answers, keyed by the same enum, into the `Evidence` both worlds hand the decision path.

>>> QUERIES[Query.KV]
Latest(series=<EngineSeries.KV_USAGE: 'kv'>, by=<By.MODEL: 'model'>, agg=<Agg.AVG: 'avg'>, leg=<Leg.ALL: 'all'>)
>>> sorted(q.value for q, d in QUERIES.items() if isinstance(d, Quantile))
['itl_p50', 'itl_p99', 'ttft_p50', 'ttft_p99']
>>> EVIDENCE_QUERIES[EvidenceQuery.PROMPT_LEN]
HistogramRate(histogram=<EngineHistogram.PROMPT_LEN: 'prompt_len'>, part=<Part.BUCKET: 'bucket'>, \
by=<By.MODEL: 'model'>, window=<Window.LENGTH: 'length'>, leg=<Leg.ENTRY: 'entry'>)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from fleetplan.planner import evidence as ev
from fleetplan.planner.arrivals import ARRIVALS, ArrivalRate, EngineSeries
from fleetplan.planner.observation import Query, Sample

__all__ = [
    "EVIDENCE_QUERIES",
    "QUERIES",
    "ROLE_LABEL",
    "Agg",
    "Arrivals",
    "By",
    "Description",
    "EngineHistogram",
    "EvidenceDescription",
    "EvidenceQuery",
    "HistogramRate",
    "Latest",
    "Leg",
    "Part",
    "Quantile",
    "Rate",
    "Window",
    "evidence_of",
]


class By(Enum):
    """What a query's samples are per."""

    MODEL = "model"  # the model (its labels: planner/observation.py MODEL_LABELS)
    REPLICA = "replica"  # the scrape target (its `replica` label)


class Agg(Enum):
    """How a query combines the samples of one group."""

    SUM = "sum"
    AVG = "avg"


ROLE_LABEL = "role"  # the scrape target label of a pool replica's role (absent on aggregated ones)


class Leg(Enum):
    """Which of a model's scrape targets a per-model query reads (their `role` label)."""

    ALL = "all"
    ENTRY = "entry"  # where requests enter: aggregated replicas and prefill pools (role != decode)
    EXIT = "exit"  # where they leave: aggregated replicas and decode pools (role != prefill)

    def counts(self, role: str) -> bool:
        """Whether a target of `role` (its label; "" or "aggregated" when it serves whole requests)
        is read.

        >>> Leg.ENTRY.counts("prefill"), Leg.ENTRY.counts("decode"), Leg.EXIT.counts("")
        (True, False, True)
        """
        if self is Leg.ENTRY:
            return role != "decode"
        if self is Leg.EXIT:
            return role != "prefill"
        return True


class Window(Enum):
    """The range a rate is taken over."""

    RATE = "rate"  # the observation's rate window
    LENGTH = "length"  # the length mix's window (at least the rate window): enough requests for a p99


class EngineHistogram(Enum):
    """The engine histograms the queries read (the value names the replay's scrape field)."""

    TTFT = "ttft"  # time to first token, seconds
    ITL = "itl"  # inter-token latency, seconds (one observation per token gap)
    TPOT = "tpot"  # a request's mean time per output token, seconds (one observation per request)
    PROMPT_LEN = "prompt_len"  # a finished request's prompt tokens
    GEN_LEN = "gen_len"  # a finished request's generated tokens


class Part(Enum):
    """Which series of a histogram a query reads."""

    BUCKET = "bucket"  # the cumulative buckets, per `le`
    SUM = "sum"  # the observations' sum
    COUNT = "count"  # their count


@dataclass(frozen=True)
class Latest:
    """`agg by (by) (series)`: each target's latest sample."""

    series: EngineSeries
    by: By = By.MODEL
    agg: Agg = Agg.SUM
    leg: Leg = Leg.ALL


@dataclass(frozen=True)
class Rate:
    """`sum by (by) (rate(series[window]))`: a counter's increase per second over the window."""

    series: EngineSeries
    by: By = By.MODEL
    window: Window = Window.RATE
    leg: Leg = Leg.ALL


@dataclass(frozen=True)
class Arrivals:
    """The arrival rate (`rule`, planner/arrivals.py) per `by`."""

    by: By = By.MODEL
    rule: ArrivalRate = ARRIVALS
    leg: Leg = Leg.ENTRY


@dataclass(frozen=True)
class Quantile:
    """`histogram_quantile(q, ...)` of a latency histogram's bucket rates over the window, per model."""

    q: float
    histogram: EngineHistogram
    leg: Leg = Leg.ALL


@dataclass(frozen=True)
class HistogramRate:
    """`sum by (by[, le]) (rate(histogram_part[window]))`: a histogram's bucket (`le` kept), `_sum`
    or `_count` rates."""

    histogram: EngineHistogram
    part: Part = Part.BUCKET
    by: By = By.MODEL
    window: Window = Window.RATE
    leg: Leg = Leg.ALL


Description = Latest | Rate | Arrivals | Quantile
EvidenceDescription = Rate | HistogramRate

QUERIES: Mapping[Query, Description] = MappingProxyType({
    Query.RATE: Arrivals(),
    Query.PROMPT: Rate(EngineSeries.PROMPT_TOKENS, leg=Leg.ENTRY),
    Query.GEN: Rate(EngineSeries.GEN_TOKENS, leg=Leg.EXIT),
    Query.WAITING: Latest(EngineSeries.WAITING),
    Query.RUNNING: Latest(EngineSeries.RUNNING),
    Query.KV: Latest(EngineSeries.KV_USAGE, agg=Agg.AVG),
    Query.TTFT_P50: Quantile(0.5, EngineHistogram.TTFT, Leg.ENTRY),
    Query.TTFT_P99: Quantile(0.99, EngineHistogram.TTFT, Leg.ENTRY),
    Query.ITL_P50: Quantile(0.5, EngineHistogram.ITL, Leg.EXIT),
    Query.ITL_P99: Quantile(0.99, EngineHistogram.ITL, Leg.EXIT),
    Query.PREFIX_QUERIES: Rate(EngineSeries.PREFIX_QUERIES, leg=Leg.ENTRY),
    Query.PREFIX_HITS: Rate(EngineSeries.PREFIX_HITS, leg=Leg.ENTRY),
    Query.REPLICA_RUNNING: Latest(EngineSeries.RUNNING, By.REPLICA),
    Query.REPLICA_WAITING: Latest(EngineSeries.WAITING, By.REPLICA),
    Query.REPLICA_RATE: Arrivals(By.REPLICA),
    Query.REPLICA_DONE: Latest(EngineSeries.REQUESTS_DONE, By.REPLICA),
})


class EvidenceQuery(Enum):
    """The length and latency evidence's queries (planner/evidence.py `collect`)."""

    PROMPT_LEN = "prompt_len"  # length buckets per model, over the length window
    GEN_LEN = "gen_len"
    DONE = "done"  # completions per replica
    TTFT = "ttft"  # latency buckets per replica
    TPOT = "tpot"
    # the histograms' exact window means (_sum / _count): quantiles consistent with them
    PROMPT_SUM = "prompt_sum"
    PROMPT_COUNT = "prompt_count"
    GEN_SUM = "gen_sum"
    GEN_COUNT = "gen_count"
    TTFT_SUM = "ttft_sum"
    TTFT_COUNT = "ttft_count"
    TPOT_SUM = "tpot_sum"
    TPOT_COUNT = "tpot_count"


def _lengths(h: EngineHistogram, part: Part) -> HistogramRate:
    # prompts where requests enter, outputs where they leave (a prefill pool's outputs are 1 token)
    return HistogramRate(h, part, By.MODEL, Window.LENGTH, Leg.ENTRY if h is EngineHistogram.PROMPT_LEN else Leg.EXIT)


def _latencies(h: EngineHistogram, part: Part) -> HistogramRate:
    return HistogramRate(h, part, By.REPLICA, Window.RATE)


EVIDENCE_QUERIES: Mapping[EvidenceQuery, EvidenceDescription] = MappingProxyType({
    EvidenceQuery.PROMPT_LEN: _lengths(EngineHistogram.PROMPT_LEN, Part.BUCKET),
    EvidenceQuery.GEN_LEN: _lengths(EngineHistogram.GEN_LEN, Part.BUCKET),
    EvidenceQuery.DONE: Rate(EngineSeries.REQUESTS_DONE, By.REPLICA),
    EvidenceQuery.TTFT: _latencies(EngineHistogram.TTFT, Part.BUCKET),
    EvidenceQuery.TPOT: _latencies(EngineHistogram.TPOT, Part.BUCKET),
    EvidenceQuery.PROMPT_SUM: _lengths(EngineHistogram.PROMPT_LEN, Part.SUM),
    EvidenceQuery.PROMPT_COUNT: _lengths(EngineHistogram.PROMPT_LEN, Part.COUNT),
    EvidenceQuery.GEN_SUM: _lengths(EngineHistogram.GEN_LEN, Part.SUM),
    EvidenceQuery.GEN_COUNT: _lengths(EngineHistogram.GEN_LEN, Part.COUNT),
    EvidenceQuery.TTFT_SUM: _latencies(EngineHistogram.TTFT, Part.SUM),
    EvidenceQuery.TTFT_COUNT: _latencies(EngineHistogram.TTFT, Part.COUNT),
    EvidenceQuery.TPOT_SUM: _latencies(EngineHistogram.TPOT, Part.SUM),
    EvidenceQuery.TPOT_COUNT: _latencies(EngineHistogram.TPOT, Part.COUNT),
})


def evidence_of(answers: Mapping[EvidenceQuery, Iterable[Sample]], *,
                model_of: Callable[[Mapping[str, str]], str | None], window_s: float, length_window_s: float,
                time_scale: float = 1.0, replica_label: str = "replica") -> ev.Evidence:
    """The evidence (planner/evidence.py `collect`) from the answers to `EVIDENCE_QUERIES`."""
    q = EvidenceQuery
    moments = ev.MomentSamples(answers[q.PROMPT_SUM], answers[q.PROMPT_COUNT], answers[q.GEN_SUM],
                               answers[q.GEN_COUNT], answers[q.TTFT_SUM], answers[q.TTFT_COUNT],
                               answers[q.TPOT_SUM], answers[q.TPOT_COUNT])
    return ev.collect(answers[q.PROMPT_LEN], answers[q.GEN_LEN], answers[q.DONE], answers[q.TTFT], answers[q.TPOT],
                      model_of=model_of, window_s=window_s, time_scale=time_scale, replica_label=replica_label,
                      moments=moments, length_window_s=length_window_s)
