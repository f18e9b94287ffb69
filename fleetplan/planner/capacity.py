"""The capacity table: max rps of one replica of each candidate config at its model's SLO.

The solver only needs this table; `plan()` builds it from the fitted profiles (fleetplan.models.profile), and
tests/benchmarks can pass a synthetic one to `plan_with_capacities()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from fleetplan.models import profile as mp
from fleetplan.models.mix import (
    FLOOR_SLACK,
    SLO_SHARE,
    LengthMix,
    MixCapacity,
    attainment_mix,
    capacity_mix,
    predict_mix,
    scaled,
)
from fleetplan.models.names import Engine, GpuType
from fleetplan.planner.knee import KneeKind, sibling_note
from fleetplan.planner.policy import ModelPolicy, Policy
from fleetplan.planner.types import ConfigKey


@dataclass(frozen=True)
class CapacityInfo:
    max_rps: float
    binding: str  # ttft | itl | memory | "" (unknown)
    warnings: tuple[str, ...] = ()
    prior_only: bool = False  # from the roofline prior, no benchmark data
    profile_rps: float | None = None  # what the profile alone says (before the correction)
    correction: str = ""  # the correction in force, readable ("" none)
    extrapolating: tuple[str, ...] = ()  # why the profile is used outside its data
    # the share of requests an idle replica serves within the SLO when a target's p99 is out of this
    # config's reach for the mix (None: reachable); see _prefer_reachable
    floor_share: float | None = None
    # the good share this window is sized for where the error budget is spent (planner/slo.py
    # planned_share; max_rps is then the rate at that share); None: the p99 targets
    planned_share: float | None = None
    # the load per replica at which this config's own replicas missed the SLO within the period, which
    # max_rps is held to (planner/knee.py knee_load; None: none shown)
    knee_rps: float | None = None


@dataclass(frozen=True)
class Predicted:
    """What the corrected profile predicts for one replica at a load (None: unknown)."""

    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    attainment: float | None = None  # the share of requests within the SLO (models/mix.py attainment_mix)


# the prediction for one replica of `config` at `rate_rps`
Predictor = Callable[[ConfigKey, float], Predicted]


@dataclass(frozen=True)
class MixedWorkload:
    """A model's request lengths: the means, and the distribution when it is known."""

    isl: float
    osl: float
    mix: LengthMix | None = None
    # the lowest prompt-length p99 the engines' histogram allows (the lower bound of the bucket holding
    # it, planner/evidence.py ModelEvidence.isl_p99_low); None: unknown (the mix's p99 is all there is)
    isl_p99_low: float | None = None
    # the share of prompt tokens the engines' prefix caches hold (observed hit rate; 0: none assumed)
    cached_share: float = 0.0

    def length_mix(self) -> LengthMix:
        mix = self.mix if self.mix is not None else LengthMix.single(self.isl, self.osl)
        return mix.with_cached_share(self.cached_share) if self.cached_share else mix


@dataclass(frozen=True)
class Speeds:
    """The engine speed applied to a config's profile, per latency (1.0: the profile as fitted)."""

    ttft: float = 1.0
    itl: float = 1.0
    note: str = ""
    # a faster engine than the profile, or a profile outside its data, is trusted up to this load per
    # replica (rps; None: no bound): evidence gathered at low load does not prove the knee
    # (planner/correction.py TRUST_GROWTH)
    trusted_rps: float | None = None
    # the replicas missed the SLO at this load per replica within the SLO's period: no more is counted
    # whatever the speeds say (planner/knee.py knee_load; None: no such load seen)
    knee_rps: float | None = None
    # the highest load per replica at which its windows held the SLO within the period (None: none seen)
    held_rps: float | None = None
    # the load its replicas held the SLO at below every miss: no less is counted whatever the speeds
    # say (planner/knee.py held_floor; None: not shown)
    floor_rps: float | None = None
    # the profile's own capacity is evidence (a fit inside its data): a trusted bound never counts a
    # replica below it. False: a prior or lengths beyond the data, bounded by the loads seen alone
    profile_proven: bool = True
    knee_kind: KneeKind = KneeKind.MISSES  # what `knee_rps` was read from


