"""Faults on the lab: controller kill -9 mid-rollout, broker restart, Prometheus down, bad policy."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections import Counter

import yaml

from fleetplan.harness.rig_tools import policy_doc, ready_replicas, wait_until


def engines_by_replica(rig) -> Counter[str]:  # type: ignore[no-untyped-def]
    return Counter(rid for _, rid in rig.engine_processes())


async def test_controller_kill9_mid_rollout_no_duplicate_no_orphan(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    # 3 replicas wanted, one START per cycle: the rollout spans several cycles
    ctrl = controller_factory(policy_doc(min_replicas=3, max_actions=1)).start()

    def starts() -> int:
        return sum(1 for a in ctrl.report()["actions"] if a["kind"] == "start")

    await wait_until(lambda: starts() >= 1, 30, "the first start published")
    ctrl.kill9()
    ctrl.start()
    await wait_until(lambda: starts() >= 2, 30, "the rollout resumed after restart")
    ctrl.kill9()  # a second kill, now mid-rollout for sure (2 of 3 started)
    ctrl.start()
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 3, 60, "3 replicas ready after two kill -9")
    await asyncio.sleep(4)  # a few more cycles: nothing else may start
    rep = ctrl.report()
    desired = {r["replica_id"] for r in rep["fleet"]}
    running = engines_by_replica(rig)
    assert len(desired) == 3, rep["fleet"]
    assert all(n == 1 for n in running.values()), f"duplicate engine: {running}"
    assert set(running) == desired, f"orphans: {set(running) - desired}, missing: {desired - set(running)}"
    gpus = [(r["host"], g) for r in rep["fleet"] for g in r["gpu_indices"]]
    assert len(gpus) == len(set(gpus)), "two replicas on one GPU"


async def test_broker_restart_agents_reconnect_engines_untouched(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    ctrl = controller_factory(policy_doc(min_replicas=2)).start()
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 2, 40, "2 replicas ready")
    before = dict((rid, pid) for pid, rid in rig.engine_processes())
    assert len(before) == 2
    rig.lab.mosquitto.restart()

    def reconnected() -> bool:
        rep = ctrl.report()
        hosts = rep["hosts"]
        fresh = all(h["online"] and h["last_status_age_s"] < 3 for h in hosts.values())
        acked = all(d["acked_version"] == d["version"] for d in rep["desired"].values())
        return bool(rep["mqtt_connected"] and len(hosts) == 2 and fresh and acked)

    await wait_until(reconnected, 40, "controller and agents reconnected, desired states acked")
    after = dict((rid, pid) for pid, rid in rig.engine_processes())
    assert after == before, "engines were restarted or replaced by a broker restart"
    assert len(ready_replicas(ctrl.report())) == 2


async def test_prometheus_stopped_fail_static_with_alert(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    ctrl = controller_factory(policy_doc(min_replicas=2, scale_down_delay_s=0)).start()
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 2, 40, "2 replicas ready")
    rig.lab.prometheus.stop()
    await wait_until(lambda: any("fail static" in a for a in ctrl.report()["alerts"]), 20,
                     "a fail-static alert in the report")
    # the operator now allows 1 replica, no delay: with no observation the controller must not scale down
    ctrl.write_policy(policy_doc(min_replicas=1, scale_down_delay_s=0))
    ctrl.signal(signal.SIGHUP)
    cycle0 = ctrl.report()["cycle_id"]
    await wait_until(lambda: (ctrl.report()["cycle_id"] or 0) >= cycle0 + 4, 30, "4 more cycles")
    rep = ctrl.report()
    assert rep["policy"]["error"] is None
    assert len(ready_replicas(rep)) == 2
    assert not [a for a in rep["actions"] if a["kind"] in ("drain", "stop")]
    notes = [n for m in rep["plan"]["explanation"]["models"] for n in m["notes"]]
    assert any("fail static" in n for n in notes), notes
    assert any("unreachable" in a for a in rep["alerts"]), rep["alerts"]
    # Prometheus back: the observation is fresh again and the surplus replica goes
    rig.lab.prometheus.start()
    await wait_until(lambda: len(ctrl.report()["fleet"]) == 1, 60, "scale-down once observed again")


async def test_invalid_policy_on_sighup_is_rejected_old_kept(rig, controller_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # also plays systemd: READY=1, WATCHDOG=1 while cycles run, STOPPING=1 on SIGTERM
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.5)
    msgs: list[str] = []
    done = threading.Event()

    def read_notify() -> None:  # like systemd: always read
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                msgs.append(notify.recv(200).decode())

    reader = threading.Thread(target=read_notify, daemon=True)
    reader.start()
    ctrl = controller_factory(policy_doc(min_replicas=2)).start(
        env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "2000000"})
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 2, 40, "2 replicas ready")
    bad = policy_doc(min_replicas=1)
    bad["models"][0]["slo"]["ttft_p99_ms"] = -5
    bad["scaling"]["bogus_key"] = 1
    ctrl.write_policy(yaml.safe_dump(bad))
    ctrl.signal(signal.SIGHUP)
    rep = await wait_until(lambda: (r := ctrl.report())["policy"]["error"] and r, 10, "the reload rejected")
    err = rep["policy"]["error"]
    assert "ttft_p99_ms" in err and "-5" in err and str(ctrl.policy_path) in err, err
    assert any("policy reload rejected" in a for a in rep["alerts"]), rep["alerts"]
    cycle0 = rep["cycle_id"] or 0
    await wait_until(lambda: (ctrl.report()["cycle_id"] or 0) >= cycle0 + 3, 30, "the loop keeps running")
    rep = ctrl.report()
    assert len(ready_replicas(rep)) == 2  # old policy (min 2) still in force
    assert not [a for a in rep["actions"] if a["kind"] in ("drain", "stop")]
    # a good file clears the error
    ctrl.write_policy(policy_doc(min_replicas=2))
    ctrl.signal(signal.SIGHUP)
    await wait_until(lambda: ctrl.report()["policy"]["error"] is None, 10, "the error cleared")
    assert ctrl.stop() == 0  # SIGTERM: clean exit
    await asyncio.sleep(0.6)
    done.set()
    reader.join(5)
    notify.close()
    assert msgs and msgs[0].startswith("READY=1"), msgs[:3]
    assert "WATCHDOG=1" in msgs and msgs[-1] == "STOPPING=1", msgs[-3:]


async def test_lost_database_adopts_running_engines(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    """A controller started on an empty database adopts the engines the agents run (none stopped, none
    duplicated) and scales them like its own."""
    ctrl = controller_factory(policy_doc(min_replicas=2)).start()
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 2, 40, "2 replicas ready")
    before = {rid: pid for pid, rid in rig.engine_processes()}
    ctrl.kill9()
    for f in ctrl.work.glob("state.db*"):
        f.unlink()
    old_port = ctrl.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        # Another process holds the report port while the controller is down (a client's ephemeral port
        # landed on it in a CI run): the restart moves the report API instead of failing.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", old_port))
        squatter.listen()
        ctrl.start()
    assert ctrl.port != old_port and ctrl.url.endswith(f":{ctrl.port}")
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 2, 30, "the 2 running engines adopted")
    await asyncio.sleep(3)  # more cycles: nothing may start or stop
    rep = ctrl.report()
    assert {r["replica_id"] for r in rep["fleet"]} == set(before)
    assert all(r["origin"] == "adopted" for r in rep["fleet"])
    acted = [a for a in rep["actions"] if a["kind"] in ("start", "drain", "stop") and a["status"] != "deferred"]
    assert not acted, acted
    assert {rid: pid for pid, rid in rig.engine_processes()} == before
    await wait_until(lambda: all(d["acked_version"] == d["version"] and d["ack_accepted"]
                                 for d in ctrl.report()["desired"].values()), 10, "desired states acked")


def test_report_explain_metrics_cli_on_a_running_controller(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    """`fleetplan report`, `fleetplan explain MODEL` and /metrics against a live controller."""
    import subprocess
    import sys

    import httpx

    from fleetplan.harness.rig_tools import MODEL, REPO

    ctrl = controller_factory(policy_doc(min_replicas=1)).start()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and len(ready_replicas(ctrl.report())) < 1:
        time.sleep(0.5)
    assert len(ready_replicas(ctrl.report())) == 1

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fleetplan", *args], capture_output=True, text=True,
                              cwd=str(REPO), timeout=60)

    out = cli("report", "--url", ctrl.url)
    assert out.returncode == 0, out.stderr
    assert "plan: 1 replicas, 4 GPUs" in out.stdout and MODEL in out.stdout and "agent=ready" in out.stdout
    out = cli("explain", MODEL, "--url", ctrl.url)
    assert out.returncode == 0, out.stderr
    assert f"{MODEL}: 1 replicas" in out.stdout and "capacity now" in out.stdout and "SLO TTFT p99" in out.stdout
    assert "why not the others" in out.stdout and "reason" in out.stdout  # the stored counterfactuals
    # the unedited policy against the live controller's state: no change (exit 0)
    out = cli("policy", "check", str(ctrl.policy_path), "--controller", ctrl.url)
    assert out.returncode == 0 and "RESULT: no change (exit 0)" in out.stdout, out.stdout + out.stderr
    out = cli("explain", "no-such-model", "--url", ctrl.url)
    assert out.returncode == 1 and "not in the current plan" in out.stderr
    deadline = time.monotonic() + 30  # Prometheus file_sd discovery takes a few seconds
    while time.monotonic() < deadline:
        obs = ((ctrl.report().get("plan") or {}).get("observation") or {}).get(MODEL) or {}
        if not obs.get("stale", True):
            break
        time.sleep(0.5)
    out = cli("observe", "--prometheus", rig.lab.prometheus_url, "--window", "10")
    assert out.returncode == 0 and MODEL in out.stdout, out.stdout + out.stderr
    metrics = httpx.get(ctrl.url + "/metrics", timeout=5).text
    assert f'fleetplan_planned_replicas{{model="{MODEL}"}} 1.0' in metrics
    assert f'fleetplan_running_replicas{{model="{MODEL}"}} 1.0' in metrics
    assert "fleetplan_solve_seconds_count" in metrics and 'fleetplan_actions_total{kind="start"' in metrics
    # what config/prometheus/fleetplan-alerts.yml and the Grafana dashboard read
    assert "fleetplan_mqtt_connected 1.0" in metrics
    for name in ("fleetplan_capacity_rps", "fleetplan_slo_ttft_p99_seconds", "fleetplan_slo_itl_p99_seconds"):
        assert f'{name}{{model="{MODEL}"}}' in metrics, name
