"""The replay's side of the daemon: the records, the agents and the drains, around the daemon's own
decision path.

`FleetplanController` is fleetplan in the replay. Each cycle `ReplayControl.cycle` runs what
`controller/daemon.py` runs, in the same order and through the same pure functions:
`act_port.reconcile` (the agents' reports against the records), `planner.cycle.observe` (the raw
readings of the replay's Prometheus, fleetplan.sim.promsim), `planner.cycle.decide` (plan_deferred,
plan, brakes), `act_port.execute`, `act.routes`; drains are `act_port.drain`, the daemon's drain
loop, its sleeps resumed by the simulated clock.

`ReplayControl` is the act loop's `Port` (planner/act_port.py) in memory: the records are kept by
the records reducer (planner/records.py, the one the daemon's StateStore persists), desired states
reach the simulated agents at once (no MQTT), an agent reports its engines and builds as they are,
and the router serves `act.routes(...)`: the aggregated replicas and the pools.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar, cast

from fleetplan.models.profile import ProfileSet
from fleetplan.planner import act, act_port, records
from fleetplan.planner.brakes import PastAction
from fleetplan.planner.cycle import CycleDecision, decide, observe
from fleetplan.planner.evidence import Evidence
from fleetplan.planner.fleetview import fleet_from_view
from fleetplan.planner.observation import ObserveRules, Readings
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import EngineBuild, Fleet, Observation, PlannerState

T = TypeVar("T")

__all__ = ["ControlSettings", "EnginePort", "FleetplanController", "ReplayControl"]


@dataclass
class FleetplanController:
    """fleetplan in the replay: the policy and profiles the daemon would load, its planner state."""

    name: str
    policy: Policy
    profiles: ProfileSet
    period_s: float = 0.0
    state: PlannerState = field(default_factory=PlannerState.initial)
    solve_s: float = 0.0
    use_history: bool = True  # False: the forecast sees no rate history (an ablation)
    # policy reloads (SIGHUP in the daemon): (simulated time, the policy from then on), in time order
    reloads: tuple[tuple[float, Policy], ...] = ()

    def __post_init__(self) -> None:
        if self.period_s <= 0:
            self.period_s = self.policy.scaling.cycle_s

    def reset(self) -> None:
        self.state = PlannerState.initial()


@dataclass(frozen=True)
class ControlSettings:
    """The daemon's settings the replay needs (controller/settings.py defaults)."""

    ready_timeout_s: float = 600.0
    ack_timeout_s: float = 10.0
    host_offline_grace_s: float = 60.0
    drain_timeout_s: float = 120.0
    drain_settle_s: float = 1.0
    drain_poll_s: float = 0.5
    cycle_s: float | None = None  # the daemon's override of the policy's scaling.cycle_s; None: the policy's


class EnginePort(Protocol):
    """What the simulated world does for the control side (implemented by FleetSim)."""

    def launch(self, row: act.ReplicaRow, t_s: float) -> None: ...

    def stop(self, replica_id: str, t_s: float) -> None: ...

    def build(self, row: act.BuildRow, t_s: float) -> None: ...

    def reports(self, t_s: float) -> dict[str, act.HostReport]: ...

    def cached(self) -> list[EngineBuild]: ...

    def inflight(self, replica_id: str) -> float | None: ...

    def route(self, routes: act.Routes, t_s: float) -> None: ...

    def later(self, t_s: float, fn: Callable[[float], None]) -> None: ...


