"""The act core after planning: `execute` turns the plan's actions into effects (START -> a replica
row on free GPUs and a free port, BUILD -> a build row, DRAIN/STOP -> removal or drain under
make-before-break), whether the view is complete enough to act or plan on (`incomplete`,
`plan_deferred`), the GPUs held outside the plan (`held_gpus`) and the agent template of an engine
(`template_for`). Pure; see `fleetplan.planner.act`.

An action deferred for the same cause as in the cycle before is not a new action-log row: the row
of its first deferral gets the count (`Repeat`). A plan that needs hosts no agent serves is one
alert naming them and the agents online for hosts the policy does not list (`unreachable`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from fleetplan.models.config_key import Role
from fleetplan.planner.act_types import (
    ActDecision,
    ActionStatus,
    ActView,
    AlertKey,
    AlertKind,
    BuildRow,
    BuildState,
    DeferCause,
    DeferKey,
    Deferral,
    Effect,
    HostReport,
    NewBuild,
    NewReplica,
    Note,
    Phase,
    Record,
    Repeat,
    ReplicaRow,
    SetPhase,
)
from fleetplan.planner.placement import first_free
from fleetplan.planner.types import Action, ActionKind, ReplicaState


def template_for(view: ActView, engine: str, *, build: bool = False, role: Role = Role.AGGREGATED) -> str:
    """The agent template for `engine`: the policy's choice (`engines.<engine>.agent_template` /
    `agent_build_template`), else the engine's name, else "<engine>-build" for a build; a pool of a
    disaggregated model runs "<that template>-<role>" (e.g. vllm-prefill, vllm-decode: the agent's
    templates carry the engine's own disaggregation flags).

    >>> view = ActView(now_s=0.0, hosts={}, replicas=(), builds=(), desired={}, known_ids=frozenset())
    >>> template_for(view, "vllm"), template_for(view, "vllm", role=Role.DECODE)
    ('vllm', 'vllm-decode')
    """
    if build:
        return view.settings.build_templates.get(engine, f"{engine}-build")
    base = view.settings.launch_templates.get(engine, engine)
    return base if role is Role.AGGREGATED else f"{base}-{role.value}"


def _unoffered(view: ActView, host: str, template: str, *, build: bool = False) -> str | None:
    """Why `host` cannot run `template` (its agent lists others), or None. An agent that lists
    nothing is not second-guessed: it accepts or rejects the desired state itself."""
    h = view.hosts.get(host)
    offered = (h.build_templates if build else h.templates) if h is not None else ()
    if not offered or template in offered:
        return None
    kind = "build" if build else "launch"
    return (f"host {host} offers no {kind} template {template!r} (it has: {', '.join(sorted(offered))}); "
            f"name one in the policy's engines.<engine>.agent_{'build_' if build else ''}template")

def _busy(view: ActView, host: str, rows: Sequence[ReplicaRow]) -> tuple[set[int], set[int]]:
    """GPUs and ports on `host` used by desired replicas/builds or by anything its agent still runs."""
    gpus: set[int] = set()
    ports: set[int] = set()
    for row in rows:
        if row.host == host:
            gpus.update(row.gpu_indices)
            ports.add(row.port)
    h = view.hosts.get(host)
    for rs in h.replicas if h is not None else ():
        if rs.state != ReplicaState.STOPPED:
            gpus.update(rs.gpu_indices)
            ports.add(rs.port)
    for b in view.builds:
        if b.host == host:
            gpus.update(b.gpu_indices)
    for bs in h.builds if h is not None else ():
        if bs.state in (BuildState.PENDING, BuildState.RUNNING):
            gpus.update(bs.gpu_indices)
    return gpus, ports


def held_gpus(view: ActView, host: str) -> tuple[int, ...]:
    """GPUs of `host` busy with something the plan does not place: an engine build, an engine its
    agent still runs that no active record names (stopping). The planner's placement avoids them."""
    h = view.hosts.get(host)
    out: set[int] = set()
    for rs in h.replicas if h is not None else ():
        if rs.state != ReplicaState.STOPPED and rs.replica_id not in view.replica_ids:
            out.update(rs.gpu_indices)
    for b in view.builds:
        if b.host == host:
            out.update(b.gpu_indices)
    for bs in h.builds if h is not None else ():
        if bs.state in (BuildState.PENDING, BuildState.RUNNING):
            out.update(bs.gpu_indices)
    return tuple(sorted(out))


def _note(a: Action, status: ActionStatus, detail: str, kind: str | None = None,
          replica_id: str | None = None, cause: DeferCause | None = None) -> Note:
    return Note(kind or a.kind.value, status, a.reason, detail, replica_id or a.replica.replica_id,
                a.replica.host, a.replica.config.model, cause, a.replica.replica_id or a.replica.config.label())


def _deferred(a: Action, cause: DeferCause, detail: str) -> Record:
    return Record(_note(a, ActionStatus.DEFERRED, detail, cause=cause))


LIST_MAX = 8  # hosts named in one alert; the rest counted


def _names(hosts: Sequence[str]) -> str:
    more = len(hosts) - LIST_MAX
    return ", ".join(hosts[:LIST_MAX]) + (f" and {more} more" if more > 0 else "")


def unreachable(view: ActView, actions: Sequence[Action]) -> str | None:
    """Why the plan cannot be carried out, or None: it starts or builds on hosts no agent serves (never
    reported, or lost past the offline grace; an agent restarting within the grace is not counted),
    or no host the policy lists has an online agent while agents are online for hosts it does not list
    (held: planner/inventory.py), named together with those agents (misnamed agents, or a policy for
    another fleet).

    >>> from fleetplan.planner.act_types import ActSettings, HostReport
    >>> from fleetplan.planner.types import ConfigKey, Replica
    >>> from fleetplan.models.names import parse_engine, parse_gpu, parse_precision
    >>> c = ConfigKey("m", parse_engine("vllm"), parse_gpu("h100"), 1, parse_precision("bf16"))
    >>> start = Action(ActionKind.START, Replica("", c, "gpu-01", (0,), ReplicaState.STARTING, None, None), "")
    >>> v = ActView(0.0, {"host-a": HostReport("host-a", True)}, (), (), {}, frozenset(),
    ...             ActSettings(listed_hosts=frozenset({"gpu-01", "gpu-02"})))
    >>> print(unreachable(v, [start, start]))
    the plan cannot be carried out: it needs gpu-01, where no agent is online (2 action(s) deferred), while agents are online for host-a, which the policy's hosts do not list (an agent's `host` must be the policy's name for it; a host to add: list it in the policy or `fleetplan hosts confirm HOST`)
    >>> print(unreachable(v, []).split(", while")[0])
    the plan cannot be carried out: no host the policy lists has an online agent (gpu-01, gpu-02)
    """
    grace = view.settings.host_offline_grace_s

    def gone(name: str) -> bool:
        h = view.hosts.get(name)
        return h is None or h.lost(view.now_s, grace)

    needing = [a.replica.host for a in actions
               if a.kind in (ActionKind.START, ActionKind.BUILD) and a.replica.host and gone(a.replica.host)]
    listed = view.settings.listed_hosts
    strangers = sorted(h for h, r in view.hosts.items() if r.online and listed and h not in listed)
    deserted = bool(strangers) and all(view.hosts.get(h) is None or not view.hosts[h].online for h in listed)
    if needing:
        text = (f"the plan cannot be carried out: it needs {_names(sorted(set(needing)))}, where no agent is "
                f"online ({len(needing)} action(s) deferred)")
    elif deserted:
        text = f"the plan cannot be carried out: no host the policy lists has an online agent ({_names(sorted(listed))})"
    else:
        return None
    if strangers:
        return (f"{text}, while agents are online for {_names(strangers)}, which the policy's hosts do not list "
                "(an agent's `host` must be the policy's name for it; a host to add: list it in the policy or "
                "`fleetplan hosts confirm HOST`)")
    return f"{text}; no agent is online for a host the policy does not list"


def repeat_deferrals(effects: Sequence[Effect], open_: Mapping[DeferKey, Deferral],
                     now_s: float) -> tuple[list[Effect], dict[DeferKey, Deferral]]:
    """A deferral open since the last cycle (same action, same cause: `Note.defer_key`, the n-th of
    identical ones counted apart) becomes a `Repeat` of its row with the count; the others stay
    new `Record`s. Returns the effects and the repeated deferrals still open (the new ones get their
    row ids once written)."""
    out: list[Effect] = []
    still: dict[DeferKey, Deferral] = {}
    seen: dict[DeferKey, int] = {}
    for e in effects:
        key = e.note.defer_key() if isinstance(e, Record) else None
        if not isinstance(e, Record) or key is None:
            out.append(e)
            continue
        nth = seen[key] = seen.get(key, -1) + 1
        note = replace(e.note, subject=f"{e.note.subject}#{nth}")
        key = note.defer_key()
        prev = open_.get(key) if key is not None else None
        if prev is None or key is None:
            out.append(Record(note))
            continue
        d = still[key] = Deferral(prev.action_id, prev.count + 1, prev.since_s)
        out.append(Repeat(d.action_id, d.count, replace(
            note, detail=f"{note.detail} (deferred {d.count} times in {max(0.0, now_s - d.since_s):.0f} s)")))
    return out, still


def incomplete(view: ActView) -> str | None:
    """Why `view` is not complete enough to act on (None: it is). After a (re)connect every host this
    controller has a desired state or a replica for must have reported (retained statuses arrive
    right after subscribing; the offline grace covers dead agents)."""
    return unreported(_needed_hosts(view), view.hosts, view.now_s,
                       view.connected_since_s, view.settings.host_offline_grace_s)


def plan_deferred(view: ActView) -> str | None:
    """Why no plan should be made from `view` yet (None: plan). A host this controller has a
    desired state or a replica on has not reported since this process started (MQTT not connected
    yet, or statuses still arriving after a (re)connect, within the offline grace): a plan now
    would see that host as gone ("no usable hosts", 0 replicas) and store that as the plan on-call
    reads. With MQTT down but every host's last status known, the plan is still made (the report
    shows what would be done); acting on it waits (`execute`)."""
    if view.connected_since_s is None:
        missing = sorted(_needed_hosts(view) - set(view.hosts))
        return f"MQTT not connected and no status yet from {', '.join(missing)}" if missing else None
    return incomplete(view)


def _needed_hosts(view: ActView) -> set[str]:
    return {*view.desired, *(r.host for r in view.replicas)}


def unreported(needed: Collection[str], hosts: Mapping[str, HostReport], now_s: float,
                connected_since_s: float | None, grace_s: float) -> str | None:
    if connected_since_s is None:
        return "MQTT down"
    missing = sorted(set(needed) - set(hosts))
    if missing and now_s - connected_since_s < grace_s:
        return f"waiting for status from {', '.join(missing)}"
    return None

def execute(view: ActView, actions: Sequence[Action], *, planned_on: ActView | None = None) -> ActDecision:
    """The effects of the plan's actions (see the module docstring). `planned_on`: the view the plan
    was made from; incomplete (statuses still arriving after a restart) -> nothing is done, even if
    the view is complete by now: a plan made without the hosts' reports stops what it did not see."""
    if view.connected_since_s is None:
        return _defer_all(view, actions, "MQTT down", DeferCause.MQTT_DOWN,
                          {AlertKey(AlertKind.MQTT): "not connected to MQTT; not acting"})
    why = incomplete(view) or (incomplete(planned_on) if planned_on is not None else None)
    if why is not None:
        return _defer_all(view, actions, why if planned_on is None or incomplete(view) else f"planned while {why}",
                          DeferCause.INCOMPLETE, {})
    effects: list[Effect] = []
    counts = {"start": 0, "drain": 0, "stop": 0, "deferred": 0}
    rows = list(view.replicas)
    cur = view  # with this cycle's new builds (their GPUs are busy for the next starts)
    noted = set(view.noted)
    first: set[str] = set()
    blocked: dict[str, set[tuple[str, int]]] = {}  # model -> (host, GPU) its deferred starts wait for
    unstarted: set[str] = set()  # models with a start deferred for a reason no drain removes
    for a in actions:
        eff: Effect | None
        if a.kind == ActionKind.START:
            eff = _start(cur, a, rows)
            if isinstance(eff, Record):
                busy, _ = _busy(cur, a.replica.host, rows)
                waits = {(a.replica.host, g) for g in a.replica.gpu_indices if g in busy}
                blocked.setdefault(a.replica.config.model, set()).update(waits)
                if not waits:  # deferred for another reason (host, port, template): nothing frees it
                    unstarted.add(a.replica.config.model)
        elif a.kind == ActionKind.BUILD:
            eff = _build(cur, a, rows, noted)
        else:
            continue
        if isinstance(eff, NewReplica):
            rows.append(eff.row)
            counts["start"] += 1
            first.add(eff.row.host)
        elif isinstance(eff, NewBuild):
            cur = replace(cur, builds=(*cur.builds, eff.row))
            counts["build"] = counts.get("build", 0) + 1
            first.add(eff.row.host)
        else:
            counts["deferred"] += 1
        if eff is not None:
            effects.append(eff)
    drains, removed_hosts = _stop_or_drain(view, actions, rows, effects, counts, blocked, unstarted)
    out, still = repeat_deferrals(effects, view.deferrals, view.now_s)
    key = AlertKey(AlertKind.UNREACHABLE)
    cannot = unreachable(view, actions)
    return ActDecision(tuple(out), publish_first=frozenset(first), publish=frozenset(removed_hosts),
                       drains=tuple(drains), alerts={key: cannot} if cannot is not None else {},
                       cleared=frozenset({AlertKey(AlertKind.MQTT)} | ({key} if cannot is None else set())),
                       counts=counts, noted=frozenset(noted), deferrals=still)


def _defer_all(view: ActView, actions: Sequence[Action], why: str, cause: DeferCause,
               alerts: Mapping[AlertKey, str]) -> ActDecision:
    effects, still = repeat_deferrals([_deferred(a, cause, why) for a in actions], view.deferrals, view.now_s)
    return ActDecision(tuple(effects), alerts=alerts, counts={"start": 0, "drain": 0, "stop": 0,
                                                              "deferred": len(actions)}, deferrals=still)


def _start(view: ActView, a: Action, rows: Sequence[ReplicaRow]) -> NewReplica | Record:
    r = a.replica
    host = view.hosts.get(r.host)
    if host is None or not host.online:
        return _deferred(a, DeferCause.NO_AGENT, f"host {r.host} has no online agent")
    where, gpus = r.host, tuple(r.gpu_indices)
    busy_gpus, busy_ports = _busy(view, where, rows)
    clash = sorted(busy_gpus & set(gpus))
    moved = ""
    if clash:
        # GPUs still held (an engine stopping, a build, the drained replica of a swap): take other free
        # GPUs of the type in one NVLink group now (the next plan sees them held: held_gpus)
        spot = _free_spot(view, r.config.gpu.value, r.config.tp, rows, prefer=r.host, only=a.hosts)
        if spot is None:
            return _deferred(a, DeferCause.GPUS_BUSY, f"GPUs {clash} on {r.host} still in use")
        moved = f" (planned GPUs {list(gpus)} on {r.host} busy: moved)"
        where, gpus = spot
        host = view.hosts[where]
        busy_gpus, busy_ports = _busy(view, where, rows)
    lo, hi = host.port_range or view.settings.default_port_range
    port = next((p for p in range(lo, hi + 1) if p not in busy_ports), None)
    if port is None:
        return _deferred(a, DeferCause.NO_PORT, f"no free port in {lo}-{hi} on {where}")
    c = r.config
    template = template_for(view, c.engine.value, role=c.role)
    why_not = _unoffered(view, where, template)
    if why_not is not None:
        return _deferred(a, DeferCause.UNOFFERED, why_not)
    row = ReplicaRow("", where, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value,
                     gpus, port, template, Phase.DESIRED,
                     "planned", view.now_s, view.now_s, None, None, c.role.value)
    return NewReplica(row, Note("start", ActionStatus.PUBLISHED, a.reason,
                                f"{where} port {port}, GPUs {list(gpus)}{moved}", "", where, c.model))


def _free_spot(view: ActView, gpu: str, tp: int, rows: Sequence[ReplicaRow], prefer: str,
               only: frozenset[str] | None = None) -> tuple[str, tuple[int, ...]] | None:
    """`tp` free GPUs of type `gpu` inside one NVLink group of an online host (`prefer` first; with
    `only`, one of those hosts: the ones holding the replica's built engine)."""
    for name in sorted(view.hosts, key=lambda h: (h != prefer, h)):
        h = view.hosts[name]
        if not h.online or h.gpu != gpu or h.gpu_count is None or (only is not None and name not in only):
            continue
        busy, _ = _busy(view, name, rows)
        spot = first_free(h.nvlink_groups or (tuple(range(h.gpu_count)),), busy, tp)
        if spot is not None:
            return name, spot
    return None


def _build(view: ActView, a: Action, rows: Sequence[ReplicaRow],
           noted: set[tuple[str, str]]) -> NewBuild | Record | None:
    """A TensorRT-LLM engine build on the GPUs the plan reserved; a repeated deferral is noted once
    (the planner repeats the BUILD every cycle until it can run)."""
    r = a.replica
    c = r.config
    label = c.label()

    def defer(why: str) -> Record | None:
        if (label, why) in noted:
            return None
        noted.add((label, why))
        return Record(_note(a, ActionStatus.DEFERRED, why))

    key = (c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value)
    if any((b.model, b.engine, b.gpu, b.tp, b.precision) == key for b in view.builds):
        return None  # already building
    host = view.hosts.get(r.host)
    if not r.host or not r.gpu_indices or host is None or not host.online:
        return defer("no free GPUs on an online host to build on yet")
    template = template_for(view, c.engine.value, build=True)
    why_not = _unoffered(view, r.host, template, build=True)
    if why_not is not None:
        return defer(why_not)
    busy, _ = _busy(view, r.host, rows)
    clash = sorted(busy & set(r.gpu_indices))
    if clash:
        return defer(f"GPUs {clash} on {r.host} still in use")
    row = BuildRow("", r.host, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value,
                   tuple(r.gpu_indices), template, Phase.DESIRED, view.now_s, view.now_s, None)
    return NewBuild(row, _note(a, ActionStatus.PUBLISHED, f"template {template}, GPUs {list(r.gpu_indices)}",
                               kind="build", replica_id=""))


def _stop_or_drain(view: ActView, actions: Sequence[Action], rows: Sequence[ReplicaRow], effects: list[Effect],
                   counts: dict[str, int], blocked: Mapping[str, set[tuple[str, int]]],
                   unstarted: set[str]) -> tuple[list[str], set[str]]:
    """DRAIN/STOP: a replica that never served is removed at once; a serving one drains unless a
    replica of the same model is still starting, or its replacement could not start yet on GPUs
    this drain does not free (start before stop). A replacement planned on the drained replica's
    own GPUs needs the drain first: allowed only while another replica of the model serves."""
    active = {r.replica_id: r for r in rows}
    starting = [r for r in rows if r.phase == Phase.DESIRED and r.ready_s is None]
    drains: list[str] = []
    removed: set[str] = set()
    removed_hosts: set[str] = set()
    for a in actions:
        if a.kind not in (ActionKind.DRAIN, ActionKind.STOP):
            continue
        rid = a.replica.replica_id
        row = active.get(rid)
        if row is None or row.phase == Phase.DRAINING or rid in drains or rid in removed:
            continue  # unknown / already removed / drain in progress
        h = view.hosts.get(row.host)
        if h is not None and h.lost(view.now_s, view.settings.host_offline_grace_s):
            # nothing reaches it and its in-flight count is unknowable: a drain would only wait for
            # its deadline while the host's GPUs and the replica's record stay held
            effects.append(SetPhase(rid, Phase.REMOVED, _note(a, ActionStatus.DONE, "removed without draining: "
                                                              "host lost", kind="stop"), cancel_start=True))
            counts["stop"] += 1
            removed_hosts.add(row.host)
            removed.add(rid)
            continue
        if row.ready_s is None or a.replica.state != ReplicaState.READY:
            effects.append(SetPhase(rid, Phase.REMOVED, _note(a, ActionStatus.DONE, "removed (not serving)",
                                                              kind="stop"), cancel_start=True))
            counts["stop"] += 1
            removed_hosts.add(row.host)
            removed.add(rid)
            continue
        if not a.covered and any(r.model == row.model and r.replica_id != rid for r in starting):
            # make-before-break (one rule, planner/core.py `_make_before_break`): the planner marks a
            # drain `covered` when READY capacity without it covers the required rate; any other
            # drain waits while a replacement of its model is starting (this view is the freshest)
            effects.append(_deferred(a, DeferCause.STARTING,
                                     "start before stop: a replica of this model is still starting"))
            counts["deferred"] += 1
            continue
        if row.model in unstarted:
            effects.append(_deferred(a, DeferCause.NOT_STARTED,
                                     "start before stop: this model's replacement could not start"))
            counts["deferred"] += 1
            continue
        waits = blocked.get(row.model, set())
        others_serving = any(r.model == row.model and r.replica_id != rid and r.ready_s is not None
                             and r.phase == Phase.DESIRED and r.replica_id not in drains for r in rows)
        if waits - {(row.host, g) for g in row.gpu_indices} or (waits and not others_serving):
            # the replacement waits for GPUs this drain does not free, or for this replica's own GPUs
            # while nothing else of the model serves: draining now would be an outage
            effects.append(_deferred(a, DeferCause.WAITS_GPUS,
                                     "start before stop: this model's replacement waits for busy GPUs"))
            counts["deferred"] += 1
            continue
        effects.append(SetPhase(rid, Phase.DRAINING, _note(a, ActionStatus.PUBLISHED, "draining: removed from routing",
                                                           kind="drain")))
        drains.append(rid)
        counts["drain"] += 1
    return drains, removed_hosts
