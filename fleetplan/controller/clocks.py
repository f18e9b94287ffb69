"""The controller's clocks: one that never steps for every duration, the wall clock watched.

- `SteadyClock.now`: unix seconds taken from the wall clock once, at start, then advanced by the
  monotonic clock. Every duration and timestamp of the controller and its pieces (the cycle's
  `now_s` and the simulated clock, holds, offline graces, ack/ready/drain deadlines, the stall
  check, the state store's records) reads it, so a step of the wall clock while the controller
  runs moves none of them; a restart takes the wall time again.
- Prometheus is asked at its own time (controller/observe.py: its `time()`), not the controller's.
- `ClockGuard` compares the wall clock with the monotonic one every cycle (planner/clockstep.py):
  a step is alerted by name ("the clock stepped -3600 s"), the cycle takes no action and the
  request-rate history is read afresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

from fleetplan.planner import clockstep
from fleetplan.planner.act_types import AlertKey, AlertKind

log = logging.getLogger(__name__)

CLOCK_ALERT = AlertKey(AlertKind.CLOCK)  # the runtime alert's key
CLOCK_ALERT_HOLD_S = 600.0  # a step stays alerted this long (monotonic seconds)


@dataclass
class SteadyClock:
    """Unix seconds that advance with the monotonic clock: the wall time at start plus the
    monotonic time since. `wall` and `mono` are injectable (tests step `wall`)."""

    wall: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._origin_s = self.wall() - self.mono()

    def now(self) -> float:
        return self._origin_s + self.mono()


@dataclass
class ClockGuard:
    """The wall clock against the monotonic one, once per cycle: the runtime alert while a step
    stands; `check` returns the step seen since the last cycle (None: none)."""

    clock: SteadyClock
    tolerance_s: float = 2.0
    alert_hold_s: float = CLOCK_ALERT_HOLD_S
    state: clockstep.ClockWatch = field(default_factory=clockstep.ClockWatch)

    def check(self, alerts: MutableMapping[AlertKey, str]) -> float | None:
        reading = clockstep.ClockReading(self.clock.wall(), self.clock.mono())
        self.state, verdict = clockstep.watch(self.state, reading, name=clockstep.WhichClock.CONTROLLER.value, tolerance_s=self.tolerance_s,
                                              alert_hold_s=self.alert_hold_s)
        if verdict.stepped_s is not None:
            log.warning("%s", verdict.alert)
        if verdict.alert is not None:
            alerts[CLOCK_ALERT] = verdict.alert
        else:
            alerts.pop(CLOCK_ALERT, None)
        return verdict.stepped_s


def observe_deadlines(cycle_wall_s: float, query_s: float | None, observe_s: float | None) -> tuple[float, float]:
    """(each Prometheus query's deadline, the whole observation's), wall seconds: the settings'
    when set, else derived from the cycle period so that a late Prometheus leaves a long period as
    it is: the observation half a period, each query 0.4 of one (never more than the observation),
    within 2-30 s and 2-10 s. The 2 s floor keeps a busy machine's slow answers from failing a
    short cycle static: at a 1.5 s period a late Prometheus stretches the cycle to about 2 s.

    >>> observe_deadlines(1.5, None, None), observe_deadlines(60.0, None, None), observe_deadlines(8.0, 3.0, None)
    ((2.0, 2.0), (10.0, 30.0), (3.0, 4.0))
    """
    observe = observe_s if observe_s is not None else min(30.0, max(2.0, 0.5 * cycle_wall_s))
    query = query_s if query_s is not None else min(10.0, max(2.0, 0.4 * cycle_wall_s))
    return min(query, observe), observe
