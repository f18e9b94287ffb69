"""The act core (planner/act.py) without servers or sleeps: every path that only the end-to-end
tests reached before (adopt, reject, ack timeout, ready timeout, drain timeout, build done/failed,
make-before-break, host loss, MQTT down, statuses missing after a restart)."""

from __future__ import annotations

import dataclasses

import pytest

from fleetplan.planner import act
from fleetplan.planner.act import (
    ActionStatus,
    ActView,
    BuildRow,
    BuildState,
    DesiredRow,
    FinishBuild,
    HostReport,
    MarkReady,
    NewBuild,
    NewReplica,
    Phase,
    Record,
    ReplicaRow,
    ReportedBuild,
    ReportedReplica,
    SetPhase,
)
from fleetplan.planner.act_types import AlertKey, AlertKind
from fleetplan.planner.types import Action, ActionKind, ConfigKey, Replica, ReplicaState
from tests.unit.planner.planner_helpers import BF16, H100, TRT, VLLM

NOW = 10_000.0
CFG = ConfigKey("llama", VLLM, H100, 1, BF16)


def row(rid: str, *, host: str = "gpu-01", gpus: tuple[int, ...] = (0,), port: int = 8000,
        ready: bool = True, phase: Phase = Phase.DESIRED, created_s: float = NOW - 600) -> ReplicaRow:
    return ReplicaRow(rid, host, "llama", "vllm", "h100", 1, "bf16", gpus, port, "vllm", phase, "planned",
                      created_s, created_s, None, created_s + 60 if ready else None)


def reported(rid: str, state: ReplicaState = ReplicaState.READY, *, gpus: tuple[int, ...] = (0,),
             port: int = 8000) -> ReportedReplica:
    return ReportedReplica(rid, state, "llama", "vllm", "h100", 1, "bf16", gpus, port, "vllm")


def host(name: str = "gpu-01", *replicas: ReportedReplica, online: bool = True,
         builds: tuple[ReportedBuild, ...] = (), gpus: int = 8) -> HostReport:
    return HostReport(name, online, "h100", gpus, (), (8000, 8009), ("vllm",), ("trtllm-build",), replicas, builds)


def view(*hosts: HostReport, rows: tuple[ReplicaRow, ...] = (), builds: tuple[BuildRow, ...] = (),
         desired: dict[str, DesiredRow] | None = None, **kw: object) -> ActView:
    d = desired if desired is not None else {
        h.name: DesiredRow(h.name, 3, {}, NOW - 30, 3, True, ()) for h in hosts}
    known = frozenset(r.replica_id for r in rows)
    return ActView(NOW, {h.name: h for h in hosts}, rows, builds, d, known,
                   connected_since_s=kw.pop("connected_since_s", NOW - 3600), **kw)  # type: ignore[arg-type]


def action(kind: ActionKind, rid: str = "new", *, gpus: tuple[int, ...] = (1,),
           state: ReplicaState = ReplicaState.STARTING, host_name: str = "gpu-01") -> Action:
    return Action(kind, Replica(rid, CFG, host_name, gpus, state), "plan says so")


# ---- adopt ----------------------------------------------------------------------------------


def test_an_engine_a_published_desired_state_names_is_adopted() -> None:
    rs = reported("r00042", gpus=(3,), port=8003)
    v = view(host("gpu-01", rs), retained={"gpu-01": (rs,)})
    d = act.adopt(v)
    (eff,) = d.effects
    assert isinstance(eff, NewReplica)
    assert (eff.row.replica_id, eff.row.origin, eff.row.ready_s) == ("r00042", "adopted", NOW)
    assert d.publish == {"gpu-01"} and not d.alerts


def test_an_engine_no_desired_state_named_is_not_adopted() -> None:
    rs = reported("r00042", gpus=(3,), port=8003)
    other = reported("r00042", gpus=(4,), port=8003)  # retained copy says other GPUs
    for retained in ({}, {"gpu-01": (other,)}):
        d = act.adopt(view(host("gpu-01", rs), retained=retained))
        assert d.effects == () and AlertKey(AlertKind.ORPHAN, "r00042") in d.alerts


