"""Scale of the controller daemon: one real Controller against N simulated hosts over one real Mosquitto.

    .venv/bin/python bench/controller_scale.py --hosts 1000 --models 50

What runs:
- one Mosquitto on a free loopback port, configured by fleetplan.harness.servers.MosquittoServer (password
  file, per-agent ACL, client id = user name);
- a fleet simulator in a child process (so its CPU is not charged to the controller's event loop):
  one asyncio task per host speaking the agent's MQTT protocol (fleetplan.controller.protocol) as its
  own `agent-<host>` user: retained status with a last will, desired-state subscription, an ack per
  version (validated with parse_desired/check_desired), replicas reported `starting` and `ready`
  `--ready-delay-s` later (no process is launched), a status every `--status-interval-s` and on
  every change, as the real agent does. The same process serves a fake Prometheus HTTP API that
  answers the Observer's queries with a fixed demand per model and an `up` series per ready replica;
  the request-rate history (range query) is flat at the demand;
- the controller in this process (fleetplan.controller.daemon.Controller, unmodified), its cycles
  driven back to back at most every `--interval-s`.

The policy has M models (`bench-m000`...), each allowed one config (vLLM, H100, `--tp`), profiled
with the roofline prior of Llama-3.1-70B; the demand per model is calibrated with one offline plan()
so that the planner wants about `--replicas` (default: one per host) in total.

Phases: rollout (from empty until every planned replica is ready and a cycle issues no action),
then `--steady-cycles` cycles. Each cycle prints its wall time split, measured by wrapping the
controller's own steps from outside:
  reconcile  Controller.reconcile minus its publishing
  observe    Observer.snapshot (HTTP + parse + interpretation)
  plan       fleetplan.planner.core.plan (in the worker thread)
  act        Controller.execute + adopt_orphans minus their publishing
  publish    Controller.publish_hosts (stage + publish + wait for the acks)
  routing    Controller.update_routing (endpoints JSON + file_sd files)
  other      the rest of Controller.cycle (fleet building, plan dict, audit, metrics, SQLite)
and, overlapping those (same event loop), `mqtt_in`: the time spent handling incoming statuses and
acks (parse + the controller's callbacks, each status an fsynced SQLite commit).

The last line is `cycle_s=<steady max> rollout_cycle_s=<max during rollout> rss_mb=<peak>` (peak RSS
of this process: the controller; the simulator and Mosquitto are reported on the line before).
`--profile DIR` writes pyinstrument reports per phase (event loop and planner thread).
Every process started (Mosquitto, the simulator) is stopped on exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

# the fleet simulator (child process): agents + fake Prometheus (bench/ is the script's own directory)
from scale_fleet import ISL, OSL, fleet_child

REPO = Path(__file__).resolve().parents[1]
BASE_MODEL = "llama-3.1-70b"  # whose roofline prior every synthetic model gets
HEADROOM = 0.2


def log(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# the scenario: policy, profiles, demand


def policy_doc(models: list[str], tp: int, max_actions: int) -> dict[str, Any]:
    return {
        "version": 1,
        "gpu_types": {"h100": {"price_usd_h": 3.0}},
        "models": [{"name": m, "slo": {"ttft_p99_ms": 1000, "itl_p99_ms": 80}, "min_replicas": 1,
                    "allowed": {"engines": ["vllm"], "tp": [tp], "gpus": ["h100"]}, "precision": "bf16",
                    "headroom": HEADROOM, "workload": {"isl": ISL, "osl": OSL}} for m in models],
        "engines": {"vllm": {"launch": {"command": "vllm", "args": ["serve", "{hf_model}", "--port", "{port}"]},
                             "startup": {"default_s": 60}}},
        "scaling": {"cycle_s": 60, "scale_down_delay_s": 600, "max_actions_per_cycle": max_actions},
    }


def profiles_for(models: list[str], tp: int) -> Any:
    from fleetplan.models.names import Engine, GpuType, Precision
    from fleetplan.models.profile import ConfigKey, ProfileSet, roofline_profile

    base = roofline_profile(ConfigKey(BASE_MODEL, Engine.VLLM, GpuType.H100, tp, Precision.BF16))
    if base is None:
        raise SystemExit(f"no roofline prior for {BASE_MODEL} tp{tp}")
    out = ProfileSet()
    for m in models:
        out = out.with_profile(dataclasses.replace(base, key=dataclasses.replace(base.key, model=m)))
    return out


def calibrate_demand(policy: Any, profiles: Any, models: list[str], hosts: int, gpus: int, target: int,
                     tp: int) -> tuple[dict[str, float], int]:
    """Demand per model (rps) so that the planner wants ~`target` replicas; checked with one plan()."""
    from fleetplan.models.names import GpuType
    from fleetplan.planner.core import plan
    from fleetplan.planner.types import Fleet, HostInventory, ModelObservation, Observation, PlannerState

    groups = (tuple(range(gpus)),)
    small = Fleet(tuple(HostInventory(f"cal-{i}", GpuType.H100, gpus, groups, True) for i in range(4)))
    one = models[0]
    probe = plan(Observation({m: ModelObservation(m, 0.01 if m == one else 0.0, ISL, OSL) for m in models}),
                 small, policy, profiles, PlannerState.initial(), time.time(), counterfactuals=False)
    me = next(e for e in probe.explanation.models if e.model == one)
    n = sum(1 for r in probe.plan.replicas if r.config.model == one)
    per_replica_rps = me.capacity_rps / max(1, n)
    demand: dict[str, float] = {}
    left = target
    for j, m in enumerate(models):
        want = max(1, round(left / (len(models) - j)))
        left -= want
        demand[m] = (want - 0.5) * per_replica_rps / (1 + HEADROOM)
    fleet = Fleet(tuple(HostInventory(f"h{i:05d}", GpuType.H100, gpus, groups, True) for i in range(hosts)))
    obs = Observation({m: ModelObservation(m, demand[m], ISL, OSL) for m in models})
    check = plan(obs, fleet, policy, profiles, PlannerState.initial(), time.time(), counterfactuals=False)
    return demand, len(check.plan.replicas)



# ---------------------------------------------------------------------------------------------
# timing the controller's steps from outside


@dataclasses.dataclass
class _Frame:
    name: str
    children_s: float = 0.0


class Phases:
    """Exclusive wall time per named step: a wrapped call's time minus its wrapped callees'."""

    def __init__(self) -> None:
        self.total_s: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._current: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar("phase", default=None)

    def _enter(self, name: str) -> tuple[_Frame, _Frame | None, contextvars.Token[_Frame | None], float]:
        parent = self._current.get()
        if parent is None and name != "cycle":
            # a step outside any cycle (routing task of a status callback, a drain): it overlaps
            # the cycle's steps on the same loop, so it is kept apart
            name = f"bg_{name}"
        frame = _Frame(name)
        return frame, parent, self._current.set(frame), time.perf_counter()

    def _exit(self, frame: _Frame, parent: _Frame | None, token: contextvars.Token[_Frame | None],
              t0: float) -> None:
        dt = time.perf_counter() - t0
        with contextlib.suppress(ValueError):  # a context copied into a thread: nothing to reset
            self._current.reset(token)
        self.total_s[frame.name] += dt - frame.children_s
        self.calls[frame.name] += 1
        if parent is not None:
            parent.children_s += dt

    def wrap_async(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = self._enter(name)
            try:
                return await fn(*args, **kwargs)
            finally:
                self._exit(*state)

        return wrapper

    def wrap_sync(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = self._enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit(*state)

        return wrapper

    def snapshot(self) -> dict[str, float]:
        return dict(self.total_s)


class Inbound:
    """Time the controller's MQTT task spends on incoming messages (parse + callbacks)."""

    def __init__(self, statuses: dict[str, Any]) -> None:
        self.total_s = 0.0
        self.count: Counter[str] = Counter()
        self.statuses = statuses  # the controller's host -> last HostStatus
        self.max_lag_s = 0.0  # status sent (agent clock, same machine) -> handled: the inbound backlog

    def wrap(self, fn: Callable[[str, bytes], None]) -> Callable[[str, bytes], None]:
        def wrapper(topic: str, payload: bytes) -> None:
            t0 = time.perf_counter()
            try:
                fn(topic, payload)
            finally:
                self.total_s += time.perf_counter() - t0
                kind = topic.rsplit("/", 1)[-1]
                self.count[kind] += 1
                st = self.statuses.get(topic.split("/")[2]) if kind == "status" else None
                if st is not None and st.updated_s is not None:
                    self.max_lag_s = max(self.max_lag_s, time.time() - st.updated_s)

        return wrapper


