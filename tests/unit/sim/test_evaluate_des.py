"""The DES replica core: FastCore and BatchCore are the same steps (groundtruth.plan_step); a macro-step
makes the decisions of the single steps it replaces, only its noise is averaged; histogram quantiles."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.core import ITL_BUCKETS_S, FastCore, replay_on_core
from fleetplan.sim.des import histogram_quantile
from fleetplan.sim.groundtruth import build_params, simulate


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


def test_histogram_quantile_like_prometheus() -> None:
    edges = (0.1, 0.2, 0.4)
    assert histogram_quantile(0.5, edges, [0, 10, 0, 0]) == pytest.approx(0.15)
    assert histogram_quantile(0.99, edges, [0, 0, 0, 5]) == pytest.approx(0.4)  # +Inf bucket
    assert histogram_quantile(0.5, edges, [0, 0, 0, 0]) is None
    counts = [0.0] * (len(ITL_BUCKETS_S) + 1)
    counts[3] = 100.0
    q = histogram_quantile(0.99, ITL_BUCKETS_S, counts)
    assert q is not None and ITL_BUCKETS_S[2] < q <= ITL_BUCKETS_S[3]


def test_lifecycle_goes_through_the_act_core_make_before_break_and_gpu_hours() -> None:
    """The replay applies the controller's actions through the shipped act core (planner/act.py):
    a start on GPUs still in use moves to free ones, a drain waits while a replacement starts (no request
    is rejected for lack of a READY replica), GPU-hours run from launch to stop."""
    from fleetplan.models.names import Precision
    from fleetplan.planner.policy import load_policy_text
    from fleetplan.planner.types import Action, ActionKind, ConfigKey, Replica, ReplicaState
    from fleetplan.sim.des import ControllerView, Decision, FleetSim, SimSettings
    from fleetplan.sim.evaluate import make_environment
    from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

    policy = load_policy_text(
        """
gpu_types: {h100: {price_usd_h: 2.0}}
hosts: [{name: h1, gpu: h100, gpu_count: 2}]
engines:
  vllm: {launch: {command: vllm}, startup: {default_s: 30}}
models:
  - {name: llama-3-8b, slo: {ttft_p99_ms: 500, itl_p99_ms: 50}, allowed: {engines: [vllm], tp: [1]},
     workload: {isl: 500, osl: 50}}
""", "p")
    cfg = ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16)

    class Scripted:
        name = "scripted"
        period_s = 60.0

        def decide(self, view: ControllerView) -> Decision:
            live = sorted((r for r in view.fleet.replicas if r.state != ReplicaState.STOPPED),
                          key=lambda r: r.gpu_indices)
            if view.t_s == 0.0:
                return Decision(actions=(Action(ActionKind.START, Replica("a", cfg, "h1", (0,),
                                                                          ReplicaState.STARTING), "warm"),))
            if view.t_s == 60.0:  # GPU 0 is busy: the start moves to GPU 1; the drain waits for it
                return Decision(actions=(Action(ActionKind.START, Replica("b", cfg, "h1", (0,), ReplicaState.STARTING),
                                                "swap"), Action(ActionKind.DRAIN, live[0], "swap")))
            if view.t_s >= 120.0 and len(live) == 2:
                return Decision(actions=(Action(ActionKind.DRAIN, live[0], "swap"),))
            return Decision()

    reqs = tuple(TraceRequest(i * 0.5, 200, 20, "llama-3-8b") for i in range(1201))  # 2 rps, 600 s
    sim = FleetSim(Trace("t", TraceFormat.AZURE, reqs), Scripted(), make_environment(policy), SimSettings())
    res = sim.run()
    rep1, rep2 = sim.replicas
    assert rep1.gpus == (0,) and rep2.gpus == (1,)
    assert rep2.t_start == 60.0 and rep2.t_ready == pytest.approx(90.0)
    assert rep1.t_stop is not None and 120.0 <= rep1.t_stop < 121.0  # drained once the replacement served
    assert res.deferred_actions == 1  # the drain while "b" started
    assert res.swap_cycles == 0 and res.replica_starts == 1  # the replacement (t = 0 is the initial fleet)
    assert res.rejected == 0
    assert res.served + res.rejected + res.unfinished == res.arrived == 1201
    assert res.gpu_hours == pytest.approx((rep1.t_stop + 600.0 - 60.0) / 3600.0, rel=1e-3)
    assert res.cost_usd == pytest.approx(2.0 * res.gpu_hours)