def test_an_engine_that_conflicts_with_planned_replicas_is_not_adopted() -> None:
    rs = reported("r00042", gpus=(0,), port=8005)
    d = act.adopt(view(host("gpu-01", rs), rows=(row("r00001"),), retained={"gpu-01": (rs,)}))
    assert d.effects == () and "conflicts" in d.alerts[AlertKey(AlertKind.ORPHAN, "r00042")]


# ---- reconcile ------------------------------------------------------------------------------


def test_a_replica_reported_ready_is_marked_ready() -> None:
    d = act.reconcile(view(host("gpu-01", reported("r00001")), rows=(row("r00001", ready=False, created_s=NOW),)))
    assert MarkReady("r00001") in d.effects


def test_a_replica_never_ready_is_removed_after_the_timeout_with_an_alert() -> None:
    stuck = row("r00001", ready=False, created_s=NOW - 2000)
    d = act.reconcile(view(host("gpu-01", reported("r00001", ReplicaState.STARTING)), rows=(stuck,)))
    (eff,) = [e for e in d.effects if isinstance(e, SetPhase)]
    assert eff.phase == Phase.REMOVED and "not ready after 900 s" in (eff.note.reason if eff.note else "")
    assert AlertKey(AlertKind.READY_TIMEOUT, "r00001") in d.alerts and "gpu-01" in d.publish
    young = row("r00001", ready=False, created_s=NOW - 100)
    assert not any(isinstance(e, SetPhase) for e in act.reconcile(view(host(), rows=(young,))).effects)


def test_an_unacked_desired_state_is_published_again_after_the_ack_timeout() -> None:
    late = {"gpu-01": DesiredRow("gpu-01", 4, {}, NOW - 30, 3, True, ())}
    fresh = {"gpu-01": DesiredRow("gpu-01", 4, {}, NOW - 2, 3, True, ())}
    never = {"gpu-01": DesiredRow("gpu-01", 4, {}, None, 3, True, ())}
    assert act.reconcile(view(host(), desired=late)).publish == {"gpu-01"}
    assert act.reconcile(view(host(), desired=fresh)).publish == frozenset()
    assert act.reconcile(view(host(), desired=never)).publish == {"gpu-01"}


def test_the_ack_timeout_raises_an_alert_that_the_ack_clears() -> None:
    late = {"gpu-01": DesiredRow("gpu-01", 4, {}, NOW - 30, 3, True, ())}
    ack = AlertKey(AlertKind.ACK_TIMEOUT, "gpu-01")
    d = act.reconcile(view(host(), desired=late))
    assert "did not ack desired v4" in d.alerts[ack] and ack not in d.cleared
    acked = {"gpu-01": DesiredRow("gpu-01", 4, {}, NOW - 30, 4, True, ())}
    d = act.reconcile(view(host(), desired=acked))
    assert ack not in d.alerts and ack in d.cleared and not d.publish


def test_a_refused_desired_state_is_acted_on_once_by_reconcile() -> None:
    """Acks are not awaited in a cycle: the refusal recorded in the store is acted on here, and the
    republished version (unacked) does not repeat it."""
    rows = (row("r00001"), row("r00002", gpus=(1,), port=8001, ready=False))
    refused = {"gpu-01": DesiredRow("gpu-01", 5, {}, NOW - 1, 5, False, ("replica r00002: template 'x' not offered",))}
    d = act.reconcile(view(host("gpu-01", reported("r00001")), rows=rows, desired=refused))
    gone = [e for e in d.effects if isinstance(e, SetPhase)]
    assert [e.replica_id for e in gone] == ["r00002"] and d.publish == {"gpu-01"}
    assert "template 'x' not offered" in d.alerts[AlertKey(AlertKind.REJECTED, "gpu-01")]
    republished = {"gpu-01": DesiredRow("gpu-01", 6, {}, NOW - 1, 5, False, ("replica r00002: ...",))}
    d = act.reconcile(view(host("gpu-01", reported("r00001")), rows=rows, desired=republished))
    assert not [e for e in d.effects if isinstance(e, SetPhase)]


