"""Disaggregated pools in the plan: their capacities as candidates, and what the explanation says.

Where a model's policy allows it (`disaggregation: {allowed: true}`), every aggregated candidate
config of the model adds its PREFILL and its DECODE config (`ConfigKey.role`): one replica's
capacity in a prefill pool, sized at the TTFT target (queue, prefill, the KV transfer over the
hosts' link, the decode side's join), and in a decode pool, sized at the ITL target (decode steps
with no prefill in them, the KV cache), both from the aggregated profile's own equations at the
model's length mix (`models.disagg.disagg_capacity`). The online correction's speeds apply as
`disagg_choice.PhaseSpeeds` says: the TTFT speed seen on aggregated replicas to the prefill pool,
a decode pool's own ITL speed once its replicas have been observed (the correction keeps one per
decode config, on the decode pool's profile: `decode_profiles`; before that, the profile's ITL once
the aggregated config was observed) to the decode pool, never the ITL speed observed on
aggregated replicas (mostly the prefill interference a decode pool does not have); a speed that is
a prior, with nothing observed (an extrapolating profile's conservative start), applies to both
pools as to the aggregated replicas (the hardware is the same); a faster-than-profiled TTFT not
yet trusted at load is not carried over (speed at most 1). A pool that cannot meet its target for
the mix at any load is no candidate.

The count solve then splits the model's rate between aggregated replicas and pool families
(`planner.disagg_counts`), and the explanation compares, at the plan's demand, the cheapest
aggregated fleet alone with the cheapest pair of pools alone (`disagg_fleet.choose_for_model`),
gives the plan's prefill:decode ratio and what would flip the choice (the demand, a factor on the
prompts' lengths, the link's rate: `disagg_choice.choose_serving` on the prefill pool's config).

The pools' capacities assume the hosts' own link (`models.disagg.host_link`: NVLink, else PCIe);
placement puts a family's prefill replicas beside its decode replicas where it can
(`planner.placement`), and the explanation carries how many it paired (`ModelPools.paired_prefill`,
counted on the plan's replicas: `placement.paired_prefill`); the others' KV moves over the network.

Pure: the policy, the profiles, the workloads and the speeds are arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from fleetplan.models.config_key import Role
from fleetplan.models.disagg import DisaggCapacity, KvLink, disagg_capacity, host_link, pool_profiles
from fleetplan.models.mix import LengthMix
from fleetplan.models.names import GpuType
from fleetplan.models.profile import PerfProfile
from fleetplan.planner.capacity import CapacityInfo, MixedWorkload, Speeds, extrapolation, knee_bound, mix_for
from fleetplan.planner.disagg_choice import (
    DisaggFleet,
    Flips,
    PhaseSpeeds,
    ServingChoice,
    choose_serving,
    explain_lines,
)
from fleetplan.planner.disagg_counts import families, served_rps
from fleetplan.planner.disagg_fleet import ModelServing, choose_for_model
from fleetplan.planner.knee import floor_note, knee_note
from fleetplan.planner.policy import ModelPolicy, Policy
from fleetplan.planner.types import ConfigCount, ConfigKey, ModelExplanation, ModelPools

EXTRAPOLATED = "pool figures from the aggregated profile's physics (no disaggregated benchmark)"


def allowed(m: ModelPolicy | None) -> bool:
    return m is not None and m.disaggregation.allowed


def phase_speeds(speeds: Mapping[ConfigKey, Speeds], key: ConfigKey,
                 observed: Collection[ConfigKey] = ()) -> PhaseSpeeds:
    """The online correction's speeds as the pools of `key`'s configuration take them (the module
    docstring); `observed`: the configs whose speeds rest on observations, not on a prior alone.

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
    >>> phase_speeds({k: Speeds(0.8, 0.5)}, k, observed={k})     # ITL seen slow with prefill in it
    PhaseSpeeds(ttft=0.8, itl=0.5, decode_itl=1.0)
    >>> phase_speeds({k: Speeds(0.8, 0.5)}, k)                   # a prior: the same hardware
    PhaseSpeeds(ttft=0.8, itl=0.5, decode_itl=0.5)
    """
    agg = key.profile_key()
    sp = speeds.get(agg, Speeds())
    dec = speeds.get(replace(agg, role=Role.DECODE))
    decode_itl = dec.itl if dec is not None else 1.0 if agg in observed else sp.itl
    ttft = min(sp.ttft, 1.0) if sp.trusted_rps is not None else sp.ttft
    return PhaseSpeeds(ttft=ttft, itl=sp.itl, decode_itl=decode_itl)


def _mix(profile: PerfProfile, w: MixedWorkload) -> tuple[LengthMix, float | None]:
    """The mix a profile's pools are evaluated on, and the prompt p99 its transfer carries when that
    mix is the mean of a spread (`planner.capacity.mix_for`)."""
    mix = mix_for(profile, w)
    spread = profile.data_range is not None and profile.data_range.length_spread
    return mix, (w.length_mix().isl_quantile(0.99) if spread else None)


def _workload(m: ModelPolicy, workloads: Mapping[str, MixedWorkload]) -> MixedWorkload:
    return workloads.get(m.name) or MixedWorkload(m.workload.isl, m.workload.osl)


def _pools_at(profile: PerfProfile, m: ModelPolicy, w: MixedWorkload, link: KvLink,
              sp: PhaseSpeeds) -> DisaggCapacity | None:
    mix, transfer = _mix(profile, w)
    return disagg_capacity(pool_profiles(profile), mix, ttft_p99_ms=m.slo.ttft_p99_ms, itl_p99_ms=m.slo.itl_p99_ms,
                           link=link, prefill_speed=sp.ttft, decode_speed=sp.decode_itl, transfer_isl_p99=transfer)


def decode_profiles(policy: Policy, profiles: Mapping[ConfigKey, PerfProfile]) -> dict[ConfigKey, PerfProfile]:
    """Per aggregated config whose model allows pools, its decode pool's profile keyed by the decode
    config: what the online correction learns a decode pool's own ITL speed on, from its replicas'
    windows (`phase_speeds` takes it once one has been observed)."""
    return {replace(k, role=Role.DECODE): pool_profiles(p).decode for k, p in sorted(profiles.items())
            if k.role is Role.AGGREGATED and allowed(policy.model(k.model))}


def pool_capacities(policy: Policy, profiles: Mapping[ConfigKey, PerfProfile], workloads: Mapping[str, MixedWorkload],
                    speeds: Mapping[ConfigKey, Speeds] | None = None, observed: Collection[ConfigKey] = (),
                    link_for: Callable[[GpuType], KvLink] = host_link) -> dict[ConfigKey, CapacityInfo]:
    """One prefill and one decode replica's capacity for every aggregated config in `profiles` whose
    model allows disaggregation (the module docstring); keyed by the pool's config. `observed`: the
    configs whose speeds rest on observations (`phase_speeds`)."""
    out: dict[ConfigKey, CapacityInfo] = {}
    for key, prof in sorted(profiles.items()):
        m = policy.model(key.model)
        if m is None or not allowed(m) or key.role is not Role.AGGREGATED:
            continue
        w = _workload(m, workloads)
        sp = phase_speeds(speeds or {}, key, observed)
        link = link_for(key.gpu)
        try:
            cap = _pools_at(prof, m, w, link, sp)
            base = cap if sp == PhaseSpeeds() else _pools_at(prof, m, w, link, PhaseSpeeds())
        except (ValueError, ArithmeticError):
            continue  # a profile that cannot answer for this mix: no pools from it
        if cap is None or base is None:
            continue  # the model's KV bytes per token are unknown
        why = (*extrapolation(prof, _mix(prof, w)[0], w.isl_p99_low), *((EXTRAPOLATED,) if cap.extrapolated else ()))
        note = "" if sp == PhaseSpeeds() else f"TTFT x{sp.ttft:.2f} (prefill), ITL x{sp.decode_itl:.2f} (decode)"
        for role, pool, fitted in ((Role.PREFILL, cap.prefill, base.prefill), (Role.DECODE, cap.decode, base.decode)):
            if pool.floor_share is not None or not (0.0 < pool.max_rps < math.inf):
                continue  # out of its target's reach for this mix (or nothing to decode): no candidate
            own = (speeds or {}).get(replace(key, role=role), Speeds())
            # its replicas missed the SLO there (knee.knee_load), or held it there below every miss
            bound = knee_bound(pool, own.knee_rps, own.floor_rps)
            knee = own.knee_rps if bound.max_rps < pool.max_rps else None  # the knee in force
            floor = own.floor_rps if bound.max_rps > pool.max_rps else None  # the floor in force
            pool_note = "; ".join(n for n in (note, knee_note(knee) if knee is not None else "",
                                              floor_note(floor) if floor is not None else "") if n)
            out[replace(key, role=role)] = CapacityInfo(bound.max_rps, pool.binding, (), prof.source == "roofline",
                                                        fitted.max_rps, pool_note, why, knee_rps=knee)
    complete = {k for f in families(sorted(out)) for k in (*f.prefill, *f.decode)}
    return {k: v for i, (k, v) in enumerate(sorted(out.items())) if i in complete}  # a pool alone serves nothing


def prefer_pools(table: Mapping[ConfigKey, CapacityInfo],
                 pools: Mapping[ConfigKey, CapacityInfo]) -> dict[ConfigKey, CapacityInfo]:
    """`table` with the aggregated configs that cannot reach their model's p99 targets for its mix
    (a floor share) left without capacity (min_replicas only) where the model has a family of pools
    (a prefill and a decode pool), which reach theirs (`pool_capacities` keeps no other), as `capacity._prefer_reachable` does between
    aggregated configs: the plan buys the pools that meet the SLO rather than replicas that miss it."""
    served = {f.key.model for f in families(sorted(pools))}
    return {k: replace(v, max_rps=0.0) if v.floor_share is not None and k.model in served else v
            for k, v in table.items()}


def _serving(policy: Policy, m: ModelPolicy, profiles: Mapping[ConfigKey, PerfProfile], w: MixedWorkload,
             demand_rps: float, speeds: Mapping[ConfigKey, Speeds], observed: Collection[ConfigKey],
             link_for: Callable[[GpuType], KvLink]) -> tuple[ModelServing, Flips] | None:
    """The model's cheapest aggregated fleet and pair of pools at `demand_rps`, and what would flip it."""
    own = {k: p for k, p in profiles.items() if k.model == m.name and k.role is Role.AGGREGATED}
    if not own or not (math.isfinite(demand_rps) and demand_rps >= 0):
        return None
    mix, transfer = _mix(own[min(own)], w)
    s = choose_for_model(policy, m.name, own, mix, demand_rps, link_for=link_for,
                         speeds={k: phase_speeds(speeds, k, observed) for k in own}, transfer_isl_p99=transfer)
    isl = link = None
    if s.prefill is not None and s.prefill.config in own:
        k = s.prefill.config
        price = policy.price_usd_h(k.gpu) or 0.0
        c = choose_serving(own[k], mix, demand_rps, ttft_p99_ms=m.slo.ttft_p99_ms, itl_p99_ms=m.slo.itl_p99_ms,
                           link=link_for(k.gpu), price_usd_h=price, headroom=m.headroom,
                           speeds=phase_speeds(speeds, k, observed), transfer_isl_p99=transfer)
        if c.flips is not None:
            isl, link = c.flips.isl_scale, c.flips.link_gb_s
    return s, Flips(s.flip_rate_rps, isl, link)


