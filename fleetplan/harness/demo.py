"""`fleetplan demo`: the whole loop on a simulated lab, needing nothing outside the repository.

1. starts the lab (Mosquitto, Prometheus, nginx; sim/lab.py) and one agent per simulated host
   (4 hosts x 8 GPUs), whose launch templates start simulated engines (sim/engine.py);
2. benchmarks the simulated engines with `fleetplan bench-engine` and fits profiles with
   `fleetplan models fit` (the user's workflow);
3. starts the controller (in this process) with a demo policy;
4. replays a day-shaped traffic pattern it generates (or --trace FILE) at 20x for ~3 minutes
   through nginx, printing a short report every cycle;
5. stops everything, then replays the same day (requests.jsonl), policy (policy.yaml, the lab's hosts
   listed) and profiles (PROFILES.json) with `fleetplan.sim.evaluate.evaluate` for fleetplan and the
   baselines, writes summary.json (live and replay figures, the `fleetplan evaluate` command that
   reproduces the replay; fleetplan/harness/demo_summary.py) and prints the same table.

`Rig` (lab + agents + files) is also what tests/e2e use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from fleetplan.harness.demo_day import (
    REAL_DAY_POLICIES,
    real_day_section,
    render_real_day,
    run_real_day,
    write_real_day,
)
from fleetplan.harness.demo_summary import (
    CONTROLLER_FILE,
    POLICY_FILE,
    REPLAY_POLICIES,
    TRACE_FILE,
    LiveGpuMeter,
    build_summary,
    evaluate_argv,
    held_gpus,
    live_figures,
    progress_printer,
    render_summary,
    run_replay,
    write_summary,
    write_trace,
)

REPO = Path(__file__).resolve().parents[2]  # fleetplan/harness/demo.py -> the repository
T = TypeVar("T")

DEMO_MODEL = "llama-3.1-8b"
DEMO_MODEL_70B = "llama-3.1-70b"


SIM_BUILD = (
    "import os, sys, time\n"
    "out, wall = sys.argv[1], float(sys.argv[2])\n"
    "for i in range(1, 11):\n"
    "    time.sleep(wall / 10)\n"
    "    print('FLEETPLAN_PROGRESS %.1f' % (i / 10.0), flush=True)\n"
    "os.makedirs(out, exist_ok=True)\n"
    "open(os.path.join(out, 'rank0.engine'), 'w').write('simulated engine')\n"
)


@dataclass
class EngineOptions:
    """How the agents' launch templates start simulated engines."""

    time_scale: float = 20.0
    startup_s: float = 40.0  # simulated seconds from launch to ready
    max_num_seqs: int | None = None  # None: the persona's default
    min_chunk_interval_ms: float = 150.0  # coalesce SSE chunks (wall ms)
    build_s: float = 600.0  # simulated seconds of a TensorRT-LLM engine build (the lab's build template)
    # trtllm serves from {engine_dir}, as real trtllm-serve does: the agent then starts it only where the
    # engine was built or stored (the demo; the shared e2e rig keeps engines that need no build)
    engine_dir: bool = False

    def build_argv(self) -> list[str]:
        """A stand-in for trtllm-build: progress lines, then an engine file in {engine_dir}."""
        wall = self.build_s / self.time_scale
        return [sys.executable, "-c", SIM_BUILD, "{engine_dir}", f"{wall:g}"]

    def argv(self, persona: str, role: str = "aggregated") -> list[str]:
        """`role`: prefill or decode, an instance of a disaggregated model's pool (the agent's
        `<engine>-prefill` / `<engine>-decode` templates)."""
        return [
            sys.executable, "-m", "fleetplan", "sim-engine", "--persona", persona,
            *(["--role", role] if role != "aggregated" else []),
            "--model", "{model}", "--gpu", "{gpu}", "--tp", "{tp}", "--precision", "{precision}",
            "--port", "{port}", "--replica-id", "{replica_id}", "--gpu-indices", "{gpu_indices}",
            "--time-scale", f"{self.time_scale:g}", "--startup-s", f"{self.startup_s:g}",
            *(["--max-num-seqs", str(self.max_num_seqs)] if self.max_num_seqs else []),
            "--min-chunk-interval-ms", f"{self.min_chunk_interval_ms:g}",
            *(["--engine-dir", "{engine_dir}"] if self.engine_dir and persona == "trtllm" else []),
        ]


