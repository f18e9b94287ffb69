"""What the controller knows of its hosts: each agent's last status (from MQTT), when it came and
went, the retained desired states the broker holds from this controller, malformed messages and
flapping hosts. Only bookkeeping: the decisions on it are the act core's (planner/act.py), which
sees a host through `host_report`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleetplan.controller.protocol import DesiredState, HostStatus
from fleetplan.planner.act import BuildState, HostReport, ReportedBuild, ReportedReplica
from fleetplan.planner.types import ReplicaState

log = logging.getLogger(__name__)


def retained_replica(d: Any) -> ReportedReplica:
    """A replica a retained desired state names (what this controller once asked for)."""
    return ReportedReplica(d.replica_id, ReplicaState.STARTING, d.model, d.engine.value,
                           d.gpu.value if d.gpu is not None else None, d.tp, d.precision.value,
                           tuple(d.gpu_indices), d.port, d.template)


def host_report(st: HostStatus, offline_since_s: float | None = None) -> HostReport:
    """The act core's view of one agent status (protocol types stay at the edge)."""
    return HostReport(
        st.host, st.online, st.gpu.value if st.gpu is not None else None, st.gpu_count,
        tuple(tuple(g) for g in st.nvlink_groups), st.port_range,
        tuple(st.templates), tuple(st.build_templates),
        tuple(ReportedReplica(r.replica_id, ReplicaState(r.state.value), r.model, r.engine.value,
                              r.gpu.value if r.gpu is not None else None, r.tp, r.precision.value,
                              tuple(r.gpu_indices), r.port, r.template, r.since_s) for r in st.replicas),
        tuple(ReportedBuild(b.build_id, BuildState(b.state.value), tuple(b.gpu_indices), b.error)
              for b in st.builds),
        offline_since_s,
    )


def agree(report: HostReport, gpu: str | None, gpu_count: int | None,
          nvlink_groups: tuple[tuple[int, ...], ...] = ()) -> tuple[HostReport, str | None]:
    """The host as the planner and the act core may use it: the agent's report where the policy's
    inventory (`gpu`, `gpu_count`, `nvlink_groups`; None: not in the policy) agrees, the smaller
    one where they differ; and what contradicts the policy (more GPUs, another type), or None. A
    status cannot add GPUs to a host (a lying or misconfigured agent would have replicas placed on
    GPUs the host does not have); fewer GPUs than the policy (one failed) are believed.

    >>> r = HostReport("h", True, "h100", 24, (tuple(range(24)),))
    >>> ok, why = agree(r, "h100", 8)
    >>> ok.gpu_count, ok.nvlink_groups, why
    (8, ((0, 1, 2, 3, 4, 5, 6, 7),), 'host h reports 24 h100 GPU(s), its policy inventory 8 h100: planning on 8')
    >>> agree(HostReport("h", True, "h100", 4, ((0, 1, 2, 3),)), "h100", 8)[0].gpu_count  # one failed: believed
    4
    >>> bad, why = agree(HostReport("h", True, "a100", 8), "h100", 8)
    >>> bad.gpu_count, why
    (0, 'host h reports 8 a100 GPU(s), its policy inventory 8 h100: planning on none of them')
    >>> agree(r, None, None)[0] is r
    True
    """
    if gpu is None or gpu_count is None or report.gpu is None or report.gpu_count is None:
        return report, None
    said = f"host {report.name} reports {report.gpu_count} {report.gpu} GPU(s), its policy inventory {gpu_count} {gpu}"
    if report.gpu.lower() != gpu.lower():
        return replace(report, gpu_count=0, nvlink_groups=()), f"{said}: planning on none of them"
    if report.gpu_count <= gpu_count:
        return report, None
    groups = nvlink_groups or tuple(g for g in (tuple(i for i in grp if i < gpu_count)
                                                for grp in report.nvlink_groups) if g)
    return replace(report, gpu_count=gpu_count, nvlink_groups=groups), f"{said}: planning on {gpu_count}"


