"""What the controller knows of its hosts: each agent's last status (from MQTT), when it came and
went, the retained desired states the broker holds from this controller, malformed messages and
flapping hosts, and each host's recorded inventory. Only bookkeeping: the decisions on it are the
act core's (planner/act.py), which sees a host through `host_report`, and the inventory rule's
(planner/inventory.py `judge`: believe a report, or hold it and plan only on what is vouched for)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleetplan.controller.protocol import DesiredState, HostStatus
from fleetplan.controller.state import StateStore
from fleetplan.controller.state_inventory import generation, load_records, save_records
from fleetplan.planner.act import AlertKey, AlertKind, BuildState, HostReport, ReportedBuild, ReportedReplica
from fleetplan.planner.host_grace import within_grace
from fleetplan.planner.inventory import Inventory, InventoryRecord, judge, keep_in_use
from fleetplan.planner.types import ReplicaState

PolicyHosts = dict[str, tuple[str, int, tuple[tuple[int, ...], ...]]]  # host -> (gpu, gpu_count, nvlink_groups)

log = logging.getLogger(__name__)


def retained_replica(d: Any) -> ReportedReplica:
    """A replica a retained desired state names (what this controller once asked for)."""
    return ReportedReplica(d.replica_id, ReplicaState.STARTING, d.model, d.engine.value,
                           d.gpu.value if d.gpu is not None else None, d.tp, d.precision.value,
                           tuple(d.gpu_indices), d.port, d.template, role=d.role.value)


def host_report(st: HostStatus, offline_since_s: float | None = None) -> HostReport:
    """The act core's view of one agent status (protocol types stay at the edge)."""
    return HostReport(
        st.host, st.online, st.gpu.value if st.gpu is not None else None, st.gpu_count,
        tuple(tuple(g) for g in st.nvlink_groups), st.port_range,
        tuple(st.templates), tuple(st.build_templates),
        tuple(ReportedReplica(r.replica_id, ReplicaState(r.state.value), r.model, r.engine.value,
                              r.gpu.value if r.gpu is not None else None, r.tp, r.precision.value,
                              tuple(r.gpu_indices), r.port, r.template, r.since_s, r.role.value)
              for r in st.replicas),
        tuple(ReportedBuild(b.build_id, BuildState(b.state.value), tuple(b.gpu_indices), b.error)
              for b in st.builds),
        offline_since_s,
    )


@dataclass
class HostBook:
    """The agents' last statuses and what came with them (wall-clock seconds from `wall`).

    `alerts` is the controller's runtime alert map (shared): wire/<host> for malformed messages,
    flap/<host> for a host going online/offline more than FLAP_MAX_TRANSITIONS times in
    FLAP_WINDOW_S."""

    alerts: MutableMapping[AlertKey, str]
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
    # the policy's inventory: host -> (gpu, gpu_count, nvlink_groups); each report is judged against
    # it and the host's record (planner/inventory.py), a held one alerted as inventory/<host>
    inventory: Callable[[], PolicyHosts] = dict
    records: dict[str, InventoryRecord] = field(default_factory=dict)  # host -> recorded inventory
    unsaved: dict[str, InventoryRecord] = field(default_factory=dict)  # records not yet in the store
    _generation: int | None = None  # the store's inventory generation the records were read at
    # per host: (report, record, policy entry, policy lists hosts) -> the judged report (a report is
    # judged again only when one of them changed)
    _judged: dict[str, tuple[tuple[Any, ...], HostReport]] = field(default_factory=dict)

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
            self.alerts.pop(AlertKey(AlertKind.WIRE, host), None)
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
        self.alerts[AlertKey(AlertKind.WIRE, host)] = f"host {host}: {n} malformed message(s) rejected; last: {text}"

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
        key = AlertKey(AlertKind.FLAP, host)
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
        return within_grace(st.online, self.offline_since.get(host), now_s=self.wall(), grace_s=self.offline_grace_s)

    def reported(self) -> dict[str, tuple[str, Any]]:
        """replica id -> (host, ReplicaStatus) from the agents' last status."""
        return {rs.replica_id: (host, rs) for host, st in self.statuses.items() for rs in st.replicas}

    def reports(self) -> dict[str, HostReport]:
        """The act core's view of each host, as far as its inventory is believed (`judge`)."""
        out = self._reports
        for h, st in self.statuses.items():
            if h not in out:
                out[h] = host_report(st, self.offline_since.get(h))
        policy = self.inventory()
        lists = bool(policy)
        judged = {}
        for h, r in out.items():
            spec = policy.get(h)
            rec = self.records.get(h)
            key = (r, rec, spec, lists)
            seen = self._judged.get(h)
            if seen is not None and seen[0][0] is r and seen[0][1] is rec and seen[0][2:] == key[2:]:
                judged[h] = seen[1]
                continue
            judged[h] = self._judge(h, r, rec, spec, lists)
            self._judged[h] = ((r, self.records.get(h), spec, lists), judged[h])
        return judged

    def _judge(self, h: str, r: HostReport, rec: InventoryRecord | None,
               spec: tuple[str, int, tuple[tuple[int, ...], ...]] | None, lists: bool) -> HostReport:
        reported = (Inventory(r.gpu, r.gpu_count, r.nvlink_groups)
                    if r.gpu is not None and r.gpu_count is not None else None)
        j = judge(h, reported, rec, Inventory(*spec) if spec is not None else None, policy_lists_hosts=lists,
                  now_s=self.wall())
        if j.record is not None:
            self.records[h] = self.unsaved[h] = j.record
            log.info("host %s: inventory recorded: %s (%s)", h, j.record.inventory.describe(), j.record.voucher.value)
        key = AlertKey(AlertKind.INVENTORY, h)
        if j.alert is None:
            self.alerts.pop(key, None)
        else:
            if self.alerts.get(key) != j.alert:
                log.warning("%s", j.alert)
            self.alerts[key] = j.alert
        if j.plan_on is None:
            return r
        held = keep_in_use(j.plan_on, (x.gpu_indices for x in r.replicas))  # a hold drains nothing
        return replace(r, gpu_count=held.gpu_count, nvlink_groups=held.groups())

    def sync_inventory(self, store: StateStore) -> None:
        """Once per cycle: the new records into the store; the store's records read again when
        something else changed them (`fleetplan hosts confirm`). The first call reads them before
        any report is judged."""
        if self.unsaved:
            save_records(store, self.unsaved)
            self.unsaved.clear()
        gen = generation(store)
        if gen != self._generation:
            self.records = load_records(store._db)
            self._generation = gen
            self._judged.clear()

    def take_dirty(self) -> dict[str, dict[str, Any]]:
        """The statuses that changed since the last call, as JSON for the state store (one commit per
        cycle instead of one fsynced commit per message on the event loop)."""
        out = {h: self.statuses[h].model_dump(mode="json") for h in sorted(self.dirty) if h in self.statuses}
        self.dirty.clear()
        return out
