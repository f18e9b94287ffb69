"""The capacity table: max rps of one replica of each candidate config at its model's SLO.

The solver only needs this table; `plan()` builds it from the fitted profiles (models.profile), and
tests/benchmarks can pass a synthetic one to `plan_with_capacities()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from models import profile as mp
from models.names import Engine, GpuType
from planner.policy import ModelPolicy, Policy
from planner.types import ConfigKey


@dataclass(frozen=True)
class CapacityInfo:
    max_rps: float
    binding: str  # ttft | itl | memory | "" (unknown)
    warnings: tuple[str, ...] = ()
    prior_only: bool = False  # from the roofline prior, no benchmark data


# predicted (ttft_p99_ms, itl_p99_ms) of one replica of `config` at `rate_rps`; None: unknown
Predictor = Callable[[ConfigKey, float], tuple[float | None, float | None]]


@dataclass(frozen=True)
class MixedWorkload:
    isl: float
    osl: float


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


def capacity_table(
    policy: Policy,
    profiles: mp.ProfileSet,
    workloads: Mapping[str, MixedWorkload],
    gpus: Iterable[GpuType],
    use_prior: bool = True,
) -> tuple[dict[ConfigKey, CapacityInfo], Predictor]:
    """Capacity of every candidate config from the profiles, and a predictor for the explanation."""
    table: dict[ConfigKey, CapacityInfo] = {}
    chosen: dict[ConfigKey, mp.PerfProfile] = {}
    for key in candidate_configs(policy, gpus):
        m = policy.model(key.model)
        assert m is not None
        prof = _profile_for(profiles, m, key.engine, key.gpu, key.tp)
        prior = False
        if prof is None and use_prior:
            prof = mp.roofline_profile(mp.ProfileKey(key.model, key.engine, key.gpu, key.tp, key.precision))
            prior = prof is not None
        if prof is None:
            continue
        w = workloads.get(key.model) or MixedWorkload(m.workload.isl, m.workload.osl)
        try:
            cap = mp.capacity(prof, mp.Workload(isl=w.isl, osl=w.osl),
                              ttft_p99_ms=m.slo.ttft_p99_ms, itl_p99_ms=m.slo.itl_p99_ms)
        except (ValueError, ArithmeticError):
            continue  # a profile that cannot answer for this mix: not a candidate
        if not (math.isfinite(cap.max_rps) and cap.max_rps > 0):
            continue
        table[key] = CapacityInfo(float(cap.max_rps), cap.binding.value, tuple(cap.warnings), prior)
        chosen[key] = prof

    def predictor(config: ConfigKey, rate_rps: float) -> tuple[float | None, float | None]:
        prof = chosen.get(config)
        m = policy.model(config.model)
        if prof is None or m is None:
            return None, None
        w = workloads.get(config.model) or MixedWorkload(m.workload.isl, m.workload.osl)
        try:
            pred = mp.predict(prof, mp.Workload(isl=w.isl, osl=w.osl), rate_rps=max(rate_rps, 1e-6))
        except (ValueError, ArithmeticError):
            return None, None
        return float(pred.ttft.p99_ms), float(pred.itl.p99_ms)

    return table, predictor
