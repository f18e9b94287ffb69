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

`by` is the model (its labels) or the scrape target (`replica`). The queries not described here
read the scrape targets themselves (`up`, the window's coverage, when the counters started) or a
range (bursts, the history): observe.py writes their PromQL and promsim.py computes them.

>>> QUERIES[Query.KV]
Latest(series=<EngineSeries.KV_USAGE: 'kv'>, by=<By.MODEL: 'model'>, agg=<Agg.AVG: 'avg'>)
>>> sorted(q.value for q, d in QUERIES.items() if isinstance(d, Quantile))
['itl_p50', 'itl_p99', 'ttft_p50', 'ttft_p99']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from fleetplan.planner.arrivals import ARRIVALS, ArrivalRate, EngineSeries
from fleetplan.planner.observation import Query

__all__ = ["QUERIES", "Agg", "Arrivals", "By", "Description", "EngineHistogram", "Latest", "Quantile", "Rate"]


class By(Enum):
    """What a query's samples are per."""

    MODEL = "model"  # the model (its labels: planner/observation.py MODEL_LABELS)
    REPLICA = "replica"  # the scrape target (its `replica` label)


class Agg(Enum):
    """How a query combines the samples of one group."""

    SUM = "sum"
    AVG = "avg"


class EngineHistogram(Enum):
    """The latency histograms the quantiles read (the value names the replay's scrape field)."""

    TTFT = "ttft"  # time to first token, seconds
    ITL = "itl"  # inter-token latency, seconds (one observation per token gap)


@dataclass(frozen=True)
class Latest:
    """`agg by (by) (series)`: each target's latest sample."""

    series: EngineSeries
    by: By = By.MODEL
    agg: Agg = Agg.SUM


@dataclass(frozen=True)
class Rate:
    """`sum by (by) (rate(series[window]))`: a counter's increase per second over the window."""

    series: EngineSeries
    by: By = By.MODEL


@dataclass(frozen=True)
class Arrivals:
    """The arrival rate (`rule`, planner/arrivals.py) per `by`."""

    by: By = By.MODEL
    rule: ArrivalRate = ARRIVALS


@dataclass(frozen=True)
class Quantile:
    """`histogram_quantile(q, ...)` of a latency histogram's bucket rates over the window, per model."""

    q: float
    histogram: EngineHistogram


Description = Latest | Rate | Arrivals | Quantile

QUERIES: Mapping[Query, Description] = MappingProxyType({
    Query.RATE: Arrivals(),
    Query.PROMPT: Rate(EngineSeries.PROMPT_TOKENS),
    Query.GEN: Rate(EngineSeries.GEN_TOKENS),
    Query.WAITING: Latest(EngineSeries.WAITING),
    Query.RUNNING: Latest(EngineSeries.RUNNING),
    Query.KV: Latest(EngineSeries.KV_USAGE, agg=Agg.AVG),
    Query.TTFT_P50: Quantile(0.5, EngineHistogram.TTFT),
    Query.TTFT_P99: Quantile(0.99, EngineHistogram.TTFT),
    Query.ITL_P50: Quantile(0.5, EngineHistogram.ITL),
    Query.ITL_P99: Quantile(0.99, EngineHistogram.ITL),
    Query.PREFIX_QUERIES: Rate(EngineSeries.PREFIX_QUERIES),
    Query.PREFIX_HITS: Rate(EngineSeries.PREFIX_HITS),
    Query.REPLICA_RUNNING: Latest(EngineSeries.RUNNING, By.REPLICA),
    Query.REPLICA_WAITING: Latest(EngineSeries.WAITING, By.REPLICA),
    Query.REPLICA_RATE: Arrivals(By.REPLICA),
    Query.REPLICA_DONE: Latest(EngineSeries.REQUESTS_DONE, By.REPLICA),
})
