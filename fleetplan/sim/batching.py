"""The simulator's continuous-batching core: one pure step rule and the two cores that apply it.

`BatchCore` has no clock: the caller (the sim-engine server, the capacity search in
`fleetplan.sim.capacity_truth`) passes `now_s` and advances time by each step's `duration_s`. It and
the discrete-event replay's `fleetplan.sim.core.FastCore` are both a `BatchState`, whose steps are
decided by ONE pure rule, `plan_step` (which requests run, how many tokens each, which join, which
are evicted); the step's duration is `fleetplan.sim.groundtruth.step_time_s` (`step_time_fn`).

One step (vLLM v1 scheduler, simplified):
  1. running requests first, in admission order: a request still in prefill takes a chunk of its
     remaining prompt (chunked prefill) within the token budget `max_num_batched_tokens`; a
     decoding request takes one token. KV blocks are allocated as tokens are computed; when the
     pool is exhausted the most recently admitted request is preempted (recompute) - persona vllm.
     Persona trtllm reserves blocks for prompt + max_tokens at admission (no eviction).
  2. waiting requests (FIFO) are admitted while the batch has fewer than `max_num_seqs`
     requests, tokens are left in the budget and the KV pool has room.
  3. the step's duration is the roofline step time times a lognormal noise factor; every
     request whose prompt is fully computed emits one token (its first token when prefill ends).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError, step_time_fn
from fleetplan.sim.prefix_cache import PREFIX_BLOCK_TOKENS, PrefixCache

# -- the step rule -------------------------------------------------------------------------------
# One rule decides every step's composition, for the sim-engine server (BatchCore) and the
# discrete-event replay (fleetplan.sim.core.FastCore): `plan_step` is pure, `BatchState.schedule`
# applies its plan, so the two cores cannot drift apart.

K = TypeVar("K")  # a request's key: the server's request id (str), the replay's trace index (int)


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


class Seq(Generic[K]):
    """One request's progress through an engine (mutable; only BatchState and FastCore change it)."""

    __slots__ = ("blocks", "computed", "emitted", "hashes", "key", "looked", "max_tokens", "pinned", "prompt",
                 "target")

    def __init__(self, key: K, prompt: int, max_tokens: int, hashes: Sequence[int] | None = None) -> None:
        self.key = key
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.computed = 0  # tokens whose KV is computed (prompt, then prompt + generated - 1)
        self.emitted = 0  # output tokens emitted
        self.target = prompt  # tokens that must be computed before the next token is emitted
        self.blocks = 0  # KV blocks held
        # prefix cache (fleetplan.sim.prefix_cache): the prompt's block hashes (None: not cacheable),
        # the leading ones this request pins, the cache epoch of its last lookup while waiting
        self.hashes = hashes
        self.pinned = 0
        self.looked = -1


@dataclass(frozen=True)
class StepRule:
    """The limits the scheduler works within (vLLM's max_num_seqs, max_num_batched_tokens, ...)."""

    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of one step
    block_size: int
    chunked_prefill: bool  # False: a prompt that does not fit the remaining budget waits
    reserve_full_kv: bool  # True: blocks for prompt + max_tokens at admission, never preempted

    @classmethod
    def of(cls, params: EngineParams) -> StepRule:
        return cls(params.max_num_seqs, params.max_num_batched_tokens, params.block_size,
                   params.chunked_prefill, params.factors.reserve_full_kv)