def test_builds_done_and_failed_leave_the_desired_state_failed_alerts() -> None:
    b1 = BuildRow("b00001", "gpu-01", "llama", "trtllm", "h100", 1, "bf16", (2,), "trtllm-build",
                  Phase.DESIRED, NOW, NOW, None)
    b2 = BuildRow("b00002", "gpu-01", "llama", "trtllm", "h100", 2, "bf16", (4, 5), "trtllm-build",
                  Phase.DESIRED, NOW, NOW, None)
    h = host("gpu-01", builds=(ReportedBuild("b00001", BuildState.DONE, (2,)),
                               ReportedBuild("b00002", BuildState.FAILED, (4, 5), "OOM")))
    d = act.reconcile(view(h, builds=(b1, b2)))
    finished = [e for e in d.effects if isinstance(e, FinishBuild)]
    assert [(f.build.build_id, f.ok, f.error) for f in finished] == [("b00001", True, None), ("b00002", False, "OOM")]
    assert "OOM" in d.alerts[AlertKey(AlertKind.BUILD_FAILED, "b00002")] and AlertKey(AlertKind.BUILD_FAILED, "b00001") not in d.alerts


def test_rejected_desired_state_drops_the_named_replicas() -> None:
    rows = (row("r00001"), row("r00002", gpus=(1,), port=8001, ready=False))
    d = act.rejected(view(host(), rows=rows), "gpu-01", 5, ["replica r00001: template 'x' not offered"])
    (eff,) = d.effects
    assert isinstance(eff, SetPhase) and eff.replica_id == "r00001" and eff.note is not None
    assert eff.note.status == ActionStatus.FAILED and d.publish == {"gpu-01"}
    # no replica named: every replica not yet ready on that host
    d = act.rejected(view(host(), rows=rows), "gpu-01", 5, ["bad payload"])
    assert [e.replica_id for e in d.effects if isinstance(e, SetPhase)] == ["r00002"]


# ---- execute --------------------------------------------------------------------------------


def test_a_start_takes_the_planned_gpus_and_the_first_free_port() -> None:
    h = host("gpu-01", reported("r00001", port=8000), reported("r00002", gpus=(2,), port=8001))
    d = act.execute(view(h, rows=(row("r00001"), row("r00002", gpus=(2,), port=8001))),
                    [action(ActionKind.START, gpus=(1,))])
    (eff,) = d.effects
    assert isinstance(eff, NewReplica) and eff.row.gpu_indices == (1,) and eff.row.port == 8002
    assert eff.row.replica_id == "" and eff.note.status == ActionStatus.PUBLISHED  # the store allocates the id
    assert d.publish_first == {"gpu-01"} and d.counts["start"] == 1


def test_the_policy_names_the_agent_template_and_a_host_without_it_waits() -> None:
    """One template mechanism: the policy's engines.<engine>.agent_template (default: the engine's
    name); a host whose agent lists other templates gets no desired state it would reject."""
    from fleetplan.planner.act import ActSettings

    d = act.execute(view(host()), [action(ActionKind.START)])
    assert isinstance(d.effects[0], NewReplica) and d.effects[0].row.template == "vllm"
    named = ActSettings(launch_templates={"vllm": "vllm-site"})
    d = act.execute(view(host(), settings=named), [action(ActionKind.START)])
    (eff,) = d.effects
    assert isinstance(eff, Record) and eff.note.status == ActionStatus.DEFERRED
    assert "offers no launch template 'vllm-site' (it has: vllm)" in eff.note.detail
    assert "agent_template" in eff.note.detail


