"""Issue 19, item 2: the router is watched. A real nginx (the lab's front) is kill -9'ed: the
controller alerts (runtime alert, /healthz degraded, fleetplan_router_up 0), a replica that turns
ready meanwhile cannot be routed (the reload fails: alerted); nginx is restarted by someone else
(a new process, not the one the controller's reloader started) and the controller re-applies the
routing through nginx's pid file: the new replica is served."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleetplan.controller import failsafe
from fleetplan.controller.daemon import Controller, ControllerSettings, RoutingSettings
from fleetplan.controller.protocol import parse_status
from fleetplan.controller.routing import NginxRouter, probe_router, read_generation
from fleetplan.controller.state import Phase, ReplicaRow, StateStore
from fleetplan.harness.procs import group_pids
from fleetplan.harness.servers import NginxServer
from fleetplan.planner.act_types import AlertKey, AlertKind

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama-3-8b"


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[NginxServer]:
    n = NginxServer(tmp_path / "nginx")
    n.workdir.mkdir(parents=True)
    n.write_config(reset_routes=True)
    n.start()
    try:
        yield n
    finally:
        n.stop()


def ready_status(rid: str, port: int) -> bytes:
    import json

    return json.dumps({
        "host": "gpu-01", "online": True, "gpu": "h100", "gpu_count": 8, "nvlink_groups": [list(range(8))],
        "port_range": [18000, 18099], "templates": ["vllm"], "template_engines": {"vllm": "vllm"},
        "updated_s": time.time(),
        "replicas": [{"replica_id": rid, "template": "vllm", "model": MODEL, "engine": "vllm", "gpu": "h100",
                      "tp": 1, "precision": "bf16", "gpu_indices": [0], "port": port, "state": "ready"}],
    }).encode()


def kill_group(n: NginxServer) -> None:
    master = n.master_pid()
    assert master is not None
    os.killpg(master, signal.SIGKILL)  # master and worker: nothing answers
    deadline = time.monotonic() + 10
    while group_pids(master) and time.monotonic() < deadline:
        time.sleep(0.05)


async def test_router_down_is_alerted_and_routing_is_reapplied_when_it_returns(
        nginx: NginxServer, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text((REPO / "config" / "example-policy.yaml").read_text())
    settings = ControllerSettings(default_host_address="127.0.0.1", routing=RoutingSettings(
        nginx_upstreams_path=nginx.upstreams_path, router_url=nginx.url))
    ctrl = Controller(settings=settings, policy_path=policy, profiles_path=None, store=StateStore(tmp_path / "s.db"))
    ctrl.load_policy(initial=True)
    ctrl.executor.router = NginxRouter(nginx.upstreams_path, nginx.reload)  # the reloader of the nginx started first
    ctrl.link.connected.set()
    ctrl.executor.connected_wall = time.time() - 1
    try:
        await failsafe.watch_router(ctrl)
        assert AlertKey(AlertKind.ROUTER) not in ctrl.runtime_alerts and ctrl.metrics.router_up._value.get() == 1.0

        kill_group(nginx)
        await failsafe.watch_router(ctrl)
        alert = ctrl.runtime_alerts[AlertKey(AlertKind.ROUTER)]
        assert nginx.url in alert and "down" in alert, alert
        assert ctrl.metrics.router_up._value.get() == 0.0
        assert any(nginx.url in d for d in failsafe.degraded(ctrl))

        # a replica turns ready while nginx is down: routing it fails, and says so
        now = time.time()
        with ctrl.store.tx() as c:
            ctrl.store.insert_replica(c, ReplicaRow("r00001", "gpu-01", MODEL, "vllm", "h100", 1, "bf16", (0,), 18001,
                                                    "vllm", Phase.DESIRED, "planned", now, now, None, None))
        ctrl.hosts.on_status("gpu-01", parse_status(ready_status("r00001", 18001), host="gpu-01"))
        await ctrl.executor.update_routing()
        assert "nginx is not running" in ctrl.runtime_alerts.get(AlertKey(AlertKind.ROUTING), ""), ctrl.runtime_alerts
        assert "r00001" not in ctrl.executor.routed
        assert ctrl.metrics.router_reload_failures._value.get() >= 1

        # someone else (systemd, an operator) starts nginx again: another process, same pid file
        again = NginxServer(nginx.workdir, nginx.port)
        again.start()
        try:
            await failsafe.watch_router(ctrl)
            assert AlertKey(AlertKind.ROUTER) not in ctrl.runtime_alerts and AlertKey(AlertKind.ROUTING) not in ctrl.runtime_alerts, ctrl.runtime_alerts
            assert ctrl.metrics.router_up._value.get() == 1.0
            assert "r00001" in ctrl.executor.routed
            served = probe_router(nginx.url)
            assert served == read_generation(nginx.upstreams_path.read_text())
            assert "127.0.0.1:18001" in nginx.upstreams_path.read_text()
            async with httpx.AsyncClient(timeout=5) as http:
                r = await http.get(nginx.url + "/v1/models")
            assert any(m["id"] == MODEL and m["replicas"] == 1 for m in r.json()["data"]), r.text
        finally:
            again.stop()
    finally:
        await ctrl.prom.aclose()
        ctrl.store.close()