def candidate_configs(policy: Policy, gpus: Iterable[GpuType]) -> list[ConfigKey]:
    """Every (model, engine, GPU, TP, precision) the policy allows on the GPU types present."""
    present = sorted(set(gpus))
    out: list[ConfigKey] = []
    for m in policy.models:
        allowed_gpus = [g for g in present if (m.allowed.gpus is None or g in m.allowed.gpus)
                        and g in policy.gpu_types]
        for e in sorted(set(m.allowed.engines)):
            if e not in policy.engines:
                continue
            for g in allowed_gpus:
                for tp in sorted(set(m.allowed.tp)):
                    out.append(ConfigKey(m.name, e, g, tp, m.precision))
    return out


def _profile_for(profiles: mp.ProfileSet, m: ModelPolicy, engine: Engine, gpu: GpuType,
                 tp: int) -> mp.PerfProfile | None:
    for name in (m.name, *m.aliases):
        p = profiles.get(name, engine, gpu, tp, m.precision)
        if p is None:
            p = profiles.get(name, engine, gpu, tp)
        if p is not None:
            return p
    return None


def resolve_profiles(policy: Policy, profiles: mp.ProfileSet, gpus: Iterable[GpuType],
                     use_prior: bool = True) -> dict[ConfigKey, mp.PerfProfile]:
    """The profile of every candidate config: fitted (by name or alias), else the roofline prior."""
    out: dict[ConfigKey, mp.PerfProfile] = {}
    for key in candidate_configs(policy, gpus):
        m = policy.model(key.model)
        assert m is not None
        prof = _profile_for(profiles, m, key.engine, key.gpu, key.tp)
        if prof is None and use_prior:
            prof = mp.roofline_profile(key)
        if prof is not None:
            out[key] = prof
    return out


EXTRAPOLATION_FACTOR = 1.25  # beyond the data's range by more than this: extrapolating
# a benchmark on a real dataset (length spread) ran requests far longer than its mean (a real mix's
# p99 is 3-5x its mean): a window whose MEAN moved by less than this stays inside the lengths the
# engine was measured on (traffic's mean output drifts by 25-35% within an hour on azure)
SPREAD_EXTRAPOLATION_FACTOR = 2.0


def extrapolation(profile: mp.PerfProfile, mix: LengthMix, isl_p99_low: float | None = None) -> tuple[str, ...]:
    """Why the profile answers outside what its benchmark data covered (empty: inside).

    `isl_p99_low`: the most favourable reading of the prompt p99 (the lower bound of the histogram
    bucket holding it): prompts count as beyond the data only if even that reading is (a coarse bucket
    is no evidence of long prompts).

    >>> from fleetplan.models.profile import DataRange, PerfParams, PerfProfile, ConfigKey
    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
    >>> prof = PerfProfile(k, PerfParams(10, 0.1, 0, 1, 0.1, 0, 1), data_range=DataRange((128, 2048), (128, 512), None, None, 5))
    >>> extrapolation(prof, LengthMix.single(1000, 200))
    ()
    >>> extrapolation(prof, LengthMix(((1000, 200, 0.98), (9000, 200, 0.02))))
    ('prompts up to 9000 tokens (p99), the data up to 2048',)
    >>> extrapolation(prof, LengthMix(((1000, 200, 0.98), (2700, 200, 0.02))), isl_p99_low=2000.0)
    ()
    >>> spread = PerfProfile(k, prof.params, data_range=DataRange((1100, 1100), (210, 210), None, None, 7,
    ...                                                           length_spread=True))
    >>> extrapolation(spread, LengthMix.single(1150, 290))  # an hour's drift of the mean: inside
    ()
    >>> extrapolation(spread, LengthMix.single(12000, 343))
    ("mean prompt 12000 tokens, the data's mean 1100",)
    """
    why: list[str] = []
    if profile.source == "roofline":
        why.append("roofline prior only (no benchmark data)")
    r = profile.data_range
    if r is None:
        return tuple(why)
    if r.latency_points == 0:
        why.append("no latency measurements in the data (throughput only)")
    mean = mix.mean()
    if r.length_spread:
        if mean.isl > r.isl[1] * SPREAD_EXTRAPOLATION_FACTOR:
            why.append(f"mean prompt {mean.isl:.0f} tokens, the data's mean {r.isl[1]:.0f}")
    else:
        p99 = mix.isl_quantile(0.99)
        low = p99 if isl_p99_low is None or not math.isfinite(isl_p99_low) else min(p99, isl_p99_low)
        if low > r.isl[1] * EXTRAPOLATION_FACTOR:
            at_least = f", at least {low:.0f}" if low < p99 else ""
            why.append(f"prompts up to {p99:.0f} tokens (p99{at_least}), the data up to {r.isl[1]:.0f}")
    if mean.osl > r.osl[1] * (SPREAD_EXTRAPOLATION_FACTOR if r.length_spread else EXTRAPOLATION_FACTOR):
        why.append(f"mean output {mean.osl:.0f} tokens, the data {'mean' if r.length_spread else 'up to'} "
                   f"{r.osl[1]:.0f}")
    return tuple(why)


