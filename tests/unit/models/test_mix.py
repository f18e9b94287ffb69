"""Capacity for a length mix (models/mix.py): one class is the profile's own answer; a heavy tail
needs more replicas than its mean; the speed inversion recovers a known engine speed."""

from __future__ import annotations

import math

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.mix import (
    FLOOR_SLACK,
    LengthMix,
    attainment_mix,
    capacity_mix,
    mix_from_quantiles,
    predict_mix,
    scaled,
    speed_from_latency,
)
from fleetplan.models.names import Engine, GpuType, Precision

KEY = mp.ConfigKey("m8", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
PARAMS = mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06, p2_ms=2e-7, q=1.0,
                       queue_tail=0.5)
PROFILE = mp.PerfProfile(KEY, PARAMS, kv_tokens=400_000.0,
                         data_range=mp.DataRange((128.0, 4096.0), (64.0, 1024.0), (0.5, 20.0), None, 8))


@pytest.mark.parametrize(("isl", "osl", "ttft", "itl"), [(820, 200, 500, 50), (4000, 300, 3000, 60),
                                                         (12000, 350, 15000, 120)])
def test_one_class_is_the_profiles_own_capacity(isl: float, osl: float, ttft: float, itl: float) -> None:
    want = mp.capacity(PROFILE, mp.Workload(isl, osl), ttft_p99_ms=ttft, itl_p99_ms=itl)
    got = capacity_mix(PROFILE, LengthMix.single(isl, osl), ttft_p99_ms=ttft, itl_p99_ms=itl)
    assert got.max_rps == pytest.approx(want.max_rps, rel=1e-4)
    assert got.binding == want.binding.value
    pred = mp.predict(PROFILE, mp.Workload(isl, osl), rate_rps=0.6 * want.max_rps)
    pm = predict_mix(PROFILE, LengthMix.single(isl, osl), 0.6 * want.max_rps)
    assert pm.ttft_p99_ms == pytest.approx(pred.ttft.p99_ms, rel=1e-9)
    assert pm.itl_p99_ms == pytest.approx(pred.itl.p99_ms, rel=1e-9)


def test_a_heavy_prompt_tail_needs_more_replicas_than_its_mean() -> None:
    # coding assistant (seed report): mean 820, p95 2,400, p99 4,100 prompt tokens
    heavy = mix_from_quantiles([(0.5, 500), (0.9, 1600), (0.95, 2400), (0.99, 4100), (0.999, 8000)],
                               [(0.5, 150), (0.9, 400)], isl_mean=820, osl_mean=200)
    assert heavy.mean().isl == pytest.approx(820, rel=1e-6)
    assert heavy.isl_quantile(0.99) > 3000
    slo = {"ttft_p99_ms": 400.0, "itl_p99_ms": 50.0}
    mean_cap = mp.capacity(PROFILE, heavy.mean(), **slo).max_rps
    mix_cap = capacity_mix(PROFILE, heavy, **slo).max_rps
    assert mix_cap < 0.85 * mean_cap
    demand = 40.0
    assert math.ceil(demand / mix_cap) > math.ceil(demand / mean_cap)
    # at the mean's capacity the mix misses the TTFT SLO, at its own capacity it meets it
    assert predict_mix(PROFILE, heavy, mean_cap * 0.999).ttft_p99_ms > slo["ttft_p99_ms"]
    assert predict_mix(PROFILE, heavy, mix_cap * 0.999).ttft_p99_ms <= slo["ttft_p99_ms"] * 1.001


@pytest.mark.parametrize("speed", [0.5, 0.71, 1.0, 1.4, 2.5])
def test_speed_from_latency_recovers_the_engine_speed(speed: float) -> None:
    mix = mix_from_quantiles([(0.5, 2000), (0.99, 30000)], [(0.5, 300)], isl_mean=4000, osl_mean=320)
    truth = scaled(PROFILE, speed)
    rate = 0.5 * capacity_mix(truth, mix, ttft_p99_ms=20000, itl_p99_ms=150).max_rps
    obs = predict_mix(truth, mix, rate)
    assert speed_from_latency(PROFILE, mix, rate, obs.ttft_p99_ms, itl=False) == pytest.approx(speed, rel=1e-6)
    assert speed_from_latency(PROFILE, mix, rate, obs.itl_p99_ms, itl=True) == pytest.approx(speed, rel=1e-6)


def test_a_slower_engine_has_less_capacity_at_the_same_slo() -> None:
    mix = LengthMix.single(2000, 300)
    base = capacity_mix(PROFILE, mix, ttft_p99_ms=1000, itl_p99_ms=60).max_rps
    slow = capacity_mix(PROFILE, mix, ttft_p99_ms=1000, itl_p99_ms=60, ttft_speed=0.7, itl_speed=0.7).max_rps
    assert slow < 0.7 * base  # the SLO does not scale with the engine: more than proportional


def test_bad_observations_are_unknown_not_a_speed() -> None:
    mix = LengthMix.single(2000, 300)
    assert speed_from_latency(PROFILE, mix, 1.0, math.nan, itl=False) is None
    assert speed_from_latency(PROFILE, mix, 1.0, -5.0, itl=True) is None
    assert speed_from_latency(PROFILE, mix, 1.0, math.inf, itl=True) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="quantiles or a mean"):
        mix_from_quantiles([], [(0.5, 10)])


