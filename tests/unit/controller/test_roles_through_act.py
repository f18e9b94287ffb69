"""A pool of a disaggregated model (a replica whose ConfigKey has a prefill or decode role) travels
the act path like any replica: the act core asks for the role's template and records the role, the
state store keeps it (an older database reads as aggregated), the desired state names it and the
agent's status echoes it, so the replica's config read back anywhere is the planned one."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

from fleetplan.controller.hosts import host_report
from fleetplan.controller.protocol import DesiredState, HostStatus
from fleetplan.controller.state import StateStore
from fleetplan.models.profile import Role
from fleetplan.planner import act
from fleetplan.planner.act import ActionStatus, ActView, DesiredRow, HostReport, NewReplica, Record
from fleetplan.planner.types import Action, ActionKind, ConfigKey, Replica, ReplicaState
from tests.unit.planner.planner_helpers import BF16, H100, VLLM

NOW = 10_000.0
AGG = ConfigKey("llama", VLLM, H100, 1, BF16)
DECODE = dataclasses.replace(AGG, role=Role.DECODE)


def _view(templates: tuple[str, ...]) -> ActView:
    h = HostReport("gpu-01", True, "h100", 8, (), (8000, 8009), templates, (), (), ())
    return ActView(NOW, {"gpu-01": h}, (), (), {"gpu-01": DesiredRow("gpu-01", 3, {}, NOW - 30, 3, True, ())},
                   frozenset(), connected_since_s=NOW - 3600)


def _start(config: ConfigKey) -> Action:
    return Action(ActionKind.START, Replica("new", config, "gpu-01", (1,), ReplicaState.STARTING), "plan says so")


def test_a_pool_replica_asks_for_its_roles_template_and_keeps_its_role() -> None:
    (eff,) = act.execute(_view(("vllm", "vllm-prefill", "vllm-decode")), [_start(DECODE)]).effects
    assert isinstance(eff, NewReplica)
    assert eff.row.template == "vllm-decode" and eff.row.role == "decode"
    assert eff.row.config == DECODE
    assert eff.row.desired_entry()["role"] == "decode"
    # an aggregated replica's entry is as before roles (older agents accept it)
    (agg,) = act.execute(_view(("vllm",)), [_start(AGG)]).effects
    assert isinstance(agg, NewReplica) and "role" not in agg.row.desired_entry() and agg.row.config == AGG


def test_a_host_whose_agent_offers_no_pool_template_gets_no_pool() -> None:
    (eff,) = act.execute(_view(("vllm",)), [_start(DECODE)]).effects
    assert isinstance(eff, Record) and eff.note.status == ActionStatus.DEFERRED
    assert "offers no launch template 'vllm-decode'" in eff.note.detail


def test_the_store_keeps_the_role_and_reads_an_older_database_as_aggregated(tmp_path: Path) -> None:
    (eff,) = act.execute(_view(("vllm", "vllm-decode")), [_start(DECODE)]).effects
    assert isinstance(eff, NewReplica)
    db = tmp_path / "state.db"
    s = StateStore(db)
    with s.tx() as c:
        s.persist(c, [eff], 1)
        payload = s.stage_desired(c, "gpu-01")
    (rep,) = s.active_replicas()
    assert rep.config == DECODE
    s.close()
    # the desired state an agent receives parses with the role
    desired = DesiredState.model_validate(json.loads(json.dumps(payload)))
    assert desired.replicas[0].role is Role.DECODE
    # a database from before roles: no role column; opened, its replicas are aggregated
    old = tmp_path / "old.db"
    s = StateStore(old)
    with s.tx() as c:
        s.persist(c, [dataclasses.replace(eff, row=dataclasses.replace(eff.row, role="aggregated"))], 1)
    s.close()
    con = sqlite3.connect(old)
    con.execute("ALTER TABLE replicas DROP COLUMN role")
    con.commit()
    con.close()
    s = StateStore(old)
    (rep,) = s.active_replicas()
    assert rep.config == AGG
    s.close()


def test_the_agents_status_echoes_the_role_and_leaves_it_out_when_aggregated() -> None:
    base = {"replica_id": "r00001", "template": "vllm-decode", "model": "llama", "engine": "vllm", "gpu": "h100",
            "tp": 1, "precision": "bf16", "gpu_indices": [1], "port": 8001, "state": "ready"}
    st = HostStatus.model_validate({"host": "gpu-01", "online": True, "replicas": [{**base, "role": "decode"}]})
    (rep,) = host_report(st).replicas
    assert rep.role == "decode"
    agg = HostStatus.model_validate({"host": "gpu-01", "online": True, "replicas": [base]})
    assert "role" not in agg.model_dump_json()
    assert host_report(agg).replicas[0].role == "aggregated"
