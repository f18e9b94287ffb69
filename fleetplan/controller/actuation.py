"""The daemon's side of the brakes (planner/brakes.py decides): the pause flag persisted in the
state store, the actuation history read from it, and the call into the pure `apply_brakes`.

The pause is a kv entry (`actuation_pause`), so a restarted controller stays paused. It is set
by `fleetplan pause` / `fleetplan resume` through the report API (POST /api/pause, /api/resume,
bearer token when the API has one) and takes effect at the next cycle's act step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fleetplan.controller.state import StateStore
from fleetplan.planner import records
from fleetplan.planner.brakes import HOUR_S, PastAction

PAUSE_KEY = "actuation_pause"


@dataclass(frozen=True)
class PauseState:
    paused: bool
    since_s: float | None = None  # wall seconds
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"paused": self.paused, "since_s": self.since_s, "reason": self.reason}


def load_pause(store: StateStore) -> PauseState:
    d = store.get_kv(PAUSE_KEY)
    if not isinstance(d, dict) or not d.get("paused"):
        return PauseState(False)
    return PauseState(True, d.get("since_s"), str(d.get("reason") or ""))


def save_pause(store: StateStore, paused: bool, reason: str = "", *, wall_s: float | None = None) -> PauseState:
    """Persist the pause (resume clears it) before the caller reports success."""
    state = PauseState(True, wall_s if wall_s is not None else time.time(), reason) if paused else PauseState(False)
    store.set_kv(PAUSE_KEY, state.to_json())
    return state


def history(store: StateStore, to_sim: Callable[[float], float], now_wall_s: float,
            time_scale: float) -> list[PastAction]:
    """The brakes' history (planner/records.py `history`) of the last hour of the planner's clock,
    read from the action log, on the planner's clock."""
    since = now_wall_s - HOUR_S / max(time_scale, 1e-9)
    return [replace(p, at_s=to_sim(p.at_s)) for p in records.history(store.action_entries(since))]