class StepPlan(NamedTuple, Generic[K]):
    """What one step computes, as decided by plan_step (nothing is changed until it is applied).

    Immutable like a frozen dataclass, but a tuple: one is made per simulated step and the replay
    makes millions (a frozen dataclass costs ~2 us to build, more than the rest of a small step)."""

    # (request, tokens computed this step): the running requests first in admission order, then
    # the admitted ones in queue order
    chunks: Sequence[tuple[Seq[K], int]]
    # (request, KV blocks it holds after the step) for every request whose holding changes
    grants: Sequence[tuple[Seq[K], int]]
    # running requests evicted to recompute later, most recently admitted first; they go back
    # to the head of the queue in admission order
    preempted: Sequence[Seq[K]]
    admitted: int  # requests taken from the head of the queue (the last `admitted` chunks)
    free_blocks: int  # KV blocks free after the step's allocation
    decode_seqs: int
    prefill_tokens: int
    context_tokens: int  # KV tokens read by the decoding requests
    attn_pairs: float  # query x key pairs of the prefill chunks


def admission(rule: StepRule, s: Seq[K], budget: int, free_blocks: int, *,
              requeued: bool = False) -> tuple[int, int] | None:
    """(tokens, blocks held after) when queued request `s` can join a step with `budget` tokens
    and `free_blocks` left, else None. requeued: `s` is running now but is evicted in this step,
    so it re-enters as a recompute of prompt + emitted tokens holding no blocks."""
    computed, blocks = (0, 0) if requeued else (s.computed, s.blocks)
    need = (s.prompt + s.emitted if requeued else s.target) - computed
    n = need if need <= budget else (budget if rule.chunked_prefill else 0)
    if n <= 0:
        return None
    bs = rule.block_size
    held = blocks_for(s.prompt + s.max_tokens, bs) if rule.reserve_full_kv else blocks_for(computed + n, bs)
    if held - blocks > free_blocks:
        return None
    return n, held


