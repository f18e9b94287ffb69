"""The planner's Fleet (hosts, replicas, engine builds) from the agents' reports and the state
store: what runs where, in which state since when, and which engine builds exist or are under way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetplan.controller.hosts import HostBook
from fleetplan.controller.state import StateStore
from fleetplan.planner.act import ActView
from fleetplan.planner.fleetview import fleet_from_view
from fleetplan.planner.types import EngineBuild, Fleet

_INVENTORY: dict[int, tuple[Any, dict[str, tuple[str, int, tuple[tuple[int, ...], ...]]]]] = {}


def policy_inventory(policy: Any) -> dict[str, tuple[str, int, tuple[tuple[int, ...], ...]]]:
    """The policy's `hosts:` as host -> (gpu, gpu_count, nvlink_groups), what a host status may not
    exceed (controller/hosts.py `agree`); one dict per loaded policy."""
    if policy is None:
        return {}
    cached = _INVENTORY.get(id(policy))
    if cached is not None and cached[0] is policy:
        return cached[1]
    inv = {h.name: (str(getattr(h.gpu, "value", h.gpu)), int(h.gpu_count), tuple(tuple(g) for g in h.nvlink_groups))
           for h in getattr(policy, "hosts", ())}
    _INVENTORY.clear()
    _INVENTORY[id(policy)] = (policy, inv)
    return inv


def fleet_from(hosts: HostBook, store: StateStore, view: ActView, to_sim: Callable[[float], float],
               policy: Any, canonical: Callable[[str], str]) -> Fleet:
    """The planner's Fleet by the pure `fleetplan.planner.fleetview.fleet_from_view` (the replay's
    too): the view's host reports are already cut to the agreed inventory (HostBook.reports); the
    engines the agents hold built come from their statuses."""
    cached = [EngineBuild(canonical(ce.model), ce.engine, ce.gpu, ce.tp, ce.precision, host, True, None)
              for host, st in hosts.statuses.items() for ce in st.engines_cached]
    return fleet_from_view(view, cached=cached, to_sim=to_sim, build_s=policy.build_s)
