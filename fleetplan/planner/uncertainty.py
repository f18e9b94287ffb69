"""The cost of uncertainty: what a plan spends above what it would with nothing left to learn. Pure.

Per model, the plan's $/h against the cheapest fleet its corrected profiles would need if every
estimate were certain: the corrections' mean speeds instead of the conservative mean - k sd (or
x0.5 for a profile used outside its data and never observed), and the demand x (1 + headroom)
without the burst floor. The difference is the price of not knowing yet, with its reasons:

- `extrapolating`: a config of the plan is used outside its profile's data and not yet confirmed;
- `unconfirmed`: a config's correction is applied below its estimate (few windows, disagreeing
  ones: planner/correction.py);
- `burst floor`: the required rate is the burst floor's, above demand x (1 + headroom).

The ideal fleet ignores inventory and placement (one config, the cheapest per unit of capacity);
it is a yardstick, not a plan.

Worked example: a model planned on 3 replicas at $12/h each because its only config's speed is
applied at x0.5 (extrapolating, never observed) while the mean is x1.0: capacity halves, so with
nothing left to learn 2 replicas would serve -> `uncertainty_usd_h` 12, why ("extrapolating: ...",).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fleetplan.models import profile as mp
from fleetplan.planner.capacity import CapacityInfo, MixedWorkload, Speeds, config_capacity
from fleetplan.planner.policy import ModelPolicy, Policy
from fleetplan.planner.types import ConfigKey, Correction, ModelExplanation

__all__ = ["Uncertainty", "cost_of_uncertainty", "mean_speeds"]


@dataclass(frozen=True)
class Uncertainty:
    usd_h: float  # the plan's $/h above the ideal fleet's
    ideal_usd_h: float
    why: tuple[str, ...]


def mean_speeds(corrections: Mapping[ConfigKey, Correction]) -> dict[ConfigKey, Speeds]:
    """Per observed config, the correction's estimate itself (no margin for its uncertainty)."""
    return {c: Speeds(math.exp(k.ttft_log), math.exp(k.itl_log)) for c, k in corrections.items()
            if k.observations > 0}


def _ideal_capacity(c: ConfigKey, info: CapacityInfo, applied: Speeds, mean: Speeds,
                    profile: mp.PerfProfile | None, workload: MixedWorkload | None, m: ModelPolicy) -> float:
    if abs(applied.ttft - mean.ttft) < 1e-9 and abs(applied.itl - mean.itl) < 1e-9:
        return info.max_rps
    if mean == Speeds() and info.profile_rps is not None and info.profile_rps > 0:
        return info.profile_rps  # the profile as fitted, computed with the table already
    if profile is None or workload is None:
        return info.max_rps
    try:
        rps = config_capacity(profile, workload, m, mean).max_rps
    except (ValueError, ArithmeticError):
        return info.max_rps
    return rps if math.isfinite(rps) and rps > 0 else info.max_rps


def cost_of_uncertainty(model: ModelExplanation, policy: Policy, table: Mapping[ConfigKey, CapacityInfo],
                        applied: Mapping[ConfigKey, Speeds], means: Mapping[ConfigKey, Speeds],
                        profiles: Mapping[ConfigKey, mp.PerfProfile],
                        workloads: Mapping[str, MixedWorkload]) -> Uncertainty:
    """`table`: the model's own configs' capacities (the caller groups the table once per plan)."""
    m = policy.model(model.model)
    if m is None:
        return Uncertainty(0.0, model.usd_h, ())
    why: list[str] = []
    ideal_req = model.demand_rps * (1.0 + model.headroom)
    if model.required_rps > ideal_req * (1.0 + 1e-6) + 1e-9:
        why.append(f"burst floor: sized for {model.required_rps:.2f} rps, demand x (1 + headroom) "
                   f"is {ideal_req:.2f}")
    for ce in model.configs:
        info = table.get(ce.config)
        a = applied.get(ce.config, Speeds())
        mean = means.get(ce.config, Speeds())
        if info is not None and info.extrapolating and (a.ttft < mean.ttft - 1e-9 or a.itl < mean.itl - 1e-9):
            why.append(f"extrapolating: {ce.config.label()} applied at TTFT x{a.ttft:.2f} / ITL x{a.itl:.2f} "
                       "until observed")
        elif a.ttft < mean.ttft - 1e-9 or a.itl < mean.itl - 1e-9:
            why.append(f"unconfirmed: {ce.config.label()} applied at TTFT x{a.ttft:.2f} / ITL x{a.itl:.2f}, "
                       f"estimated x{mean.ttft:.2f} / x{mean.itl:.2f}")
    best: float | None = None
    floor = max(m.min_replicas, 0)
    for c, info in table.items():
        if c.model != model.model or not info.max_rps > 0:
            continue
        price = policy.replica_usd_h(c) or 0.0
        cap = _ideal_capacity(c, info, applied.get(c, Speeds()), means.get(c, Speeds()), profiles.get(c),
                              workloads.get(c.model), m)
        n = max(floor, math.ceil(ideal_req / cap - 1e-9) if ideal_req > 0 else 0)
        cost = n * price
        best = cost if best is None else min(best, cost)
    if best is None:
        return Uncertainty(0.0, model.usd_h, tuple(why))
    extra = max(0.0, model.usd_h - best)
    return Uncertainty(extra, best, tuple(why) if extra > 1e-9 else ())
