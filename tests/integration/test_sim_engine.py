"""The simulated engine as a real HTTP server on a free loopback port."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.engine import EngineConfig, SimEngine
from fleetplan.sim.engine_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, buckets_1_2_5
from fleetplan.sim.replay import run_load, summarize

REPO = Path(__file__).resolve().parents[2]


async def _engine(persona: Engine, **kw: object) -> SimEngine:
    cfg = EngineConfig(persona=persona, model="llama-3.1-8b", gpu=GpuType.H100, tp=1,
                       time_scale=float(kw.pop("time_scale", 20.0)), startup_s=float(kw.pop("startup_s", 0.0)),
                       **kw)  # type: ignore[arg-type]
    e = SimEngine(cfg)
    await e.start("127.0.0.1", 0)
    return e


@pytest.fixture
async def vllm_engine() -> AsyncIterator[SimEngine]:
    e = await _engine(Engine.VLLM)
    yield e
    await e.stop()


@pytest.fixture
async def trt_engine() -> AsyncIterator[SimEngine]:
    e = await _engine(Engine.TRTLLM)
    yield e
    await e.stop()


def _url(e: SimEngine, path: str) -> str:
    return f"http://127.0.0.1:{e.port}{path}"


async def _sse(session: aiohttp.ClientSession, url: str, body: dict) -> list[dict]:
    chunks = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.strip()
            if not line:
                continue
            assert line.startswith(b"data: ")
            if line == b"data: [DONE]":
                chunks.append({"done": True})
                break
            chunks.append(json.loads(line[6:]))
    return chunks


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_streaming_completion_and_chat(vllm_engine: SimEngine) -> None:
    async with aiohttp.ClientSession() as s:
        chunks = await _sse(s, _url(vllm_engine, "/v1/completions"), {
            "model": "llama-3.1-8b", "prompt": "a b c", "prompt_tokens": 300, "max_tokens": 40,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        })
        assert chunks[-1] == {"done": True}
        usage = chunks[-2]
        assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 300, "completion_tokens": 40,
                                                            "total_tokens": 340}
        token_chunks = chunks[:-2]
        assert sum(c["n_tokens"] for c in token_chunks) == 40
        assert all(c["object"] == "text_completion" for c in token_chunks)
        assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])

        chat = await _sse(s, _url(vllm_engine, "/v1/chat/completions"), {
            "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 12,
            "ignore_eos": True, "stream": True,
        })
        assert chat[0]["object"] == "chat.completion.chunk"
        assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
        assert sum(c.get("n_tokens", 0) for c in chat) == 12

        # not streaming; natural stop with min_tokens honoured
        async with s.post(_url(vllm_engine, "/v1/completions"),
                          json={"prompt": "hello there", "max_tokens": 500, "min_tokens": 20}) as resp:
            body = await resp.json()
        assert resp.status == 200
        assert body["usage"]["prompt_tokens"] == 2
        assert 20 <= body["usage"]["completion_tokens"] <= 500
        assert len(body["choices"][0]["text"].split()) == body["usage"]["completion_tokens"]

        async with s.get(_url(vllm_engine, "/v1/models")) as resp:
            assert (await resp.json())["data"][0]["id"] == "llama-3.1-8b"


async def test_bad_requests_are_clear_errors(vllm_engine: SimEngine) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(_url(vllm_engine, "/v1/completions"), json={"model": "gpt-9", "prompt": "x"}) as resp:
            assert resp.status == 404
            assert "gpt-9" in (await resp.json())["message"]
        async with s.post(_url(vllm_engine, "/v1/completions"),
                          json={"prompt": "x", "prompt_tokens": 200_000, "max_tokens": 10}) as resp:
            assert resp.status == 400
            assert "maximum context length" in (await resp.json())["message"]
        async with s.post(_url(vllm_engine, "/v1/completions"), data=b"{not json") as resp:
            assert resp.status == 400


async def test_health_is_503_while_starting() -> None:
    e = await _engine(Engine.TRTLLM, startup_s=4.0, time_scale=10.0)  # 0.4 s wall
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(_url(e, "/health")) as resp:
                assert resp.status == 503
            async with s.post(_url(e, "/v1/completions"), json={"prompt": "x"}) as resp:
                assert resp.status == 503
            for _ in range(100):
                await asyncio.sleep(0.05)
                async with s.get(_url(e, "/health")) as resp:
                    if resp.status == 200:
                        break
            assert resp.status == 200
    finally:
        await e.stop()


def test_trtllm_without_a_cached_engine_builds_first() -> None:
    cached = EngineConfig(Engine.TRTLLM, "llama-3.1-70b", GpuType.H100, 4)
    uncached = EngineConfig(Engine.TRTLLM, "llama-3.1-70b", GpuType.H100, 4, engine_cached=False)
    p = cached.params()
    assert uncached.startup_sim_s(p) > cached.startup_sim_s(p) + 600  # a build takes tens of minutes


async def test_metrics_names_labels_buckets_and_counts(vllm_engine: SimEngine) -> None:
    reqs = [(i * 0.05, 400, 30) for i in range(30)]
    results = await run_load(reqs, f"http://127.0.0.1:{vllm_engine.port}", speed=20.0, model="llama-3.1-8b")
    summary = summarize(results)
    assert summary["ok"] == 30, summary
    async with aiohttp.ClientSession() as s, s.get(_url(vllm_engine, "/metrics")) as resp:
        text = await resp.text()
    fams = _families(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:request_queue_time_seconds", "vllm:num_preemptions"):
        assert name in fams, name
    ttft = fams["vllm:time_to_first_token_seconds"]
    labels = {tuple(sorted(smp.labels.items())) for smp in ttft.samples}
    assert all(dict(lab)["model_name"] == "llama-3.1-8b" and dict(lab)["engine"] == "0" for lab in labels)

    def edges(fam_name: str) -> list[float]:
        return [float(smp.labels["le"]) for smp in fams[fam_name].samples
                if smp.name.endswith("_bucket") and smp.labels["le"] != "+Inf"]

    assert edges("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert edges("vllm:inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert edges("vllm:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)

    def value(name: str, **lab: str) -> float:
        return sum(smp.value for f in fams.values() for smp in f.samples
                   if smp.name == name and all(smp.labels.get(k) == v for k, v in lab.items()))

    assert value("vllm:request_success_total", finished_reason="length") == 30
    assert value("vllm:prompt_tokens_total") == 30 * 400
    assert value("vllm:generation_tokens_total") == 30 * 30
    assert value("vllm:time_to_first_token_seconds_count") == 30
    assert value("vllm:inter_token_latency_seconds_count") == 30 * 29
    # simulated seconds: an 8B model on an H100 decodes a light batch in ~6-15 ms per token
    itl_mean = value("vllm:inter_token_latency_seconds_sum") / value("vllm:inter_token_latency_seconds_count")
    assert 0.005 < itl_mean < 0.015
    assert value("vllm:num_requests_running") == 0
    # the client reads the engine's clock: its TTFT and e2e are the engine's own observations
    ttft_engine = value("vllm:time_to_first_token_seconds_sum") / 30
    ttft_client = sum(r.ttft_s or 0.0 for r in results) / 30
    assert ttft_client == pytest.approx(ttft_engine, rel=1e-6)
    e2e_engine = value("vllm:e2e_request_latency_seconds_sum") / 30
    assert sum(r.e2e_s or 0.0 for r in results) / 30 == pytest.approx(e2e_engine, rel=1e-6)


async def test_length_and_per_request_tpot_histograms_as_vllm_exports_them(vllm_engine: SimEngine) -> None:
    """What planner/evidence.py reads: vllm:request_prompt_tokens / request_generation_tokens are
    histograms with build_1_2_5_buckets(max_model_len) edges, vllm:request_time_per_output_token_seconds
    one observation per request (vllm/v1/metrics/loggers.py)."""
    reqs = [(i * 0.05, 400 if i % 4 else 3000, 30) for i in range(20)]
    results = await run_load(reqs, f"http://127.0.0.1:{vllm_engine.port}", speed=20.0, model="llama-3.1-8b")
    assert all(r.outcome == "ok" for r in results)
    async with aiohttp.ClientSession() as s, s.get(_url(vllm_engine, "/metrics")) as resp:
        fams = _families(await resp.text())
    max_len = vllm_engine.params.max_model_len
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_time_per_output_token_seconds"):
        assert fams[name].type == "histogram", name

    def buckets(name: str) -> dict[str, float]:
        return {smp.labels["le"]: smp.value for smp in fams[name].samples if smp.name == name + "_bucket"}

    prompt = buckets("vllm:request_prompt_tokens")
    assert [float(le) for le in prompt if le != "+Inf"] == [float(b) for b in buckets_1_2_5(max_len)]
    assert prompt["500.0"] == 15 and prompt["5000.0"] == 20 and prompt["+Inf"] == 20
    gen = buckets("vllm:request_generation_tokens")
    assert gen["20.0"] == 0 and gen["50.0"] == 20
    tpot = buckets("vllm:request_time_per_output_token_seconds")
    assert [float(le) for le in tpot if le != "+Inf"] == list(ITL_BUCKETS)
    assert tpot["+Inf"] == 20  # per request, not per token gap (inter_token_latency has 20 x 29)
    assert sum(smp.value for smp in fams["vllm:inter_token_latency_seconds"].samples
               if smp.name == "vllm:inter_token_latency_seconds_count") == 20 * 29


async def test_trtllm_persona_exports_trtllm_names(trt_engine: SimEngine) -> None:
    results = await run_load([(0.0, 100, 10), (0.01, 100, 10)], f"http://127.0.0.1:{trt_engine.port}", speed=20.0)
    assert [r.outcome for r in results] == ["ok", "ok"]
    async with aiohttp.ClientSession() as s:
        async with s.get(_url(trt_engine, "/prometheus/metrics")) as resp:
            fams = _families(await resp.text())
        async with s.get(_url(trt_engine, "/metrics")) as resp:  # trtllm-serve: JSON iteration stats
            assert "numActiveRequests" in (await resp.json())[-1]
    for name in ("trtllm_request_success", "trtllm_e2e_request_latency_seconds", "trtllm_time_to_first_token_seconds",
                 "trtllm_time_per_output_token_seconds", "trtllm_request_queue_time_seconds",
                 "trtllm_kv_cache_utilization", "trtllm_num_requests_running", "trtllm_num_requests_waiting",
                 "trtllm_prompt_tokens", "trtllm_generation_tokens"):
        assert name in fams, name
    succ = [smp for smp in fams["trtllm_request_success"].samples if smp.name == "trtllm_request_success_total"]
    assert sum(smp.value for smp in succ) == 2
    # per request (tensorrt_llm/metrics/collector.py logs one TPOT per finished request)
    assert fams["trtllm_time_per_output_token_seconds"].type == "histogram"
    assert sum(smp.value for smp in fams["trtllm_time_per_output_token_seconds"].samples
               if smp.name == "trtllm_time_per_output_token_seconds_count") == 2
    # as trtllm-serve labels them (tests/integration/test_sim_engine_trtllm_metrics.py holds the whole set)
    assert all(smp.labels["engine_type"] == "undefined" and smp.labels["model_name"] == "undefined" for smp in succ)


async def test_coalesced_chunks_carry_their_token_count() -> None:
    e = await _engine(Engine.VLLM, time_scale=50.0, min_chunk_interval_ms=20.0)
    try:
        async with aiohttp.ClientSession() as s:
            chunks = await _sse(s, _url(e, "/v1/completions"), {
                "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True})
        token_chunks = [c for c in chunks if "n_tokens" in c]
        assert sum(c["n_tokens"] for c in token_chunks) == 200
        assert len(token_chunks) < 100  # coalesced: 200 steps of ~7 ms / 50 in far fewer 20 ms chunks
        times = [t for c in token_chunks for t in c.get("sim_token_times_s", [c["sim_time_s"]])]
        assert len(times) == 200 and times == sorted(times)
        assert all(c["sim_time_s"] == c.get("sim_token_times_s", [c["sim_time_s"]])[-1] for c in token_chunks)
        # the client rebuilds every inter-token gap from the engine's times: the engine's own ITL histogram
        (res,) = await run_load([(0.0, 50, 100)], f"http://127.0.0.1:{e.port}", speed=50.0, keep_itls=True)
        assert res.outcome == "ok" and res.itls_s is not None and len(res.itls_s) == 99
        engine_itl = e.stats.itl.sum / e.stats.itl.count  # over both requests: 199 + 99 gaps
        client_gaps = [b - a for a, b in itertools.pairwise(times)] + res.itls_s
        assert sum(client_gaps) / len(client_gaps) == pytest.approx(engine_itl, rel=1e-9)
    finally:
        await e.stop()


async def test_client_disconnect_frees_the_request(vllm_engine: SimEngine) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(_url(vllm_engine, "/v1/completions"), json={
                "prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}) as resp:
            await resp.content.readline()
    for _ in range(100):
        if vllm_engine.core.idle() and not vllm_engine.reqs:
            break
        await asyncio.sleep(0.02)
    assert vllm_engine.core.idle() and not vllm_engine.reqs
    assert vllm_engine.stats.success["abort"] == 1


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetplan", "sim-engine", "--persona", "vllm", "--model", "llama-3.1-8b",
         "--gpu", "h100", "--port", str(port), "--time-scale", "10", "--startup-s", "0", "--replica-id", "r1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "listening" in line, line

        async def scenario() -> tuple[int, int]:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}) as resp:
                    tokens = 0
                    async for raw in resp.content:
                        if raw.startswith(b"data: {"):
                            tokens += json.loads(raw[6:])["n_tokens"]
                            if tokens == 1:
                                proc.send_signal(signal.SIGTERM)
                                await asyncio.sleep(0.05)
                                async with s.get(f"http://127.0.0.1:{port}/health") as h:
                                    health = h.status
            return tokens, health

        tokens, health = asyncio.run(scenario())
        assert tokens == 150  # the in-flight request finished
        assert health == 503  # draining
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_cancelled_load_unwinds_and_the_engine_frees_its_requests(vllm_engine: SimEngine) -> None:
    load = asyncio.create_task(run_load([(0.0, 100, 5000)] * 5, f"http://127.0.0.1:{vllm_engine.port}",
                                        speed=20.0))
    for _ in range(100):
        if vllm_engine.core.num_running == 5:
            break
        await asyncio.sleep(0.02)
    assert vllm_engine.core.num_running == 5
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    for _ in range(100):
        if not vllm_engine.reqs:
            break
        await asyncio.sleep(0.02)
    assert not vllm_engine.reqs and vllm_engine.core.idle()
    assert vllm_engine.stats.success["abort"] == 5