def demo_policy(
    *,
    models: Sequence[str] = (DEMO_MODEL,),
    engines: Sequence[str] = ("vllm", "trtllm"),
    hosts: Sequence[tuple[str, int]] = (),
    cycle_s: float = 60.0,
    scale_down_delay_s: float = 300.0,
    max_actions: int = 6,
    min_replicas: int = 1,
    max_replicas: int = 8,
    ttft_p99_ms: float = 2000.0,
    itl_p99_ms: float = 100.0,
    isl: float = 512,
    osl: float = 128,
    startup_s: float = 40.0,
    headroom: float = 0.2,
    trtllm_cached: bool = True,
    build_s: float = 600.0,
    gpu: str = "h100",
    price_usd_h: float = 3.0,
) -> dict[str, Any]:
    """A policy document (dict) for the lab: H100 hosts, vLLM and TRT-LLM (cached engines)."""
    engine_doc: dict[str, Any] = {}
    for e in engines:
        doc: dict[str, Any] = {
            "launch": {"command": "sim-engine", "args": ["--persona", e]},
            "startup": {"default_s": startup_s},
        }
        if e == "trtllm":
            doc["build"] = {"default_s": build_s}
            if trtllm_cached:
                doc["cached_builds"] = [{"model": m, "gpu": gpu, "tp": tp, "precision": "bf16"}
                                        for m in models for tp in (1, 2, 4, 8)]
        engine_doc[e] = doc
    return {
        "version": 1,
        "gpu_types": {gpu: {"price_usd_h": price_usd_h}},
        "hosts": [{"name": n, "gpu": gpu, "gpu_count": c} for n, c in hosts],
        "models": [
            {
                "name": m,
                "slo": {"ttft_p99_ms": ttft_p99_ms, "itl_p99_ms": itl_p99_ms},
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "allowed": {"engines": list(engines), "tp": [1], "gpus": [gpu]},
                "precision": "bf16",
                "headroom": headroom,
                "workload": {"isl": isl, "osl": osl},
            }
            for m in models
        ],
        "engines": engine_doc,
        "scaling": {
            "cycle_s": cycle_s,
            "scale_down_delay_s": scale_down_delay_s,
            "max_actions_per_cycle": max_actions,
            "forecast_quantile": 0.9,
        },
        "solver": {"time_limit_s": 2.0, "workers": 1},
    }


# Set in the environment of the rig's agents; the engines and builds they launch (and those
# processes' children) inherit it, so that Rig.stop finds every one of them, whatever its command.
RIG_ENV = "FLEETPLAN_RIG"


