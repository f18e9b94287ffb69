"""A held host (not in the policy's hosts, or a changed report) gets no new replica, but the replicas
already running on it keep their GPUs: a policy that stops listing serving hosts must not drain them
(the fault suite's `unreachable_plan`: before, every replica of the lab was drained and 325 of 775
requests failed). planner/inventory.py `keep_in_use`, applied by controller/hosts.py."""

from __future__ import annotations

from pathlib import Path

from fleetplan.controller.protocol import parse_status
from fleetplan.planner.act_types import AlertKey, AlertKind
from fleetplan.planner.placement import place
from fleetplan.planner.types import ConfigKey, Replica, ReplicaState
from tests.unit.controller.test_failsafe_inventory import make, status
from tests.unit.planner.planner_helpers import BF16, H100, VLLM

CFG = ConfigKey("llama-3-8b", VLLM, H100, 4, BF16)


def running(rid: str, gpus: list[int]) -> dict[str, object]:
    return {"replica_id": rid, "model": "llama-3-8b", "engine": "vllm", "gpu": "h100", "tp": 4,
            "precision": "bf16", "gpu_indices": gpus, "port": 18001, "state": "ready"}


def test_a_held_host_keeps_the_gpus_of_its_running_replica_and_gets_no_new_one(tmp_path: Path) -> None:
    c = make(tmp_path)  # the policy lists gpu-01..04
    try:
        c._on_status("host-a", parse_status(status("host-a", replicas=[running("r1", [4, 5, 6, 7])]), host="host-a"))
        c._on_status("host-b", parse_status(status("host-b"), host="host-b"))
        inv = {h.name: h for h in c.build_fleet().hosts}
        assert "not in the policy's hosts" in c.runtime_alerts[AlertKey(AlertKind.INVENTORY, "host-a")]
        assert inv["host-a"].gpu_count == 0 and inv["host-a"].groups() == ((4, 5, 6, 7),)
        assert inv["host-b"].gpu_count == 0 and inv["host-b"].groups() == ((),)
        current = [Replica("r1", CFG, "host-a", (4, 5, 6, 7), ReplicaState.READY, 18001, 0.0)]
        kept = place({CFG: 2}, list(inv.values()), current)
        assert [r.replica_id for r in kept.kept] == ["r1"] and not kept.removed
        assert not kept.new and kept.unplaced == {CFG: 1}  # nothing new on a held host
    finally:
        c.store.close()
