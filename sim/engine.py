"""The simulated engine server: an OpenAI-compatible HTTP server driving a BatchCore.

One process (or one in-process server) per replica. Persona vllm serves `/v1/completions`,
`/v1/chat/completions` (SSE streaming and not), `/v1/models`, `/health` (503 while starting or
draining) and `/metrics` with vLLM's metric names, labels (`model_name`, `engine`) and histogram
bucket edges. Persona trtllm serves, as `trtllm-serve` does, `/prometheus/metrics` with the names,
types, labels and bucket edges of TensorRT-LLM's MetricsCollector, and on `/metrics` the JSON
iteration stats (see `_TrtllmCollector` for the source and what the simulation keeps).

Time: the simulated clock runs `time_scale` times faster than wall time. Everything the engine
reports (histograms, startup delay) is in SIMULATED seconds. The engine keeps its own simulated
clock: it advances by the modelled step durations and sleeps whenever it is ahead of
`time_scale` x wall time. When the host CPU cannot keep up, the simulated clock falls behind (the
engine effectively runs at a lower time scale; requests arriving meanwhile are stamped with the
engine's clock, never in its future); it catches up when the engine goes idle. With a finite
`lag_tolerance_s` it instead jumps forward when it lags by more than that much wall time (counted
in `/sim/state` as lag events). A request is never admitted before its arrival.

Each SSE chunk carries `sim_time_s`, the engine's simulated time of its last token (the first
chunk also `sim_first_token_s`; a chunk of several tokens `sim_token_times_s`, one per token), and
the response header `X-Sim-Arrival-S` the request's simulated arrival: clients can measure in exact
simulated time (fleetplan.sim.replay does when they are present) instead of wall time x time scale.

Prompt length: the request's `prompt_tokens` field when present (an extension; also accepted
inside `"fleetplan": {...}`), else the length of a token-id list prompt, else one token per
whitespace-separated word. Output length: `max_tokens` (`max_completion_tokens` for chat) when
`ignore_eos` is true; otherwise a seeded "natural" length (lognormal, mean ~ `natural_mean_tokens`)
clamped to [min_tokens, max_tokens]. Every SSE chunk carries `n_tokens`, the tokens it holds
(chunks coalesce tokens when steps are shorter than `min_chunk_interval_ms` of wall time).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import math
import os
import random
import signal
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from fleetplan.models.names import Engine, GpuType, Precision, model_key
from fleetplan.sim.groundtruth import BatchCore, EngineParams, StepResult, build_params
from fleetplan.sim.prefix_cache import prompt_block_hashes

log = logging.getLogger(__name__)

# Bucket edges as in vLLM's vllm/v1/metrics/loggers.py (and trtllm's MetricsCollector defaults).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
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


@dataclass(frozen=True)
class EngineConfig:
    persona: Engine
    model: str  # served model name (also selects the architecture)
    gpu: GpuType
    tp: int = 1
    precision: Precision = Precision.BF16
    time_scale: float = 1.0
    startup_s: float | None = None  # simulated; None: the persona's default (+ build if not cached)
    engine_cached: bool = True  # trtllm: a built engine exists (no build at startup)
    replica_id: str | None = None
    seed: int = 0
    min_chunk_interval_ms: float = 0.0  # wall
    natural_mean_tokens: float = 180.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    noise_sigma: float = 0.03
    lag_tolerance_s: float = math.inf  # wall; beyond it a lagging clock jumps forward (inf: never)
    drain_timeout_s: float = 600.0  # wall
    prefix_caching: bool = True  # vLLM's automatic prefix caching / TensorRT-LLM's KV cache reuse (both default on)

    def params(self) -> EngineParams:
        overrides: dict[str, Any] = {}
        if self.max_num_seqs is not None:
            overrides["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens is not None:
            overrides["max_num_batched_tokens"] = self.max_num_batched_tokens
        return build_params(
            self.persona, self.model, self.gpu, self.tp, self.precision, noise_sigma=self.noise_sigma, **overrides
        )

    def startup_sim_s(self, params: EngineParams) -> float:
        if self.startup_s is not None:
            return max(0.0, self.startup_s)
        size = max(1.0, params.weight_bytes_per_gpu * params.tp / 16e9)  # relative to an 8B BF16 model
        load = params.factors.startup_s * (0.5 + 0.5 * math.sqrt(size) / 3.0)
        build = 0.0
        if self.persona is Engine.TRTLLM and not self.engine_cached:
            build = params.factors.build_s * (0.75 + 0.25 * math.sqrt(size))
        return load + build


class _Req:
    __slots__ = (
        "arrival", "blocks", "cached", "chat", "done", "done_event", "event", "finish_reason", "first", "last",
        "max_tokens_param", "out_tokens", "pending", "pending_times", "prompt_tokens", "ready_at", "rid", "scheduled",
    )

    def __init__(self, rid: str, prompt_tokens: int, out_tokens: int, max_tokens_param: int, arrival: float,
                 chat: bool, blocks: tuple[int, ...] | None = None) -> None:
        self.rid = rid
        self.blocks = blocks  # the prompt's block hashes (prefix cache), None: not cacheable
        self.cached = 0  # prompt tokens found in the prefix cache at admission
        self.prompt_tokens = prompt_tokens
        self.out_tokens = out_tokens
        self.max_tokens_param = max_tokens_param
        self.arrival = arrival
        self.ready_at = arrival  # + the frontend overhead: when the scheduler sees it
        self.chat = chat
        self.scheduled: float | None = None
        self.first: float | None = None
        self.last = 0.0
        self.pending = 0
        self.pending_times: list[float] = []  # engine time of each pending token (sent with coalesced chunks)
        self.done = False
        self.finish_reason = "length"
        self.event = asyncio.Event()
        self.done_event = asyncio.Event()  # wakes a coalescing stream early: the last chunk goes out at once


class _Stats:
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


class _VllmCollector:
    def __init__(self, engine: SimEngine) -> None:
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


class _TrtllmCollector:
    """What `trtllm-serve` exports on /prometheus/metrics.

    Source: NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py @ 050f80def8df236e326949c8bd9dee10fd896a83
    (`MetricsCollector`: names with the `trtllm_` prefix, types, default bucket edges, labels; the
    per-request metrics are logged when a request finishes, the gauges from the iteration stats),
    mounted by tensorrt_llm/serve/openai_server.py (`mount_metrics`) through prometheus_client's
    multiprocess collector: counters and histograms have no `_created` series, and gauges (mode
    "all") carry a `pid` label. The simulation exports the subset it can compute; the names, types,
    labels and edges are held against the source by tests/integration/test_sim_engine_trtllm_metrics.py.
    """

    def __init__(self, engine: SimEngine) -> None:
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


class RequestError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def _error(status: int, message: str, err_type: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status,
         "error": {"message": message, "type": err_type, "code": status}},
        status=status,
    )


def _count_words(text: str) -> int:
    return len(text.split())


def prompt_length(body: dict[str, Any], chat: bool) -> int:
    """Prompt tokens of an OpenAI request body (see the module docstring)."""
    for holder in (body, body.get("fleetplan") or {}):
        if isinstance(holder, dict) and holder.get("prompt_tokens") is not None:
            try:
                n = int(holder["prompt_tokens"])
            except (TypeError, ValueError) as exc:
                raise RequestError(400, f"prompt_tokens must be an integer, got {holder['prompt_tokens']!r}") from exc
            if n < 1:
                raise RequestError(400, f"prompt_tokens must be >= 1, got {n}")
            return n
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError(400, "messages must be a non-empty list")
        total = 0
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += _count_words(content)
            elif isinstance(content, list):
                total += sum(_count_words(str(p.get("text", ""))) for p in content if isinstance(p, dict))
            total += 4  # role and template tokens
        return max(1, total)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return max(1, len(prompt))
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif prompt and isinstance(prompt[0], list):
            return max(1, len(prompt[0]))
        else:
            raise RequestError(400, "batched prompts are not supported by the simulated engine")
    if not isinstance(prompt, str):
        raise RequestError(400, "prompt must be a string or a list of token ids")
    return max(1, _count_words(prompt))


def _block_ids(raw: object) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in raw):
        raise RequestError(400, "block_hashes must be a list of integers")
    return tuple(h & 0x7FFFFFFFFFFFFFFF for h in raw)


def prompt_blocks(body: dict[str, Any], chat: bool) -> tuple[int, ...] | None:
    """The prompt's 512-token block hashes for the prefix cache (fleetplan.sim.prefix_cache): the
    body's `block_hashes` (fleetplan extension, also in `"fleetplan": {...}`: a trace's hash_ids,
    for prompts sent as a `prompt_tokens` hint), else chained hashes of the prompt's tokens (token
    ids, or the words of a text prompt; chat: each message's role and 3 template tokens, then its
    words, as prompt_length counts them). None: a hint without hashes (nothing to cache)."""
    for holder in (body, body.get("fleetplan") or {}):
        if isinstance(holder, dict) and holder.get("block_hashes") is not None:
            return _block_ids(holder["block_hashes"])
    for holder in (body, body.get("fleetplan") or {}):
        if isinstance(holder, dict) and holder.get("prompt_tokens") is not None:
            return None
    if chat:
        toks: list[str] = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            toks += [f"<{m.get('role', '')}>", "<t>", "<t>", "<t>"]
            content = m.get("content")
            if isinstance(content, str):
                toks += content.split()
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict):
                        toks += str(part.get("text", "")).split()
        return prompt_block_hashes(toks) if toks else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt_block_hashes(prompt)
    if isinstance(prompt, str) and prompt.strip():
        return prompt_block_hashes(prompt.split())
    return None


class SimEngine:
    """The engine state and its HTTP app. Use `start()` / `stop()` (or run `run_engine`)."""

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {cfg.time_scale}")
        self.cfg = cfg
        self.params = cfg.params()
        self.core = BatchCore(self.params, seed=cfg.seed)
        self.stats = _Stats(self.params.max_model_len)
        self._rng = random.Random(cfg.seed + 7919)
        self.incoming: deque[_Req] = deque()
        self.reqs: dict[str, _Req] = {}
        self._wake = asyncio.Event()
        self._all_done = asyncio.Event()
        self._t0_wall = time.monotonic()
        self._sim_t = 0.0
        self.startup_sim_s = cfg.startup_sim_s(self.params)
        self.draining = False
        self.lag_events = 0
        self.lag_sim_s = 0.0
        self.behind_max_wall_s = 0.0  # the most the simulated clock fell behind time_scale x wall
        self._warned_behind = False
        self.steps = 0
        self.last_step_s = 0.0  # simulated duration of the last engine step
        self._driver: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.vllm_registry = CollectorRegistry(auto_describe=False)
        self.vllm_registry.register(_VllmCollector(self))
        self.trtllm_registry = CollectorRegistry(auto_describe=False)
        self.trtllm_registry.register(_TrtllmCollector(self))

    # -- clock ---------------------------------------------------------------------------------
    def wall_sim_now(self) -> float:
        return (time.monotonic() - self._t0_wall) * self.cfg.time_scale

    def sim_now(self) -> float:
        return max(self._sim_t, self.wall_sim_now()) if self.core.idle() else self._sim_t

    @property
    def ready(self) -> bool:
        return self.wall_sim_now() >= self.startup_sim_s

    # -- lifecycle -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/ping", self.h_health)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/version", self.h_version)
        if self.cfg.persona is Engine.TRTLLM:
            app.router.add_get("/metrics", self.h_trt_iteration_stats)
            app.router.add_get("/prometheus/metrics", self.h_trt_metrics)
        else:
            app.router.add_get("/metrics", self.h_metrics)
        app.router.add_post("/v1/completions", self.h_completions)
        app.router.add_post("/v1/chat/completions", self.h_chat)
        app.router.add_get("/sim/state", self.h_state)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._t0_wall = time.monotonic()
        self._driver = asyncio.create_task(self._drive(), name="sim-engine-driver")
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        log.info("sim-engine %s %s on %s:%s startup %.0f sim s", self.cfg.persona.value, self.cfg.model, host,
                 self.port, self.startup_sim_s)
        return int(self.port or 0)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Stop accepting requests; wait (wall) until the in-flight ones finish. True when all did."""
        self.draining = True
        if self.reqs:
            self._all_done.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_done.wait(),
                                       self.cfg.drain_timeout_s if timeout_s is None else timeout_s)
        return not self.reqs

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._driver is not None:
            driver, self._driver = self._driver, None
            driver.cancel()
            try:
                await driver
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # stop() itself was cancelled: propagate

    # -- the driver ----------------------------------------------------------------------------
    async def _drive(self) -> None:
        core = self.core
        k = self.cfg.time_scale
        tol = self.cfg.lag_tolerance_s * k
        incoming = self.incoming
        while True:
            if core.idle() and not incoming:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.wall_sim_now()
            if core.idle():
                self._sim_t = max(self._sim_t, incoming[0].ready_at)
            else:
                behind = (now - self._sim_t) / k  # wall seconds the simulated clock is behind
                if behind > self.behind_max_wall_s:
                    self.behind_max_wall_s = behind
                    if behind > 1.0 and not self._warned_behind:
                        self._warned_behind = True
                        log.warning("the host CPU cannot keep up at time scale %g: the simulated clock is %.1f "
                                    "wall s behind (lower --time-scale or the request rate, or raise "
                                    "--min-chunk-interval-ms)", k, behind)
            if not core.idle() and now - self._sim_t > tol:  # never when tol is inf
                self.lag_events += 1
                self.lag_sim_s += now - tol - self._sim_t
                self._sim_t = now - tol
            t = self._sim_t
            while incoming and incoming[0].ready_at <= t:
                r = incoming.popleft()
                if r.rid in self.reqs:  # not cancelled meanwhile
                    core.submit(r.rid, r.prompt_tokens, r.out_tokens, r.arrival, r.blocks)
            res = core.step(t)
            if res.duration_s <= 0.0:
                await asyncio.sleep(0.001)
                continue
            end = t + res.duration_s
            self._sim_t = end
            self.steps += 1
            self.last_step_s = res.duration_s
            ahead_wall = (end - self.wall_sim_now()) / k
            await asyncio.sleep(ahead_wall if ahead_wall > 0.0005 else 0)
            self._emit(res, t, end)

    def _emit(self, res: StepResult, start: float, end: float) -> None:
        s = self.stats
        reqs = self.reqs
        s.iter_tokens.observe(res.prefill_tokens + res.decode_seqs)
        s.preemptions += len(res.preempted)
        for rid in res.admitted:
            r0 = reqs.get(rid)
            if r0 is not None and r0.scheduled is None:
                r0.scheduled = start
        for rid, cached in res.cached:
            r0 = reqs.get(rid)
            if r0 is not None:
                r0.cached = cached
        itl_obs = 0
        for rid, n in res.tokens:
            r = reqs.get(rid)
            if r is None:
                continue
            if r.first is None:
                r.first = end
                s.ttft.observe(end - r.arrival)
                s.prompt_tokens += r.prompt_tokens
            else:
                gap = end - r.last
                if abs(gap - res.duration_s) < 1e-12:
                    itl_obs += n
                else:
                    s.itl.observe(gap, n)
            r.last = end
            r.pending += n
            r.pending_times.append(end)
            s.generation_tokens += n
            r.event.set()
        if itl_obs:
            s.itl.observe(res.duration_s, itl_obs)
        for rid in res.finished:
            r = reqs.get(rid)
            if r is None:
                continue
            r.done = True
            r.done_event.set()
            self._finish_stats(r, end)
            r.event.set()

    def _finish_stats(self, r: _Req, end: float) -> None:
        s = self.stats
        first = r.first if r.first is not None else end
        sched = r.scheduled if r.scheduled is not None else first
        s.success[r.finish_reason] += 1
        s.ttft_finished.observe(first - r.arrival)
        s.prompt_tokens_finished += r.prompt_tokens
        s.prompt_cached_tokens_finished += min(r.cached, r.prompt_tokens)
        s.generation_tokens_finished += r.out_tokens
        s.e2e.observe(end - r.arrival)
        s.queue.observe(max(0.0, sched - r.arrival))
        s.prefill.observe(first - sched)
        s.prefill_trt.observe(first - sched)
        s.decode.observe(end - first)
        s.inference.observe(end - sched)
        s.prompt_req.observe(r.prompt_tokens)
        s.gen_req.observe(r.out_tokens)
        s.max_tokens_req.observe(r.max_tokens_param)
        if r.out_tokens > 1:
            s.tpot_req.observe((end - first) / (r.out_tokens - 1))

    # -- handlers ------------------------------------------------------------------------------
    async def h_health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.Response(status=503, text="draining")
        if not self.ready:
            return web.Response(status=503, text="starting")
        return web.Response(status=200)

    async def h_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fleetplan-sim", "persona": self.cfg.persona.value})

    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response({
            "object": "list",
            "data": [{"id": self.cfg.model, "object": "model", "created": int(time.time()), "owned_by": "fleetplan-sim",
                      "root": self.cfg.model, "parent": None, "max_model_len": self.params.max_model_len}],
        })

    async def h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.vllm_registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def h_trt_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.trtllm_registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def h_trt_iteration_stats(self, request: web.Request) -> web.Response:
        """trtllm-serve's `/metrics`: JSON iteration stats, not Prometheus text (the keys the
        MetricsCollector reads from them; NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py
        `log_iteration_stats`)."""
        core, p = self.core, self.params
        used = round(core.kv_usage * p.kv_blocks)
        return web.json_response([{
            "iter": self.steps,
            "iterLatencyMS": self.last_step_s * 1000.0,
            "numActiveRequests": core.num_running,
            "numQueuedRequests": core.num_waiting + len(self.incoming),
            "maxNumActiveRequests": p.max_num_seqs,
            "kvCacheStats": {"maxNumBlocks": p.kv_blocks, "usedNumBlocks": used, "freeNumBlocks": p.kv_blocks - used,
                             "tokensPerBlock": p.block_size},
        }])

    async def h_state(self, request: web.Request) -> web.Response:
        return web.json_response({
            "persona": self.cfg.persona.value, "model": self.cfg.model, "replica_id": self.cfg.replica_id,
            "gpu": self.cfg.gpu.value, "tp": self.cfg.tp, "precision": self.cfg.precision.value,
            "sim_time_s": self.sim_now(), "time_scale": self.cfg.time_scale, "ready": self.ready,
            "draining": self.draining, "startup_s": self.startup_sim_s, "running": self.core.num_running,
            "waiting": self.core.num_waiting + len(self.incoming), "kv_usage": self.core.kv_usage,
            "kv_blocks": self.params.kv_blocks, "max_num_seqs": self.params.max_num_seqs,
            "steps": self.steps, "lag_events": self.lag_events, "lag_sim_s": self.lag_sim_s,
            "behind_max_wall_s": self.behind_max_wall_s,
        })

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    def _output_length(self, body: dict[str, Any], chat: bool, prompt: int) -> tuple[int, int]:
        """(tokens to generate, the max_tokens parameter)."""
        raw = body.get("max_completion_tokens") if chat else None
        if raw is None:
            raw = body.get("max_tokens")
        room = self.params.max_model_len - prompt
        if raw is None:
            max_tokens = 16 if not chat else room
        else:
            try:
                max_tokens = int(raw)
            except (TypeError, ValueError) as exc:
                raise RequestError(400, f"max_tokens must be an integer, got {raw!r}") from exc
            if max_tokens < 1:
                raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}")
        min_tokens = int(body.get("min_tokens") or 0)
        if min_tokens > max_tokens:
            raise RequestError(400, f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
        if prompt + max_tokens > self.params.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.params.max_model_len} tokens. However, you requested "
                f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion).",
            )
        if body.get("ignore_eos") or (body.get("fleetplan") or {}).get("ignore_eos"):
            return max_tokens, max_tokens
        mean = self.cfg.natural_mean_tokens
        natural = max(1, round(self._rng.lognormvariate(math.log(mean) - 0.5 * 0.8**2, 0.8)))
        return max(min_tokens, min(max_tokens, natural)), max_tokens

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if self.draining:
            return _error(503, "the engine is shutting down", "ServiceUnavailableError")
        if not self.ready:
            return _error(503, "the engine is starting", "ServiceUnavailableError")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            model = body.get("model")
            if model is not None and model_key(str(model)) != model_key(self.cfg.model):
                raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
            prompt = prompt_length(body, chat)
            blocks = prompt_blocks(body, chat) if self.cfg.prefix_caching else None
            out, max_tokens = self._output_length(body, chat, prompt)
            if self.core.blocks_for(prompt + out) > self.params.kv_blocks:
                raise RequestError(400, f"prompt + output ({prompt + out} tokens) exceeds the KV cache")
        except json.JSONDecodeError:
            return _error(400, "the request body is not valid JSON")
        except RequestError as exc:
            return _error(exc.status, exc.message, exc.err_type)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        arrival = self.wall_sim_now()
        if not self.core.idle():
            arrival = min(arrival, self._sim_t)  # the engine's clock lags: arrive at its "now"
        r = _Req(rid, prompt, out, max_tokens, arrival, chat, blocks)
        r.ready_at = r.arrival + self.params.factors.ttft_overhead_s
        r.finish_reason = "length" if out >= max_tokens else "stop"
        self.reqs[rid] = r
        self.incoming.append(r)
        self._wake.set()
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            if stream:
                return await self._stream(request, r, include_usage)
            while not r.done:
                await r.event.wait()
                r.event.clear()
            return web.json_response(self._full_response(r))
        finally:
            if not r.done:
                self.core.cancel(rid)
                self.stats.success["abort"] += 1
            self.reqs.pop(rid, None)
            if not self.reqs:
                self._all_done.set()

    def _usage(self, r: _Req) -> dict[str, int]:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.out_tokens,
                "total_tokens": r.prompt_tokens + r.out_tokens}

    def _full_response(self, r: _Req) -> dict[str, Any]:
        text = _text(r.out_tokens, 0)
        created = int(time.time())
        if r.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": r.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason}
            obj = "text_completion"
        return {"id": r.rid, "object": obj, "created": created, "model": self.cfg.model, "choices": [choice],
                "usage": self._usage(r)}

    async def _stream(self, request: web.Request, r: _Req, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Sim-Arrival-S": repr(r.arrival)})
        await resp.prepare(request)
        created = int(time.time())
        min_gap = self.cfg.min_chunk_interval_ms / 1000.0
        last_write = 0.0
        sent = 0
        obj = "chat.completion.chunk" if r.chat else "text_completion"
        while True:
            await r.event.wait()
            r.event.clear()
            if min_gap > 0 and not r.done:
                wait = last_write + min_gap - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(r.done_event.wait(), wait)
            n = r.pending
            r.pending = 0
            times = r.pending_times
            r.pending_times = []
            final = r.done and sent + n >= r.out_tokens
            if n == 0 and not final:
                continue
            text = _text(n, sent)
            finish = r.finish_reason if final else None
            if r.chat:
                delta: dict[str, Any] = {"content": text}
                if sent == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            is_first = sent == 0
            sent += n
            chunk = {"id": r.rid, "object": obj, "created": created, "model": self.cfg.model,
                     "choices": [choice], "n_tokens": n, "sim_time_s": r.last}
            if is_first:
                chunk["sim_first_token_s"] = r.first
            if n > 1:
                chunk["sim_token_times_s"] = times
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            last_write = time.monotonic()
            if final:
                break
        if include_usage:
            usage_chunk = {"id": r.rid, "object": obj, "created": created, "model": self.cfg.model, "choices": [],
                           "usage": self._usage(r)}
            await resp.write(b"data: " + json.dumps(usage_chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


_WORDS = ("the", "fleet", "plan", "token", "serve", "model", "batch", "queue")


def _text(n: int, offset: int) -> str:
    return "".join(" " + _WORDS[(offset + i) % len(_WORDS)] for i in range(n))


async def run_engine(cfg: EngineConfig, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT; then drain gracefully (finish in-flight requests) and exit 0."""
    engine = SimEngine(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await engine.start(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", host, port, exc)
        print(f"sim-engine: cannot listen on {host}:{port}: {exc}", flush=True)
        return 1
    print(f"sim-engine {cfg.persona.value} {cfg.model} listening on http://{host}:{engine.port} "
          f"(time scale {cfg.time_scale:g}, startup {engine.startup_sim_s:.0f} simulated s)", flush=True)
    try:
        await stop.wait()
        log.info("signal received: draining %d requests", len(engine.reqs))
        ok = await engine.drain()
        if not ok:
            log.warning("drain timeout: %d requests still in flight", len(engine.reqs))
    finally:
        await engine.stop()
    return 0
