"""Actuators (process and systemd with a recording fake systemctl) and the agent's own config."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fleetplan.controller.actuators import (
    ARGV_ENV,
    Handle,
    LaunchSpec,
    ProcessActuator,
    StartError,
    SystemdActuator,
    pid_alive,
    render_env_file,
)
from fleetplan.controller.agent import Agent
from fleetplan.controller.agent_config import (
    AgentConfig,
    AgentConfigError,
    load_agent_config,
    sim_agent_config,
)
from fleetplan.controller.protocol import (
    DesiredReplica,
    check_desired,
    limits_from_status,
    parse_desired,
    parse_status,
    to_payload,
)

REPO = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- ProcessActuator


async def test_process_actuator_starts_detached_and_stops_with_sigterm(tmp_path: Path) -> None:
    act = ProcessActuator(tmp_path / "logs")
    spec = LaunchSpec("r1", (sys.executable, "-c", "import time, os; print(os.environ['X']); time.sleep(60)"),
                      {"X": "hello world"})
    handle = await act.start(spec)
    assert handle.pid is not None and handle.start_ticks is not None
    assert os.getsid(handle.pid) == handle.pid  # its own session: the agent's signals do not reach it
    assert await act.poll(handle) is None
    exited = await act.stop(handle, timeout_s=5)
    assert exited.detail == "killed by SIGTERM"
    assert "--- " in act.log_tail("r1")


async def test_process_actuator_sigkills_after_the_stop_timeout(tmp_path: Path) -> None:
    act = ProcessActuator(tmp_path / "logs")
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    handle = await act.start(LaunchSpec("stubborn", (sys.executable, "-c", code)))
    for _ in range(100):  # wait until the SIGTERM handler is installed
        if "\nup\n" in act.log_tail("stubborn"):
            break
        await asyncio.sleep(0.05)
    exited = await act.stop(handle, timeout_s=0.5)
    assert exited.code == -signal.SIGKILL


async def test_process_actuator_adopts_only_the_same_process(tmp_path: Path) -> None:
    first = ProcessActuator(tmp_path / "logs")
    handle = await first.start(LaunchSpec("r1", (sys.executable, "-c", "import time; time.sleep(60)")))
    try:
        again = ProcessActuator(tmp_path / "logs")  # a restarted agent: not its child
        restored = Handle.from_dict(json.loads(json.dumps(handle.to_dict())))
        assert await again.adopt(restored) == handle
        assert await again.adopt(Handle("r1", ("other", "argv"), handle.pid, handle.start_ticks)) is None
        assert handle.start_ticks is not None
        assert await again.adopt(Handle("r1", handle.argv, handle.pid, handle.start_ticks + 1)) is None
        assert await again.poll(restored) is None
        exited = await again.stop(restored, timeout_s=5)
        assert exited.code is None  # not our child: exit status unknown
        assert await again.adopt(restored) is None
    finally:
        await first.stop(handle, timeout_s=1)


async def test_process_actuator_reports_a_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(StartError, match="cannot start '/nonexistent/vllm'"):
        await ProcessActuator(tmp_path).start(LaunchSpec("r1", ("/nonexistent/vllm", "serve")))


# ---------------------------------------------------------------- SystemdActuator

FAKE_SYSTEMCTL = textwrap.dedent("""\
    #!{python}
    import json, sys, pathlib
    d = pathlib.Path({state!r})
    calls = d / "calls.jsonl"
    with calls.open("a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    args = sys.argv[1:]
    unit = args[-1]
    active = d / (unit + ".active")
    if args[0] == "start":
        active.write_text("1")
    elif args[0] == "stop":
        active.unlink(missing_ok=True)
    elif args[0] == "is-active":
        print("active" if active.exists() else "inactive")
        sys.exit(0 if active.exists() else 3)
    elif args[0] == "show" and args[2] == "MainPID":
        print(4242 if active.exists() else 0)
    elif args[0] == "show" and args[2] == "ExecMainStatus":
        print(0)
""")


@pytest.fixture
def systemctl(tmp_path: Path) -> Path:
    state = tmp_path / "systemd"
    state.mkdir()
    script = tmp_path / "systemctl"
    script.write_text(FAKE_SYSTEMCTL.format(python=sys.executable, state=str(state)))
    script.chmod(0o755)
    return script


def _calls(systemctl: Path) -> list[list[str]]:
    path = systemctl.parent / "systemd" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_systemd_actuator_writes_env_file_and_calls_systemctl(tmp_path: Path, systemctl: Path) -> None:
    act = SystemdActuator(tmp_path / "engines", systemctl=str(systemctl), journalctl=None)
    argv = ("/opt/vllm/bin/vllm", "serve", "org/model name", "--port", "18000")
    handle = await act.start(LaunchSpec("r1", argv, {"CUDA_VISIBLE_DEVICES": "0,1", "Q": 'a "quoted" \\ value'}))
    unit = "fleetplan-engine@r1.service"
    assert handle == Handle("r1", argv, pid=4242, unit=unit)
    env_text = (tmp_path / "engines" / "r1.env").read_text()
    assert 'CUDA_VISIBLE_DEVICES="0,1"\n' in env_text
    assert 'Q="a \\"quoted\\" \\\\ value"\n' in env_text
    assert _calls(systemctl) == [["reset-failed", unit], ["start", unit],
                                 ["show", "-p", "MainPID", "--value", unit]]
    assert await act.poll(handle) is None
    assert await act.adopt(Handle("r1", argv, unit=unit)) == handle
    await act.stop(handle, timeout_s=30)
    assert ["stop", unit] in _calls(systemctl)
    assert not (tmp_path / "engines" / "r1.env").exists()
    exited = await act.poll(handle)
    assert exited is not None and "inactive" in exited.detail
    assert await act.adopt(handle) is None


async def test_systemd_actuator_reports_a_missing_systemctl(tmp_path: Path) -> None:
    act = SystemdActuator(tmp_path, systemctl=str(tmp_path / "no-systemctl"))
    with pytest.raises(StartError, match="cannot run"):
        await act.start(LaunchSpec("r1", ("x",)))


def test_env_file_refuses_newlines_and_bad_names() -> None:
    with pytest.raises(ValueError, match="newline"):
        render_env_file({"A": "x\nEVIL=1"})
    with pytest.raises(ValueError, match="not valid"):
        render_env_file({"A B": "x"})


def test_unit_exec_helper_execs_the_argv_without_a_shell(tmp_path: Path) -> None:
    code = "import os, sys; print(repr(sys.argv[1:]), os.environ.get('FLEETPLAN_ENGINE_ARGV'), os.getcwd())"
    env = {**os.environ, ARGV_ENV: json.dumps([sys.executable, "-c", code, "a b", "$(id)"]),
           "FLEETPLAN_ENGINE_CWD": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "fleetplan.controller.actuators", "exec"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip() == f"['a b', '$(id)'] None {tmp_path}"


# ---------------------------------------------------------------- agent config and templates


def _config(tmp_path: Path, **over: object) -> AgentConfig:
    data = sim_agent_config(host="h1", gpu="h100", gpu_count=4, mqtt_host="127.0.0.1", mqtt_port=1883,
                            mqtt_user="agent-h1", mqtt_password="pw", port_range=(18000, 18010),
                            state_dir=tmp_path / "state")
    data.update(over)
    return AgentConfig.model_validate(data)


def test_launch_spec_substitutes_placeholders_as_single_argv_items(tmp_path: Path) -> None:
    agent = Agent(_config(tmp_path), actuator=ProcessActuator(tmp_path))
    replica = DesiredReplica(replica_id="r-7", template="vllm", model="org/model:v1", engine="vllm",
                             gpu="h100", tp=2, precision="bf16", gpu_indices=(2, 3), port=18004)
    spec = agent.launch_spec(replica)
    argv = list(spec.argv)
    assert argv[argv.index("--model") + 1] == "org/model:v1"
    assert argv[argv.index("--port") + 1] == "18004"
    assert argv[argv.index("--gpu-indices") + 1] == "2,3"
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "2,3" and spec.env["FLEETPLAN_REPLICA_ID"] == "r-7"
    assert not any("{" in a for a in argv)


def test_config_rejects_unknown_placeholders_with_file_and_field(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "config" / "agent.example.yaml").read_text())
    data["launch_templates"]["vllm"]["argv"].append("{cmd}")
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(AgentConfigError) as info:
        load_agent_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: launch_templates.vllm") and "unknown placeholder {cmd}" in message


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("gpu_count", 0, "gpu_count"),
    ("port_range", [9000, 8000], "port_range"),
    ("nvlink_groups", [[0, 9]], "GPU index 9 out of range"),
    ("gpu", "tpu", "unknown GPU"),
    ("host", "a/b", "host"),
])
def test_config_errors_are_one_clear_line(tmp_path: Path, field: str, value: object, needle: str) -> None:
    data = yaml.safe_load((REPO / "config" / "agent.example.yaml").read_text())
    data[field] = value
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(AgentConfigError, match=needle) as info:
        load_agent_config(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["agent.example.yaml", "agent.lab.yaml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_agent_config(REPO / "config" / name)
    assert config.launch_templates


def test_agent_cli_check(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "fleetplan", "agent", "--config",
                          str(REPO / "config" / "agent.example.yaml"), "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "OK (host gpu-node-01" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("host: [")
    out = subprocess.run([sys.executable, "-m", "fleetplan", "agent", "--config", str(bad), "--check"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and f"{bad}: not valid YAML" in out.stderr


# ---------------------------------------------------------------- the agent without MQTT


def _desired(version: int, template: str = "vllm") -> bytes:
    return json.dumps({"version": version, "replicas": [{
        "replica_id": "r1", "template": template, "model": "m", "engine": "vllm", "gpu": "h100", "tp": 1,
        "precision": "bf16", "gpu_indices": [0], "port": 18001}]}).encode()


async def test_handle_desired_persists_and_is_idempotent(tmp_path: Path) -> None:
    agent = Agent(_config(tmp_path), actuator=ProcessActuator(tmp_path))
    ack = agent.handle_desired(_desired(3))
    assert ack is not None and ack.accepted and ack.version == 3
    assert json.loads((tmp_path / "state" / "desired.json").read_text())["version"] == 3
    again = agent.handle_desired(_desired(3))
    assert again is not None and again.accepted
    assert agent.handle_desired(b"") is None  # retained message cleared: nothing to ack, nothing changes
    assert agent.desired is not None and agent.desired.version == 3
    old = agent.handle_desired(_desired(2))
    assert old is not None and not old.accepted and agent.desired.version == 3


async def test_restart_with_a_config_that_lost_the_template_keeps_instances_and_reports(tmp_path: Path) -> None:
    first = Agent(_config(tmp_path), actuator=ProcessActuator(tmp_path))
    assert first.handle_desired(_desired(1)) is not None
    config = _config(tmp_path)
    smaller = config.model_copy(update={"launch_templates": {"trtllm": config.launch_templates["trtllm"]}})
    second = Agent(smaller, actuator=ProcessActuator(tmp_path))
    await second.restore()
    assert second.desired is None
    assert any("no longer fits this config" in e and "unknown template 'vllm'" in e
               for e in second.status().errors)
    await second.reconcile_once()  # nothing to start, nothing crashes
    assert second.instances == {}


async def test_build_over_its_timeout_is_stopped_and_failed(tmp_path: Path) -> None:
    config = _config(tmp_path)
    slow = {"argv": [sys.executable, "-c", "import time; time.sleep(60)"], "timeout_s": 0.3}
    config = AgentConfig.model_validate({**config.model_dump(mode="json"), "build_templates": {"slow": slow}})
    agent = Agent(config, actuator=ProcessActuator(tmp_path / "logs"))
    ack = agent.handle_desired(json.dumps({"version": 1, "builds": [{
        "build_id": "b1", "template": "slow", "model": "m", "gpu": "h100", "tp": 1, "precision": "fp8",
        "gpu_indices": [3]}]}).encode())
    assert ack is not None and ack.accepted
    await agent.reconcile_once()
    pid = agent.builds["b1"].handle.pid if agent.builds["b1"].handle else None
    assert pid is not None
    for _ in range(100):
        await asyncio.sleep(0.05)
        await agent.reconcile_once()
        if agent.builds["b1"].state.value == "failed" and agent.builds["b1"].handle is None:
            break  # failed, and the stop (SIGTERM) has completed
    build = agent.status().builds[0]
    assert build.state.value == "failed" and "timed out after 0s" in (build.error or "")
    assert not pid_alive(pid)


def test_limits_from_status_match_the_agent_own_limits(tmp_path: Path) -> None:
    agent = Agent(_config(tmp_path, models=["m", "org/other"]), actuator=ProcessActuator(tmp_path))
    status = parse_status(to_payload(agent.status()))
    limits = limits_from_status(status)
    assert limits is not None and limits == agent.limits()
    assert limits_from_status(parse_status(b'{"host": "h1", "online": false}')) is None
    desired = parse_desired(_desired(1, template="nope"))
    assert check_desired(desired, limits) == check_desired(desired, agent.limits()) != []


def _engine_dir(cache: Path, model: str, gpu: str, tp: int, manifest: dict[str, object] | None) -> Path:
    d = cache / f"{model}__{gpu}__tp{tp}__fp8"
    d.mkdir(parents=True)
    (d / "rank0.engine").write_text("engine")
    if manifest is not None:
        (d / "fleetplan-engine.json").write_text(json.dumps(manifest))
    return d


def test_read_engine_manifests_takes_finished_engines_of_this_gpu_type_only(tmp_path: Path) -> None:
    from fleetplan.controller.agent_cache import read_engine_manifests
    from fleetplan.models.names import GpuType

    cache = tmp_path / "cache"
    assert read_engine_manifests(cache, frozenset(), GpuType.H100).found == ()  # no directory yet: nothing
    ok = _engine_dir(cache, "m", "h100", 1, {"model": "m", "gpu": "h100", "tp": 1, "precision": "fp8"})
    _engine_dir(cache, "m", "h100", 2, None)  # still being built
    _engine_dir(cache, "m", "a100", 1, {"model": "m", "gpu": "a100", "tp": 1, "precision": "fp8"})
    _engine_dir(cache, "m", "h100", 4, {"model": "other", "gpu": "h100", "tp": 4, "precision": "fp8"})
    _engine_dir(cache, "m", "h100", 8, {"model": "m", "gpu": "h100"})  # no tp: not a manifest
    (cache / "notes.txt").write_text("a file, not an engine")
    scan = read_engine_manifests(cache, frozenset(), GpuType.H100)
    assert [(name, e.tp, e.path) for name, e in scan.found] == [(ok.name, 1, str(ok))]
    assert sorted(name for name, _ in scan.foreign) == ["m__a100__tp1__fp8", "m__h100__tp4__fp8",
                                                        "m__h100__tp8__fp8"]
    assert len(scan.warnings) == 2 and any("describes another engine" in w for w in scan.warnings)
    assert any("m__h100__tp8__fp8" in w for w in scan.warnings)  # the bad manifest is named
    again = read_engine_manifests(cache, frozenset({ok.name}), GpuType.H100, dict(scan.foreign))
    assert again == type(scan)()  # what was read is not read (nor warned of) again
    # an operator mends the bad manifest: it is read again, and the engine is taken
    bad = cache / "m__h100__tp8__fp8" / "fleetplan-engine.json"
    bad.write_text(json.dumps({"model": "m", "gpu": "h100", "tp": 8, "precision": "fp8"}))
    os.utime(bad, ns=(bad.stat().st_atime_ns, bad.stat().st_mtime_ns + 1_000_000_000))
    mended = read_engine_manifests(cache, frozenset({ok.name}), GpuType.H100, dict(scan.foreign))
    assert [(name, e.tp) for name, e in mended.found] == [("m__h100__tp8__fp8", 8)] and mended.warnings == ()


async def test_a_hung_engine_cache_read_does_not_hold_up_reconcile(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A network filesystem that hangs: the pass goes on after SCAN_WAIT_S, the next passes do not
    start another read, and what the read finds once it returns is held and reported."""
    import threading
    import time as time_mod

    from fleetplan.controller import agent_cache as agent_mod

    release = threading.Event()
    calls = []
    real = agent_mod.read_engine_manifests

    def hung(cache_dir: Path, skip: frozenset[str], gpu: object, foreign: dict[str, int]) -> agent_mod.CacheScan:
        calls.append(cache_dir)
        release.wait(10.0)
        return real(cache_dir, skip, gpu, foreign)

    monkeypatch.setattr(agent_mod, "read_engine_manifests", hung)
    monkeypatch.setattr(agent_mod, "SCAN_WAIT_S", 0.2)
    config = _config(tmp_path)
    agent = Agent(config, actuator=ProcessActuator(tmp_path / "logs"))
    t0 = time_mod.monotonic()
    await agent.reconcile_once()
    await agent.reconcile_once()
    assert time_mod.monotonic() - t0 < 2.0 and len(calls) == 1  # one read, not one per pass
    _engine_dir(config.cache_dir, "m", "h100", 1, {"model": "m", "gpu": "h100", "tp": 1, "precision": "fp8"})
    release.set()
    for _ in range(50):
        await agent.reconcile_once()
        if agent.status().engines_cached:
            break
    assert [(e.model, e.tp) for e in agent.status().engines_cached] == [("m", 1)]
