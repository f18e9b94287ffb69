"""The DES replica core: FastCore and BatchCore are the same steps (batching.plan_step); a macro-step
makes the decisions of the single steps it replaces, only its noise is averaged; histogram quantiles."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.capacity_truth import simulate
from fleetplan.sim.core import FastCore, replay_on_core
from fleetplan.sim.groundtruth import build_params


def _arrivals(rate: float, n: int, seed: int = 3) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, max(1, int(rng.lognormvariate(6.6, 0.9))), max(2, int(rng.lognormvariate(5.0, 0.8)))))
    return out


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.TRTLLM])
def test_fastcore_without_macro_steps_is_batchcore(engine: Engine) -> None:
    params = build_params(engine, "llama-3-8b", GpuType.H100, 1)
    arr = _arrivals(12.0, 600)
    ref = simulate(params, arr, seed=5)
    ttft, tpot = replay_on_core(params, arr, macro=False, seed=5)
    # the same steps and the same noise draws: equal to the last bit
    assert np.array_equal(np.sort(ttft), np.sort(np.array(ref.ttft_s)))
    assert np.array_equal(np.sort(tpot[~np.isnan(tpot)]), np.sort(np.array(ref.tpot_s)))


def test_fastcore_preempts_like_batchcore_under_kv_pressure() -> None:
    # a tiny KV pool forces vLLM-style preemption (recompute)
    params = replace(build_params(Engine.VLLM, "llama-3-8b", GpuType.H100, 1), kv_blocks=1200)
    arr = [a for a in _arrivals(20.0, 300, seed=9) if a[1] + a[2] <= 4000]
    ref = simulate(params, arr, seed=2)
    ttft, _tpot = replay_on_core(params, arr, macro=False, seed=2)
    assert np.array_equal(np.sort(ttft), np.sort(np.array(ref.ttft_s)))
    core = FastCore(params, seed=2, macro=True)
    for i, (_, p, o) in enumerate(arr[:80]):
        core.submit(i, p, o)
    now = 0.0
    while not core.idle():
        te = core.begin(now)
        assert te is not None
        now = te
        core.end()
    assert core.preemptions > 0 and core.free_blocks == params.kv_blocks


@pytest.mark.parametrize(("engine", "rate", "kv_blocks"),
                         [(Engine.TRTLLM, 14.0, None), (Engine.VLLM, 11.0, None), (Engine.VLLM, 20.0, 1200)])
def test_without_noise_macro_steps_are_the_single_steps(engine: Engine, rate: float, kv_blocks: int | None) -> None:
    """A macro-step runs only while plan_step would make pure-decode steps (nothing joins, no
    eviction, nobody finishes, no arrival), and its times are exact when the step time is: the
    same TTFT and ITL per request, up to float rounding of the summed step times."""
    params = replace(build_params(engine, "llama-3-8b", GpuType.H100, 1), noise_sigma=0.0)
    if kv_blocks is not None:  # KV pressure: evictions, and macro-steps cut where the pool runs out
        params = replace(params, kv_blocks=kv_blocks)
    arr = [a for a in _arrivals(rate, 1500, seed=9) if a[1] + a[2] <= params.kv_blocks * params.block_size]
    t_ex, p_ex = replay_on_core(params, arr, macro=False)
    t_ma, p_ma = replay_on_core(params, arr, macro=True)
    assert not np.isnan(t_ex).any()
    np.testing.assert_allclose(t_ma, t_ex, rtol=0.0, atol=1e-9)
    np.testing.assert_array_equal(np.isnan(p_ma), np.isnan(p_ex))
    np.testing.assert_allclose(p_ma[~np.isnan(p_ma)], p_ex[~np.isnan(p_ex)], rtol=0.0, atol=1e-9)


@pytest.mark.parametrize(("engine", "rate"), [(Engine.TRTLLM, 14.0), (Engine.VLLM, 11.0)])
def test_macro_steps_average_the_step_noise(engine: Engine, rate: float) -> None:
    """With noise a macro-step times its steps by the noise's mean instead of one draw per step
    (the only difference, see the noise-free test above): the distributions stay close."""
    params = build_params(engine, "llama-3-8b", GpuType.H100, 1)
    arr = _arrivals(rate, 1500)
    t_ex, p_ex = replay_on_core(params, arr, macro=False)
    t_ma, p_ma = replay_on_core(params, arr, macro=True)
    p_ex, p_ma = p_ex[~np.isnan(p_ex)], p_ma[~np.isnan(p_ma)]
    assert t_ma.mean() == pytest.approx(t_ex.mean(), rel=0.05)
    assert p_ma.mean() == pytest.approx(p_ex.mean(), rel=0.03)
    assert np.quantile(t_ma, 0.99) == pytest.approx(np.quantile(t_ex, 0.99), rel=0.12)
    assert np.quantile(p_ma, 0.99) == pytest.approx(np.quantile(p_ex, 0.99), rel=0.08)




class _Planned(FastCore):
    """FastCore that plans every exact step with schedule() (plan_step), never `_plan_decoding`."""

    def _plan_single(self, now: float) -> float | None:
        self._stats = None
        return super()._plan_single(now)


class _Counted(FastCore):
    decoding_steps = 0

    def _plan_decoding(self, now: float, ctx: int) -> float:
        self.decoding_steps += 1
        return super()._plan_decoding(now, ctx)


@pytest.mark.parametrize(("engine", "rate", "max_num_seqs"),
                         [(Engine.TRTLLM, 14.0, None), (Engine.TRTLLM, 30.0, 8), (Engine.VLLM, 11.0, None)])
def test_decoding_steps_are_plan_steps(engine: Engine, rate: float, max_num_seqs: int | None) -> None:
    """A step planned from the decode statistics (every running request decoding, KV reserved at
    admission) is the step plan_step makes: the same composition, KV, duration and noise draw, so the
    replay is equal to the last bit; engines that grow their KV (vLLM) always take plan_step."""
    params = build_params(engine, "llama-3-8b", GpuType.H100, 1)
    if max_num_seqs is not None:  # a full batch: the queue waits for seats
        params = replace(params, max_num_seqs=max_num_seqs)
    arr = _arrivals(rate, 1500)
    fast, ref = _Counted(params, seed=4), _Planned(params, seed=4)
    t_f, p_f = replay_on_core(params, arr, core=fast)
    t_r, p_r = replay_on_core(params, arr, core=ref)
    assert np.array_equal(t_f, t_r)
    assert np.array_equal(p_f, p_r, equal_nan=True)
    assert fast.steps == ref.steps and fast.free_blocks == ref.free_blocks == params.kv_blocks
    if engine is Engine.TRTLLM:
        assert fast.decoding_steps > 500
    else:
        assert fast.decoding_steps == 0