def mix_for(profile: mp.PerfProfile, workload: MixedWorkload) -> LengthMix:
    """The mix a profile is evaluated on: per class for profiles fitted on fixed-length benchmarks;
    at the mean for profiles whose data already carried a length spread (counted once, not twice)."""
    if profile.data_range is not None and profile.data_range.length_spread:
        return LengthMix.single(workload.isl, workload.osl).with_cached_share(workload.cached_share)
    return workload.length_mix()


def config_capacity(profile: mp.PerfProfile, workload: MixedWorkload, m: ModelPolicy,
                    speeds: Speeds = Speeds(), *, base: MixCapacity | None = None) -> MixCapacity:
    """One replica's max rps at the model's SLO for the workload, at the given speeds, what binds it,
    and the share an idle replica reaches when a target's p99 is out of its reach (models/mix.py).
    `base`: this call's answer at the fitted speeds, when the caller has it (it bounds a trusted
    rise; computed here otherwise)."""
    return knee_bound(_speed_capacity(profile, workload, m, speeds, base), speeds.knee_rps, speeds.floor_rps)


def knee_bound(c: MixCapacity, knee_rps: float | None, floor_rps: float | None = None) -> MixCapacity:
    """`c` held to the load at which its replicas missed the SLO (planner/knee.py knee_load), where
    it lies above it, and raised to the load they held it at below every miss (`held_floor`), where
    it lies below; None: no such load shown."""
    if knee_rps is not None and c.max_rps > knee_rps:
        return MixCapacity(knee_rps, c.binding, c.floor_share)
    if floor_rps is not None and c.max_rps < floor_rps and c.floor_share is None:
        return MixCapacity(floor_rps, c.binding, c.floor_share)
    return c


def _speed_capacity(profile: mp.PerfProfile, workload: MixedWorkload, m: ModelPolicy,
                    speeds: Speeds, base: MixCapacity | None) -> MixCapacity:
    mix = mix_for(profile, workload)
    if len(mix.classes) == 1 and not mix.cached_share and speeds.ttft == 1.0 and speeds.itl == 1.0:
        isl, osl, _ = mix.classes[0]
        cap = mp.capacity(profile, mp.Workload(isl=isl, osl=osl), ttft_p99_ms=m.slo.ttft_p99_ms,
                          itl_p99_ms=m.slo.itl_p99_ms)
        if cap.max_rps > 0:  # else: out of reach even idle, sized from the floor below
            return MixCapacity(float(cap.max_rps), cap.binding.value)
    c = capacity_mix(profile, mix, ttft_p99_ms=m.slo.ttft_p99_ms, itl_p99_ms=m.slo.itl_p99_ms,
                     ttft_speed=speeds.ttft, itl_speed=speeds.itl)
    if speeds.trusted_rps is not None and c.max_rps > speeds.trusted_rps:
        if not speeds.profile_proven:  # the profile's own capacity is no evidence: the loads seen alone
            return MixCapacity(speeds.trusted_rps, c.binding, c.floor_share)
        base = base if base is not None else config_capacity(profile, workload, m)
        if base.max_rps < c.max_rps:
            return MixCapacity(max(base.max_rps, speeds.trusted_rps),
                               base.binding if base.max_rps >= speeds.trusted_rps else c.binding, c.floor_share)
    return c


