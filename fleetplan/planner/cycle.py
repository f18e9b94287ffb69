"""One control cycle's decisions, from the raw readings to the actions to carry out. Pure.

The daemon (controller/daemon.py) and the replay (sim/des.py) are two adapters around this one
decision path; only their I/O differs (Prometheus over HTTP and MQTT to agents, or a simulated
fleet's counters and a simulated agent). Per cycle, in this order:

1. `act.reconcile(view)` (planner/act.py): the agents' reports against the records;
2. `observe(readings, evidence, ...)`: what Prometheus' answers mean (planner/observation.py
   `interpret`: fail static, partial windows, a router that was down, the time scale); then
   `Observed.for_fleet(replicas)`: with the length mix and the per-config latency evidence
   (planner/evidence.py), the planner's `Observation`. The daemon observes before it knows the
   cycle's fleet (controller/observe.py `Observer.snapshot`) and asks for the planner's input once
   it does; the replay does both at once;
3. `decide(observation, view, fleet, ...)`: no plan while a known host has not reported since start
   (`act.plan_deferred`), else the plan (planner/core.py `plan`) and the brakes (planner/brakes.py:
   advisory, pause, blast-radius limits);
4. `act.execute(view, decision.allowed, planned_on=view)`: the effects (rows, desired states, drains);
5. `act.routes(...)` and `act.drain_step(...)`: what the router serves, when a drain ends.

Worked example (tests/unit/planner/test_cycle.py): readings in which one replica of `m` is up with
a full window and 4 rps, a policy asking for 1 replica per 2 rps -> `decide` returns a plan of 2
replicas and one START allowed; with `paused=True` the START is held ("held back by pause").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleetplan.models.profile import ProfileSet
from fleetplan.planner import act
from fleetplan.planner import evidence as ev
from fleetplan.planner.brakes import BrakeResult, Mode, PastAction, apply_brakes
from fleetplan.planner.observation import Interpreted, ModelMetrics, ObserveRules, Readings, interpret
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import (
    Action,
    ConfigKey,
    Fleet,
    ModelObservation,
    Observation,
    PlannerState,
    PlanResult,
    Replica,
)

__all__ = ["CycleDecision", "Observed", "brakes_for", "capacity_of", "decide", "observation_from", "observe"]


@dataclass(frozen=True)
class Observed:
    """One observation: what the readings mean (the per-model metrics, for reports) and the raw
    evidence; `for_fleet` makes the planner's input of it."""

    interpreted: Interpreted
    evidence: ev.Evidence | None
    models: tuple[str, ...]  # the models the planner asks about (canonical names)
    now_s: float

    def for_fleet(self, replicas: Sequence[Replica] | None) -> tuple[Observation, tuple[str, ...]]:
        """The planner's Observation (`observation_from`) against `replicas` (None: the per-model
        numbers only), and why some evidence was left out (the daemon logs it)."""
        return observation_from(self.interpreted, self.evidence, self.models, replicas, self.now_s)


def observation_from(interpreted: Interpreted, evidence: ev.Evidence | None, models: Sequence[str],
                     replicas: Sequence[Replica] | None, now_s: float) -> tuple[Observation, tuple[str, ...]]:
    """The planner's Observation for `models`: the per-model numbers, and with `replicas` (the
    fleet) each model's length quantiles and per-config evidence (planner/evidence.py)."""
    obs: dict[str, ModelObservation] = {}
    notes: list[str] = []
    for m in models:
        mm = interpreted.models.get(m) or ModelMetrics(model=m, stale=True, reasons=("not observed",))
        me = ev.interpret(m, evidence, replicas or (), now_s, stale=mm.stale)
        notes.extend(f"evidence for {m}: {n}" for n in me.notes)
        # the length mix's scale from the same (longer) window as its shape, where the engines export it
        isl = _window_mean(evidence.prompt_len_moments if evidence is not None and not mm.stale else None, m, mm.isl)
        osl = _window_mean(evidence.gen_len_moments if evidence is not None and not mm.stale else None, m, mm.osl)
        obs[m] = ModelObservation(
            model=m, rate_rps=mm.rate_rps, isl=isl, osl=osl,
            ttft_p99_ms=mm.ttft_p99_ms, itl_p99_ms=mm.itl_p99_ms, history=mm.history, stale=mm.stale,
            isl_quantiles=me.isl_quantiles, osl_quantiles=me.osl_quantiles,
            configs=me.configs if replicas is not None else (),
            peak_rps=mm.peak_rps, peak_window_s=mm.peak_window_s, isl_p99_low=me.isl_p99_low(),
            history_window_s=mm.history_window_s,
            prefix_hit_rate=mm.prefix_hit_rate,
            ttft_buckets=me.ttft if replicas is not None else (),
            tpot_buckets=me.tpot if replicas is not None else (),
        )
    return Observation(models=obs, alerts=tuple(interpreted.alerts)), tuple(notes)


