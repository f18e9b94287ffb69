"""Coarse histogram buckets are not evidence (issue 17.3): a fixed-length load is not called
extrapolating because of bucket width, and the correction weighs a p99 by its bucket's width."""

from __future__ import annotations

import math
from types import MappingProxyType

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
