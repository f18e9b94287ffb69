"""The length mix's cached share of the prompt (models/mix.py): prefill work, TTFT and capacity use
the uncached tokens; memory still holds the whole prompt; 0 is the old answer exactly."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from fleetplan.models import profile as mp
from fleetplan.models.mix import LengthMix, capacity_mix, mix_from_quantiles, predict_mix, prefill_work
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.profile import work_terms

KEY = mp.ConfigKey("m8", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
PARAMS = mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06, p2_ms=2e-7, q=1.0,
                       queue_tail=0.5)
PROFILE = mp.PerfProfile(KEY, PARAMS, kv_tokens=400_000.0,
                         data_range=mp.DataRange((128.0, 4096.0), (64.0, 1024.0), (0.5, 20.0), None, 8))

MIX = LengthMix(((2000.0, 300.0, 0.6), (12000.0, 350.0, 0.35), (40000.0, 400.0, 0.05)))
SLO = {"ttft_p99_ms": 20000.0, "itl_p99_ms": 120.0}


def test_zero_share_is_the_old_mix() -> None:
    assert MIX.cached_share == 0.0 and MIX.with_cached_share(None) == MIX
    np.testing.assert_array_equal(prefill_work(PARAMS, np.array([100.0, 5000.0])),
                                  work_terms(PARAMS, np.array([100.0, 5000.0]), np.array([1.0, 1.0]))[0])


def test_prefill_work_of_the_uncached_tokens() -> None:
    isl = 10000.0
    full = float(prefill_work(PARAMS, isl))
    half = float(prefill_work(PARAMS, isl, 0.5))
    c = 5000.0
    assert half == pytest.approx(PARAMS.p0_ms + PARAMS.p1_ms * (isl - c) + PARAMS.p2_ms * (isl**2 - c**2))
    assert 0.45 * full < half < 0.8 * full  # the computed half still attends to the cached half
    one = float(prefill_work(PARAMS, isl, 1.0))  # all cached: the last token is recomputed
    assert one == pytest.approx(PARAMS.p0_ms + PARAMS.p1_ms + PARAMS.p2_ms * (isl**2 - (isl - 1) ** 2))


def test_cached_share_raises_capacity_and_lowers_ttft() -> None:
    base = capacity_mix(PROFILE, MIX, **SLO)
    caps = [capacity_mix(PROFILE, MIX.with_cached_share(s), **SLO).max_rps for s in (0.0, 0.2, 0.366, 0.6)]
    assert caps[0] == pytest.approx(base.max_rps)
    assert all(b > a for a, b in itertools.pairwise(caps))
    rate = 0.5 * base.max_rps
    assert predict_mix(PROFILE, MIX.with_cached_share(0.366), rate).ttft_p99_ms < predict_mix(PROFILE, MIX, rate).ttft_p99_ms


def test_memory_bound_ignores_the_cache() -> None:
    tight = replace(PROFILE, kv_tokens=60_000.0)  # a tiny KV pool: memory binds
    loose = {"ttft_p99_ms": 1e9, "itl_p99_ms": 1e9}
    a = capacity_mix(tight, MIX, **loose)
    b = capacity_mix(tight, MIX.with_cached_share(0.5), **loose)
    assert a.binding == "memory" and b.binding == "memory"
    assert b.max_rps == pytest.approx(a.max_rps, rel=0.25)  # only the shorter stay (less prefill) moves it


def test_bounds_and_describe() -> None:
    with pytest.raises(ValueError, match="cached_share"):
        LengthMix(MIX.classes, cached_share=1.5)
    with pytest.raises(ValueError, match="cached_share"):
        LengthMix(MIX.classes, cached_share=float("nan"))
    assert MIX.with_cached_share(2.0).cached_share == 1.0
    assert "37% of prompt tokens cached" in MIX.with_cached_share(0.366).describe()
    m = mix_from_quantiles([(0.5, 1000), (0.99, 8000)], [], osl_mean=200, cached_share=0.3)
    assert m.cached_share == 0.3
