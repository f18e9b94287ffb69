"""The prefix-cache hit rate a model's replicas get, from the engines' own counters. Pure.

The engines count, per replica, the prompt tokens they looked up in their prefix cache and the
ones they found (cumulative counters; the observer takes their windowed increase or rate, summed
over a model's (or a config's) replicas):

| engine | queried tokens | cached tokens |
|---|---|---|
| vLLM (v1) | `vllm:prefix_cache_queries_total` | `vllm:prefix_cache_hits_total` |
| TensorRT-LLM (trtllm-serve) | `trtllm_prompt_tokens_total` | `trtllm_prompt_cached_tokens_total` |

vLLM: vllm/v1/metrics/loggers.py (counters `vllm:prefix_cache_queries` / `_hits`, "in terms of
number of queried / cached tokens", labels model_name, engine), incremented from
KVCacheManager.get_computed_blocks: queries += request.num_tokens, hits += the cached tokens,
each time a waiting request is scheduled (a preempted request is looked up again).
TensorRT-LLM: tensorrt_llm/metrics/collector.py (MetricsCollector, labels model_name,
engine_type): per finished request, prompt_tokens_total += its prompt tokens and
prompt_cached_tokens_total += the prompt tokens served from the KV cache.

`hit_rate` turns the two increases into a share with a minimum-sample rule: below
`min_query_tokens` queried tokens (a model with no traffic yet, a window the counters do not
cover) the rate is unknown (None), and the planner assumes no caching (`planning_share`).
"""

from __future__ import annotations

import math

# below this many queried tokens in the window, the hit rate is unknown: ~20 requests of 1000 tokens
MIN_QUERY_TOKENS = 20_000.0
# hits may exceed queries by this much (two counters scraped a moment apart) before the pair is rejected
_SLACK = 0.02


def hit_rate(queried_tokens: float | None, hit_tokens: float | None, *,
             min_query_tokens: float = MIN_QUERY_TOKENS) -> float | None:
    """The cached share of the queried prompt tokens over a window, in [0, 1].

    `queried_tokens`, `hit_tokens`: the windowed increases of the two counters (or their rates
    times the window), summed over the replicas. None (unknown) when either is missing or not a
    number, negative (a counter reset the window did not handle), the queries are fewer than
    `min_query_tokens`, or the hits exceed the queries by more than 2 %.

    >>> hit_rate(100_000, 36_600)
    0.366
    >>> hit_rate(5_000, 2_000) is None  # too few tokens to tell
    True
    """
    if queried_tokens is None or hit_tokens is None:
        return None
    q, h = float(queried_tokens), float(hit_tokens)
    if not (math.isfinite(q) and math.isfinite(h)) or q < 0 or h < 0:
        return None
    if q < min_query_tokens or q <= 0:
        return None
    if h > q * (1.0 + _SLACK):
        return None
    return min(1.0, h / q)


def hit_rate_from_rates(queried_tps: float | None, hit_tps: float | None, window_s: float, *,
                        min_query_tokens: float = MIN_QUERY_TOKENS) -> float | None:
    """hit_rate from per-second rates over a window of `window_s` seconds (PromQL `rate(...[w])`)."""
    if queried_tps is None or hit_tps is None or not (window_s > 0 and math.isfinite(window_s)):
        return None
    return hit_rate(queried_tps * window_s, hit_tps * window_s, min_query_tokens=min_query_tokens)


def planning_share(observed: float | None) -> float:
    """The cached share of the prompt the plan assumes: the observed hit rate, 0 when unknown."""
    if observed is None or not math.isfinite(observed):
        return 0.0
    return min(1.0, max(0.0, observed))