def _window_mean(moments: Mapping[str, tuple[float, float]] | None, model: str, fallback: float | None) -> float | None:
    """sum / count of a length histogram over its window (None or no requests: `fallback`)."""
    pair = (moments or {}).get(model)
    if pair is None:
        return fallback
    total, count = pair
    return total / count if count > 0 and total >= 0 else fallback


def observe(readings: Readings, evidence: ev.Evidence | None, models: Iterable[str], *, now_s: float,
            rules: ObserveRules, canonical: Callable[[str], str] = str,
            expected_replicas: Collection[str] | None = None, serving: Mapping[str, str] | None = None,
            ready_wall_s: Mapping[str, float] | None = None, router_down: bool = False) -> Observed:
    """Raw readings (and evidence) -> what they mean (planner/observation.py `interpret`; a failed
    reading keeps no evidence). `expected_replicas`: the replicas the controller runs; `serving`:
    replica id -> model of the replicas the router sends requests to; `ready_wall_s`: replica id ->
    when it became ready (unix seconds); `router_down`: the router is down or was within the rate
    window (every rate a lower bound)."""
    names = list(models)
    view = interpret(readings, names, now_s=now_s, rules=rules, canonical=canonical,
                     expected_replicas=frozenset(expected_replicas) if expected_replicas is not None else None,
                     serving=serving, router_down=router_down, ready_wall_s=ready_wall_s)
    if readings.error is not None:
        evidence = None
    wanted = tuple(dict.fromkeys([canonical(m) for m in names]))
    return Observed(view, evidence, wanted, now_s)


def capacity_of(result: PlanResult) -> dict[ConfigKey, float]:
    """Per-replica capacity (rps at the SLO) of every config the plan explains."""
    return {c.config: c.capacity_per_replica_rps for m in result.explanation.models for c in m.configs}


def brakes_for(result: PlanResult, fleet: Fleet, policy: Policy, *, paused: bool, past: Sequence[PastAction],
               now_s: float) -> BrakeResult:
    """The brakes on this plan's actions (planner/brakes.py) with the plan's own capacities."""
    mode: Mode = policy.mode
    return apply_brakes(result.actions, past, policy.scaling.brake_limits(), mode=mode, paused=paused,
                        replicas=fleet.replicas, capacity_rps=capacity_of(result), now_s=now_s)


@dataclass(frozen=True)
class CycleDecision:
    """`deferred`: why there is no plan this cycle (None: planned). Otherwise the plan and what the
    brakes allow of its actions."""

    deferred: str | None = None
    result: PlanResult | None = None
    brakes: BrakeResult | None = None

    @property
    def allowed(self) -> tuple[Action, ...]:
        return self.brakes.allowed if self.brakes is not None else ()


def decide(observation: Observation, view: act.ActView, fleet: Fleet, policy: Policy, profiles: ProfileSet,
           state: PlannerState, *, now_s: float, paused: bool, past: Sequence[PastAction],
           counterfactuals: bool = True) -> CycleDecision:
    """Plan (unless deferred) and brake. `now_s`: the planner's clock; `view`: what the plan sees
    (the act core is asked again with the view at acting time: `act.execute(..., planned_on=view)`).
    counterfactuals=False: no what-ifs in the explanation (planner/core.py `plan`; they change no action)."""
    from fleetplan.planner.core import plan

    waiting = act.plan_deferred(view)
    if waiting is not None:
        return CycleDecision(deferred=waiting)
    result = plan(observation, fleet, policy, profiles, state, now_s, counterfactuals=counterfactuals)
    brakes = brakes_for(result, fleet, policy, paused=paused, past=past, now_s=now_s)
    return CycleDecision(None, result, brakes)
