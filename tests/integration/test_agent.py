"""The agent against a real Mosquitto (password file + ACL): desired -> engines -> status -> acks.

The agent runs as a real `fleetplan agent` process; engines are a tiny HTTP server script (one
per replica) that answers /health 503 while "starting" and reports its environment on /env.
The test plays the controller with the `controller` MQTT user.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import httpx
import pytest
import yaml

from fleetplan.controller.protocol import (
    Ack,
    HostStatus,
    ack_topic,
    desired_topic,
    parse_ack,
    parse_status,
    status_topic,
)
from fleetplan.harness.lab import allocate_port_ranges
from fleetplan.harness.servers import MosquittoServer

REPO = Path(__file__).resolve().parents[2]
HOSTS = ("h-basic", "h-bad", "h-broker", "h-restart", "h-crash", "h-build", "h-kill9", "h-busy", "h-systemd", "h-hostile",
         "h-stored", "h-shared")

FAKE_ENGINE = r'''
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
port, startup_s = int(args["--port"]), float(args.get("--startup-s", "0"))
t0 = time.monotonic()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            code, body = (200, b"ok") if time.monotonic() - t0 >= startup_s else (503, b"starting")
        elif self.path == "/env":
            code, body = 200, json.dumps({"argv": sys.argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                          "tp": os.environ.get("ENGINE_TP")}).encode()
        else:
            code, body = 404, b""
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

FAKE_BUILD = r'''
import os, sys, time
out, progress_file = sys.argv[1], sys.argv[2]
for i in range(1, 5):
    time.sleep(0.15)
    print(f"FLEETPLAN_PROGRESS {i / 5}", flush=True)
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "rank0.engine"), "w").write("engine")
'''


# A stand-in for systemctl that behaves like systemd for fleetplan-engine@<id>.service: `start`
# reads the instance's EnvironmentFile (systemd quoting) and runs the unit's ExecStart
# (`python -m fleetplan.controller.actuators exec`) detached; is-active/show/stop act on that process.
FAKE_SYSTEMCTL = r'''#!{python}
import json, os, re, signal, subprocess, sys, time, pathlib
env_dir, state = pathlib.Path({env_dir!r}), pathlib.Path({state!r})
state.mkdir(exist_ok=True)
args = sys.argv[1:]
with (state / "calls.jsonl").open("a") as f:
    f.write(json.dumps(args) + "\n")
unit = args[-1]
instance = re.fullmatch(r"fleetplan-engine@(.+)\.service", unit).group(1)
pidfile = state / (instance + ".pid")
def pid():
    try:
        p = int(pidfile.read_text())
        stat = pathlib.Path(f"/proc/{{p}}/stat").read_text()
        return p if stat[stat.rfind(")") + 2] not in "ZX" else None
    except (OSError, ValueError):
        return None
def parse_env(text):
    env = {{}}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        assert value.startswith('"') and value.endswith('"'), line
        env[key] = re.sub(r'\\(.)', lambda m: m.group(1), value[1:-1])
    return env
if args[0] == "start":
    env = {{**os.environ, **parse_env((env_dir / (instance + ".env")).read_text())}}
    proc = subprocess.Popen([sys.executable, "-m", "fleetplan.controller.actuators", "exec"], env=env, cwd={repo!r},
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pidfile.write_text(str(proc.pid))
elif args[0] == "stop":
    p = pid()
    if p:
        os.killpg(p, signal.SIGTERM)
        for _ in range(100):
            if pid() is None:
                break
            time.sleep(0.05)
elif args[0] == "is-active":
    print("active" if pid() else "inactive")
    sys.exit(0 if pid() else 3)
elif args[0] == "show":
    print((pid() or 0) if args[2] == "MainPID" else 0)
'''


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-agent-it-") as d:
        root = Path(d)
        (root / "fake_engine.py").write_text(FAKE_ENGINE)
        (root / "fake_build.py").write_text(FAKE_BUILD)
        yield root


@pytest.fixture(scope="module")
def broker(workdir: Path) -> Iterator[MosquittoServer]:
    server = MosquittoServer(workdir / "mosquitto", host_names=HOSTS)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class AgentProcess:
    """`fleetplan agent --config ...` as a real process; kills its engines at teardown."""

    def __init__(self, workdir: Path, broker: MosquittoServer, host: str, systemd: bool = False) -> None:
        self.host = host
        self.dir = workdir / host
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.dir / "state"
        (self.dir / "mqtt-password").write_text(broker.agents[host].password + "\n")
        lo, hi = allocate_port_ranges(1, 10)[0]
        self.ports = list(range(lo, hi + 1))
        engine = str(workdir / "fake_engine.py")
        config = {
            "host": host, "gpu": "H100 80GB HBM3", "gpu_count": 4, "nvlink_groups": [[0, 1, 2, 3]],
            "mqtt": {"host": broker.host, "port": broker.port, "username": broker.agents[host].user,
                     "password_file": str(self.dir / "mqtt-password"), "keepalive_s": 5,
                     "backoff_initial_s": 0.2, "backoff_max_s": 1.0},
            "port_range": [lo, hi], "state_dir": str(self.state_dir),
            "status_interval_s": 2, "reconcile_interval_s": 0.2, "restart_backoff_s": [0.3, 1.0],
            "launch_templates": {
                "fake-vllm": {"engine": "vllm", "health_path": "/health", "startup_timeout_s": 20,
                              "stop_timeout_s": 5, "env": {"ENGINE_TP": "{tp}"},
                              "argv": [sys.executable, engine, "--port", "{port}", "--model", "{model}",
                                       "--replica-id", "{replica_id}", "--startup-s", "0.6"]},
                "fake-trt": {"engine": "trtllm", "health_path": "/health", "startup_timeout_s": 20,
                             "argv": [sys.executable, engine, "--port", "{port}", "--engine-dir",
                                      "{engine_dir}"]},
            },
            "build_templates": {
                "fake-build": {"argv": [sys.executable, str(workdir / "fake_build.py"), "{engine_dir}",
                                        "{progress_file}"], "timeout_s": 60},
            },
        }
        if systemd:
            systemctl = self.dir / "systemctl"
            systemctl.write_text(FAKE_SYSTEMCTL.format(python=sys.executable, env_dir=str(self.dir / "engines"),
                                                       state=str(self.dir / "systemd"), repo=str(REPO)))
            systemctl.chmod(0o755)
            config["actuator"] = {"kind": "systemd", "systemctl": str(systemctl), "journalctl": None,
                                  "env_dir": str(self.dir / "engines")}
        self.config_path = self.dir / "agent.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.dir / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleetplan", "-v", "agent", "--config", str(self.config_path)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=15)
        self.proc = None
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        pids = []
        for record in (self.state_dir / "instances").glob("*.json"):
            pid = json.loads(record.read_text())["handle"]["pid"]
            if pid:
                pids.append(pid)
        return pids

    def cleanup(self, extra_pids: list[int]) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.stop(signal.SIGKILL)
        for pid in {*self.engine_pids(), *extra_pids}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def agent_factory(workdir: Path, broker: MosquittoServer) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []
    seen_pids: list[int] = []

    def make(host: str, systemd: bool = False) -> AgentProcess:
        agent = AgentProcess(workdir, broker, host, systemd)
        agents.append(agent)
        agent.start()
        return agent

    yield make
    for agent in agents:
        seen_pids += agent.engine_pids()
        agent.cleanup(seen_pids)


class FakeController:
    """The controller side: publishes desired state, collects acks and status for one host."""

    def __init__(self, broker: MosquittoServer, host: str) -> None:
        self.broker, self.host = broker, host
        self.acks: list[Ack] = []
        self.statuses: list[HostStatus] = []
        self._client: aiomqtt.Client | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeController:
        await self.connect()
        return self

    async def connect(self) -> None:
        self._client = aiomqtt.Client(
            self.broker.host, self.broker.port, username=self.broker.controller_user,
            password=self.broker.controller_password, protocol=aiomqtt.ProtocolVersion.V5,
        )
        await self._client.__aenter__()
        await self._client.subscribe(status_topic(self.host), qos=1)
        await self._client.subscribe(ack_topic(self.host), qos=1)
        self._reader = asyncio.create_task(self._read(self._client))

    async def _read(self, client: aiomqtt.Client) -> None:
        with contextlib.suppress(aiomqtt.MqttError):
            async for message in client.messages:
                payload = message.payload
                assert isinstance(payload, bytes | bytearray)
                if message.topic.matches(ack_topic(self.host)):
                    self.acks.append(parse_ack(payload))
                elif message.topic.matches(status_topic(self.host)) and payload:
                    self.statuses.append(parse_status(payload))

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._client is not None:
            with contextlib.suppress(aiomqtt.MqttError):
                await self._client.__aexit__(None, None, None)
        self._client = self._reader = None

    async def publish(self, desired: dict[str, Any] | bytes) -> None:
        assert self._client is not None
        payload = desired if isinstance(desired, bytes) else json.dumps(desired).encode()
        await self._client.publish(desired_topic(self.host), payload, qos=1, retain=True)

    async def wait_ack(self, version: int | None, timeout_s: float = 30.0) -> Ack:
        # from the publish: the agent process may still be starting (its imports take seconds on a busy machine)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ack in self.acks:
                if ack.version == version:
                    self.acks.remove(ack)
                    return ack
            await asyncio.sleep(0.05)
        raise AssertionError(f"no ack for version {version}; acks: {self.acks}")

    async def wait_status(self, predicate: Callable[[HostStatus], bool], what: str,
                          timeout_s: float = 20.0) -> HostStatus:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.statuses and predicate(self.statuses[-1]):
                return self.statuses[-1]
            await asyncio.sleep(0.05)
        last = self.statuses[-1] if self.statuses else None
        raise AssertionError(f"status never {what}; last: {last}")


def replica(rid: str, port: int, gpus: list[int], *, template: str = "fake-vllm", engine: str = "vllm",
            model: str = "meta-llama/Llama-3.1-8B-Instruct", precision: str = "bf16") -> dict[str, Any]:
    return {"replica_id": rid, "template": template, "model": model, "engine": engine, "gpu": "h100",
            "tp": len(gpus), "precision": precision, "gpu_indices": gpus, "port": port}


def states(status: HostStatus) -> dict[str, str]:
    return {r.replica_id: r.state.value for r in status.replicas}


def pids(status: HostStatus) -> dict[str, int | None]:
    return {r.replica_id: r.pid for r in status.replicas}


def all_ready(*ids: str) -> Callable[[HostStatus], bool]:
    return lambda s: s.online and states(s) == dict.fromkeys(ids, "ready")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


async def get_json(port: int, path: str) -> Any:
    async with httpx.AsyncClient(timeout=3) as client:
        response = await client.get(f"http://127.0.0.1:{port}{path}")
        response.raise_for_status()
        return response.json()


async def test_desired_state_starts_pinned_engines_reports_ready_then_drains(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-basic")
    p = agent.ports
    async with FakeController(broker, "h-basic") as ctl:
        first = await ctl.wait_status(lambda s: s.online, "online")
        assert (first.gpu_count, first.nvlink_groups, first.desired_version) == (4, ((0, 1, 2, 3),), None)
        assert first.templates == ("fake-trt", "fake-vllm")
        await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [0]), replica("r2", p[1], [2, 3])]})
        ack = await ctl.wait_ack(1)
        assert ack.accepted and ack.errors == () and ack.host == "h-basic"
        starting = await ctl.wait_status(lambda s: "r1" in states(s), "r1 listed")
        assert states(starting)["r1"] in ("starting", "ready")
        ready = await ctl.wait_status(all_ready("r1", "r2"), "both ready")
        assert ready.desired_version == 1
        env = await get_json(p[1], "/env")
        assert env["cuda"] == "2,3" and env["tp"] == "2"
        assert env["argv"][1:] == ["--port", str(p[1]), "--model", "meta-llama/Llama-3.1-8B-Instruct",
                                   "--replica-id", "r2", "--startup-s", "0.6"]
        assert (await get_json(p[0], "/env"))["cuda"] == "0"
        before = pids(ready)

        # Scale down: r2 leaves the desired state -> SIGTERM -> gone; r1 untouched.
        await ctl.publish({"version": 2, "replicas": [replica("r1", p[0], [0])]})
        assert (await ctl.wait_ack(2)).accepted
        after = await ctl.wait_status(lambda s: states(s) == {"r1": "ready"}, "only r1")
        assert pids(after)["r1"] == before["r1"]
        r2_pid = before["r2"]
        assert r2_pid is not None
        for _ in range(100):
            if not alive(r2_pid):
                break
            await asyncio.sleep(0.05)
        assert not alive(r2_pid)
        # Same version again (e.g. the retained message after a reconnect): idempotent, acked.
        await ctl.publish({"version": 2, "replicas": [replica("r1", p[0], [0])]})
        assert (await ctl.wait_ack(2)).accepted


async def test_bad_input_is_rejected_with_a_reason_and_running_engines_are_untouched(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-bad")
    p = agent.ports
    async with FakeController(broker, "h-bad") as ctl:
        await ctl.publish({"version": 5, "replicas": [replica("r1", p[0], [0])]})
        assert (await ctl.wait_ack(5)).accepted
        ready = await ctl.wait_status(all_ready("r1"), "r1 ready")
        pid = pids(ready)["r1"]

        cases: list[tuple[bytes | dict[str, Any], int | None, str]] = [
            (b"{this is not json", None, "not JSON"),
            ({"version": 6, "replicas": [replica("r1", p[0], [0], template="rm-rf")]}, 6,
             "unknown template 'rm-rf'"),
            ({"version": 7, "replicas": [replica("r1", p[0], [3, 4])]}, 7, "GPU index 4 out of range"),
            ({"version": 8, "replicas": [replica("r1", 80, [0])]}, 8, "port 80 outside this host's range"),
            ({"version": 9, "replicas": [replica("r1", p[0], [0], model="--trust-remote-code")]}, 9,
             "replicas.0.model"),
            ({"version": 10, "replicas": [{**replica("r1", p[0], [0]), "argv": ["/bin/sh"]}]}, 10,
             "replicas.0.argv: Extra inputs are not permitted"),
            (b'{"version": NaN, "replicas": []}', None, "version = NaN"),
            (b'{"version": %d, "replicas": []}' % 2**63, None, "version = 9223372036854775808"),
            (b"[" * 200_000 + b"]" * 200_000, None, "desired state for h-bad: payload"),
            ({"version": 11, "replicas": [{**replica("r1", p[0], [0]), "port": "18000"}]}, 11, "replicas.0.port"),
            ({"version": 4, "replicas": []}, 4, "older than the applied version 5"),
            ({"version": 5, "replicas": []}, 5, "already applied with different content"),
        ]
        for payload, version, needle in cases:
            await ctl.publish(payload)
            ack = await ctl.wait_ack(version)
            assert not ack.accepted, payload
            assert any(needle in e for e in ack.errors), (needle, ack.errors)
        # Nothing running was disturbed: same process, still ready, desired version unchanged.
        await asyncio.sleep(0.5)
        status = await ctl.wait_status(lambda s: s.online, "online")
        assert states(status) == {"r1": "ready"} and pids(status)["r1"] == pid and status.desired_version == 5
        assert pid is not None and alive(pid)
        assert (await get_json(p[0], "/env"))["cuda"] == "0"
        assert "Traceback" not in agent.log()


async def test_retained_hostile_desired_state_neither_crashes_nor_crash_loops_the_agent(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-hostile")
    p = agent.ports
    async with FakeController(broker, "h-hostile") as ctl:
        await ctl.publish(b"[" * 100_000 + b"]" * 100_000)  # retained: it comes back on every (re)connect
        ack = await ctl.wait_ack(None)
        assert not ack.accepted and "desired state for h-hostile: payload" in ack.errors[0], ack.errors
        assert "nested deeper" in ack.errors[0]
        assert agent.stop() == 0  # a clean stop: the agent was alive
        agent.start()
        ack = await ctl.wait_ack(None)  # the retained message again: acked as an error, the agent lives on
        assert not ack.accepted
        await ctl.wait_status(lambda s: s.online, "online after the restart")
        await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [0])]})
        assert (await ctl.wait_ack(1)).accepted
        await ctl.wait_status(all_ready("r1"), "r1 ready")
    assert agent.proc is not None and agent.proc.poll() is None
    assert "Traceback" not in agent.log()


async def test_broker_restart_agent_reconnects_and_engines_are_untouched(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-broker")
    p = agent.ports
    async with FakeController(broker, "h-broker") as ctl:
        await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [0]), replica("r2", p[1], [1])]})
        ready = await ctl.wait_status(all_ready("r1", "r2"), "both ready")
    before = pids(ready)

    broker.restart()

    async with FakeController(broker, "h-broker") as ctl:
        # The retained status after the restart may be the old one: wait for a fresh one.
        restarted_at = time.time()
        fresh = await ctl.wait_status(
            lambda s: s.online and (s.updated_s or 0) > restarted_at, "refreshed after broker restart")
        assert pids(fresh) == before and states(fresh) == {"r1": "ready", "r2": "ready"}
        assert all(pid is not None and alive(pid) for pid in before.values())
        # The agent listens again: a new version is applied.
        await ctl.publish({"version": 2, "replicas": [replica("r1", p[0], [0])]})
        assert (await ctl.wait_ack(2)).accepted
        after = await ctl.wait_status(lambda s: states(s) == {"r1": "ready"}, "r2 drained")
        assert pids(after)["r1"] == before["r1"]
    assert "reconnecting" in agent.log()


async def test_agent_restart_readopts_engines_without_duplicates(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-restart")
    p = agent.ports
    async with FakeController(broker, "h-restart") as ctl:
        await ctl.publish({"version": 3, "replicas": [replica("r1", p[0], [0, 1]), replica("r2", p[1], [2])]})
        ready = await ctl.wait_status(all_ready("r1", "r2"), "both ready")
        before = pids(ready)

        assert agent.stop(signal.SIGTERM) == 0  # the agent stops; the engines must not
        offline = await ctl.wait_status(lambda s: not s.online, "offline after SIGTERM")
        assert pids(offline) == before  # still lists its (running) replicas
        assert all(pid is not None and alive(pid) for pid in before.values())

        seen = len(ctl.statuses)
        agent.start()
        back = await ctl.wait_status(lambda s: s.online and states(s) == {"r1": "ready", "r2": "ready"},
                                     "online again with both ready")
        assert pids(back) == before
        # No flap through "starting": the very first status after the restart already says ready.
        first_online = next(s for s in ctl.statuses[seen:] if s.online)
        assert states(first_online) == {"r1": "ready", "r2": "ready"}
        assert sorted(agent.engine_pids()) == sorted(p for p in before.values() if p is not None)
        assert "re-adopted replica r1" in agent.log() and "re-adopted replica r2" in agent.log()
        await asyncio.sleep(1.0)  # a few reconcile passes: still no second start
        assert agent.log().count("started replica r1") == 1


async def test_agent_restart_keeps_a_ready_engine_ready_while_its_health_probe_times_out(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    """A busy host (the fault suite's agent kill -9 on 2 loaded cores): an engine that served before
    the restart but does not answer its health probe in time is still ready in the first status
    (a "starting" one is unrouted: 503s while it was serving)."""
    agent = agent_factory("h-busy")
    p = agent.ports
    async with FakeController(broker, "h-busy") as ctl:
        await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [0]), replica("r2", p[1], [1])]})
        before = pids(await ctl.wait_status(all_ready("r1", "r2"), "both ready"))
        r2_pid = before["r2"]
        assert r2_pid is not None
        assert agent.stop(signal.SIGTERM) == 0
        await ctl.wait_status(lambda s: not s.online, "offline after SIGTERM")
        os.killpg(r2_pid, signal.SIGSTOP)  # r2 accepts connections (the kernel's backlog), answers none
        try:
            seen = len(ctl.statuses)
            agent.start()
            await ctl.wait_status(lambda s: s.online, "online again", timeout_s=30)
            first_online = next(s for s in ctl.statuses[seen:] if s.online)
            assert states(first_online) == {"r1": "ready", "r2": "ready"}
            assert "re-adopted replica r2" in agent.log() and "health probe 3/3 failed" in agent.log()
        finally:
            os.killpg(r2_pid, signal.SIGCONT)
        assert pids(await ctl.wait_status(all_ready("r1", "r2"), "both ready")) == before


async def test_agent_kill9_then_engine_exit_while_down_is_restarted(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-kill9")
    p = agent.ports
    async with FakeController(broker, "h-kill9") as ctl:
        await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [0]), replica("r2", p[1], [1])]})
        ready = await ctl.wait_status(all_ready("r1", "r2"), "both ready")
        before = pids(ready)
        agent.stop(signal.SIGKILL)
        # The last will marks the host offline (keepalive 5 s -> up to ~7.5 s).
        await ctl.wait_status(lambda s: not s.online, "offline (last will)", timeout_s=15)
        r2_pid = before["r2"]
        assert r2_pid is not None
        os.killpg(r2_pid, signal.SIGKILL)  # an engine dies while its agent is down
        agent.start()
        back = await ctl.wait_status(
            lambda s: s.online and states(s) == {"r1": "ready", "r2": "ready"} and pids(s)["r2"] != r2_pid,
            "r1 re-adopted, r2 started again")
        assert pids(back)["r1"] == before["r1"]


async def test_crashed_engine_is_reported_failed_then_restarted(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-crash")
    p = agent.ports
    async with FakeController(broker, "h-crash") as ctl:
        await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [0])]})
        ready = await ctl.wait_status(all_ready("r1"), "ready")
        pid = pids(ready)["r1"]
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        failed = await ctl.wait_status(lambda s: states(s) == {"r1": "failed"}, "failed")
        assert "killed by SIGKILL" in (failed.replicas[0].error or "")
        again = await ctl.wait_status(lambda s: states(s) == {"r1": "ready"}, "restarted")
        assert again.replicas[0].restarts == 1 and again.replicas[0].pid != pid


async def test_build_reports_progress_then_engine_is_cached_and_servable(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    agent = agent_factory("h-build")
    p = agent.ports
    trt = replica("t1", p[0], [0], template="fake-trt", engine="trtllm", precision="fp8")
    build = {"build_id": "b1", "template": "fake-build", "model": trt["model"], "gpu": "h100", "tp": 1,
             "precision": "fp8", "gpu_indices": [1]}
    async with FakeController(broker, "h-build") as ctl:
        # No engine built yet: a template that needs {engine_dir} is refused.
        await ctl.publish({"version": 1, "replicas": [trt]})
        ack = await ctl.wait_ack(1)
        assert not ack.accepted and "none cached, build it first" in ack.errors[0]
        await ctl.publish({"version": 2, "builds": [build]})
        assert (await ctl.wait_ack(2)).accepted
        await ctl.wait_status(lambda s: any(0 < b.progress < 1 for b in s.builds), "build progress")
        done = await ctl.wait_status(lambda s: [b.state.value for b in s.builds] == ["done"], "build done")
        assert done.builds[0].progress == 1.0
        cached = done.engines_cached
        assert [(e.model, e.gpu.value if e.gpu else None, e.tp, e.precision.value) for e in cached] == [
            (trt["model"], "h100", 1, "fp8")]
        assert cached[0].path is not None and (Path(cached[0].path) / "rank0.engine").is_file()
        # the manifest hosts sharing the cache directory find it by: what the engine is, no path
        manifest = json.loads((Path(cached[0].path) / "fleetplan-engine.json").read_text())
        assert (manifest["model"], manifest["gpu"], manifest["tp"], manifest["precision"]) == (
            trt["model"], "h100", 1, "fp8") and "path" not in manifest
        await ctl.publish({"version": 3, "replicas": [trt]})
        assert (await ctl.wait_ack(3)).accepted
        ready = await ctl.wait_status(all_ready("t1"), "trt replica ready")
        assert ready.builds == ()
        env = await get_json(p[0], "/env")
        assert env["argv"][-1] == cached[0].path


async def test_an_engine_stored_in_the_cache_directory_is_held_without_a_build(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    """A prebuilt engine an operator copied into the engine cache (what the policy's cached_builds
    declare) serves: the agent accepts its replica and reports the engine, so the planner knows
    the host holds it. An empty directory is no engine."""
    agent = agent_factory("h-stored")
    p = agent.ports
    trt = replica("t1", p[0], [0], template="fake-trt", engine="trtllm", precision="fp8")
    engine_dir = agent.state_dir / "engines" / f"{trt['model'].replace('/', '--')}__h100__tp1__fp8"
    engine_dir.mkdir(parents=True)
    async with FakeController(broker, "h-stored") as ctl:
        await ctl.publish({"version": 1, "replicas": [trt]})
        ack = await ctl.wait_ack(1)
        assert not ack.accepted and "none cached, build it first" in ack.errors[0]  # empty: no engine
        (engine_dir / "rank0.engine").write_text("prebuilt")
        await ctl.publish({"version": 2, "replicas": [trt]})
        assert (await ctl.wait_ack(2)).accepted
        ready = await ctl.wait_status(all_ready("t1"), "trt replica ready")
        assert [(e.tp, e.precision.value, e.path) for e in ready.engines_cached] == [(1, "fp8", str(engine_dir))]


async def test_an_engine_another_host_built_into_a_shared_cache_is_found_and_reported(
    broker: MosquittoServer, agent_factory: Callable[[str], AgentProcess]
) -> None:
    """A cache directory shared between hosts: an engine another host's build finished (its manifest
    written last) is held and reported without any desired replica asking for it, so the planner
    can place replicas here; one still being built (no manifest yet) or built for another GPU type
    is not."""
    agent = agent_factory("h-shared")
    cache = agent.state_dir / "engines"
    model = "org/shared-model"

    def engine(gpu: str, tp: int, manifest: bool) -> Path:
        d = cache / f"{model.replace('/', '--')}__{gpu}__tp{tp}__fp8"
        d.mkdir(parents=True)
        (d / "rank0.engine").write_text("built elsewhere")
        if manifest:
            (d / "fleetplan-engine.json").write_text(json.dumps(
                {"model": model, "engine": "trtllm", "gpu": gpu, "tp": tp, "precision": "fp8", "built_s": 1.7e9}))
        return d

    async with FakeController(broker, "h-shared") as ctl:
        await ctl.wait_status(lambda s: s.online, "online")
        building = engine("h100", 2, manifest=False)
        engine("a100", 1, manifest=True)
        done = engine("h100", 1, manifest=True)
        found = await ctl.wait_status(lambda s: len(s.engines_cached) > 0, "shared engine found")
        assert [(e.model, e.tp, e.path) for e in found.engines_cached] == [(model, 1, str(done))]
        (building / "fleetplan-engine.json").write_text(json.dumps(
            {"model": model, "engine": "trtllm", "gpu": "h100", "tp": 2, "precision": "fp8"}))
        both = await ctl.wait_status(lambda s: len(s.engines_cached) == 2, "the second build finished")
        assert sorted(e.tp for e in both.engines_cached) == [1, 2]


async def test_systemd_actuator_runs_engines_through_the_unit_exec_path(
    broker: MosquittoServer, agent_factory: Callable[..., AgentProcess]
) -> None:
    agent = agent_factory("h-systemd", systemd=True)
    p = agent.ports
    try:
        async with FakeController(broker, "h-systemd") as ctl:
            await ctl.publish({"version": 1, "replicas": [replica("r1", p[0], [1, 2]),
                                                          replica("r2", p[1], [0], model="org/model:v2")]})
            assert (await ctl.wait_ack(1)).accepted
            ready = await ctl.wait_status(all_ready("r1", "r2"), "both ready")
            assert {r.replica_id: r.unit for r in ready.replicas} == {
                "r1": "fleetplan-engine@r1.service", "r2": "fleetplan-engine@r2.service"}
            # The env file round trip, then `python -m fleetplan.controller.actuators exec` (no shell):
            env = await get_json(p[0], "/env")
            assert env["cuda"] == "1,2" and env["tp"] == "2"
            assert (await get_json(p[1], "/env"))["argv"][4] == "org/model:v2"
            assert (agent.dir / "engines" / "r1.env").is_file()
            await ctl.publish({"version": 2, "replicas": [replica("r2", p[1], [0], model="org/model:v2")]})
            await ctl.wait_status(lambda s: states(s) == {"r2": "ready"}, "r1 stopped")
            assert not (agent.dir / "engines" / "r1.env").exists()
            calls = [json.loads(line) for line in (agent.dir / "systemd" / "calls.jsonl").read_text().splitlines()]
            assert ["start", "fleetplan-engine@r1.service"] in calls
            assert ["stop", "fleetplan-engine@r1.service"] in calls
            r1_pid = pids(ready)["r1"]
            assert r1_pid is not None and not alive(r1_pid)
    finally:
        for pidfile in (agent.dir / "systemd").glob("*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pidfile.read_text()), signal.SIGKILL)
