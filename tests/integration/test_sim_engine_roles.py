"""The simulated engine as a prefill and as a decode instance of a disaggregated deployment."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.engine import EngineConfig, SimEngine

PROMPT = 4000


async def _engine(role: Role) -> SimEngine:
    cfg = EngineConfig(persona=Engine.VLLM, model="llama-3.1-8b", gpu=GpuType.H100, time_scale=20.0, startup_s=0.0,
                       role=role, noise_sigma=0.0)
    e = SimEngine(cfg)
    await e.start("127.0.0.1", 0)
    return e


async def _stream(s: aiohttp.ClientSession, e: SimEngine, body: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    """(the simulated arrival, the SSE chunks) of a streamed completion."""
    chunks = []
    async with s.post(f"http://127.0.0.1:{e.port}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        arrival = float(resp.headers["X-Sim-Arrival-S"])
        async for raw in resp.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                break
            if line:
                chunks.append(json.loads(line[6:]))
    return arrival, chunks


def _value(text: str, name: str) -> float:
    return sum(smp.value for f in text_string_to_metric_families(text) for smp in f.samples if smp.name == name)


async def test_prefill_answers_one_token_and_the_kv_params_a_decode_instance_takes() -> None:
    prefill, decode, agg = await _engine(Role.PREFILL), await _engine(Role.DECODE), await _engine(Role.AGGREGATED)
    try:
        body = {"model": "llama-3.1-8b", "prompt_tokens": PROMPT, "max_tokens": 32, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            leg = {**body, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
            async with s.post(f"http://127.0.0.1:{prefill.port}/v1/completions", json=leg) as resp:
                assert resp.status == 200
                first = await resp.json()
            assert first["usage"]["completion_tokens"] == 1
            kv = first["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["remote_port"] == prefill.port
            assert len(kv["remote_block_ids"]) == -(-PROMPT // prefill.params.block_size)
            # a prefill instance answers one token even when asked for more
            async with s.post(f"http://127.0.0.1:{prefill.port}/v1/completions", json=body) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 1

            arrival_d, chunks_d = await _stream(s, decode, {**body, "kv_transfer_params": kv})
            arrival_a, chunks_a = await _stream(s, agg, body)
            assert sum(c["n_tokens"] for c in chunks_d) == 32
            assert sum(c["n_tokens"] for c in chunks_a) == 32
            # simulated seconds: the decode instance skips the 4,000-token prefill, waits the transfer only
            ttft_d = chunks_d[0]["sim_first_token_s"] - arrival_d
            ttft_a = chunks_a[0]["sim_first_token_s"] - arrival_a
            assert ttft_d < ttft_a / 3, (ttft_d, ttft_a)
            # without kv_transfer_params a decode instance serves the request whole (as vLLM's kv_both)
            arrival_w, chunks_w = await _stream(s, decode, body)
            assert chunks_w[0]["sim_first_token_s"] - arrival_w > ttft_a / 2

            async with s.get(f"http://127.0.0.1:{prefill.port}/metrics") as resp:
                p_text = await resp.text()
            async with s.get(f"http://127.0.0.1:{decode.port}/metrics") as resp:
                d_text = await resp.text()
        assert _value(p_text, "vllm:request_success_total") == 2
        assert _value(p_text, "vllm:generation_tokens_total") == 2
        assert _value(d_text, "vllm:request_success_total") == 2
        assert _value(d_text, "vllm:generation_tokens_total") == 64
    finally:
        for e in (prefill, decode, agg):
            await e.stop()


async def test_malformed_kv_transfer_params_is_a_400() -> None:
    e = await _engine(Role.DECODE)
    try:
        async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{e.port}/v1/completions",
            json={"prompt_tokens": 10, "max_tokens": 4, "kv_transfer_params": "yes"},
        ) as resp:
            assert resp.status == 400
            assert "kv_transfer_params" in (await resp.json())["message"]
    finally:
        await e.stop()
