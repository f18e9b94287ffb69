"""Room in a decode replica's KV cache (models/kv_room.py): the share of arrivals that wait for it,
the rate at which that share is 1%, and the translated-gamma reading of the occupancy against an
exact compound-Poisson recursion."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from fleetplan.models import profile as mp
from fleetplan.models.disagg import NVLINK4, disagg_capacity, pool_profiles
from fleetplan.models.kv_room import batch_sequences, full_step_ms, kv_room_rps, kv_wait_share
from fleetplan.models.mix import LengthMix, capacity_mix, mix_from_quantiles
from fleetplan.models.names import Engine, GpuType, Precision

KEY = mp.ConfigKey("llama-3-8b", Engine.TRTLLM, GpuType.H100, 1, Precision.BF16)
DECODE = pool_profiles(mp.roofline_profile(KEY)).decode
ONE = LengthMix.single(11_800.0, 300.0)
TAIL = LengthMix(((2_000.0, 300.0, 0.9), (100_000.0, 300.0, 0.1)))  # the same mean prompt, 11,800
BOUND = 0.01


def _lognormal_mix() -> LengthMix:
    """A spread like a chat trace's: prompts log-normal (median 4k, p99 ~100k), outputs median 250."""
    q = np.array([0.1, 0.25, 0.5, 0.65, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999])
    z = np.array([-1.2816, -0.6745, 0.0, 0.3853, 0.8416, 1.2816, 1.6449, 2.0537, 2.3263, 2.5758, 3.0902])
    isl = [(float(a), float(4000 * math.exp(1.4 * b))) for a, b in zip(q, z, strict=True)]
    osl = [(float(a), float(250 * math.exp(0.8 * b))) for a, b in zip(q, z, strict=True)]
    return mix_from_quantiles(isl, osl)


def test_a_long_prompt_tail_leaves_less_room_at_the_same_mean() -> None:
    inf = math.inf
    one = capacity_mix(DECODE, ONE, ttft_p99_ms=inf, itl_p99_ms=inf)
    tail = capacity_mix(DECODE, TAIL, ttft_p99_ms=inf, itl_p99_ms=inf)
    # the mean occupancy fills the cache at about the same rate for both mixes ...
    assert one.binding == tail.binding == "memory" and tail.max_rps == pytest.approx(one.max_rps, rel=0.05)
    # ... but with a tenth of the prompts 100k tokens long a few sequences fill it: less room, sooner
    room_one, room_tail = kv_room_rps(DECODE, ONE, wait_share=BOUND), kv_room_rps(DECODE, TAIL, wait_share=BOUND)
    assert room_tail < 0.6 * room_one < room_one < one.max_rps
    assert kv_wait_share(DECODE, TAIL, room_one) > 5 * BOUND
    assert kv_wait_share(DECODE, ONE, one.max_rps) > 0.2  # the mean-occupancy limit: many wait there


@pytest.mark.parametrize("mix", [ONE, TAIL, _lognormal_mix()], ids=["one", "tail", "lognormal"])
def test_the_share_at_the_rate_is_the_bound_and_rises_with_the_rate(mix: LengthMix) -> None:
    room = kv_room_rps(DECODE, mix, wait_share=BOUND)
    assert 0.0 < room < math.inf
    assert kv_wait_share(DECODE, mix, room) == pytest.approx(BOUND, rel=0.01)
    shares = [kv_wait_share(DECODE, mix, f * room) for f in (0.25, 0.5, 0.9, 1.1, 1.5, 2.0)]
    assert shares == sorted(shares) and shares[2] < BOUND < shares[3]
    assert kv_room_rps(DECODE, mix, wait_share=0.001) < room < kv_room_rps(DECODE, mix, wait_share=0.05)


def test_a_slower_engine_holds_each_sequence_longer() -> None:
    room = kv_room_rps(DECODE, TAIL, wait_share=BOUND)
    assert kv_room_rps(DECODE, TAIL, wait_share=BOUND, speed=0.5) == pytest.approx(0.5 * room, rel=1e-9)
    assert kv_wait_share(DECODE, TAIL, room, speed=0.5) > 3 * BOUND


def test_a_bigger_cache_has_more_room() -> None:
    assert DECODE.kv_tokens is not None
    big = replace(DECODE, kv_tokens=2 * DECODE.kv_tokens)
    assert kv_room_rps(big, TAIL, wait_share=BOUND) > 1.5 * kv_room_rps(DECODE, TAIL, wait_share=BOUND)