def rate_at_share(profile: mp.PerfProfile, workload: MixedWorkload, m: ModelPolicy, share: float,
                  speeds: Speeds, p99_rps: float) -> float:
    """The largest rate one replica serves with `share` of the mix's requests within both targets
    (models/mix.py attainment_mix, at the speeds), never below `p99_rps` (the capacity at the p99
    targets, what a window is sized for without spending the budget): a bracket, then 12 halvings.

    Worked example: a replica whose p99 binds at 2.0 rps may serve 98% of the requests within the
    targets at 2.3 rps; planned at a 98% share it counts as 2.3 rps, fewer replicas carry the window.
    """
    mix = mix_for(profile, workload)

    def ok(r: float) -> bool:
        a = attainment_mix(profile, mix, r, ttft_ms=m.slo.ttft_p99_ms, itl_ms=m.slo.itl_p99_ms,
                           ttft_speed=speeds.ttft, itl_speed=speeds.itl)
        return a.share >= share

    lo = max(p99_rps, 1e-9)
    if not ok(lo):
        return p99_rps
    hi = lo * 1.25
    for _ in range(8):
        if not ok(hi):
            break
        lo, hi = hi, hi * 1.25
    else:
        return lo
    for _ in range(12):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _prefer_reachable(table: dict[ConfigKey, CapacityInfo]) -> None:
    """Where some config of a model reaches the SLO's p99 targets for its mix, the configs that cannot
    (their floor_share below 99% even idle) are no candidates for its demand (capacity 0: min_replicas
    only), so the plan buys the config that can (a higher TP, another engine) rather than replicas
    that do not help. Where none can, each keeps the capacity sized from its floor and the cheapest
    wins (the explanation says so)."""
    reachable = {k.model for k, v in table.items() if v.floor_share is None and v.max_rps > 0}
    for k, v in list(table.items()):
        if v.floor_share is not None and k.model in reachable:
            table[k] = replace(v, max_rps=0.0)


def best_reach(table: Mapping[ConfigKey, CapacityInfo], keys: Iterable[ConfigKey]) -> dict[str, float]:
    """Per model of `keys`, the most of its requests any of its configs with capacity serves within
    the SLO: SLO_SHARE where one reaches the p99 targets, else the best floor share (a floor is below
    SLO_SHARE: a target's p99 out of an idle replica's reach misses more than 1%)."""
    out: dict[str, float] = {}
    for key in keys:
        info = table.get(key)
        if info is not None and math.isfinite(info.max_rps) and info.max_rps > 0:
            share = SLO_SHARE if info.floor_share is None else info.floor_share
            out[key.model] = max(out.get(key.model, 0.0), share)
    return out


