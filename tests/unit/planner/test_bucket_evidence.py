"""Coarse histogram buckets are not evidence (issue 17.3): a fixed-length load is not called
extrapolating because of bucket width, and the correction weighs a p99 by its bucket's width."""

from __future__ import annotations

import itertools
import math
from types import MappingProxyType

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.mix import mix_from_quantiles
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.capacity import extrapolation
from fleetplan.planner.evidence import Evidence, interpret

M = "qwen-0.5b"
KEY = mp.ConfigKey(M, Engine.VLLM, GpuType.H100, 1, Precision.BF16)
# a real vLLM (CPU build) profile fitted on prompts of exactly 64 tokens
PROF = mp.PerfProfile(KEY, mp.PerfParams(s0_ms=20.0, s1_ms=0.1, s2_ms=0.0, p0_ms=5.0, p1_ms=0.2, p2_ms=0.0, q=1.0),
                      data_range=mp.DataRange((64.0, 64.0), (64.0, 64.0), (0.5, 10.0), None, 6))
EDGES = [float(m * 10 ** e) for e in range(0, 5) for m in (1, 2, 5)]  # vLLM's build_1_2_5_buckets
WINDOW = 60.0


def prompts_of_64(moments: bool) -> Evidence:
    rate = 200.0 / WINDOW  # 200 prompts of 64 tokens in the window, all in the (50, 100] bucket
    b = tuple((le, 0.0 if le < 64 else rate) for le in [*EDGES, math.inf])
    return Evidence(WINDOW, 1.0, prompt_len=MappingProxyType({M: b}),
                    prompt_len_moments=MappingProxyType({M: (64.0 * rate, rate)}) if moments else None)


def test_a_fixed_length_load_on_the_length_the_profile_was_fitted_on_is_not_extrapolating() -> None:
    me = interpret(M, prompts_of_64(moments=True), [], 0.0, stale=False)
    mix = mix_from_quantiles(me.isl_quantiles, [], isl_mean=64.0, osl_mean=64.0)
    assert mix.isl_quantile(0.99) == 64.0
    assert extrapolation(PROF, mix) == ()
    # without _sum/_count Prometheus' reading is p99 99.5 (interpolated in the bucket); the guard then
    # reads the most favourable side of the bucket (50) and the load is inside the data all the same
    plain = interpret(M, prompts_of_64(moments=False), [], 0.0, stale=False)
    pmix = mix_from_quantiles(plain.isl_quantiles, [], isl_mean=64.0, osl_mean=64.0)
    assert pmix.isl_quantile(0.99) > 80.0
    assert extrapolation(PROF, pmix) != ()  # the interpolated p99 alone
    assert extrapolation(PROF, pmix, plain.isl_p99_low()) == ()


def _fit_shape_one_by_one(occupied: list[tuple[float, float, float]], mean: float) -> tuple[float, float]:
    """evidence._fit_shape as 36 halvings placed one at a time (what the batched fit must equal)."""
    import numpy as np

    from fleetplan.planner import evidence as e

    lo = np.array([b[0] for b in occupied])
    hi = np.array([b[1] for b in occupied])
    n = np.array([b[2] for b in occupied])
    total = float(n.sum())
    with np.errstate(divide="ignore"):
        llo, lhi = np.log(lo), np.log(hi)
    bounds = np.concatenate([lo[lo > 0], hi])
    s = e._SCALES[:, None]
    a_lo = np.full(len(e._SCALES), math.log(float(bounds.min())) - 2.0)
    a_hi = np.full(len(e._SCALES), math.log(float(bounds.max())) + 2.0)
    for _ in range(36):
        mid = 0.5 * (a_lo + a_hi)
        x, _, _ = e._placed(mid[:, None], s, llo, lhi, lo, hi, e._GL_X)
        below = ((x * e._GL_W).sum(-1) * n).sum(-1) / total < mean
        a_lo, a_hi = np.where(below, mid, a_lo), np.where(below, a_hi, mid)
    a = 0.5 * (a_lo + a_hi)
    _, gl, gu = e._placed(a[:, None], s, llo, lhi, lo, hi, e._GL_X)
    ll = (n * np.log(np.maximum(gu - gl, 1e-300))).sum(-1)
    best = int(np.argmax(ll >= ll.max() - 1e-9 * max(1.0, abs(float(ll.max())))))
    return float(a[best]), float(e._SCALES[best])


@pytest.mark.parametrize("seed", range(5))
def test_the_batched_shape_fit_is_the_halvings_bit_for_bit(seed: int) -> None:
    """_fit_shape places several halvings' midpoints per pass: the same shape to the last bit."""
    import random

    from fleetplan.planner.evidence import _fit_shape

    rng = random.Random(seed)
    for _ in range(20):
        edges = sorted({round(rng.uniform(0, 5000), 1) for _ in range(rng.randint(2, 16))})
        occupied = [(a, b, float(rng.randint(1, 500))) for a, b in itertools.pairwise(edges)]
        m_lo = sum(a * c for a, _, c in occupied) / sum(c for *_, c in occupied)
        m_hi = sum(b * c for _, b, c in occupied) / sum(c for *_, c in occupied)
        mean = rng.uniform(m_lo, m_hi)
        assert _fit_shape(occupied, mean) == _fit_shape_one_by_one(occupied, mean)


@pytest.mark.parametrize("seed", range(4))
def test_the_shape_fit_of_engine_histograms_is_the_halvings_bit_for_bit(seed: int) -> None:
    """Lengths and latencies binned on the engines' own edges (a few occupied buckets, most requests in
    one or two: the scales that cannot win stop early) fit as the 36 halvings of every scale do."""
    import random

    from fleetplan.planner.evidence import _fit_shape
    from fleetplan.sim.core import LENGTH_BUCKETS, TTFT_BUCKETS_S

    rng = random.Random(seed)
    for edges, mu, sigma in ((LENGTH_BUCKETS, 6.5, 1.0), (LENGTH_BUCKETS, 4.2, 0.2), (TTFT_BUCKETS_S, -1.6, 0.6),
                             (TTFT_BUCKETS_S, -3.0, 0.05)):
        xs = [rng.lognormvariate(mu, sigma) for _ in range(rng.randint(30, 3000))]
        counts = [0.0] * len(edges)
        for x in xs:
            counts[min(next((i for i, e in enumerate(edges) if x <= e), len(edges) - 1), len(edges) - 1)] += 1.0
        lows = (0.0, *edges[:-1])
        occupied = [(a, b, c / 60.0) for a, b, c in zip(lows, edges, counts, strict=True) if c > 0 and a > 0]
        if len(occupied) < 2:
            continue
        total = sum(c for *_, c in occupied)
        mean = sum(min(max(x, a), b) for x in xs for a, b, _ in occupied if a < x <= b) / 60.0 / total
        assert _fit_shape(occupied, mean) == _fit_shape_one_by_one(occupied, mean)