@dataclass
class Rig:
    """A lab with one agent process per simulated host, and helpers to run the controller on it.

    `stop()` stops the agents, then every process they launched (the agents leave engines running
    when they stop, by design): the process groups the agents recorded, and every process that
    inherited this rig's tag (`RIG_ENV`), engine workers that left their group included."""

    dir: Path
    hosts: int = 4
    gpus_per_host: int = 8
    engine: EngineOptions = field(default_factory=EngineOptions)
    lab: Any = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    launch_templates: dict[str, Any] | None = None  # default: simulated vllm/trtllm engines
    gpu: str = "h100"
    tag: str = field(default_factory=lambda: f"rig-{uuid.uuid4().hex}")
    # the agents share one engine cache directory (as hosts mounting one NFS export do): an engine one
    # host built serves on all; False: each agent keeps its own under its state directory
    shared_engine_cache: bool = False

    def start(self) -> Rig:
        from fleetplan.harness.lab import Lab

        self.dir.mkdir(parents=True, exist_ok=True)
        self.lab = Lab(self.dir / "lab", hosts=self.hosts, gpus_per_host=self.gpus_per_host, gpu=self.gpu)
        self.lab.start()
        for h in self.lab.hosts:
            self.write_agent_config(h)
            self.start_agent(h.name)
        return self

    def agent_config_path(self, host: str) -> Path:
        return self.dir / "agents" / f"{host}.yaml"

    def agent_state_dir(self, host: str) -> Path:
        return self.dir / "agents" / host

    def write_agent_config(self, h: Any) -> None:
        cfg = {
            "host": h.name,
            "gpu": h.gpu.value,
            "gpu_count": h.gpu_count,
            "nvlink_groups": [list(g) for g in h.nvlink_groups],
            "mqtt": {
                "host": self.lab.mqtt_host, "port": self.lab.mqtt_port, "username": h.mqtt_user,
                "password": h.mqtt_password, "keepalive_s": 5, "backoff_initial_s": 0.2, "backoff_max_s": 2.0,
            },
            "port_range": list(h.port_range),
            "state_dir": str(self.agent_state_dir(h.name)),
            "launch_templates": self.launch_templates or {
                "vllm": {"engine": "vllm", "argv": self.engine.argv("vllm"), "cwd": str(REPO),
                         "startup_timeout_s": 120, "stop_timeout_s": 10},
                "trtllm": {"engine": "trtllm", "argv": self.engine.argv("trtllm"), "cwd": str(REPO),
                           "startup_timeout_s": 120, "stop_timeout_s": 10},
                # the pools of a disaggregated model (docs/agent.md); the lab's pool proxy fronts them
                **{f"vllm-{role}": {"engine": "vllm", "argv": self.engine.argv("vllm", role), "cwd": str(REPO),
                                    "startup_timeout_s": 120, "stop_timeout_s": 10} for role in ("prefill", "decode")},
            },
            "build_templates": {"trtllm-build": {"argv": self.engine.build_argv(), "cwd": str(REPO),
                                           "timeout_s": 600}},
            **({"engine_cache_dir": str(self.dir / "engine-cache")} if self.shared_engine_cache else {}),
            "status_interval_s": 1.0,
            "reconcile_interval_s": 0.5,
            "restart_backoff_s": [1.0, 10.0],
        }
        path = self.agent_config_path(h.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    def start_agent(self, host: str) -> None:
        log = open(self.dir / "agents" / f"{host}.log", "ab")
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **{RIG_ENV: self.tag})
        self.agents[host] = subprocess.Popen(
            [sys.executable, "-m", "fleetplan", "-v", "agent", "--config", str(self.agent_config_path(host))],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO), env=env,
        )
        log.close()

    def stop_agent(self, host: str, sig: int = signal.SIGTERM) -> None:
        p = self.agents.get(host)
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def _state_dirs(self) -> list[Path]:
        return [self.agent_state_dir(h.name) for h in self.lab.hosts] if self.lab else []

    def engine_pids(self) -> dict[str, int]:
        """replica or build id -> pid of every instance the agents recorded that still runs."""
        out: dict[str, int] = {}
        for handle in _recorded_handles(self._state_dirs()):
            pid, ticks = handle.get("pid"), handle.get("start_ticks")
            if isinstance(pid, int) and _same_process(pid, ticks if isinstance(ticks, int) else None):
                out[str(handle.get("instance_id"))] = pid
        return out

    def launched_processes(self) -> set[int]:
        """Every live process this rig's agents launched (see `launched_processes`)."""
        return launched_processes(self._state_dirs(), self.tag)

    def engine_processes(self) -> list[tuple[int, str]]:
        """(pid, replica id) of every running sim-engine this rig's agents started (from /proc). Found
        by the rig's tag, not by port: another lab's engines may use ports in this rig's ranges."""
        out = []
        for pid in sorted(_tagged_processes(RIG_ENV, self.tag)):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv]
            if "sim-engine" in args and "--replica-id" in args[:-1]:
                out.append((pid, args[args.index("--replica-id") + 1]))
        return out

    def controller_settings(self, **over: Any) -> Any:
        from fleetplan.controller.daemon import ControllerSettings

        base: dict[str, Any] = {
            "lab_dir": str(self.lab.dir), "ack_timeout_s": 5.0, "ready_timeout_s": 60.0,
            "drain_timeout_s": 30.0, "drain_settle_s": 1.5, "drain_poll_s": 0.5, "host_offline_grace_s": 30.0,
            "observe_window_s": 8.0, "history_s": 120.0, "history_step_s": 2.0, "peak_window_s": 2.0,
            "length_window_s": 30.0,
        }
        base.update(over)
        return ControllerSettings.model_validate(base)

    def write_controller_config(self, path: Path, **over: Any) -> Path:
        s = self.controller_settings(**over)
        # only what was set: a default (prometheus_url) written out would read as set (settings_from_lab)
        path.write_text(yaml.safe_dump(json.loads(s.model_dump_json(exclude_none=True, exclude_unset=True)),
                                       sort_keys=False))
        return path

    def stop(self) -> None:
        """Stop agents, then every process they started (engines outlive agents by design), then the lab."""
        try:
            for host in list(self.agents):
                self.stop_agent(host)
            self.stop_launched()
        finally:
            if self.lab is not None:
                self.lab.stop()

    def stop_launched(self, timeout_s: float = 15.0) -> None:
        stop_launched(self._state_dirs(), self.tag, timeout_s=timeout_s)


