"""Stage 1 with disaggregated pools: a model's rate split between aggregated replicas and pool families.

A pool family is one disaggregated deployment of a model: prefill replicas and decode replicas of
one engine and GPU type (the KV connector is the engine's, the KV moves between GPUs of one type;
the two pools' TP sizes may differ, as `planner.disagg_fleet` sizes them). A request passes through
both pools, so a family carries the rate its weaker pool carries. In the count problem each family
f of a model gets a continuous rate r_f >= 0 and

    sum_aggregated cap_i n_i + sum_f r_f + unmet >= required          (the model's demand row)
    sum_{prefill i in f} cap_i n_i >= r_f,   sum_{decode i in f} cap_i n_i >= r_f   (per family)

which keeps the problem linear. A family with no candidate in one of its pools is no family (its
other pool's candidates serve no demand). Costs are the replicas' $/h as for aggregated replicas;
a pool replica forgoes the spare-capacity tie-break and pays POOL_TIE_SHARE more, so at equal
money the aggregated fleet wins (one pool, no KV transfer, no proxy).

Pure; the MILP builder is `planner.counts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.types import ConfigKey

# the share of a pool replica's $/h added to its cost in the objective: a tie goes to aggregated
POOL_TIE_SHARE = 0.01


@dataclass(frozen=True, order=True)
class FamilyKey:
    """One disaggregated deployment of a model: its engine, GPU type and precision."""

    model: str
    engine: Engine
    gpu: GpuType
    precision: Precision

    def label(self) -> str:
        return f"{self.model}/{self.engine.value}/{self.gpu.value}/{self.precision.value}"


def family_of(config: ConfigKey) -> FamilyKey | None:
    """The family a pool config belongs to (None: an aggregated config)."""
    if config.role is Role.AGGREGATED:
        return None
    return FamilyKey(config.model, config.engine, config.gpu, config.precision)


@dataclass(frozen=True)
class Family:
    key: FamilyKey
    prefill: tuple[int, ...]  # candidate indices
    decode: tuple[int, ...]


def families(configs: Sequence[ConfigKey]) -> list[Family]:
    """The pool families among `configs` (indices into it) that have both pools, in key order."""
    found: dict[FamilyKey, tuple[list[int], list[int]]] = {}
    for i, c in enumerate(configs):
        f = family_of(c)
        if f is not None:
            pre, dec = found.setdefault(f, ([], []))
            (pre if c.role is Role.PREFILL else dec).append(i)
    return [Family(k, tuple(p), tuple(d)) for k, (p, d) in sorted(found.items()) if p and d]


def served_rps(counts: Mapping[ConfigKey, int], capacity: Mapping[ConfigKey, float]) -> dict[str, float]:
    """Per model, the rate replicas at `counts` carry: the aggregated replicas' capacities, plus per
    pool family the smaller of its prefill and decode pools' (a request needs both).

    >>> from dataclasses import replace
    >>> a = ConfigKey("m", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
    >>> p, d = replace(a, role=Role.PREFILL), replace(a, role=Role.DECODE)
    >>> served_rps({a: 2, p: 3, d: 1}, {a: 1.5, p: 4.0, d: 10.0})
    {'m': 13.0}
    >>> served_rps({p: 3}, {p: 4.0})   # a prefill pool with no decode pool serves nothing
    {'m': 0.0}
    """
    out: dict[str, float] = {}
    pools: dict[FamilyKey, list[float]] = {}
    for c, n in counts.items():
        cap = capacity.get(c, 0.0) * n
        f = family_of(c)
        if f is None:
            out[c.model] = out.get(c.model, 0.0) + cap
            continue
        side = pools.setdefault(f, [0.0, 0.0])
        side[0 if c.role is Role.PREFILL else 1] += cap
    for f, (pre, dec) in sorted(pools.items()):
        out[f.model] = out.get(f.model, 0.0) + min(pre, dec)
    return out


def pool_load_share(counts: Mapping[ConfigKey, int], capacity: Mapping[ConfigKey, float],
                    config: ConfigKey) -> float:
    """The share of its model's served rate one replica of the pool config `config` carries: its
    family's share of the model's (`served_rps`), split over the family's replicas of that role in
    proportion to their capacity (0: nothing served).

    >>> from dataclasses import replace
    >>> a = ConfigKey("m", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
    >>> p, d = replace(a, role=Role.PREFILL), replace(a, role=Role.DECODE)
    >>> counts, caps = {a: 2, p: 3, d: 1}, {a: 1.5, p: 4.0, d: 10.0}
    >>> round(pool_load_share(counts, caps, p), 4), round(pool_load_share(counts, caps, d), 4)
    (0.2564, 0.7692)
    """
    fam = family_of(config)
    served = served_rps(counts, capacity).get(config.model, 0.0)
    if fam is None or not served > 0:
        return 0.0
    mine = {c: n for c, n in counts.items() if family_of(c) == fam}
    side = sum(capacity.get(c, 0.0) * n for c, n in mine.items() if c.role is config.role)
    carried = served_rps(mine, capacity).get(config.model, 0.0)
    return carried / served * capacity.get(config, 0.0) / side if side > 0 else 0.0


def family_rates(fams: Sequence[Family], caps: Sequence[float], n: Sequence[float]) -> list[float]:
    """Per family the rate counts `n` let it carry (the smaller pool's capacity): a feasible r_f."""
    return [min(sum(caps[i] * n[i] for i in f.prefill), sum(caps[i] * n[i] for i in f.decode)) for f in fams]


def gpus_per_rps(fams: Sequence[Family], caps: Sequence[float], gpus: Sequence[int]) -> dict[str, float]:
    """Per model, the fewest GPUs per rps a pool family buys (its cheapest prefill and decode
    configs per rps, added): with the aggregated configs', what an unmet rps is priced against."""
    out: dict[str, float] = {}
    for f in fams:
        pre = min((gpus[i] / caps[i] for i in f.prefill if caps[i] > 0), default=0.0)
        dec = min((gpus[i] / caps[i] for i in f.decode if caps[i] > 0), default=0.0)
        if pre > 0 and dec > 0:
            out[f.key.model] = min(out.get(f.key.model, pre + dec), pre + dec)
    return out
