"""The closed loop on the lab: a real controller process, real agents, simulated engines.

Every test gets its own Rig (Mosquitto, Prometheus, nginx, 2 simulated hosts x 8 H100, one agent
per host) and runs `fleetplan controller` as a subprocess (so it can be kill -9'ed) against it,
with the simulated clock 20x faster than wall time: a 30 s control cycle takes 1.5 s, a 40 s
engine startup 2 s.

The profiles (tests/e2e/data/profiles-sim.json) were fitted with `fleetplan models fit` from
`fleetplan bench-engine` runs against the simulated engines (llama-3.1-70b, vLLM and TRT-LLM
personas, H100 TP4, max_num_seqs 8, ISL 1024 / OSL 256, time scale 20); regenerate them with
`python -m tests.e2e.make_profiles` when sim/groundtruth.py changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleetplan.harness.demo import EngineOptions, Rig, demo_policy

REPO = Path(__file__).resolve().parents[2]
PROFILES = Path(__file__).resolve().parent / "data" / "profiles-sim.json"
MODEL = "llama-3.1-70b"
K = 20.0
ISL, OSL = 1024, 256
MAX_NUM_SEQS = 8  # small batches: a replica saturates near 1.5 simulated rps, so scaling needs little CPU
SLO_TTFT_MS = 800.0
SLO_ITL_MS = 100.0

pytestmark = pytest.mark.e2e


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class ControllerProc:
    """`fleetplan controller` as a subprocess on a Rig, plus its report API."""

    def __init__(self, rig: Rig, work: Path, policy: dict[str, Any], *, time_scale: float = K,
                 profiles: Path | None = PROFILES, **settings: Any) -> None:
        self.rig = rig
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
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetplan", "-v", "controller", "--policy", str(self.policy_path),
             *(["--profiles", str(self.profiles)] if self.profiles else []),
             "--state-db", str(self.state_db), "--report-listen",
             f"127.0.0.1:{self.port}", "--time-scale", f"{self.time_scale:g}", "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
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


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    if not PROFILES.exists():
        pytest.skip(f"{PROFILES} missing (python -m tests.e2e.make_profiles)")
    r = Rig(tmp_path / "rig", hosts=2, gpus_per_host=8,
            engine=EngineOptions(time_scale=K, startup_s=40.0, build_s=200.0, max_num_seqs=MAX_NUM_SEQS))
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def controller_factory(rig: Rig, tmp_path: Path) -> Iterator[Callable[..., ControllerProc]]:
    made: list[ControllerProc] = []

    def make(policy: dict[str, Any] | None = None, **settings: Any) -> ControllerProc:
        work = tmp_path / f"ctrl{len(made)}"
        work.mkdir()
        c = ControllerProc(rig, work, policy or policy_doc(), **settings)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


Waiter = Callable[[Callable[[], Any], float, str], Awaitable[Any]]
