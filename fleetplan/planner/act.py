"""The act core: what the controller does about the plan and about what the agents report. Pure.

The planner decides WHAT the fleet should be; this core decides, each cycle, what the controller
writes and publishes to get there safely, from three inputs: the plan's actions, the hosts' last
reports, and the controller's own records (the state store's rows). It returns effects; the daemon
(controller/daemon.py) executes them (SQLite, MQTT, nginx) and the tests check them without
servers. No I/O, no clock (`now_s` is an input), no threads.

Two calls per cycle, in this order:

- `reconcile(view)` before planning: replicas the agents report READY are marked ready; engine
  builds done or failed leave the desired state (failed: an alert); replicas that never became
  ready within `ready_timeout_s` are removed (an alert); desired states never published, or not
  acked within `ack_timeout_s`, are published again; engines the agents run that this database
  never allocated are adopted only when a desired state this controller published names them
  (`adopt`); a host offline longer than `host_offline_grace_s` is lost: its replicas are not
  counted by the planner (planner side), and nothing here removes them (no scale-down caused by a
  fault).
- `execute(view, actions)` after planning: START -> a new replica row (id allocated by the store,
  port chosen here, committed before the desired state naming it is published), never on GPUs
  still in use (other free GPUs of the type in one NVLink group, else deferred; the planner sees
  such GPUs as held from the next cycle on: `held_gpus`);
  BUILD -> a build row on the GPUs the plan reserved; DRAIN/STOP -> a replica that never served
  is removed at once, a serving one drains, unless another replica of the model is still starting
  (make-before-break). MQTT down, or statuses still missing after a (re)connect: every action is
  deferred with the reason.

Worked example (tests/unit/planner/test_act.py): the plan says START llama on gpu-01 GPUs (0,) and
DRAIN r00007 of the same model; gpu-01 reports GPU 0 free and ports 8000-8001 taken ->
`NewReplica(host='gpu-01', gpu_indices=(0,), port=8002, ...)`, publish gpu-01, and the drain of
r00007 is DEFERRED ("start before stop") until the new replica is READY.

This module is the act core's one import name (`from fleetplan.planner import act`, then `act.X`);
the code lives in `act_types.py` (records, inputs, effects), `act_reconcile.py` (reconcile, adopt,
rejected), `act_execute.py` (execute, make-before-break, plan_deferred, held_gpus) and `act_drain.py`
(routes and the pools' proxy table, drain_step, drain holders, drain deadlines).
"""

from __future__ import annotations

from fleetplan.planner.act_drain import (
    DrainProgress,
    DrainStep,
    Pools,
    Routes,
    drain_deadline_s,
    drain_holders,
    drain_step,
    kv_hold_s,
    model_drain_deadline_s,
    ready_since,
    routes,
)
from fleetplan.planner.act_execute import execute, held_gpus, incomplete, plan_deferred, template_for
from fleetplan.planner.act_reconcile import adopt, reconcile, rejected
from fleetplan.planner.act_types import (
    ActDecision,
    ActionStatus,
    ActSettings,
    ActView,
    AlertKey,
    AlertKind,
    BuildRow,
    BuildState,
    DesiredRow,
    Effect,
    FinishBuild,
    HostReport,
    MarkReady,
    NewBuild,
    NewReplica,
    Note,
    Phase,
    Record,
    ReplicaRow,
    ReportedBuild,
    ReportedReplica,
    SetPhase,
    reported_by_id,
)

__all__ = [
    "ActDecision",
    "ActSettings",
    "ActView",
    "ActionStatus",
    "AlertKey",
    "AlertKind",
    "BuildRow",
    "BuildState",
    "DesiredRow",
    "DrainProgress",
    "DrainStep",
    "Effect",
    "FinishBuild",
    "HostReport",
    "MarkReady",
    "NewBuild",
    "NewReplica",
    "Note",
    "Phase",
    "Pools",
    "Record",
    "ReplicaRow",
    "ReportedBuild",
    "ReportedReplica",
    "Routes",
    "SetPhase",
    "adopt",
    "drain_deadline_s",
    "drain_holders",
    "drain_step",
    "execute",
    "held_gpus",
    "incomplete",
    "kv_hold_s",
    "model_drain_deadline_s",
    "plan_deferred",
    "ready_since",
    "reconcile",
    "rejected",
    "reported_by_id",
    "routes",
    "template_for",
]