def test_a_start_on_gpus_still_in_use_moves_to_free_gpus_or_waits() -> None:
    # an engine the agent still runs that no record names (stopping) holds GPU 1
    stopping = reported("r00009", ReplicaState.DRAINING, gpus=(1,), port=8005)
    v = view(host("gpu-01", stopping))
    (eff,) = act.execute(v, [action(ActionKind.START, gpus=(1,))]).effects
    assert isinstance(eff, NewReplica) and eff.row.gpu_indices == (0,) and "busy: moved" in eff.note.detail
    assert act.held_gpus(v, "gpu-01") == (1,)  # and the next plan places around it
    full = view(host("gpu-01", stopping, reported("r00001", gpus=(0,)), gpus=2), rows=(row("r00001"),))
    (eff,) = act.execute(full, [action(ActionKind.START, gpus=(1,))]).effects
    assert isinstance(eff, Record) and eff.note.status == ActionStatus.DEFERRED and "still in use" in eff.note.detail
    # a config whose built engine only gpu-01 holds moves within gpu-01 only: never to a host whose
    # agent would refuse it, however free its GPUs
    both = view(host("gpu-01", stopping, reported("r00001", gpus=(0,)), gpus=2), host("gpu-02"),
                rows=(row("r00001"),))
    start = action(ActionKind.START, gpus=(1,))
    (eff,) = act.execute(both, [start]).effects
    assert isinstance(eff, NewReplica) and eff.row.host == "gpu-02"
    (eff,) = act.execute(both, [dataclasses.replace(start, hosts=frozenset({"gpu-01"}))]).effects
    assert isinstance(eff, Record) and eff.note.status == ActionStatus.DEFERRED and "still in use" in eff.note.detail


def test_make_before_break_defers_the_drain_while_a_replica_of_the_model_starts() -> None:
    serving = row("r00001")
    h = host("gpu-01", reported("r00001"))
    acts = [action(ActionKind.START, gpus=(1,)), action(ActionKind.DRAIN, "r00001", gpus=(0,),
                                                         state=ReplicaState.READY)]
    d = act.execute(view(h, rows=(serving,)), acts)
    deferred = [e for e in d.effects if isinstance(e, Record)]
    assert len(deferred) == 1 and "start before stop" in deferred[0].note.detail and d.drains == ()
    # once nothing of the model is starting, the drain goes ahead
    d = act.execute(view(h, rows=(serving,)), acts[1:])
    assert d.drains == ("r00001",) and any(isinstance(e, SetPhase) and e.phase == Phase.DRAINING for e in d.effects)
    # a drain the planner marked covered (READY capacity without it covers the required rate) goes
    # ahead while the replacement starts: the planner's make-before-break rule is the one applied
    covered = [acts[0], dataclasses.replace(acts[1], covered=True)]
    d = act.execute(view(h, rows=(serving,)), covered)
    assert d.drains == ("r00001",) and not any(isinstance(e, Record) for e in d.effects)


def test_a_drain_waits_when_the_replacement_could_not_start_for_any_reason() -> None:
    """Make-before-break whatever kept the replacement from starting (here: its host's agent does not
    offer the template): the serving replica keeps serving."""
    from fleetplan.planner.act import ActSettings

    rows = (row("r00001", gpus=(0,)),)
    acts = [action(ActionKind.START, "new", gpus=(1,)),
            action(ActionKind.DRAIN, "r00001", gpus=(0,), state=ReplicaState.READY)]
    d = act.execute(view(host("gpu-01", reported("r00001")), rows=rows,
                         settings=ActSettings(launch_templates={"vllm": "other"})), acts)
    assert not d.drains and d.counts["drain"] == 0
    assert any(isinstance(e, Record) and "replacement could not start" in e.note.detail for e in d.effects)


def test_a_replica_that_never_served_is_removed_at_once() -> None:
    starting = row("r00001", ready=False, created_s=NOW)
    d = act.execute(view(host(), rows=(starting,)), [action(ActionKind.STOP, "r00001", gpus=(0,))])
    (eff,) = d.effects
    assert isinstance(eff, SetPhase) and eff.phase == Phase.REMOVED and eff.cancel_start
    assert d.publish == {"gpu-01"} and d.drains == ()