def test_attainment_is_the_share_the_p99_targets_stand_for() -> None:
    # at the p99-based capacity, 99% of one class meets the binding target; below it more, above fewer
    slo = {"ttft_p99_ms": 500.0, "itl_p99_ms": 50.0}
    mix = LengthMix.single(820, 200)
    cap = capacity_mix(PROFILE, mix, **slo)
    assert cap.floor_share is None
    at = attainment_mix(PROFILE, mix, cap.max_rps * 0.9999, ttft_ms=500.0, itl_ms=50.0)
    binding = at.ttft_share if cap.binding == "ttft" else at.itl_share
    assert binding == pytest.approx(0.99, abs=2e-3)
    assert attainment_mix(PROFILE, mix, 0.5 * cap.max_rps, ttft_ms=500.0, itl_ms=50.0).share > at.share
    assert attainment_mix(PROFILE, mix, 10 * cap.max_rps, ttft_ms=500.0, itl_ms=50.0).share == 0.0  # saturated


def test_a_target_out_of_reach_is_sized_from_its_floor_not_to_zero() -> None:
    # issue 18: 3% of the prompts are 12k tokens whose own prefill (~750 ms) exceeds a 500 ms TTFT:
    # no count of replicas meets the p99, an idle replica meets 97%. The config is sized to within
    # FLOOR_SLACK of that share instead of "no capacity" (min_replicas) or an endless fleet
    mix = LengthMix(((500.0, 200.0, 0.97), (12000.0, 200.0, 0.03)))
    cap = capacity_mix(PROFILE, mix, ttft_p99_ms=500.0, itl_p99_ms=80.0)
    assert cap.floor_share == pytest.approx(0.97, abs=2e-3)
    assert cap.max_rps > 0 and cap.binding == "ttft"
    at_cap = attainment_mix(PROFILE, mix, cap.max_rps * 0.999, ttft_ms=500.0, itl_ms=80.0)
    assert at_cap.share == pytest.approx(cap.floor_share - FLOOR_SLACK, abs=5e-4)
    # reachable targets keep their p99 capacity and no floor
    assert capacity_mix(PROFILE, mix, ttft_p99_ms=2000.0, itl_p99_ms=80.0).floor_share is None


def _speed_one_by_one(profile: mp.PerfProfile, mix: LengthMix, rate: float, observed: float, *, itl: bool) -> float:
    """The inversion as 40 halvings, one prediction each (what the batched halvings must equal)."""
    def latency(z: float) -> float:
        pred = predict_mix(scaled(profile, math.exp(z)), mix, rate)
        return pred.itl_p99_ms if itl else pred.ttft_p99_ms

    lo, hi = math.log(0.1), math.log(10.0)
    if latency(hi) >= observed:
        return 10.0
    if latency(lo) <= observed:
        return 0.1
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if latency(mid) > observed else (lo, mid)
    return math.exp(0.5 * (lo + hi))


@pytest.mark.parametrize("seed", range(4))
def test_the_batched_inversion_is_the_halvings_bit_for_bit(seed: int) -> None:
    """speed_from_latency predicts several halvings' midpoints at once: the same speed to the last
    bit as one prediction per halving, on mixes with and without prefix caching, stalls, saturation."""
    import random

    rng = random.Random(seed)
    params = mp.PerfParams(s0_ms=rng.uniform(5, 20), s1_ms=rng.uniform(0.01, 0.1), s2_ms=rng.uniform(1e-5, 5e-4),
                           p0_ms=rng.uniform(1, 10), p1_ms=rng.uniform(0.01, 0.1), p2_ms=rng.uniform(0, 5e-7),
                           q=rng.uniform(0.5, 2), queue_tail=rng.choice([0.0, 0.5, 1.0]),
                           itl_stall_weight=rng.choice([0.0, 0.3]), itl_p99_load=rng.choice([0.0, 0.4]))
    prof = mp.PerfProfile(KEY, params, kv_tokens=rng.choice([None, 200_000.0]))
    mix = mix_from_quantiles([(0.5, rng.uniform(300, 3000)), (0.9, 6000), (0.99, rng.uniform(8000, 30000))],
                             [(0.5, rng.uniform(50, 400)), (0.9, 700)],
                             cached_share=rng.choice([None, 0.3]))
    cap = capacity_mix(prof, mix, ttft_p99_ms=5000, itl_p99_ms=100).max_rps
    for frac in (0.0, 0.7, 1.3):
        rate = frac * cap
        for itl in (False, True):
            base = predict_mix(prof, mix, max(rate, 1e-3))
            for obs in (0.5, 1.0, 1.7, 40.0):
                want = (base.itl_p99_ms if itl else base.ttft_p99_ms) * obs
                if not math.isfinite(want):
                    want = 1e4
                assert speed_from_latency(prof, mix, rate, want, itl=itl) == _speed_one_by_one(
                    prof, mix, rate, want, itl=itl)
