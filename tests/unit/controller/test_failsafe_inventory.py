"""A host status that contradicts the policy's inventory (more GPUs, another type) is alerted and the
planner and the act core use the smaller, agreed inventory: a lying `gpu_count: 24` on an 8-GPU host
cannot get replicas placed on GPUs 8-23. A host the policy does not list is held and alerted until
`fleetplan hosts confirm`; a host's first report is recorded in the state store and a later change
is held until confirmed (planner/inventory.py decides, controller/hosts.py applies it)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fleetplan.controller import reporting
from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.protocol import parse_status
from fleetplan.controller.state import StateStore
from fleetplan.harness.cli import main
from fleetplan.planner.act_types import AlertKey, AlertKind

REPO = Path(__file__).resolve().parents[3]


def status(host: str, **over: Any) -> bytes:
    doc = {"host": host, "online": True, "gpu": "h100", "gpu_count": 8, "nvlink_groups": [list(range(8))],
           "port_range": [18000, 18099], "templates": ["vllm"], "template_engines": {"vllm": "vllm"},
           "updated_s": time.time(), **over}
    return json.dumps(doc).encode()


def make(tmp_path: Path, policy_text: str | None = None) -> Controller:
    policy = tmp_path / "policy.yaml"
    # gpu-01..04: 8 x h100
    policy.write_text(policy_text or (REPO / "config" / "example-policy.yaml").read_text())
    c = Controller(settings=ControllerSettings(), policy_path=policy, profiles_path=None,
                   store=StateStore(tmp_path / "s.db"))
    c.load_policy(initial=True)
    return c


def test_a_status_claiming_more_gpus_is_cut_to_the_policy_inventory_and_alerted(tmp_path: Path) -> None:
    c = make(tmp_path)
    try:
        c._on_status("gpu-01", parse_status(status("gpu-01", gpu_count=24, nvlink_groups=[list(range(24))]),
                                            host="gpu-01"))
        c._on_status("gpu-02", parse_status(status("gpu-02"), host="gpu-02"))
        c._on_status("gpu-09", parse_status(status("gpu-09", gpu_count=16, nvlink_groups=[list(range(16))]),
                                            host="gpu-09"))  # not in the policy: held until confirmed
        inv = {h.name: h for h in c.build_fleet().hosts}
        assert inv["gpu-01"].gpu_count == 8 and inv["gpu-01"].groups() == (tuple(range(8)),)
        assert inv["gpu-02"].gpu_count == 8 and inv["gpu-09"].gpu_count == 0
        alert = c.runtime_alerts[AlertKey(AlertKind.INVENTORY, "gpu-01")]
        assert "24" in alert and "planning on 8" in alert, alert
        assert AlertKey(AlertKind.INVENTORY, "gpu-02") not in c.runtime_alerts
        assert "not in the policy's hosts" in c.runtime_alerts[AlertKey(AlertKind.INVENTORY, "gpu-09")]
        reporting.update_inventory_metrics(c)  # the metric names the held hosts (a kind, not a prefix)
        assert {labels[0] for labels in c.metrics.inventory_mismatch._metrics} == {"gpu-01", "gpu-09"}
        # the act core (starts moved to free GPUs, held GPUs) sees the same agreed host
        view = c.executor.view()
        assert view.hosts["gpu-01"].gpu_count == 8
        assert max(i for g in view.hosts["gpu-01"].nvlink_groups for i in g) == 7
        # the agent tells the truth again: the alert clears
        c._on_status("gpu-01", parse_status(status("gpu-01"), host="gpu-01"))
        c.build_fleet()
        assert AlertKey(AlertKind.INVENTORY, "gpu-01") not in c.runtime_alerts
        reporting.update_inventory_metrics(c)
        assert {labels[0] for labels in c.metrics.inventory_mismatch._metrics} == {"gpu-09"}
    finally:
        c.store.close()


def test_another_gpu_type_plans_on_none_of_the_hosts_gpus(tmp_path: Path) -> None:
    c = make(tmp_path)
    try:
        c._on_status("gpu-03", parse_status(status("gpu-03", gpu="a100"), host="gpu-03"))
        c._on_status("gpu-04", parse_status(status("gpu-04", gpu_count=4, nvlink_groups=[[0, 1, 2, 3]]),
                                            host="gpu-04"))  # one GPU board failed: fewer is believed
        inv = {h.name: h for h in c.build_fleet().hosts}
        assert inv["gpu-03"].gpu_count == 0
        held = c.runtime_alerts[AlertKey(AlertKind.INVENTORY, "gpu-03")]
        assert "a100" in held and "none" in held
        assert inv["gpu-04"].gpu_count == 4 and AlertKey(AlertKind.INVENTORY, "gpu-04") not in c.runtime_alerts
    finally:
        c.store.close()


def cycle_records(c: Controller) -> None:
    """What each cycle does with the hosts' statuses and records (failsafe.save_statuses, reconcile)."""
    c.store.save_host_statuses(c.hosts.take_dirty())
    c.hosts.sync_inventory(c.store)


