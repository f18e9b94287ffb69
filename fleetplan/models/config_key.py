"""The identity of a serving configuration: model, engine, GPU type, TP size, precision and role."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum

from fleetplan.models.names import Engine, GpuType, Precision

__all__ = ["ConfigKey", "Role"]


class Role(StrEnum):
    """What a replica of a configuration serves: whole requests (aggregated), or one phase of a
    disaggregated deployment, the prompts (prefill) or the decode steps after the KV cache moved."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, order=True)
class ConfigKey:
    """One serving configuration of one model: engine, GPU type, TP size and precision, and the role
    its replicas serve (aggregated unless it is one pool of a disaggregated deployment). The one
    identity of a configuration everywhere: a fitted profile's key (always aggregated: a pool's
    figures come from the aggregated profile, `profile_key`), the planner's config, a replica's
    (planner.types re-exports it).

    >>> k = ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
    >>> k.label(), replace(k, role=Role.PREFILL).label()
    ('llama-3-8b/vllm/h100x1/bf16', 'llama-3-8b/vllm/h100x1/bf16/prefill')
    >>> replace(k, role=Role.DECODE).profile_key() == k
    True
    """

    model: str
    engine: Engine
    gpu: GpuType
    tp: int
    precision: Precision
    role: Role = Role.AGGREGATED

    def label(self) -> str:
        # computed once per key (the planner labels ~40k keys per plan at 500 models, bench/solve_scale.py);
        # kept in the instance dict, which a frozen dataclass allows and eq/order/hash ignore
        cached = self.__dict__.get("_label")
        if cached is None:
            cached = f"{self.model}/{self.engine.value}/{self.gpu.value}x{self.tp}/{self.precision.value}"
            if self.role is not Role.AGGREGATED:
                cached += f"/{self.role.value}"
            self.__dict__["_label"] = cached
        return cached

    def __repr__(self) -> str:
        # an aggregated key reads as before roles existed (plans' reprs, the replay's digests)
        role = "" if self.role is Role.AGGREGATED else f", role={self.role!r}"
        return (f"ConfigKey(model={self.model!r}, engine={self.engine!r}, gpu={self.gpu!r}, tp={self.tp!r}, "
                f"precision={self.precision!r}{role})")

    def profile_key(self) -> ConfigKey:
        """The key of the profile this configuration's figures come from (its aggregated self)."""
        return self if self.role is Role.AGGREGATED else replace(self, role=Role.AGGREGATED)

    def __hash__(self) -> int:
        # cached like label(): a plan at 500 models hashes ~300k keys, and each uncached hash calls
        # three enums' Python-level __hash__ (bench/solve_scale.py). An aggregated key hashes as
        # before roles existed, so the iteration order of sets of them (and every replay) is unchanged.
        cached = self.__dict__.get("_hash")
        if cached is None:
            base = (self.model, self.engine, self.gpu, self.tp, self.precision)
            cached = hash(base if self.role is Role.AGGREGATED else (*base, self.role))
            self.__dict__["_hash"] = cached
        return cached

    def __getstate__(self) -> dict[str, object]:
        # a pickled key never carries its cached hash: string hashes differ between processes. The
        # fields are read by name, never by iterating the instance dict: a process pool pickles its
        # arguments on a feeder thread while the caller's thread may cache a label or hash into that
        # dict ("dictionary changed size during iteration" in a replay's busy-machine test)
        d = self.__dict__
        return {name: d[name] for name in _FIELDS}


_FIELDS = tuple(f.name for f in fields(ConfigKey))  # what a pickled key carries