def _comparison_lines(s: ModelServing, flips: Flips) -> tuple[str, ...]:
    if s.aggregated is None:
        return ()
    pair = (None if s.prefill is None or s.decode is None or s.transfer_p99_ms is None
            else DisaggFleet(s.prefill.pool, s.decode.pool, s.transfer_p99_ms, s.extrapolated))
    lines = explain_lines(ServingChoice(s.chosen, s.aggregated.pool, pair, s.slo_reachable, flips))
    where = ("" if s.prefill is None or s.decode is None else
             f" (aggregated on {s.aggregated.config.label()}, prefill on {s.prefill.config.label()}, "
             f"decode on {s.decode.config.label()})")
    return (f"alone at this demand, {lines[0]}{where}", *lines[1:])


def explain_pools(policy: Policy, me: ModelExplanation, plan_counts: Sequence[ConfigCount],
                  profiles: Mapping[ConfigKey, PerfProfile], workloads: Mapping[str, MixedWorkload],
                  speeds: Mapping[ConfigKey, Speeds] | None = None, observed: Collection[ConfigKey] = (), *,
                  paired_prefill: int, compare: bool = True,
                  link_for: Callable[[GpuType], KvLink] = host_link) -> ModelExplanation:
    """`me` with its pools (the plan's prefill and decode replicas, the ratio, `paired_prefill`: how
    many of its prefill replicas the placement put on a host with a decode replica of their family)
    and, where `compare`, the comparison behind them in its notes (the module docstring); unchanged
    where the model's policy does not allow disaggregation."""
    m = policy.model(me.model)
    if m is None or not allowed(m):
        return me
    pre = tuple(c for c in plan_counts if c.config.model == m.name and c.config.role is Role.PREFILL)
    dec = tuple(c for c in plan_counts if c.config.model == m.name and c.config.role is Role.DECODE)
    found = _serving(policy, m, profiles, _workload(m, workloads), me.demand_rps, speeds or {}, observed,
                     link_for) \
        if compare else None
    notes: list[str] = []
    if pre or dec:
        served = served_rps({c.config: c.replicas for c in (*pre, *dec)},
                            {c.config: c.capacity_per_replica_rps for c in (*pre, *dec)}).get(m.name, 0.0)
        gpu = (pre or dec)[0].config.gpu
        s, f = found if found is not None else (None, Flips(None, None, None))
        pools = ModelPools(pre, dec, served, None if s is None or s.aggregated is None else s.aggregated.pool.usd_h,
                           None if s is None or s.prefill is None or s.decode is None
                           else s.prefill.pool.usd_h + s.decode.pool.usd_h,
                           f.rate_rps, f.isl_scale, f.link_gb_s, link_for(gpu).gb_s, paired_prefill)
        p, d = pools.replicas()
        notes.append(f"disaggregated: {p} prefill + {d} decode replicas ({pools.ratio()}) carry {served:.3g} req/s "
                     f"of the required {me.required_rps:.3g}")
        link = link_for(gpu)
        notes.append(f"the pools' capacities assume the hosts' KV link ({link.kind.value}, {link.gb_s:g} GB/s per "
                     "GPU)")
    else:
        pools = None
        notes.append("disaggregated pools allowed; the plan serves aggregated")
    if found is not None:
        notes.extend(_comparison_lines(*found))
    return replace(me, pools=pools, notes=(*me.notes, *notes))
