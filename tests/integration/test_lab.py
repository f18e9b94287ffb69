"""The lab's lifecycle: everything starts on loopback, `lab.json` describes it, stop leaves no process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fleetplan.controller.settings import ControllerSettings
from fleetplan.harness.lab import LAB_JSON, Lab, settings_from_lab
from fleetplan.harness.procs import LabError, group_pids
from fleetplan.harness.servers import PrometheusServer


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_lab_starts_everything_and_stops_with_no_orphans() -> None:
    lab = Lab(hosts=3, gpus_per_host=4, gpu="H100 SXM5")
    with lab:
        groups = lab.process_groups()
        assert set(groups) == {"mosquitto", "prometheus", "nginx", "pool-proxy"}
        pids = {name: group_pids(pgid) for name, pgid in groups.items()}
        assert len(pids["nginx"]) >= 2  # master + worker, one group
        assert all(pids.values())
        assert _tcp_open(lab.mqtt_port)
        assert httpx.get(f"{lab.prometheus_url}/-/ready").status_code == 200
        assert httpx.get(f"{lab.nginx_url}/-/healthy").status_code == 200
        assert [h.name for h in lab.hosts] == ["host-a", "host-b", "host-c"]
        assert {h.gpu.value for h in lab.hosts} == {"h100"} and {h.gpu_count for h in lab.hosts} == {4}
        ports = [p for h in lab.hosts for p in h.ports]
        assert len(ports) == len(set(ports)), "hosts' port ranges are disjoint"
        assert not {lab.mqtt_port, lab.prometheus.port, lab.nginx.port} & set(ports)  # type: ignore[union-attr]
        doc = json.loads((lab.dir / LAB_JSON).read_text())
        assert doc["mqtt"]["port"] == lab.mqtt_port and doc["mqtt"]["controller_user"] == "controller"
        assert doc["nginx"]["upstreams_path"] == str(lab.nginx_upstreams_path)
        assert doc["prometheus"]["file_sd_dir"] == str(lab.prometheus_file_sd_dir)
        # the pool proxy: an empty table the controller will write, its address for nginx
        assert doc["pool_proxy"]["upstreams_path"] == str(lab.pool_upstreams_path)
        assert json.loads(lab.pool_upstreams_path.read_text()) == {"models": {}}
        health = httpx.get(f"http://{lab.pool_proxy_address}/health").json()
        assert health["models"] == {} and health["generation"]
        assert lab.prometheus is not None
        deadline = time.monotonic() + 15  # Prometheus scrapes the proxy's own metrics
        while not any(t["labels"].get("service") == "pool-proxy" and t["health"] == "up"
                      for t in lab.prometheus.active_targets()):
            assert time.monotonic() < deadline, lab.prometheus.active_targets()
            time.sleep(0.2)
        assert [h["mqtt_user"] for h in doc["hosts"]] == ["agent-host-a", "agent-host-b", "agent-host-c"]
        assert oct((lab.dir / LAB_JSON).stat().st_mode & 0o777) == "0o600"  # holds passwords
        lab_dir = lab.dir
    assert {name: group_pids(pgid) for name, pgid in groups.items()} == {n: [] for n in groups}
    assert not any(p for plist in pids.values() for p in plist if os.path.exists(f"/proc/{p}/stat"))
    assert not lab_dir.exists()  # a temp dir the lab made is removed


def test_cli_lab_up_runs_in_background_until_down(tmp_path: Path) -> None:
    lab_dir = tmp_path / "lab"
    cli = [sys.executable, "-m", "fleetplan", "lab"]
    up = subprocess.run(
        [*cli, "up", "--dir", str(lab_dir), "--hosts", "2", "--gpus-per-host", "8", "--gpu", "h100"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    try:
        doc = json.loads((lab_dir / LAB_JSON).read_text())
        groups = {name: p["pgid"] for name, p in doc["processes"].items()}
        assert set(groups) == {"mosquitto", "prometheus", "nginx", "pool-proxy"}
        # The `up` process has exited; the servers keep running.
        assert all(group_pids(g) for g in groups.values())
        assert _tcp_open(doc["mqtt"]["port"])
        assert httpx.get(f"{doc['prometheus']['url']}/-/ready").status_code == 200
        assert httpx.get(f"{doc['nginx']['url']}/v1/models").json() == {"object": "list", "data": []}
        # An attached Lab reloads nginx like an in-process one.
        attached = Lab.attach(lab_dir)
        attached.router().apply({"m": ["127.0.0.1:9"]})
        assert httpx.post(f"{doc['nginx']['url']}/m/m/v1/completions").status_code == 502
        # a controller on this lab writes the proxy's file and routes pooled models to it
        settings, _reload = settings_from_lab(ControllerSettings(lab_dir=lab_dir))
        assert settings.routing.pool_proxy is not None
        assert settings.routing.pool_proxy.address == doc["pool_proxy"]["address"] == attached.pool_proxy_address
        assert str(settings.routing.pool_proxy.upstreams_path) == doc["pool_proxy"]["upstreams_path"]
        again = subprocess.run(
            [*cli, "up", "--dir", str(lab_dir)], capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = subprocess.run(
            [*cli, "down", "--dir", str(lab_dir)], capture_output=True, text=True, timeout=60
        )
    assert down.returncode == 0, down.stderr
    assert {name: group_pids(g) for name, g in groups.items()} == {n: [] for n in groups}
    assert lab_dir.exists()  # a dir the user named is kept (logs)


def test_startup_failure_names_the_server_and_shows_its_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = PrometheusServer(tmp_path / "prom", port=port)
        with pytest.raises(LabError) as err:
            server.start()
    message = str(err.value)
    assert "prometheus exited" in message and "address already in use" in message
    assert not server.running


async def _mqtt_login_ok(port: int, user: str, password: str) -> bool:
    import aiomqtt

    try:
        async with aiomqtt.Client("127.0.0.1", port, username=user, password=password, timeout=5):
            return True
    except aiomqtt.MqttError:
        return False


async def test_cli_lab_up_on_a_stopped_labs_dir_starts_a_new_lab(tmp_path: Path) -> None:
    """`lab up` in the directory of a stopped lab: new ports and passwords in every config (the old
    files had the old ones), the user's own files in the directory untouched."""
    import asyncio

    lab_dir = tmp_path / "lab"
    cli = [sys.executable, "-m", "fleetplan", "lab"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args, "--dir", str(lab_dir)], capture_output=True, text=True, timeout=120)

    up = await asyncio.to_thread(run, "up", "--hosts", "1")
    assert up.returncode == 0, up.stderr
    first = json.loads((lab_dir / LAB_JSON).read_text())
    down = await asyncio.to_thread(run, "down")
    assert down.returncode == 0, down.stderr
    user_files = {lab_dir / "notes.txt": "mine", lab_dir / "mosquitto" / "extra.conf": "# mine too",
                  lab_dir / "nginx" / "README": "keep"}
    for path, text in user_files.items():
        path.write_text(text)
    # the previous lab's routes (engines long gone) must not survive into the new lab
    with (lab_dir / "nginx" / "upstreams.conf").open("a") as f:
        f.write("# a stale route\n")

    again = await asyncio.to_thread(run, "up", "--hosts", "1")
    try:
        assert again.returncode == 0, again.stderr
        doc = json.loads((lab_dir / LAB_JSON).read_text())
        mqtt = doc["mqtt"]
        assert mqtt["controller_password"] != first["mqtt"]["controller_password"]
        assert doc["hosts"][0]["mqtt_password"] != first["hosts"][0]["mqtt_password"]
        assert f"listener {mqtt['port']} 127.0.0.1" in (lab_dir / "mosquitto" / "mosquitto.conf").read_text()
        assert await _mqtt_login_ok(mqtt["port"], "controller", mqtt["controller_password"])
        assert await _mqtt_login_ok(mqtt["port"], doc["hosts"][0]["mqtt_user"], doc["hosts"][0]["mqtt_password"])
        assert not await _mqtt_login_ok(mqtt["port"], "controller", first["mqtt"]["controller_password"])
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"{doc['prometheus']['url']}/-/ready")).status_code == 200
            assert (await http.get(f"{doc['nginx']['url']}/v1/models")).json() == {"object": "list", "data": []}
        assert "stale route" not in (lab_dir / "nginx" / "upstreams.conf").read_text()
        assert {path: path.read_text() for path in user_files} == user_files
        assert not list((lab_dir / "mosquitto").glob(".passwd.*"))  # no temp file left behind
        assert oct((lab_dir / "mosquitto" / "passwd").stat().st_mode & 0o777) == "0o600"
    finally:
        down = await asyncio.to_thread(run, "down")
    assert down.returncode == 0, down.stderr
    assert {name: group_pids(p["pgid"]) for name, p in doc["processes"].items()} == {
        name: [] for name in doc["processes"]}
