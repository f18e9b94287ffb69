"""The arrival rate, described once: completions + the growth of the requests in the engine.

Engines export no arrival counter, and the completion rate stops rising once a fleet saturates
while the queue grows: 10 rps completed with a queue growing by 3 per second is an arrival rate of
13 rps, the number the planner must size for. `ARRIVALS` says which engine series it reads;
controller/observe.py renders it to PromQL (`rate()` of the counter, `deriv()` of each gauge) and
the replay's Prometheus (sim/promsim.py) evaluates it on its scrapes; both combine the two parts
with `arrival_rate`. Pure.

>>> arrival_rate(10.0, 3.0)
13.0
>>> arrival_rate(2.0, -5.0)  # a queue draining faster than requests complete: no negative rate
0.0
>>> arrival_rate(10.0, None)  # the gauges are missing: the completion rate
10.0
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["ARRIVALS", "ArrivalRate", "EngineSeries", "arrival_rate"]


class EngineSeries(Enum):
    """The engine series the observation reads (each engine's metric names: controller/observe.py;
    the value names the replay's scrape field: sim/promsim.py). The arrival rate reads the first
    three; planner/queries.py describes the other queries on them."""

    REQUESTS_DONE = "completed"  # counter: requests finished
    RUNNING = "running"  # gauge: requests in the running batch
    WAITING = "waiting"  # gauge: requests queued
    PROMPT_TOKENS = "prompt_tokens"  # counter: prompt tokens of the requests finished
    GEN_TOKENS = "gen_tokens"  # counter: tokens generated
    KV_USAGE = "kv"  # gauge: the KV cache's used share
    PREFIX_QUERIES = "prefix_queries"  # counter: prompt tokens looked up in the prefix cache
    PREFIX_HITS = "prefix_hits"  # counter: prompt tokens found there


@dataclass(frozen=True)
class ArrivalRate:
    """arrivals = rate(`completions`) + the sum of deriv(g) over `in_engine`, at least `floor_rps`;
    the completion rate alone where the gauges are missing."""

    completions: EngineSeries
    in_engine: tuple[EngineSeries, ...]
    floor_rps: float = 0.0


ARRIVALS = ArrivalRate(EngineSeries.REQUESTS_DONE, (EngineSeries.RUNNING, EngineSeries.WAITING))


def arrival_rate(done_rps: float, growth_rps: float | None, rule: ArrivalRate = ARRIVALS) -> float:
    """The arrival rate from the completion rate and the summed growth of the `in_engine` gauges
    (None: they are missing)."""
    if growth_rps is None:
        return done_rps
    return max(rule.floor_rps, done_rps + growth_rps)
