"""Small builders for planner tests: a policy dict, a capacity table, observations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.policy import Policy, load_policy_dict
from fleetplan.planner.types import ConfigKey, HostInventory, ModelObservation, Observation

H100 = GpuType.H100
A100 = GpuType.A100
VLLM = Engine.VLLM
TRT = Engine.TRTLLM
BF16 = Precision.BF16


def key(model: str, engine: Engine = VLLM, gpu: GpuType = H100, tp: int = 1,
        role: Role = Role.AGGREGATED) -> ConfigKey:
    return ConfigKey(model, engine, gpu, tp, BF16, role)


def policy_dict(
    models: Iterable[str] = ("m8", "m70"),
    *,
    tps: Mapping[str, list[int]] | None = None,
    prices: Mapping[str, float] | None = None,
    cached: Iterable[tuple[str, str, int]] = (),
    budget: Mapping[str, Any] | None = None,
    scaling: Mapping[str, Any] | None = None,
    model_extra: Mapping[str, Mapping[str, Any]] | None = None,
    hosts: list[dict[str, Any]] | None = None,
    schedules: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    tps = tps or {}
    model_extra = model_extra or {}
    return {
        "gpu_types": {g: {"price_usd_h": p} for g, p in (prices or {"h100": 3.0}).items()},
        "hosts": hosts or [],
        "models": [{"name": m, "slo": {"ttft_p99_ms": 1000, "itl_p99_ms": 80},
                    "allowed": {"tp": tps.get(m, [1, 2, 4, 8])}, "headroom": 0.0,
                    "workload": {"isl": 500, "osl": 200}, **model_extra.get(m, {})} for m in models],
        "engines": {"vllm": {"launch": {"command": "vllm"}, "startup": {"default_s": 60}},
                    "trtllm": {"launch": {"command": "trtllm-serve"}, "startup": {"default_s": 45},
                               "build": {"default_s": 900},
                               "cached_builds": [{"model": m, "gpu": g, "tp": t} for m, g, t in cached]}},
        "scaling": {"churn_cost_usd_h": 0.1, "lead_time_cost_usd_h_per_min": 0.0, "scale_down_delay_s": 0,
                    "max_actions_per_cycle": 100, **(scaling or {})},
        "budget": dict(budget or {}),
        "solver": {"time_limit_s": 10.0, "relative_gap": 0.0},
        "schedules": schedules or [],
    }


def policy(**kw: Any) -> Policy:
    return load_policy_dict(policy_dict(**kw), "test-policy")


def hosts(n: int, gpu: GpuType = H100, count: int = 8, groups: tuple[tuple[int, ...], ...] | None = None,
          prefix: str = "h") -> tuple[HostInventory, ...]:
    g = groups if groups is not None else (tuple(range(count)),)
    return tuple(HostInventory(f"{prefix}{i:02d}", gpu, count, g, True) for i in range(n))


def observe(rates: Mapping[str, float | None], stale: Iterable[str] = ()) -> Observation:
    st = set(stale)
    return Observation({m: ModelObservation(m, r, 500.0, 200.0, stale=m in st) for m, r in rates.items()})


def caps(entries: Mapping[ConfigKey, float]) -> dict[ConfigKey, CapacityInfo]:
    return {k: CapacityInfo(v, "itl") for k, v in entries.items()}
