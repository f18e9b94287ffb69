"""The controller daemon: every cycle observe -> plan -> act, safely, and say why.

One asyncio loop; `controller/runner.py` runs `cycle()` on a plain interval loop (cycles never
overlap; a SIGHUP reload lands between cycles). Each cycle:

1. reconcile with what the agents report (`Executor.reconcile` -> `planner.act.reconcile`: adopt
   orphans, note ready replicas, republish unacked desired states, act on refusals, time out
   replicas that never became ready);
2. observe Prometheus (controller/observe.py; stale -> fail static);
3. plan (`planner.core.plan` in a worker thread; the plan dict is stored and is what reports render),
   then the brakes (`planner.brakes` via controller/actuation.py);
4. act (`Executor.execute` -> `planner.act.execute`): rows committed before the desired states naming
   them are published; drains only once no replica of the model is still starting;
5. routing: nginx upstreams (ready, non-draining replicas on usable hosts), endpoints JSON,
   Prometheus file_sd targets, all written atomically.

The pieces: `PolicySource` (policy and profile files), `HostBook` (the agents' statuses),
`MqttLink` (the MQTT session), `Executor` (the act core's effects), controller/reporting.py (what
the report API and the metrics show). The Controller wires them and runs the cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetplan.controller import reporting
from fleetplan.controller.clocks import ClockGuard, SteadyClock, observe_deadlines
from fleetplan.controller.executor import Executor
from fleetplan.controller.failsafe import ROUTER_ALERT
from fleetplan.controller.hosts import HostBook
from fleetplan.controller.link import MqttLink
from fleetplan.controller.metrics import ControllerMetrics
from fleetplan.controller.observe import Observer, ObserverConfig, PromClient, Snapshot, to_observation
from fleetplan.controller.policy_source import PolicySource
from fleetplan.controller.protocol import HostStatus
from fleetplan.controller.report_snapshot import ReportSnapshot
from fleetplan.controller.sdnotify import sd_notify
from fleetplan.controller.settings import ControllerSettings, RoutingSettings
from fleetplan.controller.state import Phase, StateStore
from fleetplan.planner import act_port, clockstep
from fleetplan.planner.act_types import AlertKey, AlertKind

__all__ = ["Clock", "Controller", "ControllerSettings", "RoutingSettings"]

log = logging.getLogger(__name__)


@dataclass
class Clock:
    """The controller's clock. time_scale K: simulated seconds run K x faster than wall seconds
    (lab); the origin is persisted so a restarted controller continues the same simulated time."""

    time_scale: float = 1.0
    origin_wall: float = 0.0
    origin_sim: float = 0.0
    wall: Callable[[], float] = time.time

    def now(self) -> float:
        return self.to_sim(self.wall())

    def to_sim(self, wall_s: float) -> float:
        if self.time_scale == 1.0:
            return wall_s
        return self.origin_sim + (wall_s - self.origin_wall) * self.time_scale

    def resume(self, store: StateStore) -> None:
        """Continue the simulated time of the last controller on this state store."""
        now = self.wall()
        origin = store.get_kv("clock_origin")
        if origin is None or float(origin.get("time_scale", 1.0)) != self.time_scale:
            origin = {"wall": now, "sim": now, "time_scale": self.time_scale}
            store.set_kv("clock_origin", origin)
        last = store.get_kv("clock_last")
        if last is not None and self.time_scale != 1.0:
            self.origin_wall = now
            self.origin_sim = float(last["sim"]) + (now - float(last["wall"])) * self.time_scale
        else:
            self.origin_wall = float(origin["wall"])
            self.origin_sim = float(origin["sim"])


@dataclass
class Controller:
    settings: ControllerSettings
    policy_path: Path
    profiles_path: Path | None
    store: StateStore
    time_scale: float = 1.0
    nginx_reload: Callable[[], None] | None = None
    report_listen: str = "127.0.0.1:9470"
    report_token: str | None = None
    metrics: ControllerMetrics = field(default_factory=ControllerMetrics)
    # the wall and monotonic clocks (injectable); `wall` below is the one clock of the controller and
    # its pieces: unix seconds that never step (controller/clocks.py)
    clocks: SteadyClock = field(default_factory=SteadyClock)

    def __post_init__(self) -> None:
        from fleetplan.controller.actuation import PauseState
        from fleetplan.controller.fleetview import policy_inventory

        self.wall: Callable[[], float] = self.clocks.now
        self.clock_guard = ClockGuard(self.clocks, self.settings.clock_step_tolerance_s)
        self.runtime_alerts: dict[AlertKey, str] = {}
        self.policy = PolicySource(self.policy_path, self.profiles_path, self.store, self.metrics,
                                   self.runtime_alerts, wall=self.wall,
                                   pool_proxy=self.settings.routing.pool_proxy is not None)
        self.clock = Clock(self.time_scale, wall=self.wall)
        self.hosts = HostBook(self.runtime_alerts, self.settings.host_offline_grace_s, wall=self.wall,
                              inventory=lambda: policy_inventory(self.policy.policy))
        self.link = MqttLink(self.settings.mqtt, self._on_status, self._on_ack, self._on_connect,
                             on_reject=self.hosts.on_reject, on_desired=self.hosts.on_desired)
        self.prom = PromClient(self.settings.prometheus_url)
        self._lock = asyncio.Lock()
        self.executor = Executor(self.settings, self.store, self.link, self.hosts, self.runtime_alerts,
                                 self.metrics, self.prom, self._lock, self.policy, wall=self.wall,
                                 time_scale=self.time_scale)
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.planner_state: Any = None
        self.last_snapshot: Snapshot | None = None
        self._observer: Observer | None = None
        self.cycle_count = 0
        self.metrics.mqtt_connected.set_function(lambda: float(self.link.connected.is_set()))
        self.report_runner: Any = None
        self.report_url: str | None = None
        self.correction_labels: set[tuple[str, str]] = set()  # label sets of profile_correction_ratio
        self._progress_mono = self.clocks.mono()  # last finished cycle (or the start)
        self._routing_task: asyncio.Task[None] | None = None
        self.pause = PauseState(False)  # loaded from the store at start
        self._watchdog_period_s: float | None = None
        self._router_seen_down_wall: float | None = None  # the last cycle that saw the router alert
        self.reports = ReportSnapshot()  # what the report API serves, made at the end of each cycle

    # ---- the pieces' faces, for the report API, the CLI and the tests ------------------------
    @property
    def statuses(self) -> dict[str, HostStatus]:
        return self.hosts.statuses

    @property
    def profiles(self) -> Any:
        return self.policy.profiles

    def load_policy(self, *, initial: bool) -> bool:
        return self.policy.load(initial=initial)

    async def reload_policy(self) -> bool:
        return await self.policy.reload()

    def model_names(self) -> list[str]:
        return self.policy.model_names()

    def advisory(self) -> bool:
        return self.policy.advisory()

    def cycle_s(self) -> float:
        """Simulated seconds between cycles: the settings' override, else the policy's."""
        return float(self.settings.cycle_s or self.policy.policy.scaling.cycle_s)

    # ---- MQTT callbacks (event loop) -------------------------------------------------------
    def _on_status(self, host: str, status: HostStatus) -> None:
        ready = self.hosts.on_status(host, status)
        # a replica became ready: route it now, not at the next cycle
        # (no store query per message: the ids routing last saw as desired are kept in memory)
        if (set(ready) - self.executor.routed) & self.executor.desired_ids and not self._stopping.is_set() and (
                self._routing_task is None or self._routing_task.done()):
            self._routing_task = asyncio.get_running_loop().create_task(self.executor.update_routing())

    def _on_ack(self, host: str, ack: Any) -> None:
        self.store.record_ack(host, ack.version, ack.accepted, ack.errors)

    def _on_connect(self) -> None:
        # the broker may have lost retained messages (restart without persistence): republish all
        self.executor.republish_all = True
        self.executor.connected_wall = self.wall()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        from fleetplan.controller.actuation import load_pause
        from fleetplan.controller.report import start_report_server

        self.policy.load(initial=True)
        self.policy.load_profiles()
        self.clock.resume(self.store)
        self.planner_state = self.store.planner_state()
        self.pause = load_pause(self.store)
        if self.settings.routing.nginx_upstreams_path is not None and self.nginx_reload is not None:
            from fleetplan.controller.routing import NginxRouter

            self.executor.router = NginxRouter(self.settings.routing.nginx_upstreams_path, self.nginx_reload,
                                               affinity=self.settings.routing.affinity_headers)
        self._tasks.append(asyncio.create_task(self.link.run(), name="mqtt"))
        self.report_runner, self.report_url = await start_report_server(self, self.report_listen, self.report_token)
        # resume: republish every host's desired state (version bumped), resume drains
        self.executor.republish_all = True
        for row in self.store.replicas((Phase.DRAINING,)):
            self.executor.start_drain(row.replica_id)
        sd_notify("READY=1\nSTATUS=controller running")
        wd = os.environ.get("WATCHDOG_USEC")
        if wd:
            self._tasks.append(asyncio.create_task(self._watchdog(int(wd) / 1e6), name="watchdog"))

    def health(self) -> list[str]:
        """What is wrong with the controller's own loops (empty: healthy). Healthy means the MQTT task
        runs (connected or reconnecting) and a cycle finished recently; /healthz and the systemd
        watchdog both follow it, so a dead loop gets the controller restarted."""
        problems = []
        mqtt = next((t for t in self._tasks if t.get_name() == "mqtt"), None)
        if mqtt is None:
            problems.append("MQTT task not started")
        elif mqtt.done():
            exc = None if mqtt.cancelled() else mqtt.exception()
            problems.append(f"MQTT task ended ({type(exc).__name__}: {exc})" if exc else "MQTT task ended")
        stalled = self.clocks.mono() - self._progress_mono
        if self.policy.policy is not None:
            limit = max(3 * self.cycle_s() / self.time_scale, self._watchdog_period_s or 0.0, 60.0)
            if stalled > limit:
                problems.append(f"no cycle finished for {stalled:.0f} s (limit {limit:.0f} s)")
        return problems

    async def _watchdog(self, period_s: float) -> None:
        """WATCHDOG=1 only while healthy: a wedged cycle, a dead MQTT task (or loop) gets us restarted."""
        self._watchdog_period_s = period_s
        while True:
            problems = self._ping_watchdog()
            if problems:
                log.error("unhealthy (%s): not pinging the systemd watchdog", "; ".join(problems))
            await asyncio.sleep(period_s / 2)

    def _ping_watchdog(self) -> list[str]:
        """WATCHDOG=1 when healthy and not stopping (after STOPPING=1 systemd wants no more pings)."""
        problems = self.health()
        if not problems and not self._stopping.is_set():
            sd_notify("WATCHDOG=1")
        return problems

    async def stop(self) -> None:
        sd_notify("STOPPING=1")
        self._stopping.set()
        async with self._lock:  # the current step finishes first
            pass
        tasks = list(self.executor.drains.values()) + self._tasks
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.report_runner is not None:
            await self.report_runner.cleanup()
        await self.prom.aclose()
        try:  # a store that cannot be written must not turn a clean stop into a crash
            self.store.save_host_statuses(self.hosts.take_dirty())
        except Exception as exc:
            log.error("stop: the hosts' last statuses not saved (%s): %s", self.store.path, exc)
        self.store.close()

    def build_fleet(self) -> Any:
        """The planner's Fleet from the hosts' reports and this controller's records."""
        from fleetplan.controller.fleetview import fleet_from

        return fleet_from(self.hosts, self.store, self.executor.view(), self.clock.to_sim,
                          self.policy.policy, self.policy.canonical)

    # ---- the cycle -----------------------------------------------------------------------------
    async def cycle(self) -> dict[str, Any]:
        if self._stopping.is_set():
            return {}
        async with self._lock:
            return await self._cycle()

    async def _cycle(self) -> dict[str, Any]:
        from fleetplan.controller import failsafe

        now_s = self.clock.now()
        stepped = self.clock_guard.check(self.runtime_alerts)  # the wall clock stepped: no action this cycle
        cid: int | None = None
        status = "ok"
        summary: dict[str, Any] = {"now_s": now_s}
        try:
            # the store first: one that cannot be written ends the cycle before anything is acted on
            # (controller/failsafe.py); the loop, the report API and the watchdog pings go on
            self.store.set_kv("clock_last", {"wall": self.wall(), "sim": now_s})
            failsafe.save_statuses(self)
            cid = self.store.begin_cycle(now_s)
            failsafe.store_probe(self)
            await failsafe.watch_router(self)
            await self.executor.reconcile()
            snap = await self._observe(cid, now_s, stepped is not None)
            self.executor.adopt_orphans()  # statuses may have arrived while observing: never plan around an unknown engine
            step = clockstep.step_this_cycle(stepped, snap.clock_step_s)
            if step is not None:
                summary.update(self._no_action_on_step(cid, snap, step))
            else:
                summary.update(await self._plan_and_act(cid, now_s, snap))
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            status = "error"
            summary["error"] = f"{type(exc).__name__}: {exc}"
            if self.store.write_error is not None:  # the store refused a write: alerted, not a bug
                failsafe.store_failed(self, cid)
            else:
                log.exception("cycle %s failed", cid)
                self.runtime_alerts[AlertKey(AlertKind.CYCLE)] = f"cycle {cid} failed: {type(exc).__name__}: {exc}"
        finally:
            if cid is not None:
                failsafe.finish_cycle(self, cid, status, summary)
            self.metrics.cycles.labels(status).inc()
            self.metrics.last_cycle_timestamp.set(self.wall())
            self._progress_mono = self.clocks.mono()
            self.cycle_count += 1
            self._ping_watchdog()
        if status == "ok":
            self.runtime_alerts.pop(AlertKey(AlertKind.CYCLE), None)
        failsafe.cycle_done(self, status)
        self.reports.refresh(self)
        return summary

    async def _observe(self, cid: int, now_s: float, clock_stepped: bool) -> Snapshot:
        s = self.settings
        if self._observer is None:  # one Observer: it keeps the rate history it has read
            self._observer = Observer(self.prom, ObserverConfig(
                window_s=s.observe_window_s, history_s=s.history_s, history_step_s=s.history_step_s,
                peak_window_s=s.peak_window_s, length_window_s=s.length_window_s,
                time_scale=self.time_scale), canonical=self.policy.canonical, clock=self.wall,
                mono=self.clocks.mono, step_tolerance_s=s.clock_step_tolerance_s)
        if clock_stepped:
            self._observer.forget_history()
        self.prom.deadline_s, self._observer.deadline_s = observe_deadlines(
            max(0.5, self.cycle_s() / self.time_scale), s.prometheus_query_deadline_s, s.observe_deadline_s)
        active = self.store.active_replicas()
        expected = {r.replica_id for r in active}
        serving = {r.replica_id: r.model for r in active if r.replica_id in self.executor.routed}
        # the router down now or within the last rate window: demand did not reach the engines
        if ROUTER_ALERT in self.runtime_alerts:
            self._router_seen_down_wall = self.wall()
        router_down = (self._router_seen_down_wall is not None
                       and self.wall() - self._router_seen_down_wall < self.settings.observe_window_s)
        from fleetplan.planner.act import ready_since

        ready = ready_since(active, self.hosts.reports())  # a replica serves from its agent's READY on
        snap = await self._observer.snapshot(self.model_names(), now_s=now_s, expected_replicas=expected,
                                             serving=serving, router_down=router_down, ready_wall_s=ready)
        self.last_snapshot = snap
        self.store.save_observation(cid, snap.to_json())
        return snap

    async def _plan_and_act(self, cid: int, now_s: float, snap: Snapshot) -> dict[str, Any]:
        """The pure decision path (fleetplan.planner.cycle, the replay's too), then its effects."""
        from fleetplan.controller.actuation import history
        from fleetplan.planner.core import plan_to_dict
        from fleetplan.planner.cycle import decide

        models = self.model_names()
        planned_on = self.executor.view()  # what the plan sees; checked again when acting on it
        fleet = self.build_fleet()
        obs = to_observation(snap, models, fleet.replicas)  # + length mix and per-config evidence
        past = history(self.store, self.clock.to_sim, self.wall(), self.time_scale)
        t0 = time.perf_counter()
        d = await asyncio.to_thread(decide, obs, planned_on, fleet, self.policy.policy, self.policy.profiles,
                                    self.planner_state, now_s=now_s, paused=self.pause.paused, past=past)
        if d.deferred is not None or d.result is None or d.brakes is None:
            log.info("cycle %s: no plan yet: %s", cid, d.deferred)
            return {"deferred": d.deferred, "alerts": self._set_alerts(snap, [f"no plan yet: {d.deferred}"])}
        result = d.result
        solve_s = time.perf_counter() - t0
        self.metrics.solve_seconds.observe(solve_s)
        doc = plan_to_dict(result)
        doc["observation"] = {m: mm.to_json() for m, mm in snap.models.items()}
        doc["cycle_id"] = cid
        doc["now_s"] = now_s
        self._brakes(d.brakes, doc)
        self.store.save_plan(cid, doc, solve_s, doc["next_state"])
        self.planner_state = result.next_state
        # the act loop's step, the replay's too (planner/act_port.py), with the executor as its port
        acted = await act_port.execute(self.executor, d.brakes.allowed, planned_on=planned_on, cycle_id=cid)
        summary: dict[str, Any] = {"held": len(d.brakes.held)}
        summary["decision_id"] = reporting.audit(self, cid, now_s, doc, snap, fleet, d.brakes.allowed)
        await self.executor.update_routing()
        summary.update(acted.counts)
        summary.update(solve_s=round(solve_s, 4), planned_replicas=len(result.plan.replicas),
                       plan_usd_h=result.plan.usd_h,
                       stale_models=sorted(m for m, mm in snap.models.items() if mm.stale and m in models))
        reporting.update_metrics(self, doc, snap)
        summary["alerts"] = self._set_alerts(snap, reporting.plan_alerts(doc))
        return summary

    def _no_action_on_step(self, cid: int, snap: Snapshot, step: clockstep.StepSeen) -> dict[str, Any]:
        """A cycle on which a clock stepped (the controller's, or Prometheus's) acts on nothing: the
        time ranges it read may not mean what they say (planner/clockstep.py). The next plans."""
        why = f"{step.clock.value} stepped {step.step_s:+.0f} s: no action on this cycle"
        log.warning("cycle %s: %s", cid, why)
        return {"deferred": why, "alerts": self._set_alerts(snap, [why])}

    def _set_alerts(self, snap: Snapshot, plan_alerts: list[str]) -> int:
        """The cycle's alerts (observation, plan, runtime) replace the stored ones; returns how many."""
        alerts = {f"observe/{i}": a for i, a in enumerate(snap.alerts)}
        alerts.update({f"plan/{i}": n for i, n in enumerate(plan_alerts)})
        alerts.update(reporting.stored_runtime_alerts(self.runtime_alerts))
        self.store.set_alerts("", alerts)
        self.metrics.alerts_active.set(len(alerts))
        return len(alerts)

    # ---- brakes (planner/brakes.py decides; controller/actuation.py reads the store) -------------
    def _brakes(self, b: Any, doc: dict[str, Any]) -> None:
        """Record what the brakes (planner/brakes.py, applied in planner/cycle.py) held back."""
        from fleetplan.planner.brakes import Limit, brakes_to_dict

        policy = self.policy.policy
        doc["brakes"] = brakes_to_dict(b, policy.scaling.brake_limits())
        self.metrics.actuating.set(0.0 if self.advisory() or self.pause.paused else 1.0)
        for limit in Limit:
            self.metrics.actions_held.labels(limit.value).set(sum(1 for h in b.held if h.limit is limit))
        for h in b.held:
            log.info("cycle %s: %s %s held back by %s: %s", doc.get("cycle_id"), h.action.kind.value,
                     h.action.replica.replica_id, h.limit.value, h.detail)

    def set_paused(self, paused: bool, reason: str = "") -> dict[str, Any]:
        """Pause/resume actuation (persisted first); the next cycle's act step obeys it."""
        from fleetplan.controller.actuation import save_pause

        self.pause = save_pause(self.store, paused, reason)
        self.metrics.actuating.set(0.0 if self.advisory() or paused else 1.0)
        log.warning("actuation %s%s", "PAUSED" if paused else "resumed", f": {reason}" if reason else "")
        return self.actuation()

    def actuation(self) -> dict[str, Any]:
        policy = self.policy.policy
        return {"mode": policy.mode.value if policy is not None else None, **self.pause.to_json()}

    def state(self) -> dict[str, Any]:
        return reporting.state(self)

    def report(self) -> dict[str, Any]:
        return reporting.report(self)