def plan_step(rule: StepRule, running: Sequence[Seq[K]], waiting: Sequence[Seq[K]], free_blocks: int) -> StepPlan[K]:
    """One step of continuous batching (vLLM v1's scheduler, simplified); pure.

    1. running requests in admission order: one still in prefill takes a chunk of its remaining
       prompt within the token budget (chunked prefill), a decoding one takes one token. KV
       blocks grow with the computed tokens; when the pool is exhausted the most recently
       admitted request is evicted (recompute), possibly the request itself, which ends phase 1.
    2. queued requests (evicted ones first, then FIFO) join while the batch has fewer than
       max_num_seqs requests, tokens are left in the budget and the KV pool has room.
    """
    budget = rule.max_num_batched_tokens
    bs = rule.block_size
    chunked = rule.chunked_prefill
    grow = not rule.reserve_full_kv
    free = free_blocks
    chunks: list[tuple[Seq[K], int]] = []
    grants: list[tuple[Seq[K], int]] = []
    preempted: list[Seq[K]] = []
    decode_seqs = prefill_tokens = context = 0
    attn_pairs = 0.0
    end = len(running)  # running[end:] are evicted
    i = 0
    while i < end and budget > 0:
        r = running[i]
        i += 1
        need = r.target - r.computed  # > 1 only while (re)prefilling
        n = need if need <= budget else (budget if chunked else 0)
        if n <= 0:
            continue
        if grow:
            extra = -(-(r.computed + n) // bs) - r.blocks
            if extra > 0:
                while extra > free and end >= i:
                    end -= 1
                    victim = running[end]
                    free += victim.blocks
                    preempted.append(victim)
                if end < i:  # evicted itself: nothing after it runs
                    break
                free -= extra
                grants.append((r, r.blocks + extra))
        chunks.append((r, n))
        budget -= n
        if need == 1 and r.emitted > 0:
            decode_seqs += 1
            context += r.computed
        else:
            prefill_tokens += n
            attn_pairs += n * (r.computed + n / 2.0)
    admitted, free, prefill_tokens, attn_pairs = admit(rule, preempted, waiting, rule.max_num_seqs - end, budget,
                                                       free, chunks, grants, prefill_tokens, attn_pairs)
    # the lists are not copied into tuples (per-step cost); nothing keeps a reference to them
    return StepPlan(chunks, grants, preempted, admitted, free, decode_seqs, prefill_tokens, context, attn_pairs)


def admit(rule: StepRule, preempted: Sequence[Seq[K]], waiting: Sequence[Seq[K]], seats: int, budget: int,
          free: int, chunks: list[tuple[Seq[K], int]], grants: list[tuple[Seq[K], int]], prefill_tokens: int,
          attn_pairs: float) -> tuple[int, int, int, float]:
    """plan_step's phase 2: queued requests (`preempted` reversed, then `waiting`) join while there are
    `seats`, `budget` tokens and `free` KV blocks; their chunks and grants are appended. Returns
    (admitted, free blocks left, prefill_tokens, attn_pairs), the last two carried on from the
    values given (the same float additions in the same order as one loop over the whole step)."""
    admitted = 0
    queue_len = len(preempted) + len(waiting)
    while admitted < queue_len and budget > 0 and admitted < seats:
        k = len(preempted) - 1 - admitted  # the queue: evicted ones (reversed), then waiting
        requeued = k >= 0
        s = preempted[k] if requeued else waiting[-k - 1]
        got = admission(rule, s, budget, free, requeued=requeued)
        if got is None:
            break
        n, held = got
        computed, blocks = (0, 0) if requeued else (s.computed, s.blocks)
        free -= held - blocks
        chunks.append((s, n))
        if held != s.blocks or requeued:
            grants.append((s, held))
        admitted += 1
        budget -= n
        prefill_tokens += n
        attn_pairs += n * (computed + n / 2.0)
    return admitted, free, prefill_tokens, attn_pairs


class BatchState(Generic[K]):
    """The running batch and the queue of one engine, changed only by applying plan_step's plans."""

    def __init__(self, params: EngineParams, seed: int = 0) -> None:
        self.params = params
        self.rule = StepRule.of(params)
        self._rng = random.Random(seed)
        self._step_time = step_time_fn(params)  # groundtruth.step_time_s of these params
        self._sigma = params.noise_sigma
        self.waiting: deque[Seq[K]] = deque()
        self.running: list[Seq[K]] = []
        self.free_blocks = params.kv_blocks
        self.steps = 0
        self.preemptions = 0
        # the prefix cache, made by the first request that carries block hashes (None: no request
        # did; an engine without prefix caching behaves exactly as before it existed)
        self.prefix: PrefixCache | None = None
        self.prefix_caching = True  # False: hashes are ignored (vLLM --no-enable-prefix-caching)
        # vLLM's prefix-cache counters (vllm:prefix_cache_queries / _hits, in tokens): at each
        # admission of a request, queries += the tokens it must compute, hits += the cached ones
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.params.kv_blocks

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.params.block_size)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises RequestTooLongError when the request can never fit this engine."""
        p = self.params
        total = prompt_tokens + max_tokens
        if total > p.max_model_len or -(-total // p.block_size) > p.kv_blocks:  # blocks_for, inlined: per request
            raise RequestTooLongError(
                f"prompt_tokens + max_tokens = {total} exceeds the engine's maximum context length {p.max_model_len}"
            )

    def _enqueue(self, key: K, prompt_tokens: int, max_tokens: int, blocks: Sequence[int] | None = None) -> Seq[K]:
        prompt_tokens = max(1, int(prompt_tokens))
        max_tokens = max(1, int(max_tokens))
        self.check(prompt_tokens, max_tokens)
        hashes = None
        if blocks is not None and self.prefix_caching:
            hashes = tuple(blocks)
            if self.prefix is None:
                self.prefix = PrefixCache(self.params.block_size)
        s = Seq(key, prompt_tokens, max_tokens, hashes)
        self.waiting.append(s)
        return s

    @property
    def prefix_hit_rate(self) -> float | None:
        """Cached share of the tokens queried so far (None: nothing queried)."""
        q = self.prefix_queries_tokens
        return self.prefix_hit_tokens / q if q else None

    def _lookup_prefixes(self) -> None:
        """Set the cached prefix (as already computed tokens) of the waiting requests that could
        join the next step: the head of the queue, up to the free seats and the token budget."""
        pc = self.prefix
        if pc is None or not self.waiting:
            return
        epoch = pc.epoch
        seats = self.rule.max_num_seqs - len(self.running)
        budget = self.rule.max_num_batched_tokens
        for s in self.waiting:
            if seats <= 0 or budget <= 0:
                break
            seats -= 1
            h = s.hashes
            if h is not None and s.looked != epoch and s.blocks == 0:
                s.looked = epoch
                s.computed = pc.hit_tokens(h, s.prompt, s.target)[0]
            budget -= s.target - s.computed

    def schedule(self) -> StepPlan[K]:
        """Plan the next step and apply its admissions, evictions and KV allocation."""
        pc = self.prefix
        if pc is not None:
            self._lookup_prefixes()
        plan = plan_step(self.rule, self.running, self.waiting, self.free_blocks)
        running, waiting = self.running, self.waiting
        for v in plan.preempted:
            running.pop()  # v: evicted from the tail
            v.blocks = 0
            v.computed = 0
            v.target = v.prompt + v.emitted  # recompute prompt + generated tokens as one prefill
            if pc is not None and v.pinned:
                pc.unpin(v.hashes or (), v.pinned)
                v.pinned = 0
                v.looked = -1
            waiting.appendleft(v)
        for _ in range(plan.admitted):
            s = waiting.popleft()
            running.append(s)
            if pc is not None:
                # computed: the cached prefix (0 for a request evicted in this very step)
                self.prefix_queries_tokens += s.target
                if s.computed > 0 and s.hashes is not None:
                    self.prefix_hit_tokens += s.computed
                    nb = -(-s.computed // PREFIX_BLOCK_TOKENS)
                    pc.pin(s.hashes, s.prompt, 0, nb)
                    s.pinned = nb
        for s, held in plan.grants:
            s.blocks = held
        self.free_blocks = plan.free_blocks
        if pc is not None:
            pc.trim(self.free_blocks)
        self.preemptions += len(plan.preempted)
        self.steps += 1
        return plan

    def duration_s(self, plan: StepPlan[K]) -> float:
        """The step's roofline time times a lognormal noise factor (draws from the core's RNG)."""
        return self._step_s(plan.decode_seqs, plan.prefill_tokens, plan.context_tokens, plan.attn_pairs)

    def _step_s(self, decode_seqs: int, prefill_tokens: int, context_tokens: int, attn_pairs: float) -> float:
        dur = self._step_time(decode_seqs, prefill_tokens, context_tokens, attn_pairs)
        sigma = self._sigma
        if sigma > 0:
            dur *= math.exp(self._rng.gauss(0.0, sigma))
        return dur

    def complete(self, plan: StepPlan[K], emitted: list[Seq[K]] | None = None) -> tuple[list[Seq[K]], list[Seq[K]], int]:
        """Apply the end of a scheduled step: (requests whose first token it emitted, finished
        requests, which leave the batch and free their blocks, number of tokens emitted). The
        requests that emitted a token are appended to `emitted` when given."""
        first: list[Seq[K]] = []
        count = 0
        done = False
        pc = self.prefix
        for r, n in plan.chunks:
            r.computed += n
            if r.computed >= r.target:
                if r.emitted == 0:
                    first.append(r)
                    if pc is not None and r.hashes is not None:  # prefill done: its blocks are cached
                        pc.pin(r.hashes, r.prompt, r.pinned)
                        r.pinned = len(r.hashes)
                r.emitted += 1
                r.target = r.prompt + r.emitted  # the new token's KV is computed next step
                count += 1
                if emitted is not None:
                    emitted.append(r)
                if r.emitted >= r.max_tokens:
                    done = True
        return first, (self.retire() if done else []), count

    def retire(self) -> list[Seq[K]]:
        """Remove the requests that emitted all their tokens (in batch order) and free their blocks."""
        running = self.running
        # two comprehensions: a step retires one or two of a batch of tens (a loop of appends cost 3x)
        finished = [r for r in running if r.emitted >= r.max_tokens]
        if finished:
            self.running = [r for r in running if r.emitted < r.max_tokens]
        pc = self.prefix
        for r in finished:
            self.free_blocks += r.blocks
            r.blocks = 0
            if pc is not None and r.pinned:
                pc.unpin(r.hashes or (), r.pinned)
                r.pinned = 0
        if pc is not None:
            pc.trim(self.free_blocks)
        return finished


@dataclass
class StepResult:
    duration_s: float
    tokens: list[tuple[str, int]] = field(default_factory=list)
    first_tokens: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)  # moved from waiting to running in this step
    prefill_tokens: int = 0
    decode_seqs: int = 0
    cached: list[tuple[str, int]] = field(default_factory=list)  # admitted requests' prefix-cache hits (tokens)


class BatchCore(BatchState[str]):
    """Continuous batching, clock-free, one step at a time (the sim-engine server's core).
    Not thread-safe; O(batch) per step."""

    def __init__(self, params: EngineParams, seed: int = 0) -> None:
        super().__init__(params, seed)
        self._by_id: dict[str, Seq[str]] = {}

    def has(self, req_id: str) -> bool:
        return req_id in self._by_id

    def submit(self, req_id: str, prompt_tokens: int, max_tokens: int, now_s: float,
               blocks: Sequence[int] | None = None, *, prefilled: bool = False) -> None:
        """Queue a request. Raises RequestTooLongError when it can never fit; ValueError on a duplicate id.
        `blocks`: the prompt's block hashes (fleetplan.sim.prefix_cache), None: not cacheable.
        `prefilled`: the prompt's KV arrived from a prefill instance (a decode instance of a
        disaggregated deployment): every prompt token but the last is computed, so the step that
        computes the last one emits the first output token."""
        if req_id in self._by_id:
            raise ValueError(f"duplicate request id {req_id!r}")
        s = self._enqueue(req_id, prompt_tokens, max_tokens, None if prefilled else blocks)
        if prefilled:
            s.computed = s.prompt - 1
        self._by_id[req_id] = s

    def cancel(self, req_id: str) -> bool:
        """Drop a request (client gone). True when it was known."""
        s = self._by_id.pop(req_id, None)
        if s is None:
            return False
        if s in self.running:
            self.running.remove(s)
        else:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass
        self.free_blocks += s.blocks
        s.blocks = 0
        if self.prefix is not None and s.pinned:
            self.prefix.unpin(s.hashes or (), s.pinned)
            s.pinned = 0
        return True

    def step(self, now_s: float) -> StepResult:
        """Schedule and run one iteration; its tokens are emitted at now_s + duration_s."""
        plan = self.schedule()
        chunks = plan.chunks
        # (the `if` guards skip building empty lists: most steps evict and admit nothing)
        preempted = [v.key for v in plan.preempted] if plan.preempted else []
        admitted = [s.key for s, _n in chunks[len(chunks) - plan.admitted:]] if plan.admitted else []
        if not chunks:
            return StepResult(0.0, preempted=preempted, admitted=admitted)
        res = StepResult(self.duration_s(plan), preempted=preempted, admitted=admitted,
                         prefill_tokens=plan.prefill_tokens, decode_seqs=plan.decode_seqs)
        if plan.admitted and self.prefix is not None:  # before complete(): computed is the cached prefix
            res.cached = [(s.key, s.computed) for s, _n in chunks[len(chunks) - plan.admitted:] if s.computed > 0]
        emitted: list[Seq[str]] = []
        first, finished, _count = self.complete(plan, emitted)
        res.tokens = [(s.key, 1) for s in emitted]
        if first:
            res.first_tokens = [s.key for s in first]
        if finished:
            res.finished = [s.key for s in finished]
            for s in finished:
                del self._by_id[s.key]
        return res
