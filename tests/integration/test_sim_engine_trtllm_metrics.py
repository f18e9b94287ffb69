"""The simulated TensorRT-LLM engine exports what `trtllm-serve` exports.

Reference, read from TensorRT-LLM's own source (names, types, label names, default bucket edges):
  NVIDIA/TensorRT-LLM  tensorrt_llm/metrics/collector.py  @ 050f80def8df236e326949c8bd9dee10fd896a83
    class MetricsCollector: metric_prefix "trtllm_"; per-request Counter/Histogram with the
    collector's labels (+ `finished_reason` on request_success_total), iteration-level Gauges.
  NVIDIA/TensorRT-LLM  tensorrt_llm/serve/openai_server.py  @ 00057725d9a6591f033e44f31c219e2426827bb7
    `_init_llm`: MetricsCollector({"model_name": "undefined", "engine_type": "undefined"}) when
    `return_perf_metrics` is set; `mount_metrics`: Prometheus text on /prometheus/metrics from a
    prometheus_client multiprocess registry (gauges in mode "all" gain a `pid` label; no `_created`
    series); `/metrics` stays the JSON iteration stats.
The simulation exports a subset of the collector's metrics; every family it exports must be in
REFERENCE with the same type, label names and bucket edges, and the ones fleetplan reads must be there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.engine import EngineConfig, SimEngine
from fleetplan.sim.replay import run_load

LABELS = ("engine_type", "model_name")  # the labels trtllm-serve gives its MetricsCollector
GAUGE_LABELS = (*LABELS, "pid")  # multiprocess mode "all"
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # e2e, queue, decode and inference time
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
PREFILL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                   640.0, 2560.0)

# family name (as prometheus_client's parser names it: counters without `_total`) ->
# (type, label names, bucket edges or None)
REFERENCE: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {
    "trtllm_request_success": ("counter", (*LABELS, "finished_reason"), None),
    "trtllm_e2e_request_latency_seconds": ("histogram", LABELS, E2E_BUCKETS),
    "trtllm_time_to_first_token_seconds": ("histogram", LABELS, TTFT_BUCKETS),
    "trtllm_time_per_output_token_seconds": ("histogram", LABELS, TPOT_BUCKETS),
    "trtllm_request_queue_time_seconds": ("histogram", LABELS, E2E_BUCKETS),
    "trtllm_request_prefill_time_seconds": ("histogram", LABELS, PREFILL_BUCKETS),
    "trtllm_request_decode_time_seconds": ("histogram", LABELS, E2E_BUCKETS),
    "trtllm_request_inference_time_seconds": ("histogram", LABELS, E2E_BUCKETS),
    "trtllm_prompt_tokens": ("counter", LABELS, None),
    "trtllm_generation_tokens": ("counter", LABELS, None),
    "trtllm_num_requests_completed": ("counter", LABELS, None),
    "trtllm_kv_cache_hit_rate": ("gauge", GAUGE_LABELS, None),
    "trtllm_kv_cache_utilization": ("gauge", GAUGE_LABELS, None),
    "trtllm_num_requests_running": ("gauge", GAUGE_LABELS, None),
    "trtllm_num_requests_waiting": ("gauge", GAUGE_LABELS, None),
    "trtllm_max_num_active_requests": ("gauge", GAUGE_LABELS, None),
    "trtllm_iteration_latency_seconds": ("gauge", GAUGE_LABELS, None),
    "trtllm_kv_cache_max_blocks": ("gauge", GAUGE_LABELS, None),
    "trtllm_kv_cache_free_blocks": ("gauge", GAUGE_LABELS, None),
    "trtllm_kv_cache_used_blocks": ("gauge", GAUGE_LABELS, None),
    "trtllm_kv_cache_tokens_per_block": ("gauge", GAUGE_LABELS, None),
    # KV cache reuse (prefix cache): per finished request, and the KV manager's block counts
    "trtllm_prompt_cached_tokens": ("counter", LABELS, None),
    "trtllm_kv_cache_reused_blocks": ("counter", LABELS, None),
    "trtllm_kv_cache_missed_blocks": ("counter", LABELS, None),
}
# what fleetplan reads (controller/observe.py, controller/daemon.py) and issue 9 names
REQUIRED = {
    "trtllm_request_success", "trtllm_time_to_first_token_seconds", "trtllm_time_per_output_token_seconds",
    "trtllm_num_requests_running", "trtllm_num_requests_waiting", "trtllm_kv_cache_utilization",
    "trtllm_prompt_tokens", "trtllm_generation_tokens",
}
# iteration-stat keys the collector reads from trtllm-serve's JSON `/metrics` (`log_iteration_stats`)
ITERATION_KEYS = {"numActiveRequests", "numQueuedRequests", "maxNumActiveRequests", "iterLatencyMS", "kvCacheStats"}
KV_KEYS = {"maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "tokensPerBlock"}


@pytest.fixture
async def trt_engine() -> AsyncIterator[SimEngine]:
    cfg = EngineConfig(persona=Engine.TRTLLM, model="llama-3.1-8b", gpu=GpuType.H100, tp=1, time_scale=20.0,
                       startup_s=0.0)
    e = SimEngine(cfg)
    await e.start("127.0.0.1", 0)
    yield e
    await e.stop()


async def test_prometheus_metrics_match_the_collector(trt_engine: SimEngine) -> None:
    n, isl, osl = 6, 200, 12
    results = await run_load([(i * 0.05, isl, osl) for i in range(n)], f"http://127.0.0.1:{trt_engine.port}",
                             speed=20.0)
    assert [r.outcome for r in results] == ["ok"] * n
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{trt_engine.port}/prometheus/metrics") as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert REQUIRED <= set(families), sorted(REQUIRED - set(families))
    unknown = set(families) - set(REFERENCE)
    assert not unknown, f"not exported by TensorRT-LLM's MetricsCollector: {sorted(unknown)}"
    for name, fam in families.items():
        kind, labels, buckets = REFERENCE[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for smp in fam.samples:
            assert not smp.name.endswith("_created"), "a multiprocess registry exports no _created series"
            got = tuple(sorted(k for k in smp.labels if k != "le"))
            assert got == tuple(sorted(labels)), (name, got)
            assert smp.labels["model_name"] == "undefined" and smp.labels["engine_type"] == "undefined"
        if buckets is not None:
            edges = [float(smp.labels["le"]) for smp in fam.samples if smp.name == f"{name}_bucket"]
            assert edges == [*buckets, float("inf")], name

    def value(sample: str) -> float:
        return sum(smp.value for fam in families.values() for smp in fam.samples if smp.name == sample)

    # the per-request metrics are logged once per finished request
    assert value("trtllm_request_success_total") == n
    assert value("trtllm_time_to_first_token_seconds_count") == n
    assert value("trtllm_e2e_request_latency_seconds_count") == n
    assert value("trtllm_time_per_output_token_seconds_count") == n
    assert value("trtllm_prompt_tokens_total") == n * isl
    assert value("trtllm_generation_tokens_total") == n * osl
    assert value("trtllm_num_requests_running") == 0 and value("trtllm_num_requests_waiting") == 0
    assert 0 < value("trtllm_kv_cache_tokens_per_block") and 0 < value("trtllm_kv_cache_max_blocks")
    tpot = value("trtllm_time_per_output_token_seconds_sum") / n
    assert 0.003 < tpot < 0.03  # simulated seconds: an 8B model on one H100


async def test_metrics_path_serves_json_iteration_stats_as_trtllm_serve(trt_engine: SimEngine) -> None:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{trt_engine.port}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/json")
        stats = await resp.json()
    assert isinstance(stats, list) and stats
    assert ITERATION_KEYS <= set(stats[-1]), stats[-1]
    assert KV_KEYS <= set(stats[-1]["kvCacheStats"])
    kv = stats[-1]["kvCacheStats"]
    assert kv["usedNumBlocks"] + kv["freeNumBlocks"] == kv["maxNumBlocks"] > 0