def below_best_reach(table: Mapping[ConfigKey, CapacityInfo], keys: Iterable[ConfigKey]) -> dict[ConfigKey, float]:
    """Among `keys` (the configs a plan may use), for a model none of whose configs reaches the SLO's
    p99 targets for its mix: the configs whose floor share is more than FLOOR_SLACK below the best
    one's, each with that best share. They serve no demand (min_replicas only): a config is sized
    to within FLOOR_SLACK of its own floor, so no count of it reaches what the best one's replicas
    reach, and its replicas would buy misses (long prompts an L40S or a TP1 replica cannot serve
    within the SLO at all). Where some config is reachable, `_prefer_reachable` has already left
    the others without capacity.

    >>> from fleetplan.models.names import Precision
    >>> k = lambda gpu, tp: ConfigKey("m", Engine.VLLM, GpuType(gpu), tp, Precision.BF16)
    >>> table = {k("h100", 2): CapacityInfo(0.8, "ttft", floor_share=0.89),
    ...          k("h100", 1): CapacityInfo(0.5, "ttft", floor_share=0.886),
    ...          k("l40s", 1): CapacityInfo(0.9, "ttft", floor_share=0.47)}
    >>> below_best_reach(table, table)   # the L40S replica misses half the requests even idle
    {ConfigKey(model='m', engine=<Engine.VLLM: 'vllm'>, gpu=<GpuType.L40S: 'l40s'>, tp=1, precision=<Precision.BF16: 'bf16'>): 0.89}
    """
    keys = list(keys)
    best = best_reach(table, keys)
    out: dict[ConfigKey, float] = {}
    for key in keys:
        info = table.get(key)
        top = best.get(key.model, SLO_SHARE)
        if (info is not None and info.floor_share is not None and math.isfinite(info.max_rps) and info.max_rps > 0
                and top < SLO_SHARE and info.floor_share < top - FLOOR_SLACK):
            out[key] = top
    return out


def _siblings_knees(table: dict[ConfigKey, CapacityInfo], knees: Mapping[ConfigKey, float],
                    speeds: Mapping[ConfigKey, Speeds]) -> None:
    """A config whose replicas have shown no knee of their own (planner/knee.py knee_load) is
    counted at the lowest ratio its model's siblings of the same role showed (the knee's capacity
    over what their speeds alone said), never below the highest load per replica its own windows
    held within the SLO. Why: the profiles of one model err alike (one benchmark, one length mix), so
    a knee below the profile's on TP4 says the TP8 profile's knee is as optimistic; without this the
    plan moves the fleet onto the sibling nobody saw miss (azure x4: TP4 capped at the load that
    missed, three TP8 replicas believed at 10 rps each missed 900 requests in two minutes).

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = lambda tp: ConfigKey("m", Engine.TRTLLM, GpuType("h100"), tp, Precision.BF16)
    >>> t = {k(4): CapacityInfo(5.2, "itl"), k(8): CapacityInfo(10.0, "itl")}
    >>> _siblings_knees(t, {k(4): 0.8}, {k(8): Speeds(held_rps=9.0)})
    >>> t[k(8)].max_rps   # 10 x 0.8 = 8, but its own replicas held 9 rps
    9.0
    """
    lowest: dict[tuple[str, object], tuple[float, KneeKind]] = {}
    for key, r in sorted(knees.items()):
        kind = speeds.get(key, Speeds()).knee_kind
        if r < lowest.get((key.model, key.role), (1.0, kind))[0]:
            lowest[(key.model, key.role)] = (r, kind)
    for key, info in list(table.items()):
        if (key.model, key.role) not in lowest or key in knees or not (math.isfinite(info.max_rps) and info.max_rps > 0):
            continue
        ratio, kind = lowest[(key.model, key.role)]
        held = speeds.get(key, Speeds()).held_rps or 0.0
        rps = max(info.max_rps * ratio, min(held, info.max_rps))
        if rps < info.max_rps:
            note = (f"{info.correction}; " if info.correction else "") + sibling_note(rps / info.max_rps, kind)
            table[key] = replace(info, max_rps=rps, correction=note)