def _recorded_handles(state_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """The handles in agents' instance records (engines and builds they run, or ran and did not stop)."""
    out = []
    for state_dir in state_dirs:
        d = state_dir / "instances"
        for f in sorted(d.glob("*.json")) if d.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):
                rec = json.loads(f.read_text())
                if isinstance(rec, dict) and isinstance(rec.get("handle"), dict):
                    out.append(rec["handle"])
    return out


def launched_processes(state_dirs: Sequence[Path], tag: str | None = None) -> set[int]:
    """Every live process that agents with these state dirs launched: the members of each process
    group an agent recorded (an instance leads its own group), and, with `tag`, every process whose
    environment has RIG_ENV=tag (inherited from the agent: an engine whose record was not written
    yet, workers that left their group)."""
    from fleetplan.harness.procs import group_pids

    pids: set[int] = set()
    for handle in _recorded_handles(state_dirs):
        pid, ticks = handle.get("pid"), handle.get("start_ticks")
        if not isinstance(pid, int):
            continue
        if _same_process(pid, ticks if isinstance(ticks, int) else None) or not _alive(pid):
            # the leader itself, or what is left of its group after it died (a group id is not
            # reused while the group has members); a live pid with another start time is not ours
            pids.update(group_pids(pid))
    if tag is not None:
        pids.update(_tagged_processes(RIG_ENV, tag))
    pids.discard(os.getpid())
    return pids