def test_an_unlisted_host_is_planned_on_once_confirmed_by_the_cli(tmp_path: Path, capsys: Any) -> None:
    c = make(tmp_path)
    try:
        c._on_status("gpu-09", parse_status(status("gpu-09", gpu_count=24, nvlink_groups=[list(range(24))]),
                                            host="gpu-09"))
        assert {h.name: h.gpu_count for h in c.build_fleet().hosts}["gpu-09"] == 0
        cycle_records(c)
        assert any("gpu-09" in a and "not in the policy" in a for a in c.report()["alerts"])  # on-call sees it
        assert main(["hosts", "confirm", "gpu-09", "--state-db", str(tmp_path / "s.db")]) == 0
        assert "24 h100 GPU(s)" in capsys.readouterr().out
        cycle_records(c)  # the next cycle reads the confirmation
        assert {h.name: h.gpu_count for h in c.build_fleet().hosts}["gpu-09"] == 24
        assert AlertKey(AlertKind.INVENTORY, "gpu-09") not in c.runtime_alerts
        assert main(["hosts", "confirm", "gpu-77", "--state-db", str(tmp_path / "s.db")]) == 1  # never reported
        assert "gpu-77" in capsys.readouterr().err
    finally:
        c.store.close()


def test_a_first_report_is_recorded_and_a_change_held_until_confirmed_across_a_restart(
        tmp_path: Path, capsys: Any) -> None:
    c = make(tmp_path)
    try:
        c._on_status("gpu-02", parse_status(status("gpu-02"), host="gpu-02"))
        c.build_fleet()
        cycle_records(c)
    finally:
        c.store.close()
    c = make(tmp_path)  # a restarted controller reads the records before any report
    try:
        c._on_status("gpu-02", parse_status(status("gpu-02", gpu_count=4, nvlink_groups=[[0, 1, 2, 3]]),
                                            host="gpu-02"))  # within the policy's 8, but a change
        inv = {h.name: h for h in c.build_fleet().hosts}
        assert inv["gpu-02"].gpu_count == 4
        alert = c.runtime_alerts[AlertKey(AlertKind.INVENTORY, "gpu-02")]
        assert "recorded 8" in alert and "changed" in alert and "fleetplan hosts confirm gpu-02" in alert
        cycle_records(c)
        assert main(["hosts", "list", "--state-db", str(tmp_path / "s.db")]) == 0
        assert "differs" in capsys.readouterr().out
        assert main(["hosts", "confirm", "gpu-02", "--state-db", str(tmp_path / "s.db")]) == 0
        cycle_records(c)
        c.build_fleet()
        assert AlertKey(AlertKind.INVENTORY, "gpu-02") not in c.runtime_alerts
        # back to 8 (the GPU replaced): the policy lists 8, which confirms it
        c._on_status("gpu-02", parse_status(status("gpu-02"), host="gpu-02"))
        assert {h.name: h.gpu_count for h in c.build_fleet().hosts}["gpu-02"] == 8
        assert AlertKey(AlertKind.INVENTORY, "gpu-02") not in c.runtime_alerts
    finally:
        c.store.close()


def test_a_policy_listing_no_hosts_believes_first_reports_and_holds_changes(tmp_path: Path) -> None:
    text = (REPO / "config" / "example-policy.yaml").read_text()
    head, _, rest = text.partition("hosts:")
    models = rest[rest.index("\nmodels:"):]
    c = make(tmp_path, head + "hosts: []" + models)
    try:
        c._on_status("h1", parse_status(status("h1", gpu_count=16, nvlink_groups=[list(range(16))]), host="h1"))
        assert {h.name: h.gpu_count for h in c.build_fleet().hosts}["h1"] == 16
        assert not [k for k in c.runtime_alerts if k.kind is AlertKind.INVENTORY]
        c._on_status("h1", parse_status(status("h1", gpu_count=24, nvlink_groups=[list(range(24))]), host="h1"))
        assert {h.name: h.gpu_count for h in c.build_fleet().hosts}["h1"] == 16
        assert "recorded 16" in c.runtime_alerts[AlertKey(AlertKind.INVENTORY, "h1")]
    finally:
        c.store.close()
