"""Tools for driving the lab (a `Rig`) from outside: the controller as a subprocess that can be
kill -9'ed (`ControllerProc`), the e2e policy (`policy_doc`), steady request load through nginx
(`Load`), and polling helpers. Used by tests/e2e and bench/faults.py (one piece of code each).

The controller runs with the simulated clock 20x faster than wall time (K): a 30 s control cycle
takes 1.5 s, a 40 s engine startup 2 s. The profiles (fleetplan/harness/profiles-sim.json, package data) were fitted
with `fleetplan models fit` from `fleetplan bench-engine` runs against the simulated engines
(llama-3.1-70b, vLLM and TRT-LLM personas, H100 TP4, max_num_seqs 8, ISL 1024 / OSL 256, time
scale 20); regenerate them with `python -m tests.e2e.make_profiles` when sim/groundtruth.py changes.

Load: open-loop Poisson load through nginx whose rate can change while it runs (simulated rps).
One connection per request (no keep-alive): a graceful nginx reload closes idle keep-alive
connections, and a client that reuses one at that instant gets "Can not write request body"
before nginx ever saw the request. Real clients retry such connection-level errors; this load
generator counts every failure, so it does not reuse connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from fleetplan.harness.demo import Rig, demo_policy
from fleetplan.harness.procs import free_port, port_is_free, retry_if_port_taken
from fleetplan.sim.replay import RequestResult, run_load

REPO = Path(__file__).resolve().parents[2]
PROFILES = Path(__file__).resolve().with_name("profiles-sim.json")  # installed with the package
MODEL = "llama-3.1-70b"
K = 20.0
ISL, OSL = 1024, 256
MAX_NUM_SEQS = 8  # small batches: a replica saturates near 1.5 simulated rps, so scaling needs little CPU
SLO_TTFT_MS = 800.0
SLO_ITL_MS = 100.0


def policy_doc(**over: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "models": (MODEL,), "engines": ("vllm", "trtllm"), "cycle_s": 30.0, "scale_down_delay_s": 120.0,
        "max_actions": 4, "min_replicas": 1, "max_replicas": 4, "ttft_p99_ms": SLO_TTFT_MS,
        "itl_p99_ms": SLO_ITL_MS, "isl": ISL, "osl": OSL, "startup_s": 40.0, "headroom": 0.2,
    }
    args.update(over)
    doc = demo_policy(**args)
    for m in doc["models"]:
        m["allowed"]["tp"] = [4]
    return doc


class _PortTaken(AssertionError):
    """The report API's port was held by another process when the controller tried to bind it."""