class PlanProfiler:
    """pyinstrument sessions of plan() calls (they run in a worker thread), per bench phase."""

    def __init__(self) -> None:
        self.phase = "rollout"
        self.sessions: dict[str, Any] = {}

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from pyinstrument import Profiler

            prof = Profiler(interval=0.001, async_mode="disabled")
            prof.start()
            try:
                return fn(*args, **kwargs)
            finally:
                session = prof.stop()
                old = self.sessions.get(self.phase)
                from pyinstrument.session import Session

                self.sessions[self.phase] = session if old is None else Session.combine(old, session)

        return wrapper


@contextlib.contextmanager
def instrumented(ctrl: Any, phases: Phases, inbound: Inbound, plan_prof: PlanProfiler | None) -> Iterator[None]:
    """Wrap the controller's steps (instance attributes, the Observer class, the planner module's
    plan); everything is put back on exit. Nothing in the daemon is edited."""
    import fleetplan.planner.act_port as act_port
    import fleetplan.planner.core as core
    from fleetplan.controller.observe import Observer

    ex = ctrl.executor  # the act core's effects (controller/executor.py)
    for name, step in (("reconcile", "reconcile"), ("publish", "publish_hosts"), ("routing", "update_routing")):
        setattr(ex, step, phases.wrap_async(name, getattr(ex, step)))
    ctrl.cycle = phases.wrap_async("cycle", ctrl.cycle)
    ex.adopt_orphans = phases.wrap_sync("act", ex.adopt_orphans)
    ctrl.link._dispatch = inbound.wrap(ctrl.link._dispatch)
    old_snapshot, old_plan = Observer.snapshot, core.plan
    plan_fn = plan_prof.wrap(old_plan) if plan_prof is not None else old_plan
    Observer.snapshot = phases.wrap_async("observe", old_snapshot)  # type: ignore[method-assign]
    core.plan = phases.wrap_sync("plan", plan_fn)
    old_execute = act_port.execute  # the act loop's step, called by the daemon through its module
    act_port.execute = phases.wrap_async("act", old_execute)
    try:
        yield
    finally:
        Observer.snapshot = old_snapshot  # type: ignore[method-assign]
        core.plan = old_plan
        act_port.execute = old_execute


