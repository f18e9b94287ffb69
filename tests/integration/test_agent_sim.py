"""The agent with the lab's launch templates (fleetplan.controller.agent_config.sim_agent_config): real simulated
engines (`fleetplan sim-engine`) started from MQTT desired state, serving the OpenAI API."""

from __future__ import annotations

import asyncio
import json
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

from fleetplan.controller.agent_config import sim_agent_config
from fleetplan.controller.protocol import (
    HostStatus,
    ack_topic,
    desired_topic,
    parse_ack,
    parse_status,
    status_topic,
)
from fleetplan.harness.demo import stop_launched
from fleetplan.harness.lab import allocate_port_ranges
from fleetplan.harness.servers import MosquittoServer

REPO = Path(__file__).resolve().parents[2]
HOST = "sim-host"


@pytest.fixture
def setup() -> Iterator[tuple[MosquittoServer, Path, tuple[int, int]]]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-agent-sim-") as d:
        root = Path(d)
        broker = MosquittoServer(root / "mosquitto", host_names=(HOST,))
        broker.start()
        ports = allocate_port_ranges(1, 4)[0]
        config = sim_agent_config(
            host=HOST, gpu="h100", gpu_count=8, mqtt_host=broker.host, mqtt_port=broker.port,
            mqtt_user=broker.agents[HOST].user, mqtt_password=broker.agents[HOST].password, port_range=ports,
            state_dir=root / "state", time_scale=20.0, startup_s=10.0, build_wall_s=0.5, status_interval_s=2,
        )
        (root / "agent.yaml").write_text(yaml.safe_dump(config))
        with (root / "agent.log").open("ab") as log:
            agent = subprocess.Popen([sys.executable, "-m", "fleetplan", "-v", "agent", "--config",
                                      str(root / "agent.yaml")], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield broker, root, ports
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
            stop_launched([root / "state"])  # the agent leaves its engines running, by design
            broker.stop()


async def test_sim_engines_from_desired_state(setup: tuple[MosquittoServer, Path, tuple[int, int]]) -> None:
    broker, root, (port, _) = setup
    statuses: list[HostStatus] = []
    async with aiomqtt.Client(broker.host, broker.port, username=broker.controller_user,
                              password=broker.controller_password,
                              protocol=aiomqtt.ProtocolVersion.V5) as client:
        await client.subscribe(status_topic(HOST), qos=1)
        await client.subscribe(ack_topic(HOST), qos=1)
        desired = {"version": 1, "replicas": [{
            "replica_id": "llama-a", "template": "vllm", "model": "llama-3.1-8b", "engine": "vllm",
            "gpu": "h100", "tp": 2, "precision": "bf16", "gpu_indices": [4, 5], "port": port}]}
        await client.publish(desired_topic(HOST), json.dumps(desired), qos=1, retain=True)

        async def until_ready() -> HostStatus:
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.matches(ack_topic(HOST)):
                    ack = parse_ack(message.payload)
                    assert ack.accepted, ack.errors
                    continue
                status = parse_status(message.payload)
                statuses.append(status)
                if [r.state.value for r in status.replicas] == ["ready"]:
                    return status
            raise AssertionError("no more messages")

        try:
            ready = await asyncio.wait_for(until_ready(), timeout=40)
        except TimeoutError:
            log = (root / "agent.log").read_text()[-3000:]
            raise AssertionError(f"not ready; last status {statuses[-1:]}; agent log:\n{log}") from None
    assert any(s.replicas and s.replicas[0].state.value == "starting" for s in statuses)
    async with httpx.AsyncClient(timeout=10) as http:
        models = (await http.get(f"http://127.0.0.1:{port}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["llama-3.1-8b"]
        metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        assert "vllm:" in metrics
    assert ready.replicas[0].pid is not None
