"""The simulated engines' prefix cache: LRU inside the KV memory, pinned blocks, hits skip prefill,
vLLM's counters (tokens), and the trace's single-replica reuse bound."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.batching import BatchCore
from fleetplan.sim.core import FastCore, replay_on_core
from fleetplan.sim.groundtruth import EngineParams, build_params
from fleetplan.sim.prefix_cache import PREFIX_BLOCK_TOKENS, PrefixCache, prompt_block_hashes
from fleetplan.sim.traces import TraceRequest, block_reuse_share, parse_trace_text, read_trace, reshape


def _params(kv_blocks: int | None = None, max_num_seqs: int | None = None) -> EngineParams:
    p = replace(build_params(Engine.VLLM, "llama-3.1-8b", GpuType.H100), noise_sigma=0.0)
    if kv_blocks is not None:
        p = replace(p, kv_blocks=kv_blocks)
    if max_num_seqs is not None:
        p = replace(p, max_num_seqs=max_num_seqs)
    return p


def test_cache_lru_pins_and_evicts_tail_first() -> None:
    pc = PrefixCache(kv_block_size=16)
    a = (1, 2, 3)
    pc.pin(a, 3 * 512)  # a request's prefill is done: its 3 blocks are cached, pinned
    assert pc.match((1, 2, 3, 4)) == 3 and pc.lru_blocks == 0
    pc.trim(0)  # pinned blocks are never evicted
    assert len(pc) == 3
    pc.unpin(a, 3)  # it finished: cached, evictable (32 KV blocks each)
    assert pc.lru_blocks == 96
    pc.trim(64)  # room for two: the tail (block 3) goes first
    assert pc.match(a) == 2 and 3 not in pc and pc.evicted == 1
    pc.pin((1, 9), 512 + 100)  # a hit on block 1 pins it; block 9 (100 tokens) is new
    assert pc.lru_blocks == 32 and pc.match((1, 9)) == 2
    pc.trim(0)
    assert pc.match(a) == 1  # block 2 (unpinned) evicted, block 1 pinned stays


def test_hit_is_whole_kv_blocks_below_the_last_token() -> None:
    pc = PrefixCache(kv_block_size=16)
    pc.pin((7, 8), 1024)
    # the same 1024-token prompt: vLLM recomputes the last token, in whole blocks: 1008 cached
    assert pc.hit_tokens((7, 8), 1024, 1024) == (1008, 2)
    assert pc.hit_tokens((7, 8, 9), 2000, 2000) == (1024, 2)
    assert pc.hit_tokens((6, 8), 1024, 1024) == (0, 0)  # chained: another first block, no hit


def test_prompt_block_hashes_are_chained() -> None:
    base = list(range(1000, 1000 + 1100))
    h1 = prompt_block_hashes(base)
    assert len(h1) == 3  # 512 + 512 + 76
    h2 = prompt_block_hashes(base[:1024] + [5] * 300)
    assert h2[:2] == h1[:2] and h2[2] != h1[2]
    h3 = prompt_block_hashes([1, *base[1:]])
    assert not set(h3) & set(h1)  # a different first block changes every later hash
    assert prompt_block_hashes("a b c".split()) == prompt_block_hashes("a b c".split())
    assert all(h >= 0 for h in h1)


def test_no_blocks_is_the_old_core() -> None:
    p = _params()
    arr = [(0.1 * i, 3000, 50) for i in range(30)]
    core = FastCore(p)
    ttft, tpot = replay_on_core(p, arr, core=core)
    ref_ttft, ref_tpot = replay_on_core(p, arr)
    assert core.prefix is None and core.prefix_queries_tokens == 0 == core.prefix_hit_tokens
    np.testing.assert_array_equal(ttft, ref_ttft)
    np.testing.assert_array_equal(tpot, ref_tpot)


def test_repeated_prompt_hits_and_skips_prefill() -> None:
    p = _params()
    blocks = tuple(range(16))  # 8000 tokens: 15 full blocks + 320
    arr = [(0.0, 8000, 20, blocks), (5.0, 8000, 20, blocks), (10.0, 8000, 20, (99, *blocks[1:]))]
    core = FastCore(p)
    ttft, _ = replay_on_core(p, arr, core=core)
    assert core.prefix_queries_tokens == 3 * 8000
    assert core.prefix_hit_tokens == 7984  # the second: all but the last KV block; the third: nothing
    assert ttft[1] < 0.2 * ttft[0]  # 16 tokens of prefill instead of 8000
    assert ttft[2] == pytest.approx(ttft[0], rel=0.05)
    assert core.prefix_hit_rate == pytest.approx(7984 / 24000)


def test_conversation_turns_hit_their_prefix() -> None:
    p = _params()
    turn1 = (0, 1, 2)  # 1500 tokens
    turn2 = (0, 1, 2, 3, 4)  # 2500 tokens: the first 3 blocks are turn 1's (chained ids), 1024 of them full
    core = FastCore(p)
    replay_on_core(p, [(0.0, 1500, 10, turn1), (3.0, 2500, 10, turn2)], core=core)
    # turn 1's third block is partial (476 tokens) and turn 2's third block shares its id: the
    # trace says equal ids are equal prefixes, so 1500 tokens are cached
    assert core.prefix_hit_tokens == 1500


def test_cache_bounded_by_kv_memory() -> None:
    p = _params(kv_blocks=1200)  # 19200 tokens of KV: room for ~2 prompts of 8000
    core = FastCore(p)
    reqs = [(float(i), 8000, 10, tuple(range(100 * i, 100 * i + 16))) for i in range(6)]
    reqs.append((10.0, 8000, 10, tuple(range(0, 16))))  # the first prompt again: evicted long ago
    reqs.append((11.0, 8000, 10, tuple(range(500, 516))))  # the last one: still cached
    replay_on_core(p, reqs, core=core)
    pc = core.prefix
    assert pc is not None
    assert core.prefix_hit_tokens == 7984
    assert pc.lru_blocks <= core.free_blocks and pc.evicted > 0
    assert core.free_blocks == p.kv_blocks  # everything finished


def test_pinned_blocks_survive_pressure_and_preemption_unpins() -> None:
    p = _params(kv_blocks=800, max_num_seqs=8)  # 12800 tokens: three prompts of 4000 then grow past it
    core = BatchCore(p)
    for i in range(4):
        core.submit(f"r{i}", 4000, 400, 0.0, blocks=tuple(range(10 * i, 10 * i + 8)))
    now = 0.0
    while not core.idle():
        pc = core.prefix
        assert pc is not None
        assert pc.lru_blocks <= core.free_blocks
        for s in core.running:  # a running request that finished its prefill pins its blocks
            if s.emitted > 0 and s.hashes is not None:
                assert s.pinned == len(s.hashes) and pc.match(s.hashes) == len(s.hashes)
        now += core.step(now).duration_s
    assert core.preemptions > 0  # the pool was too small for all four: recompute
    assert core.prefix is not None and core.prefix.pinned_count == 0


def test_trtllm_persona_hits_too() -> None:
    p = replace(build_params(Engine.TRTLLM, "llama-3.1-8b", GpuType.H100), noise_sigma=0.0)
    core = FastCore(p)
    b = tuple(range(4))
    replay_on_core(p, [(0.0, 2000, 5, b), (2.0, 2000, 5, b)], core=core)
    assert core.prefix_hit_tokens == 1984


def test_trace_keeps_hash_ids_and_reuse_bound() -> None:
    text = "\n".join([
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}',
        '{"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]}',
        '{"timestamp": 30, "input_length": 600, "output_length": 5}',
    ])
    tr = parse_trace_text(text, "t.jsonl")
    assert tr.requests[1].blocks == (0, 1, 2) and tr.requests[3].blocks is None
    assert block_reuse_share(tr.requests) == pytest.approx(3 / 7)
    assert block_reuse_share([TraceRequest(0.0, 10, 10)]) is None
    assert tr.summary()["block_reuse_share"] == pytest.approx(3 / 7, abs=1e-4)


def test_bad_hash_ids_named() -> None:
    with pytest.raises(ValueError, match="hash_ids"):
        parse_trace_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1, "x"]}', "t")


def test_tiled_copies_are_new_conversations() -> None:
    reqs = tuple(TraceRequest(float(i), 600, 5, blocks=(0, 10 + i)) for i in range(200))
    tr = replace(parse_trace_text('{"timestamp": 0, "input_length": 1, "output_length": 1}', "t"), requests=reqs)
    tiled = reshape(tr, duration_s=200.0, rate_scale=3.0)
    ids = [b for r in tiled.requests for b in (r.blocks or ())]
    assert ids.count(0) == len(tiled.requests)  # the shared first block stays shared
    assert len(set(ids)) == 1 + len(tiled.requests)  # each request's second block is its own
    assert block_reuse_share(tiled.requests) == pytest.approx(block_reuse_share(tr.requests), abs=0.01)


def test_mooncake_conversation_bound_is_36_6_percent(shared_data: Path) -> None:
    tr = read_trace(shared_data / "traces" / "mooncake_conversation.jsonl")  # the repository's data/
    assert all(r.blocks is not None and len(r.blocks) == -(-r.prompt_tokens // PREFIX_BLOCK_TOKENS)
               for r in tr.requests)
    assert block_reuse_share(tr.requests) == pytest.approx(0.366, abs=0.0005)
