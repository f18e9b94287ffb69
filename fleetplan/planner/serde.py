"""DEMAND and CURRENT documents <-> planner values (pure; the caller reads the files).

DEMAND (YAML or JSON), see docs/planning.md:
    time_s: 1731500000            # optional: the instant to plan for (epoch s); default: now
    models:
      llama-3-8b: {rate_rps: 40, isl: 820, osl: 200, history: [[t_s, rps], ...], stale: false}
CURRENT (JSON): {"hosts": [...], "replicas": [...], "builds": [...], "planner_state": {...}}
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType, Precision, parse_engine, parse_gpu, parse_precision
from fleetplan.planner.policy import PolicyError, format_loc, short_repr
from fleetplan.planner.slo import BudgetSlice
from fleetplan.planner.types import (
    ConfigKey,
    Correction,
    EngineBuild,
    Fleet,
    HeldLengths,
    HostInventory,
    ModelObservation,
    Observation,
    PlannerState,
    Replica,
    ReplicaState,
)


def _wrap(fn: Any) -> Any:
    def inner(v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return fn(v)
        except ValueError as exc:
            raise ValueError(str(exc)) from None

    return inner


EngineName = Annotated[Engine, BeforeValidator(_wrap(parse_engine))]
GpuName = Annotated[GpuType, BeforeValidator(_wrap(parse_gpu))]
PrecisionName = Annotated[Precision, BeforeValidator(_wrap(parse_precision))]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelDemandDoc(_Strict):
    rate_rps: float | None = Field(default=None, ge=0)
    isl: float | None = Field(default=None, gt=0)
    osl: float | None = Field(default=None, gt=0)
    ttft_p99_ms: float | None = Field(default=None, ge=0)
    itl_p99_ms: float | None = Field(default=None, ge=0)
    history: tuple[tuple[float, float], ...] = ()
    stale: bool = False
    isl_quantiles: dict[float, float] | None = None  # {q: tokens}: the prompt-length distribution
    osl_quantiles: dict[float, float] | None = None


class DemandDoc(_Strict):
    time_s: float | None = None
    models: dict[str, ModelDemandDoc]
    alerts: tuple[str, ...] = ()


class HostDoc(_Strict):
    name: str
    gpu: GpuName
    gpu_count: int = Field(ge=1)
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    online: bool = True


class ReplicaDoc(_Strict):
    replica_id: str
    model: str
    engine: EngineName
    gpu: GpuName
    tp: int = Field(ge=1)
    precision: PrecisionName = Precision.BF16
    role: Role = Role.AGGREGATED  # a pool's replica of a disaggregated deployment: prefill | decode
    host: str
    gpu_indices: tuple[int, ...]
    state: ReplicaState = ReplicaState.READY
    port: int | None = None
    since_s: float | None = None


class BuildDoc(_Strict):
    model: str
    engine: EngineName = Engine.TRTLLM
    gpu: GpuName
    tp: int = Field(ge=1)
    precision: PrecisionName = Precision.BF16
    host: str | None = None
    ready: bool = False
    eta_s: float | None = None
    gpu_indices: tuple[int, ...] = ()


class SurplusDoc(_Strict):
    model: str
    engine: EngineName
    gpu: GpuName
    tp: int
    precision: PrecisionName
    role: Role = Role.AGGREGATED
    since_s: float


class CorrectionDoc(_Strict):
    model: str
    engine: EngineName
    gpu: GpuName
    tp: int
    precision: PrecisionName
    role: Role = Role.AGGREGATED
    ttft_log: float = Field(ge=-5, le=5)
    ttft_var: float = Field(ge=0, le=100)
    itl_log: float = Field(ge=-5, le=5)
    itl_var: float = Field(ge=0, le=100)
    observations: int = Field(ge=0)
    since_s: float | None = None
    updated_s: float | None = None
    observed_ttft_speed: float | None = None
    observed_itl_speed: float | None = None
    applied_ttft_log: float = Field(default=0.0, ge=-5, le=5)
    applied_itl_log: float = Field(default=0.0, ge=-5, le=5)
    # (load per replica rps, ln speed, completions) of the last windows (planner/correction.py)
    ttft_points: tuple[tuple[float, float, float], ...] = Field(default=(), max_length=32)
    itl_points: tuple[tuple[float, float, float], ...] = Field(default=(), max_length=32)
    # (t_s, load per replica rps, missed) of the SLO period's windows (planner/knee.py knee_load)
    slo_windows: tuple[tuple[float, float, bool], ...] = Field(default=(), max_length=128)
    # (t_s, load per replica rps, TTFT p99 ms, its sampling interval's low end ms) of the SLO period's
    # windows (planner/knee.py queue_knee); a state written before the low end was kept has three
    ttft_windows: tuple[tuple[float, float, float, float] | tuple[float, float, float], ...] = Field(
        default=(), max_length=128)


class LengthsDoc(_Strict):
    model: str
    t_s: float
    isl: float | None = Field(default=None, gt=0)
    osl: float | None = Field(default=None, gt=0)
    isl_quantiles: tuple[tuple[float, float], ...] = Field(default=(), max_length=64)
    osl_quantiles: tuple[tuple[float, float], ...] = Field(default=(), max_length=64)
    isl_p99_low: float | None = Field(default=None, gt=0)


class BudgetSliceDoc(_Strict):
    model: str
    t_s: float
    updated_s: float
    requests: float = Field(ge=0)
    missed_lo: float = Field(ge=0)
    missed_hi: float = Field(ge=0)


class StateDoc(_Strict):
    cycle: int = 0
    surplus_since_s: tuple[SurplusDoc, ...] = ()
    corrections: tuple[CorrectionDoc, ...] = ()
    # (model, t_s, excess rps, level rps); a stored 3-tuple (model, t_s, capacity needed) is read
    # with level 0 (planner/demand.py drops it as a step once the rate holds half of it)
    bursts: tuple[tuple[str, float, float, float] | tuple[str, float, float], ...] = ()
    lengths: tuple[LengthsDoc, ...] = ()
    budget: tuple[BudgetSliceDoc, ...] = Field(default=(), max_length=100_000)


class FleetDoc(_Strict):
    hosts: tuple[HostDoc, ...] = ()
    replicas: tuple[ReplicaDoc, ...] = ()
    builds: tuple[BuildDoc, ...] = ()
    planner_state: StateDoc | None = None


def _validate(cls: type[BaseModel], data: Any, source: str) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                problems.append(f"{format_loc(loc)}: required key missing")
            else:
                problems.append(f"{format_loc(loc)} = {short_repr(err.get('input'))}: {msg}")
        raise PolicyError(source, problems) from None


def observation_from_dict(data: Any, source: str = "demand") -> tuple[Observation, float | None]:
    """A DEMAND document -> (Observation, time_s or None). Raises PolicyError naming key + value."""
    doc: DemandDoc = _validate(DemandDoc, data, source)
    models = {
        name: ModelObservation(name, m.rate_rps, m.isl, m.osl, m.ttft_p99_ms, m.itl_p99_ms, m.history, m.stale,
                               tuple(sorted((m.isl_quantiles or {}).items())),
                               tuple(sorted((m.osl_quantiles or {}).items())))
        for name, m in sorted(doc.models.items())
    }
    return Observation(models, doc.alerts), doc.time_s


def fleet_from_dict(data: Any, source: str = "fleet") -> tuple[Fleet, PlannerState]:
    """A CURRENT document -> (Fleet, PlannerState). Raises PolicyError naming key + value."""
    doc: FleetDoc = _validate(FleetDoc, data, source)
    hosts = tuple(HostInventory(h.name, h.gpu, h.gpu_count, h.nvlink_groups, h.online) for h in doc.hosts)
    replicas = tuple(
        Replica(r.replica_id, ConfigKey(r.model, r.engine, r.gpu, r.tp, r.precision, r.role), r.host, r.gpu_indices,
                r.state, r.port, r.since_s)
        for r in doc.replicas
    )
    builds = tuple(EngineBuild(b.model, b.engine, b.gpu, b.tp, b.precision, b.host, b.ready, b.eta_s,
                               b.gpu_indices) for b in doc.builds)
    state = _state(doc.planner_state) if doc.planner_state is not None else PlannerState.initial()
    return Fleet(hosts, replicas, builds), state


def _key_dict(c: ConfigKey) -> dict[str, Any]:
    return {"model": c.model, "engine": c.engine.value, "gpu": c.gpu.value, "tp": c.tp,
            "precision": c.precision.value, "role": c.role.value}


def state_to_dict(state: PlannerState) -> dict[str, Any]:
    """The planner state as stored with every plan (the daemon reloads it after a restart)."""
    return {
        "cycle": state.cycle,
        "surplus_since_s": [{**_key_dict(c), "since_s": t} for c, t in state.surplus_since_s],
        "corrections": [{**_key_dict(k.config), "ttft_log": k.ttft_log, "ttft_var": k.ttft_var,
                         "itl_log": k.itl_log, "itl_var": k.itl_var, "observations": k.observations,
                         "since_s": k.since_s, "updated_s": k.updated_s,
                         "observed_ttft_speed": k.observed_ttft_speed, "observed_itl_speed": k.observed_itl_speed,
                         "applied_ttft_log": k.applied_ttft_log, "applied_itl_log": k.applied_itl_log,
                         "ttft_points": [list(p) for p in k.ttft_points],
                         "itl_points": [list(p) for p in k.itl_points],
                         # a tenth of a second and four decimals of rps say all a knee needs, in half the bytes
                         "slo_windows": [[round(t, 1), round(x, 4), m] for t, x, m in k.slo_windows],
                         "ttft_windows": [[round(t, 1), round(x, 4), round(ms, 1), round(lo, 1)]
                                          for t, x, ms, lo in k.ttft_windows]}
                        for k in state.corrections],
        "bursts": [list(b) for b in state.bursts],
        "lengths": [{"model": h.model, "t_s": h.t_s, "isl": h.isl, "osl": h.osl,
                     "isl_quantiles": [list(q) for q in h.isl_quantiles],
                     "osl_quantiles": [list(q) for q in h.osl_quantiles], "isl_p99_low": h.isl_p99_low}
                    for h in state.lengths],
        "budget": [{"model": b.model, "t_s": b.t_s, "updated_s": b.updated_s, "requests": b.requests,
                    "missed_lo": b.missed_lo, "missed_hi": b.missed_hi} for b in state.budget],
    }


def _state(doc: StateDoc) -> PlannerState:
    def key(s: SurplusDoc | CorrectionDoc) -> ConfigKey:
        return ConfigKey(s.model, s.engine, s.gpu, s.tp, s.precision, s.role)

    return PlannerState(
        tuple(sorted((key(s), s.since_s) for s in doc.surplus_since_s)),
        doc.cycle,
        tuple(sorted((Correction(key(k), k.ttft_log, k.ttft_var, k.itl_log, k.itl_var, k.observations, k.since_s,
                                 k.updated_s, k.observed_ttft_speed, k.observed_itl_speed, k.applied_ttft_log,
                                 k.applied_itl_log, tuple(k.ttft_points), tuple(k.itl_points),
                                 tuple(k.slo_windows),
                                 tuple((w[0], w[1], w[2], w[3] if len(w) > 3 else w[2]) for w in k.ttft_windows))
                      for k in doc.corrections), key=lambda c: c.config)),
        tuple((b[0], b[1], b[2], b[3] if len(b) > 3 else 0.0) for b in doc.bursts),
        tuple(HeldLengths(h.model, h.t_s, h.isl, h.osl, tuple(h.isl_quantiles), tuple(h.osl_quantiles),
                          h.isl_p99_low) for h in doc.lengths),
        tuple(BudgetSlice(b.model, b.t_s, b.updated_s, b.requests, b.missed_lo, b.missed_hi) for b in doc.budget),
    )


def state_from_dict(data: Any, source: str = "state") -> PlannerState:
    """A stored planner state; raises PolicyError naming the key and value."""
    return _state(_validate(StateDoc, data, source))


def fleet_to_dict(fleet: Fleet, state: PlannerState | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "hosts": [{"name": h.name, "gpu": h.gpu.value, "gpu_count": h.gpu_count,
                   "nvlink_groups": [list(g) for g in h.nvlink_groups], "online": h.online} for h in fleet.hosts],
        "replicas": [{"replica_id": r.replica_id, "model": r.config.model, "engine": r.config.engine.value,
                      "gpu": r.config.gpu.value, "tp": r.config.tp, "precision": r.config.precision.value,
                      "role": r.config.role.value,
                      "host": r.host, "gpu_indices": list(r.gpu_indices), "state": r.state.value,
                      "port": r.port, "since_s": r.since_s} for r in fleet.replicas],
        "builds": [{"model": b.model, "engine": b.engine.value, "gpu": b.gpu.value, "tp": b.tp,
                    "precision": b.precision.value, "host": b.host, "ready": b.ready, "eta_s": b.eta_s,
                    "gpu_indices": list(b.gpu_indices)}
                   for b in fleet.builds],
    }
    if state is not None:
        out["planner_state"] = state_to_dict(state)
    return out


def observation_to_dict(observation: Observation, time_s: float | None = None) -> dict[str, Any]:
    """An Observation -> a DEMAND document (observation_from_dict reads it back). Values the DEMAND
    format cannot hold (NaN, inf, a negative rate, a zero ISL/OSL) become null: unknown."""

    def ok(v: float | None, positive: bool = False) -> float | None:
        if v is None or not math.isfinite(v) or v < 0 or (positive and v == 0):
            return None
        return v

    out: dict[str, Any] = {
        "models": {name: {"rate_rps": ok(o.rate_rps), "isl": ok(o.isl, True), "osl": ok(o.osl, True),
                          "ttft_p99_ms": ok(o.ttft_p99_ms), "itl_p99_ms": ok(o.itl_p99_ms),
                          "history": [list(p) for p in o.history if all(math.isfinite(x) for x in p)],
                          "stale": o.stale}
                   for name, o in sorted(observation.models.items())},
        "alerts": list(observation.alerts),
    }
    if time_s is not None:
        out["time_s"] = time_s
    return out