def stop_launched(state_dirs: Sequence[Path], tag: str | None = None, *, timeout_s: float = 15.0) -> None:
    """SIGTERM every process `launched_processes` finds (and its process group), SIGKILL what is left
    after `timeout_s`; raises RuntimeError naming any process that survives SIGKILL. For after the
    agents stopped: they leave their engines running by design."""
    pids = launched_processes(state_dirs, tag)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = launched_processes(state_dirs, tag)  # children forked meanwhile are found too
        _signal_all(pids, signal.SIGTERM)
    if pids:
        _signal_all(pids, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = launched_processes(state_dirs, tag)
            _signal_all(pids, signal.SIGKILL)
    if pids:
        dirs = ", ".join(str(d) for d in state_dirs)
        raise RuntimeError(f"processes {sorted(pids)} launched by the agents of {dirs} survive SIGKILL")


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    """Signal each pid's process group (the engines lead theirs) and the pid itself."""
    own_group = os.getpgrp()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group != own_group:  # never our own group (a caller that did not start a session)
                os.killpg(group, sig)
            os.kill(pid, sig)


def _same_process(pid: int, start_ticks: int | None) -> bool:
    """`pid` runs and (when known) started at `start_ticks` (/proc/<pid>/stat field 22): not a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def _tagged_processes(name: str, value: str) -> set[int]:
    """Live processes whose environment has name=value (inherited from whoever set it)."""
    entry = f"{name}={value}".encode()
    found = set()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            environ = (pid_dir / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if entry in environ.split(b"\0") and _alive(int(pid_dir.name)):
            found.add(int(pid_dir.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---------------------------------------------------------------------------------------------
# traffic


def day_requests(
    duration_s: float, *, base_rps: float, peak_rps: float, isl: int, osl: int, model: str, seed: int = 0
) -> list[tuple[float, int, int, str]]:
    """A compressed 'day' over `duration_s` simulated seconds: night trough, morning ramp, afternoon
    peak, evening decline (Poisson arrivals; prompt/output lengths jittered around isl/osl)."""
    rng = random.Random(seed)

    def rate(t: float) -> float:
        x = t / duration_s  # 0..1 = one day
        shape = 0.5 - 0.5 * math.cos(2 * math.pi * x)  # 0 at midnight, 1 at noon
        return float(base_rps + (peak_rps - base_rps) * shape ** 1.5)

    out: list[tuple[float, int, int, str]] = []
    t = 0.0
    lam_max = max(base_rps, peak_rps)
    while True:
        t += rng.expovariate(lam_max)
        if t >= duration_s:
            break
        if rng.random() <= rate(t) / lam_max:  # thinning
            p = max(16, int(rng.gauss(isl, isl * 0.25)))
            o = max(8, int(rng.gauss(osl, osl * 0.25)))
            out.append((t, p, o, model))
    return out


# ---------------------------------------------------------------------------------------------
# benchmark + fit (the user's workflow)


def bench_and_fit(engine_opts: EngineOptions, out_dir: Path, models: Sequence[str], engines: Sequence[str], *,
                  isl: int, osl: int, tp: int = 1, concurrency: Sequence[int] = (1, 4, 16, 32, 64),
                  num_prompts: int = 32, gpu: str = "h100", log: Any = print) -> Path:
    """Start one simulated engine per (model, engine), sweep it with `fleetplan bench-engine`, and fit
    PROFILES.json with `fleetplan models fit`."""
    from fleetplan.harness.procs import free_port

    bench_dir = out_dir / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    k = engine_opts.time_scale
    procs = []
    try:
        jobs = []
        for m in models:
            for e in engines:
                port = free_port()
                # the benchmark host holds a built engine (a user benchmarks the engine they built)
                engine_dir = bench_dir / f"engine-{m}-{e}"
                engine_dir.mkdir(exist_ok=True)
                (engine_dir / "rank0.engine").write_text("benchmark engine\n")
                argv = [a.format(model=m, gpu=gpu, tp=str(tp), precision="bf16", port=port,
                                 replica_id=f"bench-{e}", gpu_indices=",".join(str(i) for i in range(tp)),
                                 engine_dir=str(engine_dir))
                        for a in engine_opts.argv(e)]
                argv[argv.index("--startup-s") + 1] = "0"
                lf = open(bench_dir / f"engine-{m}-{e}.log", "wb")
                procs.append(subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, cwd=str(REPO),
                                              start_new_session=True))
                lf.close()
                jobs.append((m, e, port))
        import httpx

        for _m, _e, port in jobs:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.3)
        conc = ",".join(str(c) for c in concurrency)
        for m, e, port in jobs:
            t0 = time.monotonic()
            for c in concurrency:
                # at least two waves per level: with fewer prompts than clients the run holds fewer in
                # flight than it says (16 prompts at concurrency 32 measured concurrency 16 twice)
                cmd = [sys.executable, "-m", "fleetplan", "bench-engine", "--target", f"http://127.0.0.1:{port}",
                       "--isl", str(isl), "--osl", str(osl), "--concurrency", str(c),
                       "--num-prompts", str(max(num_prompts, 2 * c)), "--time-scale", f"{k:g}", "--model", m,
                       "--out", str(bench_dir / f"{m}-{e}"), "--label", f"{e}-{gpu}-tp{tp}"]
                subprocess.run(cmd, check=True, cwd=str(REPO), capture_output=True, timeout=600)
            log(f"  benchmarked {m} on a simulated {e} engine, {gpu.upper()} TP{tp}, ISL {isl} / OSL {osl}, "
                f"concurrency {conc}: {time.monotonic() - t0:.0f} s")
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
    profiles = out_dir / "PROFILES.json"
    fit_cmd = [sys.executable, "-m", "fleetplan", "models", "fit"]
    for m in models:
        for e in engines:
            fit_cmd += [str(bench_dir / f"{m}-{e}")]
    fit_cmd += ["--out", str(profiles)]
    res = subprocess.run(fit_cmd, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"models fit failed: {res.stderr.strip()[-500:]}")
    log(f"  fitted {profiles}")
    return profiles


# ---------------------------------------------------------------------------------------------
# the demo


def _short_cycle_line(ctrl: Any, summary: dict[str, Any], t_wall: float, sent: int, failed: int) -> str:
    snap = ctrl.last_snapshot
    parts = []
    rep = ctrl.hosts.reported()
    for m in ctrl.model_names():
        mm = snap.models.get(m) if snap else None
        ready = sum(1 for r in ctrl.store.active_replicas()
                    if r.model == m and r.phase == "desired" and r.replica_id in rep
                    and rep[r.replica_id][1].state.value == "ready")
        active = sum(1 for r in ctrl.store.active_replicas() if r.model == m)
        rps = "-" if mm is None or mm.rate_rps is None else f"{mm.rate_rps:.2f}"
        p99 = "-" if mm is None or mm.ttft_p99_ms is None else f"{mm.ttft_p99_ms:.0f}"
        stale = " STALE" if mm is not None and mm.stale else ""
        parts.append(f"{m}: {rps} rps, TTFT p99 {p99} ms, replicas {ready} ready/{active} desired{stale}")
    acts = ", ".join(f"{k} {summary.get(k)}" for k in ("start", "drain", "stop", "deferred") if summary.get(k))
    return (f"[t={t_wall:5.0f}s sim={summary.get('now_s', 0) - ctrl.clock.origin_sim:6.0f}s] "
            + "; ".join(parts) + (f" | actions: {acts}" if acts else "") + f" | requests {sent} ({failed} failed)")


def run_demo(args: argparse.Namespace) -> int:
    own_dir = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="fleetplan-demo-")) if own_dir else Path(args.dir).resolve()
    try:
        return asyncio.run(_demo(args, work))
    finally:
        if own_dir and not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


async def _demo(args: argparse.Namespace, work: Path) -> int:
    from fleetplan.controller.daemon import Controller
    from fleetplan.controller.report import render_explain, render_report
    from fleetplan.controller.state import StateStore
    from fleetplan.harness.lab import settings_from_lab
    from fleetplan.sim.replay import run_load

    k = float(args.speed)
    engines = ("vllm", "trtllm")
    model = DEMO_MODEL_70B
    isl, osl = 1024, 1024
    slo_ttft_ms, slo_itl_ms = 1000.0, 30.0
    # long outputs and a tight ITL SLO: a replica serves well under 1 simulated rps, so a day that needs
    # several replicas stays within what 2 CPU cores can simulate at 20x (SSE chunks every 300 ms wall)
    rig = Rig(work, hosts=args.hosts, gpus_per_host=args.gpus_per_host,
              engine=EngineOptions(time_scale=k, startup_s=40.0, min_chunk_interval_ms=300.0, engine_dir=True),
              shared_engine_cache=True)
    print(f"== fleetplan demo in {work} (simulated time runs {k:g}x wall time)", flush=True)
    t_start = time.monotonic()
    ctrl = None
    try:
        print("== starting the lab: Mosquitto, Prometheus, nginx, "
              f"{args.hosts} simulated hosts x {args.gpus_per_host} H100, one agent per host", flush=True)
        await asyncio.to_thread(rig.start)
        print("== benchmarking the simulated engines and fitting profiles (the user's workflow:\n"
              "   fleetplan bench-engine ... && fleetplan models fit ...)", flush=True)
        profiles = await asyncio.to_thread(
            bench_and_fit, rig.engine, work, (model,), engines, isl=isl, osl=osl, tp=4,
            concurrency=(1, 4, 16, 32), num_prompts=16,
            log=lambda m: print(m, flush=True),
        )
        policy_path = work / POLICY_FILE
        # the lab's hosts are listed so that the replay (`fleetplan evaluate`) simulates the same
        # inventory; the daemon takes its fleet from the agents' reports (they agree)
        policy = demo_policy(models=(model,), engines=engines, isl=isl, osl=osl, max_replicas=8,
                             ttft_p99_ms=slo_ttft_ms, itl_p99_ms=slo_itl_ms, cycle_s=60.0,
                             scale_down_delay_s=300.0, max_actions=4, startup_s=40.0,
                             trtllm_cached=False, build_s=rig.engine.build_s,
                             hosts=[(h.name, h.gpu_count) for h in rig.lab.hosts])
        policy["models"][0]["allowed"]["tp"] = [4]
        policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
        # the replay reads the same windows and waits the same timeouts (run_replay: CONTROLLER_FILE)
        live_over = {"observe_window_s": 12.0, "history_s": 40.0}
        settings, reload = settings_from_lab(rig.controller_settings(**live_over))
        rig.write_controller_config(work / CONTROLLER_FILE, **live_over)
        store = StateStore(work / "state.db")
        ctrl = Controller(settings=settings, policy_path=policy_path, profiles_path=profiles, store=store,
                          time_scale=k, nginx_reload=reload, report_listen="127.0.0.1:0")
        await ctrl.start()
        print(f"== controller up: policy {policy_path}, report API {ctrl.report_url}", flush=True)
        await asyncio.wait_for(ctrl.link.connected.wait(), 20)
        for _ in range(70):
            if len(ctrl.statuses) >= args.hosts:
                break
            await asyncio.sleep(0.3)
        sim_duration = args.minutes * 60.0 * k
        real_day_requests: int | None = None
        if args.trace:
            from fleetplan.sim.traces import read_trace, shape_day

            tr = shape_day(read_trace(args.trace).as_single_model(model), sim_duration, rate_scale=0.05)
            reqs: list[Any] = [(r.t_s, r.prompt_tokens, r.output_tokens, model) for r in tr.requests]
            what = f"{args.trace} shaped into a day"
        else:
            reqs = day_requests(sim_duration, base_rps=args.base_rps, peak_rps=args.peak_rps, isl=isl, osl=osl,
                                model=model)
            what = f"a generated day (night trough {args.base_rps:g} rps, afternoon peak {args.peak_rps:g} rps)"
            if args.real_day:  # the same day at its real length, replayed after the live run
                real_day_requests = write_real_day(work, day_requests, base_rps=args.base_rps, peak_rps=args.peak_rps,
                                                   isl=isl, osl=osl, model=model)[1]
        write_trace(work / TRACE_FILE, reqs)
        day = {"source": what, "trace": str(work / TRACE_FILE), "requests": len(reqs),
               "span_s": round(reqs[-1][0] - reqs[0][0], 1) if reqs else 0.0, "speed": k,
               "wall_minutes": args.minutes}
        print(f"== the day's requests: {work / TRACE_FILE} (a trace `fleetplan evaluate --trace` reads)",
              flush=True)
        # place the minimum before traffic starts
        await ctrl.cycle()
        for _ in range(100):
            if ctrl.executor.routed:
                break
            await asyncio.sleep(0.2)
        print(f"== replaying {what}: {len(reqs)} requests over {sim_duration / 3600:.1f} simulated hours "
              f"({args.minutes:g} wall minutes at {k:g}x) through nginx {rig.lab.nginx_url}", flush=True)
        results: list[Any] = []
        failed = 0

        def on_result(r: Any) -> None:
            nonlocal failed
            results.append(r)
            if r.outcome != "ok":
                failed += 1

        import aiohttp

        # one connection per request: a graceful nginx reload closes idle keep-alive connections, and a
        # request written into one at that instant fails before nginx sees it (real clients retry those)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=400, force_close=True),
                                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        load = asyncio.create_task(run_load(reqs, rig.lab.nginx_url + f"/m/{model}", speed=k,
                                            max_in_flight=400, timeout_s=120, on_result=on_result,
                                            session=session))
        cycle_wall = policy["scaling"]["cycle_s"] / k
        t0 = time.monotonic()
        # GPU-hours per engine from the controller's records, sampled every 0.5 s wall (10 simulated s
        # at 20x) on the load's clock, clipped to the day's span as the replay clips them
        meter = LiveGpuMeter(t_from_s=reqs[0][0] if reqs else 0.0, t_to_s=reqs[-1][0] if reqs else 0.0)

        async def sample_gpus() -> None:
            while True:
                meter.sample((time.monotonic() - t0) * k, *held_gpus(ctrl.store))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample_gpus())
        try:
            while not load.done():
                await asyncio.sleep(cycle_wall)
                summary = await ctrl.cycle()
                now = time.monotonic()
                print(_short_cycle_line(ctrl, summary, now - t0, len(results), failed), flush=True)
            res = load.result()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        meter.sample((time.monotonic() - t0) * k, *held_gpus(ctrl.store))
        await session.close()
        live = live_figures(res, ttft_slo_ms=slo_ttft_ms, itl_slo_ms=slo_itl_ms, meter=meter,
                            price_usd_h=float(policy["gpu_types"]["h100"]["price_usd_h"]))
        live["actions"] = ctrl.store.action_counts()
        live["cycles"] = ctrl.cycle_count
        counts = live["actions"]
        hours = (meter.t_to_s - meter.t_from_s) / 3600
        print("")
        print(render_report(ctrl.report(), actions=10))
        print("")
        print(render_explain(ctrl.report(), model) or "")
        print("")
        print("== live run")
        print(f"  requests: {live['requests']} sent, {live['served']} ok, {live['failed']} failed")
        for r in [r for r in res if r.outcome != "ok"][:3]:
            print(f"    failed: t={r.t_s:.0f}s {r.outcome} HTTP {r.status} {r.output_tokens}/"
                  f"{r.output_tokens_requested} tokens {r.error or ''}")
        print(f"  SLO attainment (per request: TTFT <= {slo_ttft_ms:.0f} ms and per-request ITL <= "
              f"{slo_itl_ms:.0f} ms, failed = miss): {100.0 * (live['slo_attainment'] or 0.0):.2f}%; "
              f"TTFT p50 {live['ttft_p50_ms']} ms, p99 {live['ttft_p99_ms']} ms; per-request ITL p99 "
              f"{live['itl_p99_ms']} ms (p99 targets {'met' if live['slo_p99_met'] else 'MISSED'})")
        by = live["gpu_hours_by_engine"]
        print(f"  GPU-hours (simulated, over the day's {hours:.2f} h): {live['gpu_hours']:.2f} (vLLM "
              f"{by.get('vllm', 0.0):.2f}, TRT-LLM {by.get('trtllm', 0.0):.2f} incl. builds "
              f"{live['build_gpu_hours']:.2f})")
        print("  actions: " + (", ".join(f"{k_}={v}" for k_, v in sorted(counts.items())) or "none"))
        print(f"  cycles: {ctrl.cycle_count}; wall time {time.monotonic() - t_start:.0f} s")
        rc = 0 if live["failed"] == 0 else 1
    finally:
        print("== stopping everything", flush=True)
        if ctrl is not None:
            with contextlib.suppress(Exception):
                await ctrl.stop()
        await asyncio.to_thread(rig.stop)
    summary = await _replay_and_summarise(work, model, day, {"ttft_p99_ms": slo_ttft_ms, "itl_p99_ms": slo_itl_ms},
                                          live, time_scale=k)
    if real_day_requests is not None:
        await _replay_real_day(work, model, summary, real_day_requests)
    return rc


async def _with_progress(fn: Callable[[], T], what: str, progress_s: float) -> tuple[T | None, str | None, float]:
    """Run `fn` in a thread with a progress line every `progress_s` wall seconds: (its result or None,
    its error or None, the wall seconds). An error is returned, not raised: what was measured before
    it is still written."""
    t0 = time.monotonic()
    task = asyncio.create_task(asyncio.to_thread(fn))
    tick = progress_printer(what, lambda m: print(m, flush=True))
    while True:
        done, _ = await asyncio.wait({task}, timeout=progress_s)
        if done:
            break
        tick(time.monotonic() - t0)
    try:
        return task.result(), None, time.monotonic() - t0
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0


async def _replay_real_day(work: Path, model: str, summary: dict[str, Any], requests: int, *, workers: int = 2,
                           progress_s: float = 10.0) -> None:
    """Replay the demo's day at its real length (fleetplan/harness/demo_day.py), add it to summary.json
    and print its lines."""
    section = real_day_section(work, model, None, requests=requests)
    print(f"== replaying the same day at its real length (24 h, {requests} requests): {section['command']}",
          flush=True)
    doc, error, wall_s = await _with_progress(
        lambda: run_real_day(work, model, workers=workers),
        f"{', '.join(REAL_DAY_POLICIES)} over 24 h on {workers} workers", progress_s)
    summary["real_length_day"] = real_day_section(work, model, doc, requests=requests, wall_s=wall_s, error=error)
    path = write_summary(work, summary)
    print(f"== summary ({path}): the real-length day added", flush=True)
    print("\n".join(render_real_day(summary["real_length_day"])), flush=True)


async def _replay_and_summarise(work: Path, model: str, day: dict[str, Any], slo: dict[str, float],
                                live: dict[str, Any], *, workers: int = 2, progress_s: float = 10.0,
                                time_scale: float | None = None) -> dict[str, Any]:
    """Replay the demo's day, policy and profiles (fleetplan.sim.evaluate.evaluate, after the lab has
    stopped: the CPU is the replay's), write summary.json and print the table."""
    argv = evaluate_argv(work, model, time_scale=time_scale)
    print(f"== replaying the same day, policy and profiles in the simulator: {' '.join(argv)}", flush=True)
    replay, error, wall_s = await _with_progress(
        lambda: run_replay(work, model, workers=workers, time_scale=time_scale),
        f"{', '.join(REPLAY_POLICIES)} and the ground-truth capacities on {workers} workers", progress_s)
    summary = build_summary(work=work, model=model, day=day, slo=slo, live=live, replay=replay,
                            replay_wall_s=wall_s, replay_error=error, time_scale=time_scale)
    path = write_summary(work, summary)
    print(f"== summary ({path}): live vs replay, same day, policy and profiles", flush=True)
    print(render_summary(summary), flush=True)
    return summary
