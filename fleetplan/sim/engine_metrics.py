"""What the simulated engine exports: the bucket edges of vLLM's and TensorRT-LLM's histograms,
`Hist`, `EngineStats` (everything /metrics exports, in simulated seconds) and the two Prometheus
collectors with the real engines' metric names, types and labels (`VllmCollector`, `TrtllmCollector`:
see its docstring for the source and what the simulation keeps).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from fleetplan.sim.core import ITL_BUCKETS_S, TTFT_BUCKETS_S

if TYPE_CHECKING:
    from fleetplan.sim.batching import BatchCore
    from fleetplan.sim.engine_config import EngineConfig
    from fleetplan.sim.groundtruth import EngineParams

# Bucket edges as in vLLM's vllm/v1/metrics/loggers.py (and trtllm's MetricsCollector defaults):
# one definition for every simulated engine, the replay's (fleetplan.sim.core) and this HTTP one
TTFT_BUCKETS: tuple[float, ...] = TTFT_BUCKETS_S
ITL_BUCKETS: tuple[float, ...] = ITL_BUCKETS_S
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
ITERATION_TOKEN_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRTLLM_PREFILL_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    640.0, 2560.0,
)
FINISH_REASONS = ("stop", "length", "abort")
# trtllm-serve builds its MetricsCollector with these label values, whatever the model (NVIDIA/TensorRT-LLM
# tensorrt_llm/serve/openai_server.py @ 00057725d9a6591f033e44f31c219e2426827bb7, `_init_llm`): the model
# must come from the scrape target's labels, never from `model_name`.
TRTLLM_SERVE_LABEL_VALUES = {"model_name": "undefined", "engine_type": "undefined"}


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count histogram edges)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class Hist:
    """A histogram with bulk observe (n identical values at once); exported by a collector."""

    __slots__ = ("count", "counts", "edges", "sum")

    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = tuple(float(e) for e in edges)
        self.counts = [0] * (len(self.edges) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for edge, c in zip(self.edges, self.counts, strict=False):
            acc += c
            out.append((repr(edge), float(acc)))
        out.append(("+Inf", float(self.count)))
        return out

class EngineStats:
    """Everything /metrics exports (simulated seconds)."""

    def __init__(self, max_model_len: int) -> None:
        tok = buckets_1_2_5(max_model_len)
        self.ttft = Hist(TTFT_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)
        self.tpot_req = Hist(ITL_BUCKETS)
        self.e2e = Hist(REQUEST_LATENCY_BUCKETS)
        self.queue = Hist(REQUEST_LATENCY_BUCKETS)
        self.inference = Hist(REQUEST_LATENCY_BUCKETS)
        self.prefill = Hist(REQUEST_LATENCY_BUCKETS)
        self.prefill_trt = Hist(TRTLLM_PREFILL_BUCKETS)
        self.decode = Hist(REQUEST_LATENCY_BUCKETS)
        self.prompt_req = Hist(tok)
        self.gen_req = Hist(tok)
        self.max_tokens_req = Hist(tok)
        self.iter_tokens = Hist(ITERATION_TOKEN_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        # TensorRT-LLM logs every per-request metric once, when the request finishes
        self.ttft_finished = Hist(TTFT_BUCKETS)
        self.prompt_tokens_finished = 0
        self.generation_tokens_finished = 0
        self.prompt_cached_tokens_finished = 0


def _hist(name: str, doc: str, labels: Sequence[str], values: Sequence[str], h: Hist) -> HistogramMetricFamily:
    m = HistogramMetricFamily(name, doc, labels=list(labels))
    m.add_metric(list(values), h.cumulative(), sum_value=h.sum)
    return m


def _gauge(name: str, doc: str, labels: Sequence[str], values: Sequence[str], v: float) -> GaugeMetricFamily:
    m = GaugeMetricFamily(name, doc, labels=list(labels))
    m.add_metric(list(values), v)
    return m


def _counter(name: str, doc: str, labels: Sequence[str], values: Sequence[str], v: float) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=list(labels))
    m.add_metric(list(values), v)
    return m


def _success_counter(
    name: str, labels: Sequence[str], values: Sequence[str], success: Mapping[str, float]
) -> CounterMetricFamily:
    """Finished requests by `finished_reason`, every reason present from the start (at 0)."""
    m = CounterMetricFamily(name, "Count of successfully processed requests.",
                            labels=[*labels, "finished_reason"])
    for reason, v in success.items():
        m.add_metric([*values, reason], v)
    return m


class ExportedEngine(Protocol):
    """What the collectors read of a simulated engine (fleetplan.sim.engine.SimEngine)."""

    @property
    def stats(self) -> EngineStats: ...

    @property
    def cfg(self) -> EngineConfig: ...

    @property
    def core(self) -> BatchCore: ...

    @property
    def params(self) -> EngineParams: ...

    @property
    def incoming(self) -> Sized: ...


class VllmCollector:
    def __init__(self, engine: ExportedEngine) -> None:
        self.e = engine

    def collect(self) -> Iterable[Metric]:
        e, s = self.e, self.e.stats
        ln, lv = ["model_name", "engine"], [e.cfg.model, "0"]
        core = e.core
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", ln, lv,
                     core.num_running)
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", ln, lv,
                     core.num_waiting + len(e.incoming))
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", ln, lv, core.kv_usage)
        yield _gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (deprecated name).", ln, lv, core.kv_usage)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", ln, lv,
                       s.preemptions)
        yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                       ln, lv, core.prefix_queries_tokens)
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", ln, lv,
                       core.prefix_hit_tokens)
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ln, lv, s.prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", ln, lv,
                       s.generation_tokens)
        yield _success_counter("vllm:request_success", ln, lv, s.success)
        yield _hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", ln, lv, s.prompt_req)
        yield _hist("vllm:request_generation_tokens", "Number of generation tokens processed.", ln, lv, s.gen_req)
        yield _hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", ln, lv,
                    s.max_tokens_req)
        yield _hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ln, lv,
                    s.iter_tokens)
        yield _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ln, lv,
                    s.ttft)
        yield _hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ln, lv,
                    s.itl)
        yield _hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ln, lv,
                    s.itl)
        yield _hist("vllm:request_time_per_output_token_seconds",
                    "Histogram of time_per_output_token_seconds per request.", ln, lv, s.tpot_req)
        yield _hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", ln, lv, s.e2e)
        yield _hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                    ln, lv, s.queue)
        yield _hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                    ln, lv, s.inference)
        yield _hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                    ln, lv, s.prefill)
        yield _hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                    ln, lv, s.decode)


class TrtllmCollector:
    """What `trtllm-serve` exports on /prometheus/metrics.

    Source: NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py @ 050f80def8df236e326949c8bd9dee10fd896a83
    (`MetricsCollector`: names with the `trtllm_` prefix, types, default bucket edges, labels; the
    per-request metrics are logged when a request finishes, the gauges from the iteration stats),
    mounted by tensorrt_llm/serve/openai_server.py (`mount_metrics`) through prometheus_client's
    multiprocess collector: counters and histograms have no `_created` series, and gauges (mode
    "all") carry a `pid` label. The simulation exports the subset it can compute; the names, types,
    labels and edges are held against the source by tests/integration/test_sim_engine_trtllm_metrics.py.
    """

    def __init__(self, engine: ExportedEngine) -> None:
        self.e = engine

    def collect(self) -> Iterable[Metric]:
        e, s = self.e, self.e.stats
        ln = list(TRTLLM_SERVE_LABEL_VALUES)
        lv = [TRTLLM_SERVE_LABEL_VALUES[k] for k in ln]
        gn, gv = [*ln, "pid"], [*lv, str(os.getpid())]
        core = e.core
        kv_used = round(core.kv_usage * e.params.kv_blocks)
        yield _success_counter("trtllm_request_success", ln, lv, s.success)
        yield _hist("trtllm_e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                    ln, lv, s.e2e)
        yield _hist("trtllm_time_to_first_token_seconds", "Histogram of time to first token in seconds.", ln, lv,
                    s.ttft_finished)
        yield _hist("trtllm_time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                    ln, lv, s.tpot_req)
        yield _hist("trtllm_request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                    ln, lv, s.queue)
        yield _hist("trtllm_request_prefill_time_seconds", "Histogram of prefill (context) phase duration in seconds.",
                    ln, lv, s.prefill_trt)
        yield _hist("trtllm_request_decode_time_seconds", "Histogram of decode (generation) phase duration in seconds.",
                    ln, lv, s.decode)
        yield _hist("trtllm_request_inference_time_seconds", "Histogram of total inference duration in seconds.",
                    ln, lv, s.inference)
        yield _counter("trtllm_prompt_tokens", "Cumulative number of prompt (input) tokens processed.", ln, lv,
                       s.prompt_tokens_finished)
        yield _counter("trtllm_generation_tokens", "Cumulative number of generation (output) tokens produced.",
                       ln, lv, s.generation_tokens_finished)
        yield _counter("trtllm_num_requests_completed", "Total number of completed requests across iterations",
                       ln, lv, sum(s.success.values()) - s.success["abort"])
        yield _counter("trtllm_prompt_cached_tokens", "Process-lifetime total prompt tokens served from KV cache.",
                       ln, lv, s.prompt_cached_tokens_finished)
        bs = e.params.block_size  # the KV manager's reuse stats, in blocks (cumulative, as the iteration stats)
        reused = core.prefix_hit_tokens // bs
        missed = -(-(core.prefix_queries_tokens - core.prefix_hit_tokens) // bs)
        yield _counter("trtllm_kv_cache_reused_blocks", "Cumulative number of KV cache blocks reused (cache hits)",
                       ln, lv, reused)
        yield _counter("trtllm_kv_cache_missed_blocks", "Cumulative number of KV cache blocks missed (cache misses)",
                       ln, lv, missed)
        yield _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate", gn, gv,
                     reused / (reused + missed) if reused + missed else 0.0)
        yield _gauge("trtllm_kv_cache_utilization", "KV cache utilization", gn, gv, core.kv_usage)
        yield _gauge("trtllm_num_requests_running", "Number of active requests", gn, gv, core.num_running)
        yield _gauge("trtllm_num_requests_waiting", "Number of queued requests", gn, gv,
                     core.num_waiting + len(e.incoming))
        yield _gauge("trtllm_max_num_active_requests", "Maximum number of active requests", gn, gv,
                     e.params.max_num_seqs)
        yield _gauge("trtllm_kv_cache_max_blocks", "Maximum number of KV cache blocks", gn, gv, e.params.kv_blocks)
        yield _gauge("trtllm_kv_cache_used_blocks", "Number of used KV cache blocks", gn, gv, kv_used)
        yield _gauge("trtllm_kv_cache_free_blocks", "Number of free KV cache blocks", gn, gv,
                     e.params.kv_blocks - kv_used)
        yield _gauge("trtllm_kv_cache_tokens_per_block", "Number of tokens per KV cache block", gn, gv,
                     e.params.block_size)
