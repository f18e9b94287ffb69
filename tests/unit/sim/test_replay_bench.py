"""Pure helpers of replay-load, bench-engine and the engine's request parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetplan.sim.benchclient import file_name, result_json
from fleetplan.sim.engine_metrics import Hist, buckets_1_2_5
from fleetplan.sim.engine_requests import RequestError, prompt_length
from fleetplan.sim.replay import (
    PROMPT_TOKEN_IDS,
    LoadRequest,
    PromptStyle,
    RequestResult,
    TargetError,
    _as_load_request,
    check_target,
    request_body,
    summarize,
)
from fleetplan.sim.traces import TraceRequest


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:80/m/x",
                                 "http://127.3.4.5:9"])
def test_loopback_targets_are_accepted(url: str) -> None:
    assert check_target(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "https://8.8.8.8"])
def test_remote_targets_need_allow_remote(url: str) -> None:
    with pytest.raises(TargetError, match="allow-remote"):
        check_target(url)
    assert check_target(url, allow_remote=True) == url


def test_malformed_target() -> None:
    with pytest.raises(TargetError, match="expected http"):
        check_target("127.0.0.1:8000")


def test_request_items_and_body() -> None:
    assert _as_load_request((1.5, 100, 20)) == LoadRequest(1.5, 100, 20, None)
    assert _as_load_request(TraceRequest(2.0, 7, 3, "m")) == LoadRequest(2.0, 7, 3, "m")
    body = request_body(LoadRequest(0.0, 300, 40), "llama")
    assert body["prompt_tokens"] == 300 and body["max_tokens"] == 40 and body["min_tokens"] == 40
    assert body["ignore_eos"] and body["stream"] and body["model"] == "llama"
    assert body["stream_options"]["include_usage"]
    words = request_body(LoadRequest(0.0, 300, 40, "other"), "llama", PromptStyle.WORDS)
    assert len(words["prompt"].split()) == 300 and words["model"] == "other"
    assert "prompt_tokens" not in words  # servers that forbid unknown fields (trtllm-serve) take it
    ids = request_body(LoadRequest(0.0, 300, 40), "llama", PromptStyle.TOKEN_IDS, seed=1)
    assert len(ids["prompt"]) == 300 and all(isinstance(t, int) for t in ids["prompt"])
    assert "prompt_tokens" not in ids and ids["max_tokens"] == 40 and ids["ignore_eos"]
    assert all(PROMPT_TOKEN_IDS[0] <= t < PROMPT_TOKEN_IDS[1] for t in ids["prompt"])
    # a different prompt per request (no prefix-cache hits), the same one for the same request
    assert ids["prompt"] != request_body(LoadRequest(0.0, 300, 40), None, PromptStyle.TOKEN_IDS, seed=2)["prompt"]
    assert ids["prompt"] == request_body(LoadRequest(0.0, 300, 40), None, PromptStyle.TOKEN_IDS, seed=1)["prompt"]
    assert prompt_length(ids, chat=False) == 300 and prompt_length(words, chat=False) == 300  # the sim agrees


def test_summary_counts_only_successes_in_latency() -> None:
    rs = [RequestResult(0, 0.0, None, 10, 5, outcome="ok", output_tokens=5, ttft_s=0.1, itl_mean_s=0.01, e2e_s=0.2),
          RequestResult(1, 1.0, None, 10, 5, outcome="ok", output_tokens=5, ttft_s=0.3, itl_mean_s=0.03, e2e_s=0.5),
          RequestResult(2, 1.5, None, 10, 5, outcome="http_503")]
    s = summarize(rs)
    assert s["outcomes"] == {"ok": 2, "http_503": 1}
    assert s["ttft_mean_ms"] == pytest.approx(200.0)
    assert s["itl_p99_ms"] == pytest.approx(30.0)
    assert s["duration_s"] == pytest.approx(1.5)
    assert s["request_rps"] == pytest.approx(2 / 1.5)


def test_prompt_length_rules() -> None:
    assert prompt_length({"prompt": "a b  c"}, chat=False) == 3
    assert prompt_length({"prompt": [1, 2, 3, 4]}, chat=False) == 4
    assert prompt_length({"prompt": "x", "prompt_tokens": 900}, chat=False) == 900
    assert prompt_length({"prompt": "x", "fleetplan": {"prompt_tokens": 12}}, chat=False) == 12
    assert prompt_length({"messages": [{"role": "user", "content": "one two"}]}, chat=True) == 6
    with pytest.raises(RequestError, match="prompt_tokens must be >= 1"):
        prompt_length({"prompt": "x", "prompt_tokens": 0}, chat=False)
    with pytest.raises(RequestError, match="messages"):
        prompt_length({}, chat=True)


def test_histogram_buckets() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    h = Hist((0.1, 1.0))
    h.observe(0.1)  # le semantics: 0.1 falls in the 0.1 bucket
    h.observe(0.5, 3)
    h.observe(7.0)
    assert h.cumulative() == [("0.1", 1.0), ("1.0", 4.0), ("+Inf", 5.0)]
    assert h.sum == pytest.approx(0.1 + 1.5 + 7.0)


def test_bench_result_has_the_vllm_bench_serve_fields(shared_data: Path) -> None:
    example = json.loads(next((shared_data / "benchmarks" / "vllm-bench-serve-example").glob("*.json")).read_text())
    rs = [RequestResult(i, 0.0, "m", 100, 10, outcome="ok", output_tokens=10, ttft_s=0.05, itl_mean_s=0.01,
                        e2e_s=0.14, itls_s=[0.01] * 9) for i in range(8)]
    doc = result_json(rs, duration_s=0.5, model="m", concurrency=4, meta={"engine": "vllm"})
    assert set(example) <= set(doc)
    assert doc["completed"] == 8 and doc["max_concurrency"] == 4 and doc["request_throughput"] == pytest.approx(16)
    assert doc["mean_itl_ms"] == pytest.approx(10.0) and doc["mean_ttft_ms"] == pytest.approx(50.0)


def test_bench_file_name_carries_the_metadata() -> None:
    from fleetplan.models.names import Engine, GpuType, Precision
    from fleetplan.models.readers import file_hints

    name = file_name("llama-3.1-8b", {"engine": "trtllm", "gpu": "h100", "tp": 2, "precision": "fp8"}, 467, 128, 16)
    hints = file_hints("/x/" + name)
    assert (hints.engine, hints.gpu, hints.tp, hints.precision) == (Engine.TRTLLM, GpuType.H100, 2, Precision.FP8)
    assert (hints.isl, hints.osl, hints.concurrency) == (467, 128, 16)


def test_model_placeholder_in_the_target_routes_each_request() -> None:
    from fleetplan.sim.replay import request_url

    assert request_url("http://127.0.0.1:8080/m/{model}", "/v1/completions", "llama 3/8b") == (
        "http://127.0.0.1:8080/m/llama%203%2F8b/v1/completions")
    assert request_url("http://127.0.0.1:8080", "/v1/completions", None) == "http://127.0.0.1:8080/v1/completions"
    with pytest.raises(ValueError, match="no model"):
        request_url("http://127.0.0.1:8080/m/{model}", "/v1/completions", None)
