"""Issue 19, item 4: a host status that contradicts the policy's inventory (more GPUs, another
type) is alerted and the planner and the act core use the smaller, agreed inventory: a lying
`gpu_count: 24` on an 8-GPU host cannot get replicas placed on GPUs 8-23."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.protocol import parse_status
from fleetplan.controller.state import StateStore

REPO = Path(__file__).resolve().parents[3]


def status(host: str, **over: Any) -> bytes:
    doc = {"host": host, "online": True, "gpu": "h100", "gpu_count": 8, "nvlink_groups": [list(range(8))],
           "port_range": [18000, 18099], "templates": ["vllm"], "template_engines": {"vllm": "vllm"},
           "updated_s": time.time(), **over}
    return json.dumps(doc).encode()


def make(tmp_path: Path) -> Controller:
    policy = tmp_path / "policy.yaml"
    policy.write_text((REPO / "config" / "example-policy.yaml").read_text())  # gpu-01..04: 8 x h100
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
                                            host="gpu-09"))  # not in the policy: its report is all there is
        inv = {h.name: h for h in c.build_fleet().hosts}
        assert inv["gpu-01"].gpu_count == 8 and inv["gpu-01"].groups() == (tuple(range(8)),)
        assert inv["gpu-02"].gpu_count == 8 and inv["gpu-09"].gpu_count == 16
        alert = c.runtime_alerts["inventory/gpu-01"]
        assert "24" in alert and "planning on 8" in alert, alert
        assert "inventory/gpu-02" not in c.runtime_alerts and "inventory/gpu-09" not in c.runtime_alerts
        # the act core (starts moved to free GPUs, held GPUs) sees the same agreed host
        view = c.executor.view()
        assert view.hosts["gpu-01"].gpu_count == 8
        assert max(i for g in view.hosts["gpu-01"].nvlink_groups for i in g) == 7
        # the agent tells the truth again: the alert clears
        c._on_status("gpu-01", parse_status(status("gpu-01"), host="gpu-01"))
        c.build_fleet()
        assert "inventory/gpu-01" not in c.runtime_alerts
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
        assert "a100" in c.runtime_alerts["inventory/gpu-03"] and "none" in c.runtime_alerts["inventory/gpu-03"]
        assert inv["gpu-04"].gpu_count == 4 and "inventory/gpu-04" not in c.runtime_alerts
    finally:
        c.store.close()
