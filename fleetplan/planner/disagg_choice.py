"""Aggregated or disaggregated serving for one model: the cheaper fleet at the SLO, and what would flip it.

For a model's demand (a rate and a length mix) and its SLO (TTFT and per-request ITL p99 targets),
on one configuration (engine, GPU type, TP) and its profile:

- the aggregated fleet: replicas = ceil(rate x (1 + headroom) / capacity), the capacity of one
  replica for the mix at both targets (`models.mix.capacity_mix`);
- the disaggregated pair of pools: prefill replicas sized for the TTFT target alone (prefill,
  queue, KV transfer), decode replicas for the ITL target alone (decode steps with no prefill in
  them, the KV cache), each with the same headroom (`models.disagg`).

The cheaper one that meets the SLO wins; on a tie, aggregated (one pool, no transfer, no proxy).
Where neither reaches the p99 targets for the mix, aggregated stays (`slo_reachable` False).

Why disaggregation can win: in an aggregated replica the prefill work of long prompts enters every
decode step (the step time s0 / (1 - rho) counts it, and the p99 request carries the prefill stalls
where the profile has them), so a tight ITL target caps the utilisation of the whole replica; the
decode pool runs at that cap with only decode work, the prefill pool at the TTFT target's. What it
costs: at least one replica per pool (a light load stays aggregated), the KV transfer in every TTFT
(a slow link between the pools flips it back), and the decode side's first step.

What would flip it (`Flips`), each the nearest crossing found, None when there is none in range:
the demand (x 1/64 .. 64), the prompt lengths (every prompt x 1/8 .. 8) and the link bandwidth.

Pure; the profiles and prices are arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from fleetplan.models.disagg import (
    DisaggCapacity,
    KvLink,
    PoolProfiles,
    disagg_capacity,
    pool_profiles,
    replicas_for,
)
from fleetplan.models.mix import LengthMix, MixCapacity, capacity_mix
from fleetplan.models.profile import PerfProfile

RATE_RANGE = 64.0  # the demand is searched from rate / 64 to rate x 64
RATE_STEPS_PER_OCTAVE = 16
ISL_RANGE = 8.0  # prompts scaled from 1/8 to 8 times
LINK_RANGE = (0.1, 10_000.0)  # GB/s searched for the link's crossing
_HALVINGS = 8  # bisection steps on the log of a scale (prompts: ~1.2% resolution over 8x)


class Serving(StrEnum):
    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class Pool:
    """Replicas of one configuration serving one phase (or both, aggregated)."""

    replicas: int
    gpus: int
    usd_h: float
    capacity_rps: float  # one replica's, at the pool's targets
    binding: str  # what limits a replica: ttft | itl | memory
    reachable: bool  # its p99 target(s) can be met for the mix (floor_share None)


@dataclass(frozen=True)
class DisaggFleet:
    prefill: Pool
    decode: Pool
    transfer_p99_ms: float  # KV transfer of the p99 prompt
    extrapolated: bool  # the pools are derived from the aggregated profile (no disaggregated benchmark)

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @property
    def usd_h(self) -> float:
        return self.prefill.usd_h + self.decode.usd_h

    @property
    def reachable(self) -> bool:
        return self.prefill.reachable and self.decode.reachable

    def ratio(self) -> str:
        """prefill:decode replicas, for the explanation."""
        return f"{self.prefill.replicas}:{self.decode.replicas}"


@dataclass(frozen=True)
class Flips:
    """Where the other serving mode would win (None: not within the searched range)."""

    rate_rps: float | None  # the nearest demand (same mix) at which it would
    isl_scale: float | None  # the nearest factor on every prompt's length at which it would
    link_gb_s: float | None  # the link line rate (GB/s per GPU) at which it would


@dataclass(frozen=True)
class ServingChoice:
    chosen: Serving
    aggregated: Pool
    disaggregated: DisaggFleet | None  # None: the KV bytes per token are unknown
    slo_reachable: bool  # the chosen fleet meets the p99 targets for the mix
    flips: Flips | None  # None: not computed (flips=False)

    def saving_usd_h(self) -> float:
        """What the chosen fleet saves against the other one ($/h; 0 when there is no other)."""
        if self.disaggregated is None:
            return 0.0
        agg, dis = self.aggregated.usd_h, self.disaggregated.usd_h
        return agg - dis if self.chosen is Serving.DISAGGREGATED else dis - agg


@dataclass(frozen=True)
class PhaseSpeeds:
    """Engine speeds relative to the profiles (the online correction's; 1.0: as fitted)."""

    ttft: float = 1.0  # observed through the aggregated replicas' TTFT: the aggregated and the prefill side
    itl: float = 1.0  # observed through the aggregated replicas' ITL: the aggregated side only
    decode_itl: float = 1.0  # observed through a decode pool's ITL (1.0 until one runs)


@dataclass(frozen=True)
class _Inputs:
    profile: PerfProfile
    pools: PoolProfiles
    ttft_p99_ms: float
    itl_p99_ms: float
    link: KvLink
    price_usd_h: float
    headroom: float
    speeds: PhaseSpeeds
    transfer_isl_p99: float | None = None


def size_pool(need_rps: float, cap: MixCapacity, tp: int, price_usd_h: float) -> Pool:
    """Replicas of capacity `cap` (TP `tp`, `price_usd_h` a GPU) that carry `need_rps`."""
    reachable = cap.floor_share is None and cap.max_rps > 0.0
    replicas = replicas_for(need_rps, cap.max_rps) if cap.max_rps > 0.0 else 0
    gpus = replicas * tp
    return Pool(replicas, gpus, gpus * price_usd_h, cap.max_rps, cap.binding, reachable)


def _fleets(inp: _Inputs, rate_rps: float, agg: MixCapacity,
            dis: DisaggCapacity | None) -> tuple[Pool, DisaggFleet | None]:
    tp = inp.profile.key.tp
    need = max(rate_rps, 0.0) * (1.0 + inp.headroom)
    a = size_pool(need, agg, tp, inp.price_usd_h)
    if dis is None:
        return a, None
    d = DisaggFleet(size_pool(need, dis.prefill, tp, inp.price_usd_h), size_pool(need, dis.decode, tp, inp.price_usd_h),
                    dis.transfer_p99_ms, dis.extrapolated)
    return a, d


def decide(a: Pool, d: DisaggFleet | None) -> tuple[Serving, bool]:
    """(the mode, whether it meets the SLO): the cheaper reachable one; on a tie aggregated."""
    if d is None or not d.reachable:
        return Serving.AGGREGATED, a.reachable
    if not a.reachable or d.usd_h < a.usd_h:
        return Serving.DISAGGREGATED, True
    return Serving.AGGREGATED, True


def _capacities(inp: _Inputs, mix: LengthMix, link: KvLink) -> tuple[MixCapacity, DisaggCapacity | None]:
    sp = inp.speeds
    agg = capacity_mix(inp.profile, mix, ttft_p99_ms=inp.ttft_p99_ms, itl_p99_ms=inp.itl_p99_ms,
                       ttft_speed=sp.ttft, itl_speed=sp.itl)
    return agg, _disagg(inp, mix, link)


def serving_capacities(profile: PerfProfile, mix: LengthMix, *, ttft_p99_ms: float, itl_p99_ms: float,
                       link: KvLink, pools: PoolProfiles | None = None, speeds: PhaseSpeeds = PhaseSpeeds(),
                       transfer_isl_p99: float | None = None) -> tuple[MixCapacity, DisaggCapacity | None]:
    """One aggregated replica's capacity and one prefill and one decode replica's, as `choose_serving`
    computes them (`pools`, `speeds`, `transfer_isl_p99`: as there)."""
    inp = _Inputs(profile, pools if pools is not None else pool_profiles(profile), ttft_p99_ms, itl_p99_ms,
                  link, 0.0, 0.0, speeds, transfer_isl_p99)
    return _capacities(inp, mix, link)


def _disagg(inp: _Inputs, mix: LengthMix, link: KvLink) -> DisaggCapacity | None:
    return disagg_capacity(inp.pools, mix, ttft_p99_ms=inp.ttft_p99_ms, itl_p99_ms=inp.itl_p99_ms, link=link,
                           prefill_speed=inp.speeds.ttft, decode_speed=inp.speeds.decode_itl,
                           transfer_isl_p99=inp.transfer_isl_p99)


def choose_serving(profile: PerfProfile, mix: LengthMix, rate_rps: float, *, ttft_p99_ms: float,
                   itl_p99_ms: float, link: KvLink, price_usd_h: float, headroom: float = 0.0,
                   pools: PoolProfiles | None = None, speeds: PhaseSpeeds = PhaseSpeeds(),
                   transfer_isl_p99: float | None = None, flips: bool = True) -> ServingChoice:
    """The cheaper of the aggregated fleet and the disaggregated pair for `rate_rps` of `mix` at the
    SLO, on `profile`'s configuration, the pools' KV moving over `link`; `pools`: the pool profiles
    (default: derived from `profile`, extrapolated); `flips`: also search what would flip it.

    `speeds`: the online correction's. The TTFT speed seen on aggregated replicas applies to the
    prefill pool too (the same prefill); the ITL speed seen on them does not reach the decode pool:
    an ITL slower than the profile says on aggregated replicas is mostly the prefill interference the
    profile misses, which a decode pool does not have (its own speed, `decode_itl`, once one runs).
    `transfer_isl_p99`: the prompt p99 when `mix` is the mean of a spread (`models.disagg.disagg_capacity`).

    >>> from fleetplan.models.disagg import NVLINK4, ETH_25G
    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> from fleetplan.models.profile import ConfigKey, roofline_profile
    >>> prof = roofline_profile(ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16))
    >>> rag = LengthMix.single(4096, 32)   # long prompts, short answers, a tight ITL target
    >>> c = choose_serving(prof, rag, 20.0, ttft_p99_ms=600, itl_p99_ms=20, link=NVLINK4, price_usd_h=3.0)
    >>> c.chosen.value, c.aggregated.replicas, c.disaggregated.ratio(), c.saving_usd_h()
    ('disaggregated', 8, '6:1', 3.0)
    >>> c.aggregated.binding, round(c.aggregated.capacity_rps, 2), round(c.disaggregated.prefill.capacity_rps, 2)
    ('itl', 2.83, 3.93)
    >>> f = c.flips   # less demand, shorter prompts or a slower link: aggregated
    >>> round(f.rate_rps, 1), round(f.isl_scale, 2), round(f.link_gb_s, 1)
    (16.8, 0.38, 6.7)
    >>> choose_serving(prof, rag, 20.0, ttft_p99_ms=600, itl_p99_ms=20, link=ETH_25G, price_usd_h=3.0,
    ...                flips=False).chosen.value
    'aggregated'
    """
    if not (math.isfinite(rate_rps) and rate_rps >= 0):
        raise ValueError(f"rate_rps={rate_rps!r}: expected a finite rate >= 0")
    if not price_usd_h >= 0:
        raise ValueError(f"price_usd_h={price_usd_h!r}: expected a price >= 0")
    inp = _Inputs(profile, pools if pools is not None else pool_profiles(profile), ttft_p99_ms, itl_p99_ms,
                  link, price_usd_h, headroom, speeds, transfer_isl_p99)
    agg, dis = _capacities(inp, mix, link)
    a, d = _fleets(inp, rate_rps, agg, dis)
    chosen, reachable = decide(a, d)
    found = _flips(inp, mix, rate_rps, chosen, agg, dis) if flips and d is not None else None
    return ServingChoice(chosen, a, d, reachable, found)


def _flips(inp: _Inputs, mix: LengthMix, rate_rps: float, chosen: Serving, agg: MixCapacity,
           dis: DisaggCapacity | None) -> Flips:
    def mode_at_rate(r: float) -> Serving:
        return decide(*_fleets(inp, r, agg, dis))[0]

    def mode_at_isl(scale: float) -> Serving:
        scaled = replace(mix, classes=tuple((i * scale, o, w) for i, o, w in mix.classes))
        return decide(*_fleets(inp, rate_rps, *_capacities(inp, scaled, inp.link)))[0]

    def mode_at_link(gb_s: float) -> Serving:
        return decide(*_fleets(inp, rate_rps, agg, _disagg(inp, mix, replace(inp.link, gb_s=gb_s))))[0]

    return Flips(_nearest_rate(mode_at_rate, rate_rps, chosen),
                 _nearest_scale(mode_at_isl, 1.0, chosen, 1.0 / ISL_RANGE, ISL_RANGE),
                 _nearest_scale(mode_at_link, inp.link.gb_s, chosen, *LINK_RANGE))


def _nearest_rate(mode: Callable[[float], Serving], rate_rps: float, chosen: Serving) -> float | None:
    """The demand nearest to `rate_rps` (in ratio, on a 1/16-octave grid) where the mode differs."""
    if rate_rps <= 0.0:
        return None
    steps = int(math.log2(RATE_RANGE) * RATE_STEPS_PER_OCTAVE)
    for k in range(1, steps + 1):
        for sign in (-1, 1):
            r = rate_rps * 2.0 ** (sign * k / RATE_STEPS_PER_OCTAVE)
            if mode(r) is not chosen:
                return float(r)
    return None


def _nearest_scale(mode: Callable[[float], Serving], at: float, chosen: Serving, lo: float,
                   hi: float) -> float | None:
    """A value between `at` and a range end where the mode differs from `chosen`, by bisection on the
    log scale: towards `lo` first when disaggregated is chosen (shorter prompts, a slower link take
    it back), towards `hi` first when aggregated is (None: the mode is the same at both ends)."""
    for end in ((lo, hi) if chosen is Serving.DISAGGREGATED else (hi, lo)):
        if mode(end) is chosen:
            continue
        same, other = math.log(at), math.log(end)
        for _ in range(_HALVINGS):
            mid = 0.5 * (same + other)
            if mode(math.exp(mid)) is chosen:
                same = mid
            else:
                other = mid
        return math.exp(other)
    return None


def explain_lines(choice: ServingChoice) -> tuple[str, ...]:
    """What the explanation says about the choice: both fleets, why, and what would flip it.

    >>> a = Pool(8, 8, 24.0, 2.83, "itl", True)
    >>> d = DisaggFleet(Pool(6, 6, 18.0, 3.93, "ttft", True), Pool(1, 1, 3.0, 45.4, "itl", True), 1.6, True)
    >>> for line in explain_lines(ServingChoice(Serving.DISAGGREGATED, a, d, True, Flips(16.8, 0.38, 6.71))):
    ...     print(line)
    disaggregated: 6 prefill + 1 decode replicas (6:1), 7 GPUs, $21.00/h; aggregated: 8 replicas, 8 GPUs, $24.00/h
    one replica: aggregated 2.83 req/s (itl binds), prefill 3.93 (ttft), decode 45.4 (itl); KV transfer of the p99 prompt 1.6 ms
    aggregated would win at 16.8 req/s; with prompts x0.38; over a 6.71 GB/s link
    the pools are extrapolated from the aggregated profile (no disaggregated benchmark)
    """
    a, d = choice.aggregated, choice.disaggregated
    agg = f"aggregated: {a.replicas} replicas, {a.gpus} GPUs, ${a.usd_h:.2f}/h"
    if d is None:
        return (f"{agg}; no disaggregated pair (the model's KV bytes per token are unknown)",)
    dis = (f"disaggregated: {d.prefill.replicas} prefill + {d.decode.replicas} decode replicas ({d.ratio()}), "
           f"{d.gpus} GPUs, ${d.usd_h:.2f}/h")
    lines = [f"{dis}; {agg}" if choice.chosen is Serving.DISAGGREGATED else f"{agg}; {dis}"]
    if not choice.slo_reachable:
        lines.append("neither fleet meets the p99 targets for this mix: aggregated kept")
    lines.append(f"one replica: aggregated {a.capacity_rps:.3g} req/s ({a.binding} binds), prefill "
                 f"{d.prefill.capacity_rps:.3g} ({d.prefill.binding}), decode {d.decode.capacity_rps:.3g} "
                 f"({d.decode.binding}); KV transfer of the p99 prompt {d.transfer_p99_ms:.2g} ms")
    for what, pool in (("prefill", d.prefill), ("decode", d.decode), ("aggregated", a)):
        if not pool.reachable:
            lines.append(f"the {what} replicas cannot meet their p99 target for this mix at any count")
    if choice.flips is not None:
        f = choice.flips
        said = [s for s in (f"at {f.rate_rps:.3g} req/s" if f.rate_rps is not None else None,
                            f"with prompts x{f.isl_scale:.2f}" if f.isl_scale is not None else None,
                            f"over a {f.link_gb_s:.3g} GB/s link" if f.link_gb_s is not None else None)
                if s is not None]
        other = Serving.AGGREGATED if choice.chosen is Serving.DISAGGREGATED else Serving.DISAGGREGATED
        lines.append(f"{other.value} would win " + ("; ".join(said) if said else "nowhere in the searched range"))
    if d.extrapolated:
        lines.append("the pools are extrapolated from the aggregated profile (no disaggregated benchmark)")
    return tuple(lines)
