"""The KV room a decode replica's arrivals find (models/kv_room.py) against the simulator's decode
engine (TensorRT-LLM persona, H100 TP1: KV reserved for prompt + output at admission, FIFO): at the
rate the model gives for 1% of arrivals waiting, about 1% or fewer wait there, and more than that at
1.5x the rate (the model is not far on the safe side); at the rate where the MEAN occupancy fills
the cache (the memory limit the decode pool was sized at before) most do."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from fleetplan.models.config_key import Role
from fleetplan.models.disagg import pool_profiles
from fleetplan.models.kv_room import kv_room_rps
from fleetplan.models.mix import QUANTILE_LEVELS, LengthMix, capacity_mix, mix_from_quantiles
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.profile import roofline_profile
from fleetplan.planner.types import ConfigKey, HostInventory
from fleetplan.sim.baselines import StaticController
from fleetplan.sim.core import TTFT_BUCKETS_S
from fleetplan.sim.des import Environment, FleetSim, SimSettings
from fleetplan.sim.groundtruth import build_params
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

M = "llama-3-8b"
AGG = ConfigKey(M, Engine.TRTLLM, GpuType.H100, 1, Precision.BF16)
PRE, DEC = replace(AGG, role=Role.PREFILL), replace(AGG, role=Role.DECODE)
PARAMS = build_params(Engine.TRTLLM, M, GpuType.H100, 1, noise_sigma=0.0)
KV_TOKENS = float(PARAMS.kv_blocks * PARAMS.block_size)  # the engine's own cache
# the decode pool as the planner reads it: the roofline prior's steps, the engine's cache size
DECODE = replace(pool_profiles(roofline_profile(AGG)).decode, kv_tokens=KV_TOKENS)
LATE_S = 0.25  # a decode-side TTFT beyond this waited for KV room (transfer + first step: < 0.1 s)
DURATION_S = 1200.0


def _env() -> Environment:
    return Environment(hosts=(HostInventory("h1", GpuType.H100, 8),), price_usd_h={"h100": 2.0},
                       params_for=lambda c: PARAMS, startup_s=lambda c: 30.0, build_s=lambda c: None,
                       cached=frozenset(), ttft_slo_ms={M: 15_000.0}, itl_slo_ms={M: 120.0})


def _lengths(kind: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if kind == "tail":  # a tenth of the prompts 100k tokens long, the rest 2k
        return np.where(rng.random(n) < 0.1, 100_000, 2_000), np.full(n, 300)
    isl = np.minimum(rng.lognormal(math.log(4000), 1.4, n), 120_000).astype(int)  # a chat-like spread
    return isl, np.maximum(rng.lognormal(math.log(250), 0.8, n), 2).astype(int)


def _mix(kind: str) -> LengthMix:
    """The mix as the planner reads it from the engines' histograms: quantiles and means."""
    isl, osl = _lengths(kind, 200_000, np.random.default_rng(1))
    return mix_from_quantiles([(q, float(np.quantile(isl, q))) for q in QUANTILE_LEVELS],
                              [(q, float(np.quantile(osl, q))) for q in QUANTILE_LEVELS],
                              isl_mean=float(isl.mean()), osl_mean=float(osl.mean()))


def _late_share(kind: str, rate_rps: float, seed: int = 3) -> float:
    """The share of the decode replica's requests whose TTFT there (from their arrival at it, as the
    engine exports it) is beyond LATE_S: one decode replica behind seven prefill replicas."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * DURATION_S)))
    isl, osl = _lengths(kind, len(t), rng)
    reqs = tuple(TraceRequest(float(a), int(p), int(o), M) for a, p, o in zip(t, isl, osl, strict=True))
    sim = FleetSim(Trace("t", TraceFormat.AZURE, reqs), StaticController("fixed", {PRE: 7, DEC: 1}), _env(),
                   SimSettings())
    res = sim.run()
    assert res.served == len(reqs)
    dec = next(r for r in sim.replicas if r.config == DEC)
    hist = np.array(dec.counters.ttft)  # per bucket, the last +Inf
    return float(hist[TTFT_BUCKETS_S.index(LATE_S) + 1:].sum() / hist.sum())


@pytest.mark.parametrize("kind", ["tail", "lognormal"])
def test_at_the_room_rate_about_one_percent_wait_at_the_mean_limit_most(kind: str) -> None:
    mix = _mix(kind)
    room = kv_room_rps(DECODE, mix, wait_share=0.01)
    mean_limit = capacity_mix(DECODE, mix, ttft_p99_ms=math.inf, itl_p99_ms=math.inf)
    assert mean_limit.binding == "memory" and room < 0.6 * mean_limit.max_rps
    assert _late_share(kind, room) <= 0.015  # measured: tail 1.1%, lognormal 0.0%
    assert _late_share(kind, 1.5 * room) > 0.015  # 3.1%, 2.6%
    assert _late_share(kind, mean_limit.max_rps) >= 0.5  # 96%, 96%