# ---------------------------------------------------------------------------------------------
# the run


def rss_now_mb(pid: int | None = None) -> float:
    try:
        pages = int(Path(f"/proc/{pid or 'self'}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return math.nan
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


SPLIT = ("reconcile", "observe", "plan", "act", "publish", "routing", "other")


@dataclasses.dataclass
class CycleRecord:
    phase: str
    index: int
    wall_s: float
    split: dict[str, float]
    inbound_s: float
    inbound: dict[str, int]
    background: dict[str, float]
    summary: dict[str, Any]
    ready: int
    active: int
    cpu_s: float  # this process's CPU (all threads) during the cycle
    status_lag_s: float  # the oldest status handled during the cycle: sent -> handled


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.hosts = [f"h{i:05d}" for i in range(args.hosts)]
        self.models = [f"bench-m{j:03d}" for j in range(args.models)]
        self.mosquitto: Any = None
        self.fleet_proc: subprocess.Popen[bytes] | None = None
        self.fleet_log = work / "fleet.log"
        self.ctrl: Any = None
        self.records: list[CycleRecord] = []
        self.errors: list[str] = []
        self.last_start = 0.0

    # ---- processes -----------------------------------------------------------------------------
    def start_mosquitto(self) -> None:
        from fleetplan.harness.servers import MosquittoServer

        t0 = time.perf_counter()
        self.mosquitto = MosquittoServer(self.work / "mosquitto", self.hosts)
        self.mosquitto.start()
        log(f"mosquitto on {self.mosquitto.host}:{self.mosquitto.port} with {len(self.hosts)} agent users "
            f"({time.perf_counter() - t0:.1f} s)")

    def start_fleet(self, demand: dict[str, float], prom_port: int) -> None:
        m = self.mosquitto
        cfg = {"mqtt_host": m.host, "mqtt_port": m.port, "gpus": self.args.gpus_per_host,
               "ready_delay_s": self.args.ready_delay_s, "status_interval_s": self.args.status_interval_s,
               "demand": demand, "prom_port": prom_port,
               "agents": {h: (u.user, u.password) for h, u in m.agents.items()}}
        path = self.work / "fleet.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds passwords
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        with open(self.fleet_log, "ab") as out:
            self.fleet_proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--fleet-child", str(path)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def fleet_report(self) -> dict[str, Any]:
        try:
            lines = self.fleet_log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return {}
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                data: dict[str, Any] = json.loads(line)
                return data
        return {}

    def stop_all(self) -> None:
        proc, self.fleet_proc = self.fleet_proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self.mosquitto is not None:
            self.mosquitto.stop()
            self.mosquitto = None

    # ---- the controller ------------------------------------------------------------------------
    def make_controller(self, prom_port: int) -> Any:
        from fleetplan.controller.daemon import Controller, ControllerSettings, RoutingSettings
        from fleetplan.controller.mqtt import MqttSettings
        from fleetplan.controller.state import StateStore

        m = self.mosquitto
        (self.work / "routing").mkdir(parents=True, exist_ok=True)
        settings = ControllerSettings(
            prometheus_url=f"http://127.0.0.1:{prom_port}",
            mqtt=MqttSettings(host=m.host, port=m.port, username=m.controller_user, password=m.controller_password,
                              keepalive_s=30, backoff_initial_s=0.2, backoff_max_s=2.0),
            routing=RoutingSettings(endpoints_path=self.work / "routing" / "endpoints.json",
                                    file_sd_path=self.work / "routing" / "file_sd.json"),
        )
        return Controller(settings=settings, policy_path=self.work / "policy.yaml",
                          profiles_path=self.work / "profiles.json", store=StateStore(self.work / "state.db"),
                          report_listen="127.0.0.1:0")

    def counts(self) -> tuple[int, int]:
        """(replicas the controller wants that the agents report ready, replicas it wants)."""
        from fleetplan.controller.state import Phase

        rep = self.ctrl.hosts.reported()
        rows = self.ctrl.store.replicas((Phase.DESIRED,))
        ready = sum(1 for r in rows if r.replica_id in rep and rep[r.replica_id][1].state.value == "ready")
        return ready, len(rows)

    async def wait_online(self) -> None:
        n = len(self.hosts)
        t0 = time.perf_counter()
        last = -1.0
        while True:
            online = sum(1 for st in self.ctrl.statuses.values() if st.online and st.gpu_count)
            if online >= n:
                break
            if self.fleet_proc is not None and self.fleet_proc.poll() is not None:
                raise RuntimeError(f"the fleet simulator exited ({self.fleet_proc.returncode}); see {self.fleet_log}")
            if time.perf_counter() - t0 > self.args.connect_timeout_s:
                raise RuntimeError(f"only {online}/{n} agents online after {self.args.connect_timeout_s:.0f} s; "
                                   f"simulator: {self.fleet_report()}")
            if time.perf_counter() - last >= 2.0:
                last = time.perf_counter()
                log(f"  agents online {online}/{n} ({time.perf_counter() - t0:.0f} s)")
            await asyncio.sleep(0.2)
        log(f"all {n} agents online after {time.perf_counter() - t0:.1f} s")

    async def one_cycle(self, phase: str, index: int, phases: Phases, inbound: Inbound) -> CycleRecord:
        before, in_s, in_n = phases.snapshot(), inbound.total_s, Counter(inbound.count)
        inbound.max_lag_s = 0.0
        t0, cpu0 = time.perf_counter(), time.process_time()
        summary = await self.ctrl.cycle()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = phases.snapshot()
        split = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (*SPLIT, "cycle")}
        split["other"] = split.pop("cycle")
        background = {k[3:]: after[k] - before.get(k, 0.0) for k in after if k.startswith("bg_")}
        ready, active = self.counts()
        rec = CycleRecord(phase, index, wall, split, inbound.total_s - in_s, dict(inbound.count - in_n),
                          {k: v for k, v in background.items() if v > 0}, summary, ready, active, cpu,
                          inbound.max_lag_s)
        self.records.append(rec)
        parts = " ".join(f"{k} {split[k]:.2f}" for k in SPLIT)
        acts = " ".join(f"{k}={summary.get(k, 0)}" for k in ("start", "drain", "stop", "deferred"))
        err = f" ERROR {summary['error']}" if "error" in summary else ""
        bg = "".join(f", {k} tasks {v:.2f} s" for k, v in sorted(rec.background.items()))
        log(f"[{phase} {index:>2}] {wall:6.2f} s (cpu {cpu:.2f}) = {parts} | loop also: mqtt_in {rec.inbound_s:.2f} s "
            f"({rec.inbound.get('status', 0)} statuses, {rec.inbound.get('ack', 0)} acks, status lag "
            f"{rec.status_lag_s:.1f} s){bg} | planned "
            f"{summary.get('planned_replicas', '?')} {acts} | ready {ready}/{active} | "
            f"rss {rss_now_mb():.0f} MB{err}")
        if "error" in summary:
            self.errors.append(f"{phase} cycle {index}: {summary['error']}")
        return rec

    async def pace(self, started: float) -> None:
        rest = self.args.interval_s - (time.perf_counter() - started)
        if rest > 0:
            await asyncio.sleep(rest)

    async def run(self) -> None:
        from fleetplan.harness.procs import free_port
        from fleetplan.planner.policy import load_policy_dict
        from fleetplan.shared.benchfiles import save_profiles

        a = self.args
        target = a.replicas or a.hosts
        doc = policy_doc(self.models, a.tp, a.max_actions or target)
        (self.work / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        policy = load_policy_dict(doc, "bench")
        profiles = profiles_for(self.models, a.tp)
        save_profiles(self.work / "profiles.json", profiles)
        t0 = time.perf_counter()
        demand, planned = await asyncio.to_thread(calibrate_demand, policy, profiles, self.models, a.hosts,
                                                  a.gpus_per_host, target, a.tp)
        log(f"demand {sum(demand.values()):.0f} rps over {len(self.models)} models: an empty fleet of "
            f"{a.hosts} x {a.gpus_per_host} GPUs plans {planned} replicas (tp{a.tp}; target {target}; "
            f"calibrated in {time.perf_counter() - t0:.1f} s)")
        await asyncio.to_thread(self.start_mosquitto)
        prom_port = free_port()
        self.start_fleet(demand, prom_port)
        log(f"fleet simulator pid {self.fleet_proc.pid if self.fleet_proc else '?'}: {a.hosts} agents, fake "
            f"Prometheus on 127.0.0.1:{prom_port} (log {self.fleet_log})")
        self.ctrl = self.make_controller(prom_port)
        phases, inbound = Phases(), Inbound(self.ctrl.statuses)
        plan_prof = PlanProfiler() if a.profile else None
        loop_prof: Any = None
        loop_sessions: dict[str, Any] = {}
        with instrumented(self.ctrl, phases, inbound, plan_prof):
            await self.ctrl.start()
            try:
                await asyncio.wait_for(self.ctrl.link.connected.wait(), 30)
                await self.wait_online()
                if a.profile:
                    from pyinstrument import Profiler

                    loop_prof = Profiler(interval=0.001, async_mode="disabled")
                    loop_prof.start()
                rollout_t0 = time.perf_counter()
                i = 0
                while True:
                    i += 1
                    started = time.perf_counter()
                    self.last_start = started
                    rec = await self.one_cycle("rollout", i, phases, inbound)
                    acted = any(rec.summary.get(k, 0) for k in ("start", "drain", "stop", "deferred"))
                    planned_n = rec.summary.get("planned_replicas")
                    if planned_n and rec.ready >= planned_n and rec.active == planned_n and not acted:
                        break
                    if time.perf_counter() - rollout_t0 > a.rollout_timeout_s:
                        self.errors.append(f"rollout not finished after {a.rollout_timeout_s:.0f} s "
                                           f"(ready {rec.ready}/{planned_n})")
                        log(f"!! {self.errors[-1]}")
                        break
                    await self.pace(started)
                log(f"rollout done: {rec.ready} replicas ready after {i} cycles, "
                    f"{time.perf_counter() - rollout_t0:.1f} s")
                if loop_prof is not None:
                    from pyinstrument import Profiler

                    loop_sessions["rollout"] = loop_prof.stop()
                    loop_prof = Profiler(interval=0.001, async_mode="disabled")  # a restarted one accumulates
                    loop_prof.start()
                if plan_prof is not None:
                    plan_prof.phase = "steady"
                for k in range(1, a.steady_cycles + 1):
                    await self.pace(self.last_start)  # one interval after the last cycle began
                    self.last_start = time.perf_counter()
                    await self.one_cycle("steady", k, phases, inbound)
                if loop_prof is not None:
                    loop_sessions["steady"] = loop_prof.stop()
                    loop_prof = None
            finally:
                if loop_prof is not None:
                    with contextlib.suppress(Exception):
                        loop_prof.stop()
                await self.ctrl.stop()
        if a.profile:
            write_profiles(Path(a.profile), loop_sessions, plan_prof.sessions if plan_prof else {})

    def report(self) -> str:
        roll = [r for r in self.records if r.phase == "rollout"]
        steady = [r for r in self.records if r.phase == "steady"]
        fleet = self.fleet_report()
        for name, rows in (("rollout", roll), ("steady", steady)):
            if not rows:
                continue
            mean = {k: sum(r.split[k] for r in rows) / len(rows) for k in SPLIT}
            worst = max(rows, key=lambda r: r.wall_s)
            log(f"{name}: {len(rows)} cycles, max {worst.wall_s:.2f} s (cycle {worst.index}), mean "
                f"{sum(r.wall_s for r in rows) / len(rows):.2f} s; mean split "
                + " ".join(f"{k} {mean[k]:.2f}" for k in SPLIT)
                + f"; mqtt_in mean {sum(r.inbound_s for r in rows) / len(rows):.2f} s")
        log(f"simulator: {fleet}; mosquitto rss {self._mosquitto_rss():.0f} MB")
        for e in self.errors:
            log(f"error: {e}")
        cycle_s = max((r.wall_s for r in steady), default=math.nan)
        rollout_s = max((r.wall_s for r in roll), default=math.nan)
        return f"cycle_s={cycle_s:.3f} rollout_cycle_s={rollout_s:.3f} rss_mb={peak_rss_mb():.0f}"

    def _mosquitto_rss(self) -> float:
        m = self.mosquitto
        if m is None or m.proc is None or m.proc.pid is None:
            return math.nan
        return rss_now_mb(m.proc.pid)


def write_profiles(out: Path, loop_sessions: dict[str, Any], plan_sessions: dict[str, Any]) -> None:
    from pyinstrument.renderers import ConsoleRenderer

    out.mkdir(parents=True, exist_ok=True)
    for kind, sessions in (("loop", loop_sessions), ("plan", plan_sessions)):
        for phase, session in sessions.items():
            tree = ConsoleRenderer(show_all=False, short_mode=False).render(session)
            flat = ConsoleRenderer(flat=True, flat_time="self").render(session)
            (out / f"{kind}-{phase}.txt").write_text(tree)
            (out / f"{kind}-{phase}-flat.txt").write_text(flat)
            session.save(str(out / f"{kind}-{phase}.pyisession"))
    log(f"profiles written to {out}/ (loop-*: the event loop thread; plan-*: plan() in its worker thread)")


async def _main(args: argparse.Namespace, bench: Bench) -> None:
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    await bench.run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--steady-cycles", type=int, default=5)
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=None, help="replicas the demand asks for (default: --hosts)")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel size of every replica")
    ap.add_argument("--max-actions", type=int, default=None,
                    help="policy scaling.max_actions_per_cycle (default: --replicas, the rollout in one plan)")
    ap.add_argument("--ready-delay-s", type=float, default=2.0, help="starting -> ready in the simulated agents")
    ap.add_argument("--status-interval-s", type=float, default=15.0, help="agents' status heartbeat (agent default)")
    ap.add_argument("--interval-s", type=float, default=3.0, help="at most one cycle start per this many seconds")
    ap.add_argument("--connect-timeout-s", type=float, default=300.0)
    ap.add_argument("--rollout-timeout-s", type=float, default=600.0)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run's files here (default: a temp dir)")
    ap.add_argument("--profile", type=Path, default=None, help="write pyinstrument reports to this directory")
    ap.add_argument("--fleet-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fleet_child:
        return fleet_child(args.fleet_child)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("fleetplan.audit").setLevel(logging.WARNING)  # one JSON line per cycle: not here
    # aiomqtt warns once per publish beyond 10 in flight (the controller publishes to every host at
    # once); its logger's level is set when aiomqtt is imported, so import it first
    import aiomqtt  # noqa: F401

    logging.getLogger("mqtt").setLevel(logging.ERROR)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fleetplan-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"controller scale bench: {args.hosts} hosts x {args.gpus_per_host} GPUs, {args.models} models, "
        f"work dir {work}")
    bench = Bench(args, work)
    interrupted = False
    try:
        asyncio.run(_main(args, bench))
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
        log("interrupted: stopping")
    except Exception as exc:
        bench.errors.append(f"{type(exc).__name__}: {exc}")
        log(f"!! bench failed: {type(exc).__name__}: {exc}")
    finally:
        line = bench.report()
        bench.stop_all()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    log(line)
    return 1 if bench.errors or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
