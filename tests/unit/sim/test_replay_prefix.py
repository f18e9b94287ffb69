"""replay-load's prompts reproduce a trace's prefix reuse: same block id, same 512 tokens."""

from __future__ import annotations

from fleetplan.sim.prefix_cache import prompt_block_hashes
from fleetplan.sim.replay import LoadRequest, PromptStyle, _as_load_request, request_body, request_prompt
from fleetplan.sim.traces import TraceRequest


def test_shared_blocks_share_tokens() -> None:
    a = LoadRequest(0.0, 1200, 5, blocks=(0, 1, 2))
    b = LoadRequest(1.0, 1800, 5, blocks=(0, 1, 7, 8))
    pa = request_prompt(a, PromptStyle.TOKEN_IDS, seed=0)
    pb = request_prompt(b, PromptStyle.TOKEN_IDS, seed=1)
    assert isinstance(pa, list) and isinstance(pb, list)
    assert len(pa) == 1200 and len(pb) == 1800
    assert pa[:1024] == pb[:1024] and pa[1024:1100] != pb[1024:1100]
    ha, hb = prompt_block_hashes(pa), prompt_block_hashes(pb)  # what a server's cache hashes
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    wa = request_prompt(a, PromptStyle.WORDS, seed=0)
    wb = request_prompt(b, PromptStyle.WORDS, seed=1)
    assert isinstance(wa, str) and isinstance(wb, str)
    assert wa.split()[:1024] == wb.split()[:1024] and len(wb.split()) == 1800


def test_unique_and_salted_and_short_blocks() -> None:
    a = LoadRequest(0.0, 600, 5, blocks=(0, 1))
    assert request_prompt(a, PromptStyle.TOKEN_IDS, 0, unique=True) != request_prompt(a, PromptStyle.TOKEN_IDS, 1,
                                                                                       unique=True)
    assert request_prompt(a, PromptStyle.TOKEN_IDS, 0) == request_prompt(a, PromptStyle.TOKEN_IDS, 1)
    assert request_prompt(a, PromptStyle.TOKEN_IDS, 0, salt="x") != request_prompt(a, PromptStyle.TOKEN_IDS, 0)
    longer = LoadRequest(0.0, 1500, 5, blocks=(0,))  # fewer ids than the prompt needs: the rest is its own
    p = request_prompt(longer, PromptStyle.TOKEN_IDS, 3)
    assert isinstance(p, list) and len(p) == 1500


def test_hint_bodies_carry_the_ids() -> None:
    a = LoadRequest(0.0, 600, 5, blocks=(0, 1))
    body = request_body(a, "m", PromptStyle.HINT)
    assert body["prompt_tokens"] == 600 and body["block_hashes"] == [0, 1]
    assert "block_hashes" not in request_body(a, "m", PromptStyle.HINT, unique=True)
    assert request_body(a, "m", PromptStyle.HINT, salt="s")["block_hashes"] != [0, 1]
    assert "block_hashes" not in request_body(a, "m", PromptStyle.TOKEN_IDS)


def test_trace_requests_keep_blocks() -> None:
    assert _as_load_request(TraceRequest(1.0, 600, 5, None, (3, 4))).blocks == (3, 4)
    assert _as_load_request((1.0, 600, 5, None, [3, 4])).blocks == (3, 4)
    assert _as_load_request((1.0, 600, 5)).blocks is None