class _Later:
    """What a loop step waits for: `delay_s` of simulated time (`ReplayControl._resume`)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __await__(self) -> Generator[_Later, None, None]:
        yield self


def _at_once(step: Coroutine[_Later, None, T]) -> T:
    """Run a loop step that waits for nothing (a cycle's act step) to its end."""
    try:
        wait = step.send(None)
    except StopIteration as end:
        return cast(T, end.value)
    step.close()
    raise RuntimeError(f"a cycle's act step waited {wait.delay_s} s")


class ReplayControl:
    """The daemon's records and effects in the replay (see the module docstring)."""

    def __init__(self, ctl: FleetplanController, engines: EnginePort, *, epoch0_s: float, rules: ObserveRules,
                 settings: ControlSettings | None = None, counterfactuals: bool = False) -> None:
        self.ctl = ctl
        self.policy = ctl.policy
        self.engines = engines
        self.epoch0_s = epoch0_s
        self.rules = rules
        self.s = settings or ControlSettings()
        self.counterfactuals = counterfactuals
        self.records = records.Records()
        self.noted: frozenset[tuple[str, str]] = frozenset()
        self.drains: set[str] = set()  # replicas whose drain runs
        self._t = 0.0  # the simulated time a loop step runs at
        self._unpublished: list[records.Step] = []
        self.models = [m.name for m in self.policy.models]
        self.decisions: list[tuple[float, CycleDecision]] = []  # (t, decision), for parity checks
        self.deferred = 0
        self.swap_cycles = 0
        self.drain_timeouts = 0
        self.notes: list[str] = []
        self.serving: dict[str, str] = {}  # replica id -> model the router sends requests to
        self.keep_observations = False  # tests: what each cycle observed, beside the truth
        self.observations: list[tuple[float, Observation]] = []

    # ---- the records ---------------------------------------------------------------------------
    @property
    def rows(self) -> Mapping[str, act.ReplicaRow]:
        """The active replica records (desired or draining), by id."""
        return self.records.replicas

    @property
    def past(self) -> list[PastAction]:
        """The brakes' history, read from the records' action log."""
        return records.history(self.records.log)

    def wall(self, t_s: float) -> float:
        return self.epoch0_s + t_s

    def view(self, t_s: float | None = None) -> act.ActView:
        """The act view at `t_s` (None: the time the running loop step is at)."""
        t_s = self._t if t_s is None else t_s
        pol = self.policy
        s = self.s
        return act.ActView(
            now_s=self.wall(t_s), hosts=self.engines.reports(t_s), replicas=tuple(self.rows.values()),
            builds=tuple(self.records.builds.values()), desired={}, known_ids=self.records.known_ids,
            settings=act.ActSettings(s.ready_timeout_s, s.ack_timeout_s, s.host_offline_grace_s, (8000, 8999),
                                     pol.agent_templates(), pol.agent_templates(build=True)),
            connected_since_s=-math.inf, noted=self.noted)

    def fleet(self, view: act.ActView) -> Fleet:
        return fleet_from_view(view, cached=self.engines.cached(), to_sim=lambda x: x,
                               build_s=self.policy.build_s)

    def _record(self, effects: Sequence[records.RecordEffect], t_s: float, *, cycle: bool) -> records.Step:
        """The records after `effects` (planner/records.py, the reducer StateStore persists)."""
        step = records.apply(self.records, effects, self.wall(t_s), cycle_id=len(self.decisions) if cycle else None)
        self.records = step.records
        return step

    def _publish(self, step: records.Step, t_s: float) -> None:
        """What the agents do once the records change: launch, build, stop (desired states at once)."""
        for w in step.writes:
            if isinstance(w, records.PutReplica):
                if w.new:
                    self.engines.launch(w.row, t_s)
                elif w.row.phase == act.Phase.REMOVED:
                    self.drains.discard(w.row.replica_id)
                    self.engines.stop(w.row.replica_id, t_s)
            elif isinstance(w, records.PutBuild) and w.new:
                self.engines.build(w.row, t_s)

    def apply(self, decision: act.ActDecision, cycle_id: int | None) -> None:
        self._apply(decision, self._t, cycle=cycle_id is not None)

    def _apply(self, d: act.ActDecision, t_s: float, *, cycle: bool) -> None:
        """What StateStore.apply does with the effects, and what the agents then do."""
        self.noted = self.noted | d.noted
        step = self._record(d.effects, t_s, cycle=cycle)
        self.deferred += sum(1 for n in step.notes() if n.status == act.ActionStatus.DEFERRED)
        self._publish(step, t_s)

    def update_routing(self, t_s: float) -> None:
        r = act.routes(tuple(self.rows.values()), self.engines.reports(t_s), self.models, now_s=self.wall(t_s),
                       connected_since_s=-math.inf, grace_s=self.s.host_offline_grace_s)
        if r is not None:
            self.serving = {rid: m for m, ids in r.serving.items() for rid in ids}
            self.serving.update({rid: m for m, p in r.pools.items() for rid in p.ids()})
            self.engines.route(r, t_s)

    # ---- one cycle -----------------------------------------------------------------------------
    def reconcile(self, t_s: float) -> None:
        self._t = t_s
        act_port.reconcile(self)

    def reload(self, t_s: float) -> None:
        """A SIGHUP lands between cycles: the latest policy reloaded by `t_s` applies from this cycle."""
        due = [p for t, p in self.ctl.reloads if t <= t_s]
        if due and due[-1] is not self.policy:
            self.policy = due[-1]
            self.models = [m.name for m in self.policy.models]

    def cycle(self, t_s: float, readings: Readings, evidence: Evidence | None) -> CycleDecision:
        """One cycle of controller/daemon.py `_cycle`: reconcile, observe, plan and brake, act, route."""
        self.reload(t_s)
        self.reconcile(t_s)
        view = self.view(t_s)
        fleet = self.fleet(view)
        now = self.wall(t_s)
        # the simulated router never goes down: its rates are never a lower bound for that reason
        obs, _ = observe(readings, evidence, self.models, now_s=now, rules=self.rules,
                         expected_replicas=frozenset(self.rows), serving=self.serving,
                         ready_wall_s=act.ready_since(view.replicas, view.hosts),
                         router_down=False).for_fleet(fleet.replicas)
        if self.keep_observations:
            self.observations.append((t_s, obs))
        return self.decide_and_act(t_s, obs, view, fleet)

    def observe_warm(self, readings: Readings) -> Observation:
        """The warm start's observation at t = 0: the pre-roll's readings (fleetplan.sim.des) through
        the cycle's own path, for the fleet the warm-up has not started yet."""
        view = self.view(0.0)
        obs, _ = observe(readings, None, self.models, now_s=self.wall(0.0), rules=self.rules,
                         router_down=False).for_fleet(self.fleet(view).replicas)
        return obs

    def decide_and_act(self, t_s: float, obs: Observation, view: act.ActView, fleet: Fleet) -> CycleDecision:
        if not self.ctl.use_history:
            obs = Observation(models={m: replace(o, history=()) for m, o in obs.models.items()}, alerts=obs.alerts)
        now = self.wall(t_s)
        d = decide(obs, view, fleet, self.policy, self.ctl.profiles, self.ctl.state, now_s=now, paused=False,
                   past=self.past, counterfactuals=self.counterfactuals)
        self.decisions.append((t_s, d))
        if d.result is None:
            return d
        self.ctl.state = d.result.next_state
        self.ctl.solve_s += d.result.explanation.solve_s
        stale = [m.model for m in d.result.explanation.models if m.fail_static]
        if stale and len(self.notes) < 50:
            self.notes.append(f"t={t_s:.0f}s: fail static (demand unknown, no scale-down) for " + ", ".join(stale))
        self._t = t_s
        out = _at_once(act_port.execute(self, d.allowed, planned_on=view, cycle_id=len(self.decisions)))
        started = {e.row.model for e in out.effects if isinstance(e, act.NewReplica)}
        drained = [e for e in out.effects if isinstance(e, act.SetPhase) and e.phase == act.Phase.DRAINING]
        if any(self.rows[e.replica_id].model in started for e in drained if e.replica_id in self.rows):
            self.swap_cycles += 1
        self.update_routing(t_s)  # the cycle's routing (the daemon's after its audit)
        return d

    # ---- drains: planner/act_port.py `drain` through this port ----------------------------------
    def deadline_s(self, model: str) -> float:
        return act.model_drain_deadline_s(self.policy.model(model), floor_s=self.s.drain_timeout_s)

    def start_drain(self, rid: str, t_s: float | None = None) -> None:
        t_s = self._t if t_s is None else t_s
        row = self.rows.get(rid)
        if row is None or rid in self.drains:
            return
        self.drains.add(rid)
        self._resume(self._drain(row), t_s)

    async def _drain(self, row: act.ReplicaRow) -> None:
        done = await act_port.drain(self, row.replica_id, deadline_s=self.deadline_s(row.model),
                                    settle_s=self.s.drain_settle_s, poll_s=self.s.drain_poll_s,
                                    hold_s=act.kv_hold_s(self.policy.model(row.model), row.role))
        self.drains.discard(row.replica_id)
        if done is not None and done.timed_out:
            self.drain_timeouts += 1

    def _resume(self, step: Coroutine[_Later, None, None], t_s: float) -> None:
        """Run a loop step until it waits (`sleep`), then again when the simulation reaches its time."""
        self._t = t_s
        try:
            wait = step.send(None)
        except StopIteration:
            return
        self.engines.later(t_s + wait.delay_s, lambda t: self._resume(step, t))

    # ---- the port (planner/act_port.py Port) in memory ------------------------------------------
    def now_s(self) -> float:
        return self.wall(self._t)

    def reports(self) -> Mapping[str, act.HostReport]:
        return self.engines.reports(self._t)

    def replica(self, replica_id: str) -> act.ReplicaRow | None:
        return self.records.replicas.get(replica_id)

    def active_replicas(self) -> Sequence[act.ReplicaRow]:
        return tuple(self.rows.values())

    async def inflight(self, row: act.ReplicaRow) -> float | None:
        return self.engines.inflight(row.replica_id)

    async def sleep(self, delay_s: float) -> None:
        await _Later(delay_s)

    async def record(self, effects: Sequence[records.RecordEffect], cycle_id: int | None) -> list[act.Note]:
        step = self._record(effects, self._t, cycle=cycle_id is not None)
        self._unpublished.append(step)
        return step.notes()

    async def route(self) -> None:
        self.update_routing(self._t)

    async def publish(self, hosts: frozenset[str]) -> None:
        """Desired states reach the simulated agents at once: what the records changed since."""
        steps, self._unpublished = self._unpublished, []
        for step in steps:
            self._publish(step, self._t)

    def exclusive(self) -> AbstractAsyncContextManager[object]:
        return nullcontext()

    # ---- warm start ------------------------------------------------------------------------------
    def warm(self, obs: Observation, ready: Callable[[str], None], *, rounds: int = 32) -> None:
        """Before t = 0 the daemon has run long enough for its fleet to be READY for the first
        window's traffic: cycles on the true first window through the same plan, brakes and act
        core, each started replica made READY at once (`ready`); replicas that need an engine build
        are not warm (their builds stay in progress)."""
        for _ in range(rounds):
            self.reconcile(0.0)
            view = self.view(0.0)
            before = set(self.rows)
            d = self.decide_and_act(0.0, obs, view, self.fleet(view))
            new = [rid for rid in self.rows if rid not in before]
            for rid in new:
                ready(rid)
            self.reconcile(0.0)
            self.update_routing(0.0)
            if d.result is None or not new:
                break
        self.records = replace(self.records, log=())  # the warm-up's actions are not the day's
        self.ctl.reset()

