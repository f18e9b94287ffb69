"""Prefill and decode pools derived from an aggregated profile (models/disagg.py), and the per-class
TTFT latency they add to models/mix.py's capacity."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.disagg import (
    ETH_25G,
    IB_NDR_400G,
    NVLINK4,
    KvLink,
    LinkKind,
    PoolProfiles,
    disagg_capacity,
    host_link,
    kv_bytes_per_token,
    kv_transfer_ms,
    pool_profiles,
    prefill_mix,
    replicas_for,
)
from fleetplan.models.mix import LengthMix, capacity_mix, predict_mix
from fleetplan.models.names import Engine, GpuType, Precision

KEY = mp.ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
PROFILE = mp.roofline_profile(KEY)
assert PROFILE is not None
LONG = LengthMix(((2048.0, 16.0, 0.7), (8000.0, 40.0, 0.3)))
SLO = {"ttft_p99_ms": 1500.0, "itl_p99_ms": 30.0}


def test_kv_bytes_from_the_architecture() -> None:
    # Llama-3-8B: 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes
    assert kv_bytes_per_token(KEY) == 32 * 8 * 128 * 2 * 2
    assert kv_bytes_per_token(replace(KEY, precision=Precision.FP8)) == 32 * 8 * 128 * 2
    assert kv_bytes_per_token(replace(KEY, model="unknown-model")) is None


def test_transfer_time_is_bytes_over_the_links_of_the_tp_group() -> None:
    b = 131072.0
    t1 = kv_transfer_ms(b, 4000, IB_NDR_400G) - IB_NDR_400G.latency_ms
    assert kv_transfer_ms(b, 8000, IB_NDR_400G) - IB_NDR_400G.latency_ms == pytest.approx(2 * t1)
    assert kv_transfer_ms(b, 4000, IB_NDR_400G, tp=4) - IB_NDR_400G.latency_ms == pytest.approx(t1 / 4)
    assert kv_transfer_ms(b, 4000, NVLINK4) < kv_transfer_ms(b, 4000, IB_NDR_400G) < kv_transfer_ms(b, 4000, ETH_25G)
    assert kv_transfer_ms(b, 0, ETH_25G) == ETH_25G.latency_ms


def test_host_link_by_gpu_generation() -> None:
    assert host_link(GpuType.H100) == NVLINK4 and host_link(GpuType.A100).gb_s < NVLINK4.gb_s
    assert host_link(GpuType.B200).gb_s > NVLINK4.gb_s
    assert host_link(GpuType.RTX4090).kind is LinkKind.PCIE


def test_link_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="gb_s"):
        KvLink(LinkKind.NETWORK, 0.0, 0.5)
    with pytest.raises(ValueError, match="latency_ms"):
        KvLink(LinkKind.NETWORK, 10.0, math.nan)


def test_added_latency_is_a_tighter_ttft_target_for_one_class() -> None:
    one = LengthMix.single(3000.0, 100.0)
    zero = capacity_mix(PROFILE, one, **SLO, ttft_added_ms=[0.0])
    assert zero == capacity_mix(PROFILE, one, **SLO)
    added = capacity_mix(PROFILE, one, ttft_p99_ms=SLO["ttft_p99_ms"], itl_p99_ms=1e9, ttft_added_ms=[400.0])
    tighter = capacity_mix(PROFILE, one, ttft_p99_ms=SLO["ttft_p99_ms"] - 400.0, itl_p99_ms=1e9)
    assert added.max_rps == pytest.approx(tighter.max_rps, rel=1e-9)
    assert added.max_rps < capacity_mix(PROFILE, one, ttft_p99_ms=SLO["ttft_p99_ms"], itl_p99_ms=1e9).max_rps
    with pytest.raises(ValueError, match="one latency per length class"):
        capacity_mix(PROFILE, LONG, **SLO, ttft_added_ms=[1.0])


def test_decode_pool_has_no_prefill_in_its_steps() -> None:
    pools = pool_profiles(PROFILE)
    assert pools.extrapolated and pools.prefill == PROFILE
    base = disagg_capacity(pools, LONG, **SLO, link=NVLINK4)
    assert base is not None and base.extrapolated
    # prefill three times as expensive: the aggregated replica and the prefill pool lose capacity,
    # the decode pool none
    slow = replace(PROFILE, params=replace(PROFILE.params, p1_ms=3 * PROFILE.params.p1_ms))
    slow_cap = disagg_capacity(pool_profiles(slow), LONG, **SLO, link=NVLINK4)
    assert slow_cap is not None
    assert slow_cap.decode == base.decode
    assert slow_cap.prefill.max_rps < 0.6 * base.prefill.max_rps
    assert capacity_mix(slow, LONG, **SLO).max_rps < capacity_mix(PROFILE, LONG, **SLO).max_rps
    # with room in its KV cache for every arrival (models/kv_room.py: this cache binds a hair below
    # the ITL), at its capacity the decode pool's ITL p99 is the target; the aggregated profile's, at
    # that rate, saturated
    roomy = pool_profiles(replace(PROFILE, kv_tokens=None))
    free = disagg_capacity(roomy, LONG, **SLO, link=NVLINK4)
    assert free is not None and base.decode.max_rps <= free.decode.max_rps
    at = predict_mix(roomy.decode, LONG, free.decode.max_rps)
    assert free.decode.binding == "itl" and at.itl_p99_ms == pytest.approx(SLO["itl_p99_ms"], rel=1e-3)
    assert predict_mix(PROFILE, LONG, free.decode.max_rps).saturated


def test_decode_pool_bounded_by_the_kv_cache() -> None:
    small = replace(PROFILE, kv_tokens=50_000.0)  # ~10 sequences of the long class
    cap = disagg_capacity(pool_profiles(small), LONG, ttft_p99_ms=1500.0, itl_p99_ms=200.0, link=NVLINK4)
    assert cap is not None and cap.decode.binding == "memory"
    roomy = disagg_capacity(pool_profiles(PROFILE), LONG, ttft_p99_ms=1500.0, itl_p99_ms=200.0, link=NVLINK4)
    assert roomy is not None and roomy.decode.max_rps > cap.decode.max_rps


def test_prefill_pool_pays_the_transfer() -> None:
    pools = pool_profiles(PROFILE)
    caps = [disagg_capacity(pools, LONG, **SLO, link=link) for link in (NVLINK4, IB_NDR_400G, ETH_25G)]
    assert all(c is not None for c in caps)
    rps = [c.prefill.max_rps for c in caps if c is not None]
    assert rps[0] > rps[1] > rps[2]
    transfer = [c.transfer_p99_ms for c in caps if c is not None]
    assert transfer[0] < transfer[1] < transfer[2]
    # the p99 prompt (8000 tokens, 1 GB of KV) over 25 GbE takes ~330 ms
    assert transfer[2] == pytest.approx(kv_transfer_ms(131072.0, 8000.0, ETH_25G))
    # the prefill pool serves prompts only: the same as the aggregated profile with one output token
    # each and the transfer and join added to every class
    nv = caps[0]
    assert nv is not None
    added = [kv_transfer_ms(131072.0, isl, NVLINK4) + nv.join_ms for isl, _, _ in LONG.classes]
    assert nv.prefill == capacity_mix(PROFILE, prefill_mix(LONG), ttft_p99_ms=SLO["ttft_p99_ms"],
                                      itl_p99_ms=math.inf, ttft_added_ms=added)


def test_unknown_architecture_needs_the_kv_bytes() -> None:
    other = replace(PROFILE, key=replace(KEY, model="my-model"))
    assert disagg_capacity(pool_profiles(other), LONG, **SLO, link=NVLINK4) is None
    given = disagg_capacity(pool_profiles(other), LONG, **SLO, link=NVLINK4, kv_bytes=131072.0)
    assert given == disagg_capacity(pool_profiles(PROFILE), LONG, **SLO, link=NVLINK4)


def test_measured_pools_are_not_extrapolated() -> None:
    derived = pool_profiles(PROFILE)
    measured = PoolProfiles(derived.prefill, derived.decode, extrapolated=False)
    cap = disagg_capacity(measured, LONG, **SLO, link=NVLINK4)
    assert cap is not None and not cap.extrapolated


def test_one_token_outputs_need_no_decode() -> None:
    cap = disagg_capacity(pool_profiles(PROFILE), LengthMix.single(4000.0, 1.0), **SLO, link=NVLINK4)
    assert cap is not None and math.isinf(cap.decode.max_rps)
    assert cap.pool_counts(5.0)[1] == 1


def test_pool_counts() -> None:
    cap = disagg_capacity(pool_profiles(PROFILE), LONG, **SLO, link=NVLINK4)
    assert cap is not None
    rate = 3.0 * cap.prefill.max_rps
    n_p, n_d = cap.pool_counts(rate)
    assert n_p == 3 and n_d == 1
    assert cap.pool_counts(rate, headroom=0.2)[0] == 4
    assert cap.pool_counts(0.0) == (0, 0)
    assert replicas_for(10.0, 2.5) == 4 and replicas_for(10.1, 2.5) == 5 and replicas_for(0.1, math.inf) == 1
    with pytest.raises(ValueError, match="serves nothing"):
        replicas_for(1.0, 0.0)


def test_a_mean_standing_for_a_spread_carries_the_p99_transfer() -> None:
    mean = LengthMix.single(2000.0, 30.0)
    pools = pool_profiles(PROFILE)
    plain = disagg_capacity(pools, mean, **SLO, link=ETH_25G)
    tail = disagg_capacity(pools, mean, **SLO, link=ETH_25G, transfer_isl_p99=8000.0)
    assert plain is not None and tail is not None
    assert tail.transfer_p99_ms == pytest.approx(kv_transfer_ms(131072.0, 8000.0, ETH_25G))
    assert tail.prefill.max_rps < plain.prefill.max_rps and tail.decode == plain.decode
    # a floor below every class changes nothing
    assert disagg_capacity(pools, mean, **SLO, link=ETH_25G, transfer_isl_p99=100.0) == plain
