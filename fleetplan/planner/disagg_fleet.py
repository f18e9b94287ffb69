"""A model's cheapest aggregated fleet against its cheapest disaggregated pair, across its configurations.

`disagg_choice.choose_serving` compares the two on one configuration. A model may run several
(engines, GPU types, TP sizes): the aggregated fleet is the cheapest single configuration, and the
two pools of a disaggregated pair are sized independently, each on the configuration cheapest for
its own target (a prefill pool at a larger TP for the TTFT, a decode pool at a smaller one for
the ITL: the parallelism TensorRT-LLM's and vLLM's disaggregated serving let each phase choose).
A pair shares the engine (the KV connector is the engine's) and the GPU type (the pools' KV moves
over `link_for(gpu)`); the transfer is computed on the prefill pool's TP (each of its GPUs sends its
shard). Capacities are computed once per configuration; a demand only re-counts replicas, so the
demand at which the other mode would win is searched on the same 1/16-octave grid as one
configuration's (`disagg_choice.RATE_RANGE`).

Pure: the policy, the profiles and the speeds are arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fleetplan.models.disagg import DisaggCapacity, KvLink, host_link
from fleetplan.models.mix import LengthMix, MixCapacity
from fleetplan.models.names import Engine, GpuType
from fleetplan.models.profile import PerfProfile
from fleetplan.planner.disagg_choice import (
    RATE_RANGE,
    RATE_STEPS_PER_OCTAVE,
    DisaggFleet,
    PhaseSpeeds,
    Pool,
    Serving,
    decide,
    serving_capacities,
    size_pool,
)
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey


@dataclass(frozen=True)
class ConfigPool:
    config: ConfigKey
    pool: Pool


@dataclass(frozen=True)
class ModelServing:
    """The chosen serving mode of one model at one demand, and the best fleet of each mode."""

    model: str
    rate_rps: float
    chosen: Serving
    slo_reachable: bool  # the chosen fleet meets the p99 targets for the mix
    aggregated: ConfigPool | None  # None: no configuration with a profile and a price
    prefill: ConfigPool | None  # None: no pair (KV bytes unknown, or no configuration)
    decode: ConfigPool | None
    transfer_p99_ms: float | None  # the pair's KV transfer of the p99 prompt
    extrapolated: bool  # the pair's pools are derived from aggregated profiles
    flip_rate_rps: float | None  # the nearest demand at which the other mode would win (None: none in range)

    def gpus(self) -> int:
        """GPUs of the chosen fleet."""
        if self.chosen is Serving.DISAGGREGATED and self.prefill is not None and self.decode is not None:
            return self.prefill.pool.gpus + self.decode.pool.gpus
        return 0 if self.aggregated is None else self.aggregated.pool.gpus


@dataclass(frozen=True)
class _Config:
    key: ConfigKey
    price_usd_h: float
    agg: MixCapacity
    dis: DisaggCapacity | None


def _cheapest(pools: list[ConfigPool]) -> ConfigPool | None:
    """The cheapest reachable pool (then fewer GPUs, then the config's order); else the cheapest."""
    if not pools:
        return None
    return min(pools, key=lambda cp: (not cp.pool.reachable, cp.pool.usd_h, cp.pool.gpus, cp.config))


def _at(model: str, rate_rps: float, headroom: float, configs: list[_Config]) -> ModelServing:
    need = max(rate_rps, 0.0) * (1.0 + headroom)
    agg = _cheapest([ConfigPool(c.key, size_pool(need, c.agg, c.key.tp, c.price_usd_h)) for c in configs])
    best: tuple[ConfigPool, ConfigPool, DisaggCapacity] | None = None
    groups: dict[tuple[Engine, GpuType], list[_Config]] = {}
    for c in configs:
        if c.dis is not None:
            groups.setdefault((c.key.engine, c.key.gpu), []).append(c)
    for group in groups.values():
        pre = _cheapest([ConfigPool(c.key, size_pool(need, c.dis.prefill, c.key.tp, c.price_usd_h))
                         for c in group if c.dis is not None])
        dec = _cheapest([ConfigPool(c.key, size_pool(need, c.dis.decode, c.key.tp, c.price_usd_h))
                         for c in group if c.dis is not None])
        assert pre is not None and dec is not None
        pre_dis = next(c.dis for c in group if c.key == pre.config and c.dis is not None)
        if best is None or _pair_order(pre, dec) < _pair_order(best[0], best[1]):
            best = (pre, dec, pre_dis)
    if agg is None:
        return ModelServing(model, rate_rps, Serving.AGGREGATED, False, None, None, None, None, False, None)
    fleet = None if best is None else DisaggFleet(best[0].pool, best[1].pool, best[2].transfer_p99_ms,
                                                  best[2].extrapolated)
    chosen, reachable = decide(agg.pool, fleet)
    return ModelServing(model, rate_rps, chosen, reachable, agg, None if best is None else best[0],
                        None if best is None else best[1], None if fleet is None else fleet.transfer_p99_ms,
                        False if fleet is None else fleet.extrapolated, None)


def _pair_order(pre: ConfigPool, dec: ConfigPool) -> tuple[bool, float, int]:
    reachable = pre.pool.reachable and dec.pool.reachable
    return (not reachable, pre.pool.usd_h + dec.pool.usd_h, pre.pool.gpus + dec.pool.gpus)


def choose_for_model(policy: Policy, model: str, profiles: Mapping[ConfigKey, PerfProfile], mix: LengthMix,
                     rate_rps: float, *, link_for: Callable[[GpuType], KvLink] = host_link,
                     speeds: Mapping[ConfigKey, PhaseSpeeds] | None = None,
                     transfer_isl_p99: float | None = None) -> ModelServing:
    """The cheaper of `model`'s best aggregated fleet and best disaggregated pair for `rate_rps` of
    `mix` at its SLO and headroom, over the configurations in `profiles` (those of `model` whose GPU
    type has a price in the policy; `planner.capacity.resolve_profiles` gives them), each at its
    speeds (none: as profiled). `transfer_isl_p99`: the prompt p99 when `mix` is the mean of a spread
    (`planner.capacity.mix_for` evaluates length-spread profiles at the mean).

    On Llama-3-8B vLLM H100 TP1 and TP2 (roofline priors), 4,096-token prompts and 32-token outputs
    at 20 rps, TTFT 600 ms and ITL 20 ms, no headroom: aggregated TP1 x 8 (8 GPUs) against 6 prefill
    + 1 decode replicas of TP1 (7 GPUs): disaggregated (tests/unit/planner/test_disagg_fleet.py).
    """
    if not (math.isfinite(rate_rps) and rate_rps >= 0):
        raise ValueError(f"rate_rps={rate_rps!r}: expected a finite rate >= 0")
    m = policy.model(model)
    if m is None:
        raise ValueError(f"model {model!r} is not in the policy")
    configs: list[_Config] = []
    for key, prof in sorted(profiles.items()):
        price = policy.price_usd_h(key.gpu)
        if key.model != m.name or price is None:
            continue
        try:
            agg, dis = serving_capacities(prof, mix, ttft_p99_ms=m.slo.ttft_p99_ms, itl_p99_ms=m.slo.itl_p99_ms,
                                          link=link_for(key.gpu), speeds=(speeds or {}).get(key, PhaseSpeeds()),
                                          transfer_isl_p99=transfer_isl_p99)
        except (ValueError, ArithmeticError):
            continue  # a profile that cannot answer for this mix: not a candidate
        configs.append(_Config(key, price, agg, dis))
    here = _at(m.name, rate_rps, m.headroom, configs)
    flip = None
    if rate_rps > 0.0 and here.aggregated is not None:
        steps = int(math.log2(RATE_RANGE) * RATE_STEPS_PER_OCTAVE)
        for k in range(1, steps + 1):
            rates = [rate_rps * 2.0 ** (sign * k / RATE_STEPS_PER_OCTAVE) for sign in (-1, 1)]
            hit = [r for r in rates if _at(m.name, r, m.headroom, configs).chosen is not here.chosen]
            if hit:
                flip = float(hit[0])
                break
    return ModelServing(here.model, here.rate_rps, here.chosen, here.slo_reachable, here.aggregated, here.prefill,
                        here.decode, here.transfer_p99_ms, here.extrapolated, flip)