def capacity_table(
    policy: Policy,
    profiles: mp.ProfileSet | Mapping[ConfigKey, mp.PerfProfile],
    workloads: Mapping[str, MixedWorkload],
    gpus: Iterable[GpuType],
    use_prior: bool = True,
    speeds: Mapping[ConfigKey, Speeds] | None = None,
    shares: Mapping[str, float] | None = None,
) -> tuple[dict[ConfigKey, CapacityInfo], Predictor]:
    """Capacity of every candidate config for its model's length mix and SLO, at the speeds the
    online correction applies (planner/correction.py; none: the profiles as fitted), and a predictor
    for the explanation. `profiles`: a ProfileSet, or the per-config profiles already resolved.
    `shares`: per model the good share its windows are sized for where the error budget is spent
    (planner/slo.py planned_share; a model left out: the p99 targets): the capacity at the targets
    x the rate-at-share over the capacity-at-the-targets ratio at the same speeds (`rate_at_share`;
    the correction's trust bound on a faster engine scales with it)."""
    chosen = (resolve_profiles(policy, profiles, gpus, use_prior) if isinstance(profiles, mp.ProfileSet)
              else dict(profiles))
    table: dict[ConfigKey, CapacityInfo] = {}
    knees: dict[ConfigKey, float] = {}  # a knee's capacity over what the speeds alone say, per config
    for key, prof in sorted(chosen.items()):
        m = policy.model(key.model)
        assert m is not None
        w = workloads.get(key.model) or MixedWorkload(m.workload.isl, m.workload.osl)
        sp = (speeds or {}).get(key, Speeds())
        try:
            base = config_capacity(prof, w, m)
            # the speeds' capacity once, and the knee's bound on it (the siblings' ratio below needs both)
            unbent = base if sp == Speeds() else config_capacity(prof, w, m, replace(sp, knee_rps=None), base=base)
            applied = knee_bound(unbent, sp.knee_rps, sp.floor_rps)
            base_rps, rps, binding = base.max_rps, applied.max_rps, applied.binding
            warnings = mp.capacity(prof, mp.Workload(isl=w.isl, osl=w.osl), ttft_p99_ms=m.slo.ttft_p99_ms,
                                   itl_p99_ms=m.slo.itl_p99_ms).warnings
        except (ValueError, ArithmeticError):
            continue  # a profile that cannot answer for this mix: not a candidate
        if not (math.isfinite(rps) and rps >= 0):
            continue  # 0 stays: the SLO out of reach at this mix (planner.core keeps min_replicas on it)
        share = (shares or {}).get(key.model)
        if share is not None and rps > 0 and applied.floor_share is None:
            # the same speeds, no trust bound: the ratio a spent budget buys, applied to what is trusted
            free = (unbent if sp.trusted_rps is None
                    else config_capacity(prof, w, m, replace(sp, trusted_rps=None, knee_rps=None)))
            try:
                rps *= max(1.0, rate_at_share(prof, w, m, share, sp, free.max_rps) / free.max_rps)
            except (ValueError, ArithmeticError):
                share = None
        else:
            share = None
        if 0 < applied.max_rps < unbent.max_rps:
            knees[key] = applied.max_rps / unbent.max_rps
        table[key] = CapacityInfo(rps, binding, tuple(warnings), prof.source == "roofline", base_rps, sp.note,
                                  extrapolation(prof, mix_for(prof, w), w.isl_p99_low), applied.floor_share,
                                  share, sp.knee_rps if key in knees else None)
    _siblings_knees(table, knees, speeds or {})
    _prefer_reachable(table)

    def predictor(config: ConfigKey, rate_rps: float) -> Predicted:
        prof = chosen.get(config)
        m = policy.model(config.model)
        if prof is None or m is None:
            return Predicted()
        w = workloads.get(config.model) or MixedWorkload(m.workload.isl, m.workload.osl)
        sp = (speeds or {}).get(config, Speeds())
        try:
            mix = mix_for(prof, w)
            t = predict_mix(scaled(prof, sp.ttft), mix, max(rate_rps, 1e-6))
            i = predict_mix(scaled(prof, sp.itl), mix, max(rate_rps, 1e-6))
            a = attainment_mix(prof, mix, max(rate_rps, 0.0), ttft_ms=m.slo.ttft_p99_ms, itl_ms=m.slo.itl_p99_ms,
                               ttft_speed=sp.ttft, itl_speed=sp.itl)
        except (ValueError, ArithmeticError):
            return Predicted()
        return Predicted(float(t.ttft_p99_ms), float(i.itl_p99_ms), a.share)

    return table, predictor