def test_mqtt_down_defers_everything_with_an_alert() -> None:
    d = act.execute(view(host(), connected_since_s=None), [action(ActionKind.START)])
    assert [type(e) for e in d.effects] == [Record] and d.counts["deferred"] == 1 and AlertKey(AlertKind.MQTT) in d.alerts


def test_after_a_restart_nothing_acts_until_every_known_host_reported() -> None:
    desired = {h: DesiredRow(h, 3, {}, NOW - 30, 3, True, ()) for h in ("gpu-01", "gpu-02")}
    acts = [action(ActionKind.START)]
    d = act.execute(view(host("gpu-01"), desired=desired, connected_since_s=NOW - 5), acts)
    assert isinstance(d.effects[0], Record) and "waiting for status from gpu-02" in d.effects[0].note.detail
    # the grace passed: a host that never reported does not block the others
    d = act.execute(view(host("gpu-01"), desired=desired, connected_since_s=NOW - 3600), acts)
    assert isinstance(d.effects[0], NewReplica)
    # a host known only from this controller's replica records counts too
    rows = (row("r00009", host="gpu-03"),)
    d = act.execute(view(host("gpu-01"), rows=rows, connected_since_s=NOW - 5), acts)
    assert isinstance(d.effects[0], Record) and "gpu-03" in d.effects[0].note.detail


def test_no_plan_is_made_before_every_host_reported_after_a_restart() -> None:
    desired = {h: DesiredRow(h, 3, {}, NOW - 30, 3, True, ()) for h in ("gpu-01", "gpu-02")}
    early = view(host("gpu-01"), desired=desired, connected_since_s=NOW - 1)
    assert act.plan_deferred(early) == "waiting for status from gpu-02"
    assert act.plan_deferred(view(host("gpu-01"), host("gpu-02"), desired=desired, connected_since_s=NOW - 1)) is None
    assert act.plan_deferred(view(host("gpu-01"), desired=desired, connected_since_s=NOW - 61)) is None  # grace over
    # MQTT down: a plan from the last statuses is still made (acting waits), but not before any came
    assert act.plan_deferred(view(host("gpu-01"), host("gpu-02"), desired=desired, connected_since_s=None)) is None
    assert act.plan_deferred(view(host("gpu-01"), desired=desired, connected_since_s=None)) == (
        "MQTT not connected and no status yet from gpu-02")


def test_a_plan_made_before_the_statuses_arrived_does_nothing_even_once_they_have() -> None:
    """The restart race: the plan saw no host (statuses still arriving) and stops every replica as
    'host offline'; by the time it is acted on the statuses are in. It must not act."""
    rows = (row("r00001"),)
    stop = [action(ActionKind.STOP, "r00001", gpus=(0,), state=ReplicaState.STARTING)]
    before = view(rows=rows, desired={"gpu-01": DesiredRow("gpu-01", 3, {}, NOW - 30, 3, True, ())},
                  connected_since_s=NOW - 1)
    now = view(host("gpu-01", reported("r00001")), rows=rows, connected_since_s=NOW - 1)
    d = act.execute(now, stop, planned_on=before)
    assert not [e for e in d.effects if isinstance(e, SetPhase)] and d.counts["deferred"] == 1
    assert "planned while waiting for status from gpu-01" in d.effects[0].note.detail
    assert [type(e) for e in act.execute(now, stop).effects] == [SetPhase]  # the same plan on a full view acts


def test_host_loss_defers_starts_there_and_removes_nothing() -> None:
    lost = host("gpu-02", online=False)
    rows = (row("r00001", host="gpu-02"),)
    d = act.execute(view(host("gpu-01"), lost, rows=rows), [action(ActionKind.START, host_name="gpu-02")])
    assert isinstance(d.effects[0], Record) and "no online agent" in d.effects[0].note.detail
    r = act.reconcile(view(host("gpu-01"), lost, rows=rows))
    assert not any(isinstance(e, SetPhase) for e in r.effects)  # a fault never scales down


