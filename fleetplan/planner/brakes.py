"""Brakes on actuation: advisory mode, pause, and blast-radius limits. Pure.

The planner decides WHAT the fleet should look like; the brakes decide how much of that may be
done NOW. `apply_brakes` takes the planner's actions, the recent actuation history (from the
state store, converted by the caller to the planner's clock) and the limits, and returns the
actions allowed this cycle plus the ones held back, each with the limit that held it. Nothing is
lost: a held action is planned again by the next cycle and goes through once the limit allows.

Limits (policy `scaling:`; None = no limit):
- max_gpus_started_per_hour: GPUs of replicas started in the last hour (history + this cycle);
- max_gpus_stopped_per_hour: GPUs of replicas drained or stopped (surplus) in the last hour;
- max_drains_per_host_per_cycle: drains of serving replicas per host in one cycle;
- min_ready_capacity_fraction: per model, the READY capacity left after this cycle's drains must
  stay >= this fraction of the model's READY capacity now (so a model is never drained at once;
  with a floor > 0 a model's last serving replica is never drained).

Never held (they free nothing that serves, or finish a decision already taken): STOP of a FAILED
replica, STOP of a replica already DRAINING, engine BUILDs. A STOP that completes a held DRAIN is
held with it; a START waiting for the GPUs of a held replica is held with it.
Order of checks for a scale-down: the capacity floor, drains per host, GPUs stopped per hour.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fleetplan.planner.types import Action, ActionKind, ConfigKey, Replica, ReplicaState

HOUR_S = 3600.0
_EPS = 1e-9


class Mode(StrEnum):
    """`active`: the controller acts on its plans; `advisory`: it plans, reports and exports
    metrics, and issues no action (no desired-state publish, no routing change)."""

    ACTIVE = "active"
    ADVISORY = "advisory"


class Limit(StrEnum):
    """What held an action back (the value is what reports print after "held back by")."""

    ADVISORY = "advisory mode"
    PAUSED = "pause"
    GPUS_STARTED_PER_HOUR = "max_gpus_started_per_hour"
    GPUS_STOPPED_PER_HOUR = "max_gpus_stopped_per_hour"
    DRAINS_PER_HOST_PER_CYCLE = "max_drains_per_host_per_cycle"
    CAPACITY_FLOOR = "min_ready_capacity_fraction"


class Direction(StrEnum):
    UP = "up"  # GPUs started
    DOWN = "down"  # GPUs drained/stopped


@dataclass(frozen=True)
class BrakeLimits:
    max_gpus_started_per_hour: int | None = None
    max_gpus_stopped_per_hour: int | None = None
    max_drains_per_host_per_cycle: int | None = None
    min_ready_capacity_fraction: float | None = None


@dataclass(frozen=True)
class PastAction:
    """One replica started or taken out of service earlier (times on the planner's clock)."""

    direction: Direction
    at_s: float
    gpus: int


@dataclass(frozen=True)
class HeldAction:
    action: Action
    limit: Limit
    detail: str

    def text(self) -> str:
        return f"held back by {self.limit.value}: {self.detail}"


@dataclass(frozen=True)
class BrakeResult:
    allowed: tuple[Action, ...]
    held: tuple[HeldAction, ...]
    mode: Mode
    paused: bool
    gpus_started_last_hour: int  # history + allowed this cycle
    gpus_stopped_last_hour: int


def _gpus(r: Replica) -> int:
    return max(1, r.config.tp)


def _exempt(a: Action) -> bool:
    if a.kind is ActionKind.BUILD:
        return True
    return a.kind is ActionKind.STOP and a.replica.state in (ReplicaState.FAILED, ReplicaState.DRAINING,
                                                             ReplicaState.STOPPED)


def replica_capacity(
    replicas: Iterable[Replica], capacity_rps: Mapping[ConfigKey, float]
) -> dict[str, float]:
    """replica id -> rps it serves at the SLO: its config's capacity when known, else the mean known
    capacity of its model's replicas, else 1.0 (then the floor counts replicas)."""
    reps = list(replicas)
    known: dict[str, list[float]] = {}
    for r in reps:
        c = capacity_rps.get(r.config)
        if c is not None and c > 0:
            known.setdefault(r.config.model, []).append(c)
    out: dict[str, float] = {}
    for r in reps:
        c = capacity_rps.get(r.config)
        if c is None or c <= 0:
            ks = known.get(r.config.model)
            c = sum(ks) / len(ks) if ks else 1.0
        out[r.replica_id] = c
    return out


def apply_brakes(
    actions: Sequence[Action],
    history: Iterable[PastAction],
    limits: BrakeLimits,
    *,
    mode: Mode,
    paused: bool,
    replicas: Sequence[Replica],
    capacity_rps: Mapping[ConfigKey, float],
    now_s: float,
) -> BrakeResult:
    """Split `actions` into allowed and held (see the module docstring). Pure and deterministic:
    actions keep the planner's order; the first action that would pass a limit is held, and so is
    every later one of the same kind that would too (a smaller later one may still fit)."""
    recent = [p for p in history if now_s - HOUR_S < p.at_s <= now_s]
    started = sum(p.gpus for p in recent if p.direction is Direction.UP)
    stopped = sum(p.gpus for p in recent if p.direction is Direction.DOWN)
    if mode is Mode.ADVISORY or paused:
        limit = Limit.ADVISORY if mode is Mode.ADVISORY else Limit.PAUSED
        detail = ("policy mode is advisory: planned, not acted on" if limit is Limit.ADVISORY
                  else "actuation paused by an operator (fleetplan resume)")
        return BrakeResult((), tuple(HeldAction(a, limit, detail) for a in actions), mode, paused, started,
                           stopped)

    cap = replica_capacity(replicas, capacity_rps)
    ready_cap: dict[str, float] = {}
    for r in replicas:
        if r.state is ReplicaState.READY:
            ready_cap[r.config.model] = ready_cap.get(r.config.model, 0.0) + cap[r.replica_id]
    floor = limits.min_ready_capacity_fraction
    floor_rps = {m: (floor or 0.0) * c for m, c in ready_cap.items()}
    left_rps = dict(ready_cap)
    drains_per_host: dict[str, int] = {}
    draining_now = {a.replica.replica_id for a in actions if a.kind is ActionKind.DRAIN}

    held_ids: dict[str, HeldAction] = {}  # replica id -> why (scale-downs)
    allowed: list[Action] = []
    held: list[HeldAction] = []

    def hold(a: Action, limit: Limit, detail: str) -> None:
        h = HeldAction(a, limit, detail)
        held.append(h)
        if a.kind in (ActionKind.DRAIN, ActionKind.STOP):
            held_ids[a.replica.replica_id] = h

    # scale-downs first: a START may wait for the GPUs of a held replica
    downs_ok: set[int] = set()
    for i, a in enumerate(actions):
        if a.kind not in (ActionKind.DRAIN, ActionKind.STOP) or _exempt(a):
            continue
        r = a.replica
        rid = r.replica_id
        if a.kind is ActionKind.STOP and rid in draining_now:
            if rid in held_ids:
                h = held_ids[rid]
                held.append(HeldAction(a, h.limit, h.detail))
            else:
                downs_ok.add(i)
            continue
        serving = a.kind is ActionKind.DRAIN and r.state is ReplicaState.READY
        g = _gpus(r)
        m = r.config.model
        if serving and floor is not None:
            after = left_rps.get(m, 0.0) - cap.get(rid, 0.0)
            if after < floor_rps.get(m, 0.0) - _EPS:
                hold(a, Limit.CAPACITY_FLOOR,
                     f"draining {rid} would leave {m} {max(after, 0.0):.2f} rps READY, below "
                     f"{floor:g} x {ready_cap.get(m, 0.0):.2f} rps")
                continue
        if serving and limits.max_drains_per_host_per_cycle is not None:
            n = drains_per_host.get(r.host, 0)
            if n + 1 > limits.max_drains_per_host_per_cycle:
                hold(a, Limit.DRAINS_PER_HOST_PER_CYCLE,
                     f"{n} drain(s) on {r.host} this cycle already (limit {limits.max_drains_per_host_per_cycle})")
                continue
        if limits.max_gpus_stopped_per_hour is not None and stopped + g > limits.max_gpus_stopped_per_hour:
            hold(a, Limit.GPUS_STOPPED_PER_HOUR,
                 f"{stopped} GPU(s) stopped in the last hour + {g} > {limits.max_gpus_stopped_per_hour}")
            continue
        stopped += g
        if serving:
            drains_per_host[r.host] = drains_per_host.get(r.host, 0) + 1
            if r.state is ReplicaState.READY:
                left_rps[m] = left_rps.get(m, 0.0) - cap.get(rid, 0.0)
        downs_ok.add(i)

    held_reps = [h.action.replica for h in held_ids.values()]
    for i, a in enumerate(actions):
        if _exempt(a) or i in downs_ok:
            allowed.append(a)
            continue
        if a.kind is not ActionKind.START:
            continue  # a held scale-down (recorded above)
        r = a.replica
        blocker = next((h for h in held_reps if h.host == r.host and set(h.gpu_indices) & set(r.gpu_indices)),
                       None)
        if blocker is not None:
            why = held_ids[blocker.replica_id]
            hold(a, why.limit, f"waits for the GPUs of {blocker.replica_id}, itself held ({why.detail})")
            continue
        g = _gpus(r)
        if limits.max_gpus_started_per_hour is not None and started + g > limits.max_gpus_started_per_hour:
            hold(a, Limit.GPUS_STARTED_PER_HOUR,
                 f"{started} GPU(s) started in the last hour + {g} > {limits.max_gpus_started_per_hour}")
            continue
        started += g
        allowed.append(a)
    order = {id(a): i for i, a in enumerate(actions)}
    held.sort(key=lambda h: order.get(id(h.action), 0))
    return BrakeResult(tuple(allowed), tuple(held), mode, paused, started, stopped)


def held_to_dict(h: HeldAction) -> dict[str, Any]:
    r = h.action.replica
    return {
        "kind": h.action.kind.value, "replica_id": r.replica_id, "model": r.config.model, "host": r.host,
        "engine": r.config.engine.value, "gpu": r.config.gpu.value, "tp": r.config.tp,
        "gpu_indices": list(r.gpu_indices), "reason": h.action.reason, "limit": h.limit.value,
        "detail": h.detail, "text": h.text(),
    }


def brakes_to_dict(b: BrakeResult, limits: BrakeLimits) -> dict[str, Any]:
    """What the stored plan carries about the brakes (reports render it, never recompute it)."""
    return {
        "mode": b.mode.value,
        "paused": b.paused,
        "limits": {
            "max_gpus_started_per_hour": limits.max_gpus_started_per_hour,
            "max_gpus_stopped_per_hour": limits.max_gpus_stopped_per_hour,
            "max_drains_per_host_per_cycle": limits.max_drains_per_host_per_cycle,
            "min_ready_capacity_fraction": limits.min_ready_capacity_fraction,
        },
        "gpus_started_last_hour": b.gpus_started_last_hour,
        "gpus_stopped_last_hour": b.gpus_stopped_last_hour,
        "allowed": len(b.allowed),
        "held": [held_to_dict(h) for h in b.held],
    }