@dataclass
class HostBook:
    """The agents' last statuses and what came with them (wall-clock seconds from `wall`).

    `alerts` is the controller's runtime alert map (shared): wire/<host> for malformed messages,
    flap/<host> for a host going online/offline more than FLAP_MAX_TRANSITIONS times in
    FLAP_WINDOW_S."""

    alerts: MutableMapping[str, str]
    offline_grace_s: float
    wall: Callable[[], float] = time.time
    statuses: dict[str, HostStatus] = field(default_factory=dict)
    status_wall: dict[str, float] = field(default_factory=dict)  # host -> last status (wall)
    offline_since: dict[str, float] = field(default_factory=dict)
    retained_desired: dict[str, DesiredState] = field(default_factory=dict)  # what the broker holds from us
    rejected_messages: dict[str, int] = field(default_factory=dict)  # host -> malformed messages rejected
    rejected_wall: dict[str, float] = field(default_factory=dict)  # host -> last malformed message (wall)
    flaps: dict[str, list[float]] = field(default_factory=dict)  # host -> online/offline transitions (wall)
    dirty: set[str] = field(default_factory=set)  # hosts whose status is not yet in the state store
    # the act core's view of each host, built once per status (routing asks for it on every change:
    # rebuilding 10,000 hosts' reports each time held the loop for seconds per cycle at 10,000 hosts)
    _reports: dict[str, HostReport] = field(default_factory=dict)
    # the policy's inventory: host -> (gpu, gpu_count, nvlink_groups); a status claiming more GPUs or
    # another type is cut to the agreed inventory (`agree`) and alerted as inventory/<host>
    inventory: Callable[[], dict[str, tuple[str, int, tuple[tuple[int, ...], ...]]]] = dict

    WIRE_ALERT_QUIET_S = 300.0  # a host's malformed-message alert clears after this long without one
    FLAP_WINDOW_S = 60.0
    FLAP_MAX_TRANSITIONS = 3

    def on_status(self, host: str, status: HostStatus) -> list[str]:
        """Take one status; returns the replica ids it reports ready."""
        now = self.wall()
        prev = self.statuses.get(host)
        self._note_flap(host, prev.online if prev is not None else None, status.online, now)
        if host in self.rejected_wall and now - self.rejected_wall[host] > self.WIRE_ALERT_QUIET_S:
            del self.rejected_wall[host]
            self.rejected_messages.pop(host, None)
            self.alerts.pop(f"wire/{host}", None)
        # an offline status (the last will) keeps the replicas the host last reported
        self.statuses[host] = status if status.online or prev is None else prev.model_copy(update={"online": False})
        self.status_wall[host] = now
        if status.online:
            self.offline_since.pop(host, None)
        else:
            self.offline_since.setdefault(host, now)
        self.dirty.add(host)
        self._reports.pop(host, None)
        return [r.replica_id for r in status.replicas if r.state.value == "ready"]

    def on_reject(self, host: str, text: str) -> None:
        n = self.rejected_messages[host] = self.rejected_messages.get(host, 0) + 1
        self.rejected_wall[host] = self.wall()
        self.alerts[f"wire/{host}"] = f"host {host}: {n} malformed message(s) rejected; last: {text}"

    def on_desired(self, host: str, desired: DesiredState | None) -> None:
        """The retained desired state the broker holds for `host` (only this controller may write it)."""
        if desired is None:
            self.retained_desired.pop(host, None)
        else:
            self.retained_desired[host] = desired

    def _note_flap(self, host: str, was_online: bool | None, online: bool, now: float) -> None:
        """Count online/offline transitions; too many raise an alert (two agents with one client id,
        a crash loop, a bad network)."""
        times = [t for t in self.flaps.get(host, []) if now - t <= self.FLAP_WINDOW_S]
        if was_online is not None and was_online != online:
            times.append(now)
        self.flaps[host] = times
        key = f"flap/{host}"
        if len(times) > self.FLAP_MAX_TRANSITIONS:
            if key not in self.alerts:
                log.warning("host %s flaps: %d online/offline transitions in %.0f s", host, len(times),
                            self.FLAP_WINDOW_S)
            self.alerts[key] = (
                f"host {host} flaps: {len(times)} online/offline transitions in {self.FLAP_WINDOW_S:.0f} s "
                "(two agents with the same MQTT client id or credentials? an agent crash-looping?)"
            )
        else:
            self.alerts.pop(key, None)

    def online(self, host: str) -> bool:
        """Usable: online, or offline for less than the grace (an agent restart is not a lost host)."""
        st = self.statuses.get(host)
        if st is None:
            return False
        if st.online:
            return True
        return self.wall() - self.offline_since.get(host, self.wall()) < self.offline_grace_s

    def reported(self) -> dict[str, tuple[str, Any]]:
        """replica id -> (host, ReplicaStatus) from the agents' last status."""
        return {rs.replica_id: (host, rs) for host, st in self.statuses.items() for rs in st.replicas}

    def reports(self) -> dict[str, HostReport]:
        """The act core's view of each host, cut to the policy's inventory where a status claims more."""
        out = self._reports
        for h, st in self.statuses.items():
            if h not in out:
                out[h] = host_report(st, self.offline_since.get(h))
        inventory = self.inventory()
        if not inventory:
            return dict(out)
        agreed = {}
        for h, r in out.items():
            spec = inventory.get(h)
            if spec is None:
                agreed[h] = r
                self.alerts.pop(f"inventory/{h}", None)
                continue
            agreed[h], why = agree(r, *spec)
            key = f"inventory/{h}"
            if why is None:
                self.alerts.pop(key, None)
            else:
                if self.alerts.get(key) != why:
                    log.warning("%s", why)
                self.alerts[key] = why
        return agreed

    def take_dirty(self) -> dict[str, dict[str, Any]]:
        """The statuses that changed since the last call, as JSON for the state store (one commit per
        cycle instead of one fsynced commit per message on the event loop)."""
        out = {h: self.statuses[h].model_dump(mode="json") for h in sorted(self.dirty) if h in self.statuses}
        self.dirty.clear()
        return out