def test_a_replica_on_a_host_past_its_grace_is_removed_without_draining() -> None:
    """Nothing reaches a lost host's replica and its in-flight count is unknowable: a drain would only
    wait for its deadline. Within the grace (an agent restart) it drains as usual."""
    rows = (row("r00001"),)
    acts = [action(ActionKind.DRAIN, "r00001", gpus=(0,), state=ReplicaState.READY),
            action(ActionKind.STOP, "r00001", gpus=(0,), state=ReplicaState.READY)]
    lost = HostReport("gpu-01", False, "h100", 8, replicas=(reported("r00001"),), offline_since_s=NOW - 120)
    d = act.execute(view(lost, rows=rows), acts)
    gone = [e for e in d.effects if isinstance(e, SetPhase)]
    assert [(e.replica_id, e.phase) for e in gone] == [("r00001", Phase.REMOVED)] and not d.drains
    assert "host lost" in gone[0].note.detail
    brief = HostReport("gpu-01", False, "h100", 8, replicas=(reported("r00001"),), offline_since_s=NOW - 5)
    assert act.execute(view(brief, rows=rows), acts).drains == ("r00001",)


def test_a_build_is_staged_once_and_a_repeated_deferral_is_noted_once() -> None:
    b = Action(ActionKind.BUILD, Replica("b", ConfigKey("llama", TRT, H100, 2, BF16), "gpu-01", (4, 5),
                                         ReplicaState.STARTING), "TRT-LLM is cheaper")
    d = act.execute(view(host()), [b])
    assert isinstance(d.effects[0], NewBuild) and d.effects[0].row.template == "trtllm-build"
    busy = host("gpu-01", reported("r00003", gpus=(4,), port=8003))
    d1 = act.execute(view(busy), [b])
    assert isinstance(d1.effects[0], Record)
    d2 = act.execute(view(busy, noted=d1.noted), [b])
    assert d2.effects == ()


def test_drain_ends_when_in_flight_reaches_zero_twice_or_at_the_timeout() -> None:
    p = act.DrainProgress(started_s=0.0)
    step, p = act.drain_step(p, 3.0, 5.0, 120.0)
    assert step == act.DrainStep.WAIT and p.zeros == 0
    step, p = act.drain_step(p, 0.0, 7.0, 120.0)
    assert step == act.DrainStep.WAIT
    step, p = act.drain_step(p, 0.0, 9.0, 120.0)
    assert step == act.DrainStep.DONE
    assert act.drain_step(act.DrainProgress(0.0), 5.0, 121.0, 120.0)[0] == act.DrainStep.TIMEOUT


def test_the_planner_places_new_replicas_off_held_gpus() -> None:
    from fleetplan.planner.placement import place
    from fleetplan.planner.types import HostInventory

    h = HostInventory("gpu-01", H100, 2, (), True, held_gpus=(0,))
    p = place({CFG: 1}, [h])
    assert [r.gpu_indices for r in p.replicas] == [(1,)]
    assert place({CFG: 2}, [h]).replicas.__len__() == 1  # the held GPU is never used


def test_a_drain_waits_when_the_replacement_could_not_start() -> None:
    # the replacement's GPU 1 is still held by an engine stopping: draining r00001 now would leave
    # the model with nothing serving (seen on the lab: 503s during a swap)
    h = host("gpu-01", reported("r00001"), reported("r00009", ReplicaState.DRAINING, gpus=(1,), port=8005), gpus=2)
    acts = [action(ActionKind.START, gpus=(1,)), action(ActionKind.DRAIN, "r00001", gpus=(0,),
                                                         state=ReplicaState.READY)]
    d = act.execute(view(h, rows=(row("r00001"),)), acts)
    assert d.drains == () and all(isinstance(e, Record) for e in d.effects)
    # planned on the drained replica's own GPU: the drain must come first, but never of the model's
    # last serving replica (an outage); with another one serving it goes ahead
    swap_in_place = [action(ActionKind.START, gpus=(0,)), acts[1]]
    d = act.execute(view(host("gpu-01", reported("r00001"), gpus=1), rows=(row("r00001"),)), swap_in_place)
    assert d.drains == ()
    two = (row("r00001"), row("r00002", gpus=(1,), port=8002))
    d = act.execute(view(host("gpu-01", reported("r00001"), reported("r00002", gpus=(1,), port=8002), gpus=2),
                         rows=two), swap_in_place)
    assert d.drains == ("r00001",)


