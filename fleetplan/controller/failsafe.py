"""Fail safe when the machine around the controller fails (issue 19): a state store that cannot be
written, a router that is down or refuses its configuration. The controller never dies of these:
it stops acting on what it cannot record, says so (a runtime alert, /healthz "degraded", a metric)
and resumes by itself.

- **The store.** Every cycle starts with store writes (the clock, the hosts' statuses, the cycle
  row) before anything is acted on; a write the database refuses ("database or disk is full", a
  read-only directory: `StateStore.write_error`) ends the cycle there: nothing is reconciled,
  planned, published or routed that could not be recorded. The MQTT session, the report API,
  /healthz and the watchdog pings go on (a live loop). While the alert stands, each cycle first
  probes the store with a write of a cycle's size; once it takes it, the drains a failed write
  interrupted resume and every host's desired state is republished (as a restart does), and the
  first cycle that records everything clears the alert.
- **The router.** Each cycle probes the router's health path (`GET /-/healthy` through nginx) when
  `routing.router_url` is set, and notes the result of the last reload; down or refusing: an alert
  and `fleetplan_router_up 0`. When it answers again, the routing table is rewritten and reloaded
  (through the configured reload command, which signals the master named by nginx's pid file).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fleetplan.controller.state import Phase
from fleetplan.planner.act_types import AlertKey, AlertKind

if TYPE_CHECKING:
    from fleetplan.controller.daemon_face import ControllerFace

log = logging.getLogger(__name__)

STORE_ALERT = AlertKey(AlertKind.STORE)  # runtime alert keys
ROUTER_ALERT = AlertKey(AlertKind.ROUTER)
ROUTING_ALERT = AlertKey(AlertKind.ROUTING)  # controller/executor.py: the last routing update failed


def save_statuses(ctrl: ControllerFace) -> None:
    """The hosts' changed statuses into the store; kept for the next cycle when it cannot be written."""
    dirty = ctrl.hosts.take_dirty()
    try:
        ctrl.store.save_host_statuses(dirty)
    except BaseException:
        ctrl.hosts.dirty.update(dirty)
        raise


def store_failed(ctrl: ControllerFace, cycle_id: int | None) -> None:
    """A store write failed (its error is `store.write_error`): alert, metric, one log line per outage."""
    what = ctrl.store.write_error or f"state store {ctrl.store.path} cannot be written"
    text = (f"{what} (cycle {cycle_id if cycle_id is not None else '-'}): actuation stopped, nothing is acted on "
            "that cannot be recorded; engines keep running; resumes by itself once the store takes writes")
    if STORE_ALERT not in ctrl.runtime_alerts:
        log.error("%s", text)
    ctrl.runtime_alerts[STORE_ALERT] = text
    ctrl.metrics.store_writable.set(0.0)


def store_probe(ctrl: ControllerFace) -> None:
    """During an outage, before acting: the store must take a cycle's worth of records (a probe
    write; raises when it cannot). Then resume what a failed write interrupted: the drains, and
    every host's desired state republished (versions bumped), as a restart does."""
    if STORE_ALERT not in ctrl.runtime_alerts:
        return
    ctrl.store.probe_write()
    ctrl.executor.republish_all = True
    for row in ctrl.store.replicas((Phase.DRAINING,)):
        ctrl.executor.start_drain(row.replica_id)


def cycle_done(ctrl: ControllerFace, status: str) -> None:
    """A cycle that wrote all its records ends the outage: alert cleared, metric back to 1."""
    if status != "ok" or ctrl.store.write_error is not None:
        return
    ctrl.metrics.store_writable.set(1.0)
    if ctrl.runtime_alerts.pop(STORE_ALERT, None) is not None:
        log.warning("state store %s takes writes again: acting again", ctrl.store.path)


def finish_cycle(ctrl: ControllerFace, cycle_id: int, status: str, summary: dict[str, Any]) -> None:
    """The cycle row's end; a store that cannot take it is alerted, never raised."""
    try:
        ctrl.store.finish_cycle(cycle_id, status, summary)
    except Exception:
        if ctrl.store.write_error is None:
            log.exception("cycle %s: finishing the cycle record failed", cycle_id)
        else:
            store_failed(ctrl, cycle_id)


def degraded(ctrl: ControllerFace) -> list[str]:
    """What the controller cannot do now although its loops live (/healthz "degraded"): the store
    cannot be written, the router is down or refuses its configuration."""
    alerts = getattr(ctrl, "runtime_alerts", None) or {}
    return [alerts[k] for k in (STORE_ALERT, ROUTER_ALERT, ROUTING_ALERT) if k in alerts]


async def watch_router(ctrl: ControllerFace) -> None:
    """Probe the router (`routing.router_url`) and note the last reload's result: an alert and
    fleetplan_router_up 0 while it is down or refuses its configuration; when it answers again (or
    serves another table than the routing file), the routing is re-applied at once."""
    from fleetplan.controller.routing import probe_router, read_generation

    alerts = ctrl.runtime_alerts
    url = ctrl.settings.routing.router_url
    if url is not None:
        try:
            served: str | None = await asyncio.to_thread(probe_router, url)
        except Exception as exc:
            text = (f"router {url} is down ({type(exc).__name__}: {exc}): requests do not reach the replicas "
                    "and replicas started meanwhile are not routed; the routing is re-applied when it answers")
            if ROUTER_ALERT not in alerts:
                log.error("%s", text)
            alerts[ROUTER_ALERT] = text
            ctrl.metrics.router_up.set(0.0)
            return
        came_back = alerts.pop(ROUTER_ALERT, None) is not None
        if came_back:
            log.warning("router %s answers again: re-applying the routing", url)
        router = ctrl.executor.router
        want = read_generation(router.current_text() or "") if router is not None else None
        if router is not None and not ctrl.advisory() and (
                came_back or ROUTING_ALERT in alerts or (want is not None and served != want)):
            if want is not None and served != want:
                log.warning("router %s serves routing generation %s, the file %s: reloading", url, served, want)
                try:
                    await asyncio.to_thread(router.reload_now)
                except Exception as exc:
                    alerts[ROUTING_ALERT] = f"routing update failed: {exc}"
                    ctrl.metrics.router_reload_failures.inc()
            await ctrl.executor.update_routing()  # what changed while it was down
    ctrl.metrics.router_up.set(0.0 if ROUTING_ALERT in alerts or ROUTER_ALERT in alerts else 1.0)
