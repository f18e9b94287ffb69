"""The HTTP simulated engine's prefix cache: a repeated prompt prefix is a hit, counted as the real
engines count it (vLLM: vllm:prefix_cache_queries_total / _hits_total in tokens; TensorRT-LLM:
trtllm_prompt_cached_tokens_total per finished request)."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.engine import EngineConfig, SimEngine
from fleetplan.sim.engine_requests import prompt_blocks


async def _metrics(port: int, path: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}") as resp:
        text = await resp.text()
    return {smp.name: smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples}


async def _complete(port: int, body: dict[str, object]) -> dict[str, object]:
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out: dict[str, object] = await resp.json()
        return out


@pytest.mark.parametrize("persona", [Engine.VLLM, Engine.TRTLLM])
async def test_repeated_prefix_hits(persona: Engine) -> None:
    e = SimEngine(EngineConfig(persona=persona, model="llama-3.1-8b", gpu=GpuType.H100, time_scale=20.0,
                               startup_s=0.0))
    port = await e.start("127.0.0.1", 0)
    try:
        shared = [1000 + (i % 3000) for i in range(1536)]  # 3 blocks of 512
        for tail in ([7] * 100, [8] * 200):  # a conversation's two turns: the same 1536-token prefix
            await _complete(port, {"prompt": shared + tail, "max_tokens": 4, "ignore_eos": True})
        if persona is Engine.VLLM:
            m = await _metrics(port, "/metrics")
            assert m["vllm:prefix_cache_queries_total"] == 1636 + 1736
            assert m["vllm:prefix_cache_hits_total"] == 1536
        else:
            m = await _metrics(port, "/prometheus/metrics")
            assert m["trtllm_prompt_cached_tokens_total"] == 1536
            assert m["trtllm_prompt_tokens_total"] == 1636 + 1736
            assert m["trtllm_kv_cache_reused_blocks_total"] == 1536 // 16
            assert 0.4 < m["trtllm_kv_cache_hit_rate"] < 0.5
    finally:
        await e.stop()


async def test_hint_prompts_carry_block_hashes() -> None:
    e = SimEngine(EngineConfig(persona=Engine.VLLM, model="llama-3.1-8b", gpu=GpuType.H100, time_scale=20.0,
                               startup_s=0.0))
    port = await e.start("127.0.0.1", 0)
    try:
        for ids in ([0, 1, 2], [0, 1, 2, 3]):  # a trace's hash_ids with a prompt_tokens hint
            await _complete(port, {"prompt": "x", "prompt_tokens": 512 * len(ids), "max_tokens": 2,
                                     "ignore_eos": True, "fleetplan": {"block_hashes": ids}})
        await _complete(port, {"prompt": "x", "prompt_tokens": 4000, "max_tokens": 2, "ignore_eos": True})
        m = await _metrics(port, "/metrics")
        assert m["vllm:prefix_cache_hits_total"] == 1536
        assert m["vllm:prefix_cache_queries_total"] == 1536 + 2048 + 4000
    finally:
        await e.stop()


def test_prompt_blocks() -> None:
    assert prompt_blocks({"prompt": "x", "prompt_tokens": 900}, False) is None
    assert prompt_blocks({"prompt": [1, 2, 3]}, False) == prompt_blocks({"prompt": [[1, 2, 3]]}, False)
    words = prompt_blocks({"prompt": "hello " * 600}, False)
    assert words is not None and len(words) == 2
    chat = prompt_blocks({"messages": [{"role": "user", "content": "hi " * 700}]}, True)
    assert chat is not None and len(chat) == 2
    assert prompt_blocks({"prompt": "x", "block_hashes": [5, 6]}, False) == (5, 6)


async def test_replay_of_a_conversation_reproduces_its_reuse() -> None:
    from fleetplan.sim.replay import PromptStyle, run_load
    from fleetplan.sim.traces import TraceRequest

    e = SimEngine(EngineConfig(persona=Engine.VLLM, model="llama-3.1-8b", gpu=GpuType.H100, time_scale=20.0,
                               startup_s=0.0))
    port = await e.start("127.0.0.1", 0)
    try:
        turns = [TraceRequest(0.0, 1100, 4, None, (0, 1, 2)), TraceRequest(2.0, 2000, 4, None, (0, 1, 3, 4))]
        for style in (PromptStyle.TOKEN_IDS, PromptStyle.HINT):
            res = await run_load(turns, f"http://127.0.0.1:{port}", speed=20.0, prompts=style,
                                 prefix_salt=style.value)
            assert [r.outcome for r in res] == ["ok", "ok"]
        m = await _metrics(port, "/metrics")
        assert m["vllm:prefix_cache_hits_total"] == 2 * 1024  # turn 2 finds turn 1's two full blocks, twice
        res = await run_load(turns, f"http://127.0.0.1:{port}", speed=20.0, prompts=PromptStyle.TOKEN_IDS,
                             unique_prompts=True)
        assert (await _metrics(port, "/metrics"))["vllm:prefix_cache_hits_total"] == 2 * 1024
    finally:
        await e.stop()