class ControllerProc:
    """`fleetplan controller` as a subprocess on a Rig, plus its report API."""

    def __init__(self, rig: Rig, work: Path, policy: dict[str, Any], *, time_scale: float = K,
                 profiles: Path | None = PROFILES, env: dict[str, str] | None = None, **settings: Any) -> None:
        self.rig = rig
        self.env = dict(env or {})  # added to the environment of every start (e.g. libfaketime's)
        self.time_scale = time_scale
        self.profiles = profiles
        self.work = work
        self.policy_path = work / "policy.yaml"
        self.write_policy(policy)
        self.state_db = work / "state.db"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = rig.write_controller_config(work / "controller.yaml", **settings)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = work / "controller.log"

    def write_policy(self, policy: dict[str, Any] | str) -> None:
        text = policy if isinstance(policy, str) else yaml.safe_dump(policy, sort_keys=False)
        tmp = self.policy_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.policy_path)

    def start(self, env: dict[str, str] | None = None) -> ControllerProc:
        """Start the controller and wait for its report API.

        A restart reuses the port, unless something took it while the controller was down (a client's
        ephemeral port can land on it; the CI saw that once). Then the report API moves to a fresh port:
        the controller's behaviour under test does not depend on the port, and `url` follows it.
        """
        if not port_is_free(self.port):
            self._move_port()
        return retry_if_port_taken(lambda: self._start_once(env), lambda exc: isinstance(exc, _PortTaken),
                                   self._move_port, tries=2)

    def _move_port(self) -> None:
        self.port = free_port(exclude=(self.port,))
        self.url = f"http://127.0.0.1:{self.port}"

    def _start_once(self, env: dict[str, str] | None) -> ControllerProc:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetplan", "-v", "controller", "--policy", str(self.policy_path),
             *(["--profiles", str(self.profiles)] if self.profiles else []),
             "--state-db", str(self.state_db), "--report-listen",
             f"127.0.0.1:{self.port}", "--time-scale", f"{self.time_scale:g}", "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env, **(env or {})),
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # Why check the port, not the log: the exit is the controller's; whether the port is held
                # by another process is a fact the harness can read itself.
                if not port_is_free(self.port):
                    raise _PortTaken(f"controller could not bind port {self.port}:\n{self.log_tail()}")
                raise AssertionError(f"controller exited {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.2)
        raise AssertionError(f"controller report API not up:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None

    def report(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/report", timeout=30)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data


def ready_replicas(report: dict[str, Any], model: str = MODEL) -> list[dict[str, Any]]:
    """Replicas that serve: ready (agent) and in the nginx upstream (controller)."""
    return [r for r in report["fleet"] if r["model"] == model and r["phase"] == "desired"
            and r.get("reported_state") == "ready" and r.get("routed")]


async def wait_until(
    pred: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5,
    describe: Callable[[], str] | None = None,
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(pred)
        if last:
            return last
        await asyncio.sleep(poll_s)
    extra = ""
    if describe is not None:
        with contextlib.suppress(Exception):
            extra = "\n" + describe()
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{extra}")


def describe(ctrl: ControllerProc) -> Callable[[], str]:
    def text() -> str:
        from fleetplan.controller.report import render_report

        return render_report(ctrl.report(), actions=30) + "\n--- controller log ---\n" + ctrl.log_tail(30)

    return text


class Load:
    def __init__(self, base_url: str, model: str, *, speed: float, isl: int, osl: int, seed: int = 0) -> None:
        self.url = f"{base_url.rstrip('/')}/m/{model}"
        self.model = model
        self.speed = speed
        self.isl, self.osl = isl, osl
        self.rate_rps = 0.0
        self.results: list[RequestResult] = []
        self.sent_wall_s: list[float] = []  # per result: when it was sent (time.monotonic())
        self._scheduled_s: list[float] = []  # when each request is (was) due, finished or not
        self._finished_scheduled_s: list[float] = []
        self._rng = random.Random(seed)
        self._chunks: list[asyncio.Task[Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self, rate_rps: float) -> None:
        self.rate_rps = rate_rps
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1000, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        chunk_wall = 1.0
        while True:
            span = chunk_wall * self.speed  # simulated seconds in this chunk
            reqs = []
            t = 0.0
            if self.rate_rps > 0:
                while True:
                    t += self._rng.expovariate(self.rate_rps)
                    if t >= span:
                        break
                    p = max(16, int(self._rng.gauss(self.isl, self.isl * 0.2)))
                    o = max(8, int(self._rng.gauss(self.osl, self.osl * 0.2)))
                    reqs.append((t, p, o, self.model))
            if reqs:
                t0 = time.monotonic()
                self._scheduled_s.extend(t0 + t / self.speed for t, *_ in reqs)
                self._chunks.append(asyncio.create_task(
                    run_load(reqs, self.url, speed=self.speed, timeout_s=120,
                             on_result=functools.partial(self._record, t0), session=self._session)))
            await asyncio.sleep(chunk_wall)

    def _record(self, chunk_start_s: float, r: RequestResult) -> None:
        self.sent_wall_s.append(chunk_start_s + (r.t_s + r.late_s) / self.speed)
        self._finished_scheduled_s.append(chunk_start_s + r.t_s / self.speed)
        self.results.append(r)

    def sent_between(self, t0_s: float, t1_s: float) -> list[tuple[float, RequestResult]]:
        """(sent time, result) of the finished requests sent in [t0_s, t1_s) (time.monotonic())."""
        return [(t, r) for t, r in zip(self.sent_wall_s, self.results, strict=True) if t0_s <= t < t1_s]

    def unfinished_before(self, t_s: float) -> int:
        """Requests due before t_s (time.monotonic()) that have no result yet."""
        return (sum(1 for s in self._scheduled_s if s < t_s)
                - sum(1 for s in self._finished_scheduled_s if s < t_s))

    async def stop(self) -> list[RequestResult]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._chunks:
            await asyncio.gather(*self._chunks)
        if self._session is not None:
            await self._session.close()
        return self.results

    def failures(self) -> list[RequestResult]:
        return [r for r in self.results if r.outcome != "ok"]