# ---- routing --------------------------------------------------------------------------------


def _routes(*hosts: HostReport, rows: tuple[ReplicaRow, ...], connected_since_s: float | None = NOW - 3600,
            now_s: float = NOW) -> act.Routes | None:
    return act.routes(rows, {h.name: h for h in hosts}, ["llama"], now_s=now_s,
                      connected_since_s=connected_since_s, grace_s=60.0)


def test_routing_serves_ready_desired_replicas_and_scrapes_draining_ones() -> None:
    rows = (row("r1"), row("r2", gpus=(1,), port=8001), row("r3", gpus=(2,), port=8002, phase=Phase.DRAINING),
            row("r4", gpus=(3,), port=8003, ready=False))
    h = host("gpu-01", reported("r1"), reported("r2", ReplicaState.STARTING, gpus=(1,)),
             reported("r3", gpus=(2,)), reported("r4", ReplicaState.STARTING, gpus=(3,)))
    got = _routes(h, rows=rows)
    assert got is not None
    assert got.serving == {"llama": ("r1",)} and got.scraped == ("r1", "r3")


def test_routing_is_left_as_it_is_until_every_host_reported_after_a_restart() -> None:
    # the fault suite's kill -9 mid drain: gpu-01 reported first, gpu-02's status came 0.2 s later;
    # routing from that view took gpu-02's serving replica out of nginx (503s)
    rows = (row("r1"), row("r2", host="gpu-02"))
    first = host("gpu-01", reported("r1"))
    assert _routes(first, rows=rows, connected_since_s=NOW - 0.2) is None
    assert _routes(first, rows=rows, connected_since_s=None) is None  # MQTT down: keep the files
    both = _routes(first, host("gpu-02", reported("r2")), rows=rows, connected_since_s=NOW - 0.2)
    assert both is not None and both.serving == {"llama": ("r1", "r2")}
    # a host that never reports within the grace is left out once the grace has passed
    late = _routes(first, rows=rows, connected_since_s=NOW - 61)
    assert late is not None and late.serving == {"llama": ("r1",)}


def test_routing_drops_a_lost_host_but_keeps_one_whose_agent_restarts() -> None:
    rows = (row("r1"), row("r2", host="gpu-02"))
    for offline_s, served in ((NOW - 10, ("r1", "r2")), (NOW - 61, ("r1",))):
        gone = HostReport("gpu-02", False, "h100", 8, replicas=(reported("r2"),), offline_since_s=offline_s)
        got = _routes(host("gpu-01", reported("r1")), gone, rows=rows)
        assert got is not None and got.serving == {"llama": served}


def test_a_models_drain_deadline_is_one_rule_for_the_daemon_and_the_replay() -> None:
    from tests.unit.planner.planner_helpers import policy

    base = policy(tps={"m8": [1], "m70": [4]}).model("m8")
    assert base is not None
    m = base.model_copy(update={"max_output_tokens": 2000})
    sim = act.model_drain_deadline_s(m, floor_s=1.0)
    assert sim == act.drain_deadline_s(slo_ttft_s=m.slo.ttft_p99_ms / 1000, slo_itl_s=m.slo.itl_p99_ms / 1000,
                                       max_output_tokens=m.max_output_tokens, explicit_s=m.drain_timeout_s,
                                       floor_s=1.0)
    # the lab's clock runs 20x: the same deadline in wall seconds, above the wall floor
    assert sim > 1.0
    assert act.model_drain_deadline_s(m, floor_s=0.0, time_scale=20.0) == pytest.approx(sim / 20.0)
    assert act.model_drain_deadline_s(None, floor_s=120.0) == 120.0
