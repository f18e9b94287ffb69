"""The replay's replica core: one simulated engine replica advanced step by step, fast.

`FastCore` and BatchCore (fleetplan.sim.batching) are both a BatchState: every step is decided by
the one rule `batching.plan_step`. FastCore advances a run of steps that rule would make
pure-decode steps (every running request decoding, the queue's head cannot join, no eviction) as ONE
macro-step up to the next event (a request finishing, the KV pool running out, or an arrival routed
to that replica, which splits the macro-step at the step boundary after the arrival). Step times in
a macro-step are the noise-free step time interpolated linearly in the context length times the
mean of the lognormal noise: without noise a macro-step equals its single steps (to float
rounding), with it only the per-step noise draws are averaged (tests/unit/sim/test_evaluate_des.py).

`replay_on_core` runs one replica open loop; `capacity_at_slo` is the ground-truth capacity search
built on it (the oracle's and the charts' capacities, fleetplan.sim.evaluate).

The engines' histogram bucket edges live here too (the ones vLLM exports,
vllm/v1/metrics/loggers.py), for every simulated engine: the replay's and the HTTP one's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from fleetplan.models.mix import QUANTILE_LEVELS
from fleetplan.sim.batching import BatchState, Seq, StepPlan, admission, admit
from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError
from fleetplan.sim.search import smallest_count

RATE_FLOOR_RPS = 1e-3  # below it a config has no capacity at the SLO (0.0)
RATE_CEIL_RPS = 1e5  # the search stops there

# vLLM bucket edges (vllm/v1/metrics/loggers.py), seconds
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)

# vLLM's request_prompt_tokens / request_generation_tokens buckets: build_1_2_5_buckets(max_model_len)
LENGTH_BUCKETS: tuple[float, ...] = tuple(float(m * 10 ** e) for e in range(0, 7) for m in (1, 2, 5))
TPOT_BUCKETS_S = ITL_BUCKETS_S  # vllm:request_time_per_output_token_seconds (per request)
# the quantiles of the length histograms the controller reads (what controller/observe.py asks)
LENGTH_QUANTILES: tuple[float, ...] = QUANTILE_LEVELS


# ----------------------------------------------------------------------------------------------
# The replica core
# ----------------------------------------------------------------------------------------------


class FastCore(BatchState[int]):
    """The replay's replica core: BatchState's steps (the one rule, batching.plan_step), with
    runs of pure-decode steps macro-stepped (see the module docstring).

    Protocol: `begin(now)` plans the next (macro-)step and returns its end time (None: idle);
    `split(t)` shortens a macro-step in progress to the first step boundary >= t; `end()` applies
    the step in progress and returns (first-token request indices, finished indices, itl_gap_s,
    itl_gap_count) for the ITL histogram.
    """

    def __init__(self, params: EngineParams, seed: int = 0, *, macro: bool = True) -> None:
        super().__init__(params, seed)
        self.macro = macro
        self._noise_mean = math.exp(params.noise_sigma**2 / 2.0) if params.noise_sigma > 0 else 1.0
        # step in progress
        self.busy = False
        self.t0 = 0.0
        self.t_end = 0.0
        self._plan: StepPlan[int] | None = None  # a single step in progress
        self._k = 0  # macro-step: number of decode steps (0: a single exact step)
        self._a = 0.0
        self._b = 0.0
        # (steps until the first finish, context tokens) of the running batch when every running
        # request is decoding, as left by the last macro-step; None: unknown, recompute
        self._stats: tuple[int, int] | None = None
        # a `_plan_decoding` step in progress: the chunks of the requests it admitted, and how many
        # running requests it decodes (the first `_nb` of the batch)
        self._adm: list[tuple[Seq[int], int]] | None = None
        self._nb = 0

    def submit(self, idx: int, prompt_tokens: int, max_tokens: int, blocks: Sequence[int] | None = None) -> None:
        """Queue request `idx`. `blocks`: its prompt's 512-token block hashes (a trace's hash_ids,
        fleetplan.sim.prefix_cache) for the prefix cache; None: not cacheable (every prompt token
        is computed, as before the cache existed). The cumulative counters `prefix_queries_tokens`
        and `prefix_hit_tokens` are vLLM's vllm:prefix_cache_queries / _hits (BatchState)."""
        self._enqueue(idx, prompt_tokens, max_tokens, blocks)

    # -- planning a step
    def begin(self, now: float) -> float | None:
        assert not self.busy
        if not self.running and not self.waiting:  # idle(), inlined: once per step
            return None
        if self.macro and self._plan_macro(now):
            return self.t_end
        return self._plan_single(now)

    def _plan_macro(self, now: float) -> bool:
        """A run of steps that plan_step would make pure-decode steps: every running request
        decodes, the queue's head cannot join, the KV pool holds the growth (no eviction), up to
        the first request's last token."""
        running = self.running
        nb = len(running)
        if nb == 0:
            return False
        if self.prefix is not None and self.waiting:
            self._lookup_prefixes()  # the queue head's cached prefix decides whether it can join
        st = self._stats
        if st is not None:
            k, ctx = st  # all running are decoding (computed by the previous macro-step's end())
        else:
            k = 1 << 62
            ctx = 0
            for r in running:
                if r.target - r.computed != 1 or r.emitted == 0:
                    return False
                rem = r.max_tokens - r.emitted
                if rem < k:
                    k = rem
                ctx += r.computed
            self._stats = (k, ctx)  # every running request decodes: _plan_single may use it too
        rule = self.rule
        budget = rule.max_num_batched_tokens
        if nb > budget:
            return False
        waiting = self.waiting  # the queue's head could join the step (plan_step's admission): no macro-step
        if (waiting and budget - nb > 0 and nb < rule.max_num_seqs
                and admission(rule, waiting[0], budget - nb, self.free_blocks) is not None):
            return False
        if not rule.reserve_full_kv:
            bs = rule.block_size

            def extra(j: int) -> int:
                return sum(-(-(r.computed + j) // bs) - r.blocks for r in running)  # blocks_for, inlined: hot

            if extra(k) > self.free_blocks:
                lo, hi = 0, k  # extra(lo) fits, extra(hi) does not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if extra(mid) <= self.free_blocks:
                        lo = mid
                    else:
                        hi = mid
                k = lo
        if k < 2:
            return False
        a = self._step_time(nb, 0, ctx, 0.0)
        z = self._step_time(nb, 0, ctx + (k - 1) * nb, 0.0)
        m = self._noise_mean
        self._a = a * m
        self._b = (z - a) * m / (k - 1)
        self._k = k
        self.busy = True
        self.t0 = now
        self.t_end = now + self._cum(k)
        return True

    def _cum(self, j: int) -> float:
        return j * self._a + self._b * j * (j - 1) / 2.0

    def split(self, t: float) -> float:
        """Shorten a macro-step in progress so that it ends at the first step boundary >= t."""
        if not self.busy or self._k == 0 or t >= self.t_end:
            return self.t_end
        d = t - self.t0
        a, b = self._a, self._b
        if abs(b) < 1e-15:
            j = math.ceil(d / a) if a > 0 else 1
        else:
            c2, c1 = b / 2.0, a - b / 2.0
            disc = c1 * c1 + 4.0 * c2 * d
            j = math.ceil((-c1 + math.sqrt(max(0.0, disc))) / (2.0 * c2))
        while j > 1 and self._cum(j - 1) >= d:
            j -= 1
        while self._cum(j) < d and j < self._k:
            j += 1
        j = max(1, min(self._k, j))
        if j < self._k:
            self._k = j
            self.t_end = self.t0 + self._cum(j)
        return self.t_end

    def _plan_single(self, now: float) -> float | None:
        """One exact step: BatchState.schedule (plan_step) and its noisy duration, as BatchCore.step."""
        st = self._stats
        if (st is not None and self.rule.reserve_full_kv and self.prefix is None
                and len(self.running) <= self.rule.max_num_batched_tokens):
            return self._plan_decoding(now, st[1])
        self._stats = None
        plan = self.schedule()
        if not plan.chunks:
            return None
        self._plan = plan
        self._k = 0
        self.busy = True
        self.t0 = now
        self.t_end = now + self.duration_s(plan)
        return self.t_end

    def _plan_decoding(self, now: float, ctx: int) -> float:
        """The step plan_step makes when every running request decodes (`_stats` known: `ctx` their
        context tokens), KV is reserved at admission (no growth, no eviction) and there is no prefix
        cache: each running request takes its one token, then the queue's head joins as `admit`
        says. The same step, composition, KV and duration (the same float operations and noise
        draw) as schedule(), without a Python pass over the running batch to plan it."""
        rule = self.rule
        nb = len(self.running)
        adm: list[tuple[Seq[int], int]] = []
        grants: list[tuple[Seq[int], int]] = []
        admitted, free, prefill_tokens, attn_pairs = admit(rule, (), self.waiting, rule.max_num_seqs - nb,
                                                           rule.max_num_batched_tokens - nb, self.free_blocks,
                                                           adm, grants, 0, 0.0)
        waiting, running = self.waiting, self.running
        for _ in range(admitted):
            running.append(waiting.popleft())
        for q, held in grants:
            q.blocks = held
        self.free_blocks = free
        self.steps += 1
        self._adm = adm
        self._nb = nb
        self._k = 0
        self.busy = True
        self.t0 = now
        self.t_end = now + self._step_s(nb, prefill_tokens, ctx, attn_pairs)
        return self.t_end

    def _end_decoding(self) -> tuple[list[int], list[int], float, int]:
        """Apply a `_plan_decoding` step as complete() applies it; the running batch's decode
        statistics (`_stats`) are kept when every request decodes after it."""
        adm = self._adm
        self._adm = None
        assert adm is not None
        done = False
        kmin = 1 << 62
        ctx = 0
        count = 0
        for r in self.running[:self._nb]:
            c = r.computed + 1
            r.computed = c
            e = r.emitted + 1
            r.emitted = e
            r.target = r.prompt + e
            rem = r.max_tokens - e
            if rem <= 0:
                done = True
            else:
                if rem < kmin:
                    kmin = rem
                ctx += c
        count = self._nb
        first: list[int] = []
        decoding = True
        for r, n in adm:
            r.computed += n
            if r.computed >= r.target:
                if r.emitted == 0:
                    first.append(r.key)
                r.emitted += 1
                r.target = r.prompt + r.emitted
                count += 1
                rem = r.max_tokens - r.emitted
                if rem <= 0:
                    done = True
                else:
                    if rem < kmin:
                        kmin = rem
                    ctx += r.computed
            else:
                decoding = False  # a chunked prefill goes on
        finished = [r.key for r in self.retire()] if done else []
        self._stats = (kmin, ctx) if decoding and self.running else None
        return first, finished, self.t_end - self.t0, count - len(first)

    # -- applying a step
    def end(self) -> tuple[list[int], list[int], float, int]:
        assert self.busy
        self.busy = False
        if self._adm is not None:
            return self._end_decoding()
        if self._k > 0:
            j = self._k
            self.steps += j
            reserve = self.rule.reserve_full_kv
            bs = self.rule.block_size
            done = False
            kmin = 1 << 62
            ctx = 0
            if reserve:  # KV reserved at admission: no growth to allocate (the loop below without it)
                for r in self.running:
                    c = r.computed + j
                    r.computed = c
                    e = r.emitted + j
                    r.emitted = e
                    r.target = r.prompt + e
                    rem = r.max_tokens - e
                    if rem <= 0:
                        done = True
                    else:
                        if rem < kmin:
                            kmin = rem
                        ctx += c
            else:
                for r in self.running:
                    c = r.computed + j
                    r.computed = c
                    e = r.emitted + j
                    r.emitted = e
                    r.target = r.prompt + e
                    nbk = -(-c // bs)  # blocks_for, inlined: hot
                    if nbk > r.blocks:
                        self.free_blocks -= nbk - r.blocks
                        r.blocks = nbk
                    rem = r.max_tokens - e
                    if rem <= 0:
                        done = True
                    else:
                        if rem < kmin:
                            kmin = rem
                        ctx += c
            gap = (self.t_end - self.t0) / j
            count = j * len(self.running)
            finished = [r.key for r in self.retire()] if done else []
            if self.prefix is not None and not done:
                self.prefix.trim(self.free_blocks)  # the decode growth took free blocks
            self._k = 0
            self._stats = (kmin, ctx) if self.running else None
            return [], finished, gap, count
        self._stats = None
        plan = self._plan
        assert plan is not None
        self._plan = None
        first, fin, count = self.complete(plan)
        return ([r.key for r in first] if first else [], [r.key for r in fin] if fin else [], self.t_end - self.t0,
                count - len(first))


def replay_on_core(params: EngineParams,
                   arrivals: Sequence[tuple[float, int, int]] | Sequence[tuple[float, int, int, Sequence[int] | None]],
                   *, macro: bool = True, seed: int = 0, core: FastCore | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One replica, open loop: per-request TTFT (incl. frontend overhead) and mean ITL, seconds, in
    the order of the arrivals sorted by (time, prompt, output).

    An arrival may carry a 4th element, its prompt's block hashes (the prefix cache; see
    FastCore.submit). `core`: run on this core (read its counters afterwards) instead of a new one.
    The reference loop of capacity_truth.simulate() with FastCore; used to validate macro-steps."""
    if core is None:
        core = FastCore(params, seed=seed, macro=macro)
    arr: list[tuple[Any, ...]] = sorted(arrivals, key=lambda a: (a[0], a[1], a[2]))  # ties by length, as before
    n = len(arr)
    first = np.full(n, np.nan)
    fin = np.full(n, np.nan)
    oh = params.factors.ttft_overhead_s
    arr_t = [a[0] + oh for a in arr]
    now = 0.0
    i = 0
    while True:
        while i < n and arr_t[i] <= now:
            a = arr[i]
            core.submit(i, a[1], a[2], a[3] if len(a) > 3 else None)
            i += 1
        if core.idle():
            if i >= n:
                break
            now = arr_t[i]
            continue
        te = core.begin(now)
        if te is None:
            now = arr_t[i] if i < n else now + 1e-3
            continue
        if i < n and core._k > 0 and arr_t[i] < te:
            te = core.split(arr_t[i])
        now = te
        firsts, fins, _gap, _cnt = core.end()
        for j in firsts:
            first[j] = now
        for j in fins:
            fin[j] = now
    ttft = first - np.array(arr_t) + oh
    outs = np.array([a[2] for a in arr], dtype=float)
    tpot = np.where(outs > 1, (fin - first) / np.maximum(outs - 1, 1), np.nan)
    return ttft, tpot


def capacity_at_slo(params: EngineParams, lengths: Sequence[tuple[int, int]], ttft_p99_ms: float,
                    itl_p99_ms: float, *, n: int = 1500, seed: int = 0, rel_tol: float = 0.02,
                    repeats: int = 1) -> float:
    """The median over `repeats` independent draws (seeds seed, seed+1, ...) of _capacity_once():
    a heavy-tailed length mix (Mooncake) makes one draw's p99 noisy (+-25% at n = 1500)."""
    runs = sorted(_capacity_once(params, lengths, ttft_p99_ms, itl_p99_ms, n=n, seed=seed + k, rel_tol=rel_tol)
                  for k in range(max(1, repeats)))
    return runs[len(runs) // 2] if len(runs) % 2 else 0.5 * (runs[len(runs) // 2 - 1] + runs[len(runs) // 2])


def _capacity_once(params: EngineParams, lengths: Sequence[tuple[int, int]], ttft_p99_ms: float,
                   itl_p99_ms: float, *, n: int, seed: int, rel_tol: float) -> float:
    """Ground-truth capacity of one replica: the highest Poisson rate (req/s) at which p99 TTFT and
    p99 per-request ITL (mean inter-token time) of `n` requests, lengths drawn from `lengths`
    (the trace's own mix), stay within the targets. Same definitions as the SLO attainment, so
    that the oracle built on it bounds a policy that meets the p99 targets in every window (not one
    that reaches 99% over a whole trace: docs/evaluate.md)."""
    if not lengths:
        return 0.0
    rng = random.Random(seed)
    pool = [(max(1, int(p)), max(1, int(o))) for p, o in lengths]
    limit = params.max_model_len
    pool = [x for x in pool if x[0] + x[1] <= limit] or pool[:1]
    sample = [pool[rng.randrange(len(pool))] for _ in range(n)]
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    warm = n // 10

    def ok(rate: float) -> bool:
        t = 0.0
        arr = []
        for g, (p, o) in zip(gaps, sample, strict=True):
            t += g / rate
            arr.append((t, p, o))
        try:
            ttft, tpot = replay_on_core(params, arr, seed=seed)
        except RequestTooLongError:
            return False
        tt = ttft[warm:]
        it = tpot[warm:]
        it = it[~np.isnan(it)]
        if np.isnan(tt).any():
            return False
        return bool(np.quantile(tt, 0.99) * 1000.0 <= ttft_p99_ms
                    and (it.size == 0 or np.quantile(it, 0.99) * 1000.0 <= itl_p99_ms))

    # the rates searched: a geometric grid (steps of rel_tol) from RATE_FLOOR_RPS to RATE_CEIL_RPS;
    # the capacity is the last rate of the grid that meets the SLO, the first that does not found by
    # the one bracket-and-bisect (fleetplan.sim.search), from 0.25 rps
    step = math.log1p(rel_tol)
    n_max = math.ceil(math.log(RATE_CEIL_RPS / RATE_FLOOR_RPS) / step)

    def rate(i: int) -> float:
        return RATE_FLOOR_RPS * math.exp(i * step)

    first_miss = smallest_count(lambda i: not ok(rate(i)), n_max, start=round(math.log(0.25 / RATE_FLOOR_RPS) / step))
    if first_miss is None:
        return rate(n_max)
    return 0.0 if first_miss <= 1 else rate(first_miss - 1)
