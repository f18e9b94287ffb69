"""The act core before planning: `reconcile` (ready replicas, finished builds, ready and ack
timeouts, refused desired states) and `adopt` (engines a published desired state names), `rejected`
(a desired state the agent refused). Pure; see `fleetplan.planner.act`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fleetplan.models.config_key import Role
from fleetplan.planner.act_execute import template_for
from fleetplan.planner.act_types import (
    ActDecision,
    ActionStatus,
    ActView,
    AlertKey,
    AlertKind,
    BuildState,
    Effect,
    FinishBuild,
    MarkReady,
    NewReplica,
    Note,
    Phase,
    ReplicaRow,
    SetPhase,
)
from fleetplan.planner.types import ReplicaState


def reconcile(view: ActView) -> ActDecision:
    """Bring the records in line with what the agents report (before planning)."""
    adopted = adopt(view)
    effects: list[Effect] = list(adopted.effects)
    alerts = dict(adopted.alerts)
    changed = set(adopted.publish)
    active = {r.replica_id: r for r in view.replicas}
    for host in view.hosts.values():
        if not host.online:
            continue
        for rs in host.replicas:
            row = active.get(rs.replica_id)
            if row is not None and rs.replica_id in view.known_ids and rs.state == ReplicaState.READY \
                    and row.ready_s is None:
                effects.append(MarkReady(row.replica_id))
    for b in view.builds:
        bhost = view.hosts.get(b.host)
        bs = next((x for x in bhost.builds if x.build_id == b.build_id), None) if bhost is not None else None
        if bs is None or bs.state not in (BuildState.DONE, BuildState.FAILED):
            continue
        ok = bs.state == BuildState.DONE
        effects.append(FinishBuild(b, ok, None if ok else bs.error))
        if not ok:
            alerts[AlertKey(AlertKind.BUILD_FAILED, b.build_id)] = (
                f"engine build {b.build_id} ({b.model} {b.engine} {b.gpu} tp{b.tp}) failed on {b.host}: {bs.error}"
            )
        changed.add(b.host)
    rep = view.reported()
    timeout = view.settings.ready_timeout_s
    for row in view.replicas:
        if row.phase != Phase.DESIRED or row.ready_s is not None or view.now_s - row.created_s < timeout:
            continue
        seen = rep.get(row.replica_id)
        if seen is not None and seen[1].state == ReplicaState.READY:
            continue
        effects.append(SetPhase(row.replica_id, Phase.REMOVED, Note(
            "stop", ActionStatus.DONE, f"not ready after {timeout:.0f} s", replica_id=row.replica_id,
            host=row.host, model=row.model)))
        alerts[AlertKey(AlertKind.READY_TIMEOUT, row.replica_id)] = (
            f"replica {row.replica_id} ({row.model} on {row.host}) not ready after {timeout:.0f} s; removed"
        )
        changed.add(row.host)
    cleared: set[AlertKey] = set()
    for host_name, d in view.desired.items():
        if d.acked_version == d.version and d.ack_accepted is False:
            # the agent refused this version: its offending replicas leave it (acks are never awaited
            # inside a cycle; the refusal is acted on here, once, since the new version is unacked)
            refused = rejected(view, host_name, d.version, d.ack_errors)
            effects += refused.effects
            alerts.update(refused.alerts)
            changed |= refused.publish
        key = AlertKey(AlertKind.ACK_TIMEOUT, host_name)
        unacked = d.acked_version != d.version and d.published_s is not None and \
            view.now_s - d.published_s > view.settings.ack_timeout_s
        if unacked:
            alerts[key] = (f"host {host_name} did not ack desired v{d.version} within "
                           f"{view.settings.ack_timeout_s:.0f} s (published again)")
        elif d.acked_version == d.version:
            cleared.add(key)
        if view.republish_all or d.published_s is None or unacked:
            changed.add(host_name)
    return ActDecision(tuple(effects), publish=frozenset(changed), alerts=alerts, cleared=frozenset(cleared))


def adopt(view: ActView) -> ActDecision:
    """Engines the agents run that this database never allocated (a lost database): adopted when a
    desired state this controller published (the broker's retained copy: only the controller may
    write it) names them with the same model, engine, GPUs and port, and they conflict with nothing.
    A replica that no controller asked for is never adopted (alert: not routed, not counted)."""
    effects: list[Effect] = []
    alerts: dict[AlertKey, str] = {}
    changed: set[str] = set()
    known = set(view.known_ids)
    rows = list(view.replicas)
    for host in sorted(view.hosts.values(), key=lambda h: h.name):
        if not host.online:
            continue
        for rs in host.replicas:
            if rs.replica_id in known or rs.state not in (ReplicaState.STARTING, ReplicaState.READY):
                continue
            key = AlertKey(AlertKind.ORPHAN, rs.replica_id)
            asked = next((d for d in view.retained.get(host.name, ()) if d.replica_id == rs.replica_id), None)
            if asked is None or (asked.model, asked.engine, asked.tp, asked.precision, asked.gpu_indices,
                                 asked.port, asked.role) != (rs.model, rs.engine, rs.tp, rs.precision,
                                                             rs.gpu_indices, rs.port, rs.role) or (
                    rs.gpu is not None and rs.gpu != asked.gpu):
                alerts[key] = (
                    f"unknown replica {rs.replica_id} reported by {host.name} matches no desired state this "
                    "controller published; not adopted (not routed, not counted)"
                )
                continue
            mine = [r for r in rows if r.host == host.name]
            if {g for r in mine for g in r.gpu_indices} & set(rs.gpu_indices) or rs.port in {r.port for r in mine}:
                alerts[key] = (
                    f"unknown replica {rs.replica_id} on {host.name} conflicts with planned replicas; not adopted "
                    "(the agent stops it)"
                )
                continue
            row = ReplicaRow(
                rs.replica_id, host.name, rs.model, rs.engine, rs.gpu or host.gpu or "", rs.tp, rs.precision,
                rs.gpu_indices, rs.port, rs.template or template_for(view, rs.engine, role=Role(rs.role)),
                Phase.DESIRED, "adopted", view.now_s, view.now_s, None,
                view.now_s if rs.state == ReplicaState.READY else None, rs.role,
            )
            effects.append(NewReplica(row, Note("adopt", ActionStatus.DONE,
                                                "running engine unknown to the controller: adopted",
                                                replica_id=rs.replica_id, host=host.name, model=rs.model)))
            rows.append(row)
            known.add(rs.replica_id)
            changed.add(host.name)
    return ActDecision(tuple(effects), publish=frozenset(changed), alerts=alerts)



def rejected(view: ActView, host: str, version: int, errors: Sequence[str]) -> ActDecision:
    """The agent rejected a whole desired state: the replicas its errors name (else every replica
    on that host not yet ready) leave the desired state as failed starts; alert; republish.

    Why not retry as is: a rejected state is rejected again (a template the agent does not offer,
    GPUs it does not have); dropping the named replicas lets the next plan place them elsewhere."""
    text = "; ".join(errors) or "no reason given"
    named = {m.group(1) for e in errors for m in _RID_IN_ERROR.finditer(e)}
    rows = [r for r in view.replicas if r.host == host]
    bad = [r for r in rows if r.replica_id in named] or [r for r in rows if r.ready_s is None]
    alerts = {AlertKey(AlertKind.REJECTED, host): f"host {host} rejected desired v{version}: {text}"}
    effects = tuple(SetPhase(r.replica_id, Phase.REMOVED, Note("start", ActionStatus.FAILED, "rejected by agent",
                                                               text, r.replica_id, host, r.model)) for r in bad)
    return ActDecision(effects, publish=frozenset({host}) if bad else frozenset(), alerts=alerts)


_RID_IN_ERROR = re.compile(r"replica ([A-Za-z0-9_-]+)")
