"""The one step rule of continuous batching (fleetplan.sim.batching.plan_step), shared by the
sim-engine's BatchCore and the replay's FastCore: composition of a step, limits, KV, eviction."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.batching import BatchState, Seq, StepRule, admission, plan_step
from fleetplan.sim.groundtruth import build_params

BS = 16  # block size of every rule below


def _rule(*, seqs: int = 8, budget: int = 100, chunked: bool = True, reserve: bool = False) -> StepRule:
    return StepRule(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=BS, chunked_prefill=chunked,
                    reserve_full_kv=reserve)


def _decoding(key: str, prompt: int, emitted: int, max_tokens: int = 100) -> Seq[str]:
    """A running request that has emitted `emitted` tokens and holds the blocks for what it computed."""
    s = Seq(key, prompt, max_tokens)
    s.emitted = emitted
    s.computed = prompt + emitted - 1
    s.target = prompt + emitted
    s.blocks = -(-s.computed // BS)
    return s


def _state(s: Seq[str]) -> tuple[int, int, int, int]:
    return s.computed, s.emitted, s.target, s.blocks


def test_running_decodes_first_then_the_queue_head_gets_a_prefill_chunk_within_the_budget() -> None:
    a, b = _decoding("a", 40, 3), _decoding("b", 20, 1)
    w1, w2 = Seq("w1", 300, 10), Seq("w2", 5, 10)
    plan = plan_step(_rule(budget=100), [a, b], [w1, w2], free_blocks=1000)
    assert [(s.key, n) for s, n in plan.chunks] == [("a", 1), ("b", 1), ("w1", 98)]
    assert plan.admitted == 1  # the budget is spent: w2 waits
    assert (plan.decode_seqs, plan.prefill_tokens, plan.context_tokens) == (2, 98, a.computed + b.computed)
    assert plan.attn_pairs == 98 * 49.0
    assert plan.preempted == []
    # only w1's holding changes (98 tokens: 7 blocks); a's and b's next tokens fit their blocks
    assert [(s.key, h) for s, h in plan.grants] == [("w1", 7)]
    assert plan.free_blocks == 1000 - 7


def test_a_prefill_in_progress_continues_and_a_decode_left_without_budget_waits() -> None:
    p = Seq("p", 250, 5)
    p.computed, p.blocks = 100, 7  # chunked: 100 of 250 prompt tokens computed
    d = _decoding("d", 10, 2)
    plan = plan_step(_rule(budget=100), [p, d], [], free_blocks=1000)
    assert [(s.key, n) for s, n in plan.chunks] == [("p", 100)]  # in admission order; d gets nothing
    assert plan.prefill_tokens == 100 and plan.decode_seqs == 0


def test_without_chunked_prefill_a_long_prompt_blocks_the_queue() -> None:
    plan = plan_step(_rule(budget=100, chunked=False), [_decoding("a", 10, 1)], [Seq("long", 150, 5), Seq("s", 5, 5)],
                     free_blocks=1000)
    assert [s.key for s, _n in plan.chunks] == ["a"]  # FIFO: "s" does not overtake "long"
    assert plan.admitted == 0


def test_the_batch_never_exceeds_max_num_seqs() -> None:
    running = [_decoding(f"r{i}", 10, 1) for i in range(3)]
    plan = plan_step(_rule(seqs=4, budget=1000), running, [Seq(f"w{i}", 5, 5) for i in range(5)], free_blocks=1000)
    assert plan.admitted == 1 and len(plan.chunks) == 4


def test_grow_mode_admits_the_blocks_of_the_chunk_reserve_mode_those_of_the_whole_request() -> None:
    w = Seq("w", 40, 200)  # 40 tokens: 3 blocks; 240 tokens: 15 blocks
    assert admission(_rule(), w, 100, 3) == (40, 3)
    assert admission(_rule(), w, 100, 2) is None
    assert admission(_rule(reserve=True), w, 100, 15) == (40, 15)
    assert admission(_rule(reserve=True), w, 100, 14) is None
    plan = plan_step(_rule(reserve=True), [], [w, Seq("x", 10, 10)], free_blocks=16)
    assert plan.admitted == 1 and plan.free_blocks == 1  # x needs 2 blocks


def test_an_exhausted_pool_evicts_the_most_recent_requests_which_rejoin_first_in_admission_order() -> None:
    # a and b each need one more block for their next token; c and d (admitted last) hold 2 each
    a, b = _decoding("a", 16, 1), _decoding("b", 32, 1)
    c, d = _decoding("c", 20, 2), _decoding("d", 20, 2)
    queued = Seq("w", 8, 4)
    before = [_state(s) for s in (a, b, c, d, queued)]
    plan = plan_step(_rule(budget=100), [a, b, c, d], [queued], free_blocks=0)
    # a evicts d (2 blocks free), a and b take one each, c runs; the queue is then d, w: d's
    # recompute (22 tokens, 2 blocks) does not fit, so nothing joins
    assert plan.preempted == [d]
    assert [(s.key, n) for s, n in plan.chunks] == [("a", 1), ("b", 1), ("c", 1)]
    assert plan.admitted == 0 and plan.free_blocks == 0
    assert [_state(s) for s in (a, b, c, d, queued)] == before  # pure: nothing changed


def test_a_request_that_evicts_itself_ends_the_running_phase() -> None:
    a = Seq("a", 40, 5)
    a.computed, a.blocks = 10, 1  # its next chunk (30 tokens) needs 2 more blocks
    b = _decoding("b", 10, 1)  # 1 block
    plan = plan_step(_rule(), [a, b], [], free_blocks=0)
    assert plan.preempted == [b, a] and plan.chunks == []  # b's block is not enough: a evicts itself
    # back in the queue, a (first) would recompute its 40 tokens: 3 blocks, only 2 are free
    assert plan.admitted == 0 and plan.free_blocks == 2
    assert admission(_rule(), a, 100, 2, requeued=True) is None
    assert admission(_rule(), a, 100, 3, requeued=True) == (40, 3)
    assert (a.computed, a.blocks) == (10, 1)


def test_evicted_requests_rejoin_first_in_admission_order() -> None:
    a = Seq("a", 200, 10)
    a.computed, a.blocks = 100, 7  # its next prefill chunk (100 tokens) needs 6 more blocks
    c, d = _decoding("c", 60, 1), _decoding("d", 60, 1)  # 4 blocks each; d admitted last
    plan = plan_step(_rule(budget=120), [a, c, d], [Seq("w", 5, 5)], free_blocks=0)
    assert plan.preempted == [d, c]  # d first, then c: 8 blocks free, a takes 6
    # the queue is c, d, w: c (admitted before d) rejoins with the 20 tokens left in the budget
    assert [(s.key, n) for s, n in plan.chunks] == [("a", 100), ("c", 20)]
    assert plan.admitted == 1
    assert [(s.key, h) for s, h in plan.grants] == [("a", 13), ("c", 2)] and plan.free_blocks == 0
    assert (plan.prefill_tokens, plan.attn_pairs) == (120, 100 * 150.0 + 20 * 10.0)


def test_schedule_applies_the_plan_to_the_batch_and_the_queue() -> None:
    state: BatchState[str] = BatchState(build_params(Engine.VLLM, "llama-3-8b", GpuType.H100, 1))
    state.rule = _rule(budget=120)
    a = Seq("a", 200, 10)
    a.computed, a.blocks = 100, 7
    c, d, w = _decoding("c", 60, 1), _decoding("d", 60, 1), Seq("w", 5, 5)
    state.running, state.waiting, state.free_blocks = [a, c, d], deque([w]), 0
    plan = state.schedule()
    assert state.running == [a, c] and list(state.waiting) == [d, w]
    assert (a.blocks, c.blocks, c.computed, c.target) == (13, 2, 0, 61)  # c recomputes prompt + 1 token
    assert (d.blocks, d.computed, d.target) == (0, 0, 61)
    assert state.free_blocks == plan.free_blocks == 0 and state.preemptions == 2
    _first, _finished, emitted = state.complete(plan)
    assert (a.computed, c.computed, emitted) == (200, 20, 1)  # a's prompt is done: its first token


def _seqs(draw: st.DrawFn, n: int, prefix: str, running: bool) -> list[Seq[str]]:
    out = []
    for i in range(n):
        prompt = draw(st.integers(1, 400))
        s = Seq(f"{prefix}{i}", prompt, draw(st.integers(1, 100)))
        if running:
            s.computed = draw(st.integers(0, prompt - 1)) if draw(st.booleans()) else prompt
            if s.computed == prompt:  # decoding
                s.emitted = draw(st.integers(1, max(1, s.max_tokens - 1)))
                s.target = prompt + s.emitted
                s.computed = s.target - 1
            s.blocks = -(-s.computed // BS)
        out.append(s)
    return out


@st.composite
def _worlds(draw: st.DrawFn) -> tuple[StepRule, list[Seq[str]], list[Seq[str]], int]:
    rule = _rule(seqs=draw(st.integers(1, 12)), budget=draw(st.integers(1, 600)), chunked=draw(st.booleans()),
                 reserve=draw(st.booleans()))
    running = _seqs(draw, draw(st.integers(0, rule.max_num_seqs)), "r", True)
    if rule.reserve_full_kv:
        for s in running:
            s.blocks = -(-(s.prompt + s.max_tokens) // BS)
    return rule, running, _seqs(draw, draw(st.integers(0, 8)), "w", False), draw(st.integers(0, 200))


@settings(max_examples=300, deadline=None)
@given(_worlds())
def test_any_plan_respects_the_budget_the_seats_and_the_pool_and_changes_nothing(
    world: tuple[StepRule, list[Seq[str]], list[Seq[str]], int],
) -> None:
    rule, running, waiting, free = world
    before = [_state(s) for s in running + waiting]
    plan = plan_step(rule, running, waiting, free)
    assert [_state(s) for s in running + waiting] == before
    assert sum(n for _s, n in plan.chunks) <= rule.max_num_batched_tokens
    assert plan.decode_seqs + plan.prefill_tokens == sum(n for _s, n in plan.chunks)
    assert all(n >= 1 for _s, n in plan.chunks)
    assert len(running) - len(plan.preempted) + plan.admitted <= max(rule.max_num_seqs, len(running))
    assert plan.free_blocks >= 0
    assert not (rule.reserve_full_kv and plan.preempted)  # reserved blocks are never taken back
    # blocks are conserved: what is free after = before + evicted holdings - growth of the holdings
    held = {s.key: s.blocks for s in running + waiting}
    for v in plan.preempted:
        held[v.key] = 0
    after = dict(held)
    for s, h in plan.grants:
        after[s.key] = h
    assert plan.free_blocks == free + sum(s.blocks for s in plan.preempted) - sum(after[k] - held[k] for k in held)
    # every chunk fits its blocks; a prefill chunk never passes its target
    for s, n in plan.chunks:
        requeued = s in plan.preempted
        computed = 0 if requeued else s.computed
        assert n <= (s.prompt + s.emitted if requeued else s.target) - computed
        if not rule.reserve_full_kv:
            assert after[s.key] * BS >= computed + n
    # the admitted are the head of the queue: evicted ones in admission order, then FIFO
    queue = list(reversed(plan.preempted)) + waiting
    assert [s for s, _n in plan.chunks[len(plan.chunks) - plan.admitted:]] == queue[:plan.admitted]