def test_unknown_cache_and_prompts_longer_than_the_cache() -> None:
    unknown = replace(DECODE, kv_tokens=None)
    assert kv_room_rps(unknown, TAIL, wait_share=BOUND) == math.inf and kv_wait_share(unknown, TAIL, 3.0) == 0.0
    small = replace(DECODE, kv_tokens=90_000.0)  # the 100k class never fits
    assert kv_room_rps(small, TAIL, wait_share=BOUND) == 0.0  # a tenth of the arrivals always waits
    rare = LengthMix(((2_000.0, 300.0, 0.995), (100_000.0, 300.0, 0.005)))
    assert kv_wait_share(small, rare, 0.0) == pytest.approx(0.005)
    assert 0.0 < kv_room_rps(small, rare, wait_share=BOUND) < math.inf


def _exact_shares(mix: LengthMix, kv_tokens: float, batch: float, units: int = 1500) -> float:
    """The wait share with the occupancy's compound Poisson distribution computed exactly on a grid
    of kv_tokens / units (Panjer's recursion; sizes rounded up: never less held than the mix's)."""
    c = np.array(mix.classes, dtype=float)
    isl, osl, w = c[:, 0], np.maximum(c[:, 1], 1.0), c[:, 2]
    size = np.ceil((isl + osl) / (kv_tokens / units)).astype(int)
    fits = isl + osl <= kv_tokens
    f = np.zeros(units + 1)
    for s, u in zip(size[fits], (w * osl)[fits] / np.sum((w * osl)[fits]), strict=True):
        f[min(s, units)] += u
    jf = np.arange(units + 1) * f
    g = np.zeros(units + 1)
    g[0] = math.exp(-batch)
    support = np.nonzero(f)[0]
    for s in range(1, units + 1):
        j = support[support <= s]
        g[s] = batch / s * float(np.dot(jf[j], g[s - j]))
    cdf = np.cumsum(g)
    return float(sum(wi * (1.0 - cdf[units - s]) if s <= units else wi for s, wi in zip(size, w, strict=True)))


@pytest.mark.parametrize("mix", [ONE, TAIL, _lognormal_mix()], ids=["one", "tail", "lognormal"])
def test_translated_gamma_against_the_exact_compound_poisson(mix: LengthMix) -> None:
    """At the rate the approximation gives for 1%, the exact occupancy makes 0.5-1.5% wait, and the
    batch at which exactly 1% wait is within 5% of the approximation's."""
    assert DECODE.kv_tokens is not None
    kv = DECODE.kv_tokens
    room = kv_room_rps(DECODE, mix, wait_share=BOUND)
    batch = batch_sequences(DECODE.params, mix, room, kv)
    assert room == pytest.approx(batch / (mix.mean().osl * full_step_ms(DECODE.params, kv, batch)) * 1000.0,
                                 rel=0.02)
    exact = _exact_shares(mix, kv, batch)
    assert 0.5 * BOUND <= exact <= 1.5 * BOUND
    lo, hi = 0.0, 2.0 * batch  # the batch at which exactly 1% wait
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _exact_shares(mix, kv, mid) <= BOUND else (lo, mid)
    assert lo == pytest.approx(batch, rel=0.05)


def test_the_decode_pool_is_sized_for_room_not_for_the_mean_occupancy() -> None:
    """disagg_capacity's decode replica: where the tail's room binds before the ITL, its capacity is
    the room (binding "memory"), and its arrivals find room 99% of the time."""
    cap = disagg_capacity(pool_profiles(mp.roofline_profile(KEY)), TAIL, ttft_p99_ms=15_000.0, itl_p99_ms=120.0,
                          link=NVLINK4)
    assert cap is not None and cap.decode.binding == "memory"
    assert cap.decode.max_rps == pytest.approx(kv_room_rps(DECODE, TAIL, wait_share=BOUND))
    assert cap.decode.max_rps < 0.5 * capacity_mix(DECODE, TAIL, ttft_p99_ms=math.inf, itl_p99_ms=120.0).max_rps
    assert kv_wait_share(DECODE, TAIL, cap.decode.max_rps) <= BOUND * 1.01
    one = disagg_capacity(pool_profiles(mp.roofline_profile(KEY)), ONE, ttft_p99_ms=15_000.0, itl_p99_ms=120.0,
                          link=NVLINK4)
    assert one is not None and one.decode.max_rps > 2 * cap.decode.max_rps
