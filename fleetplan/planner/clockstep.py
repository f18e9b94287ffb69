"""Steps of a wall clock, and what a cycle does about them (pure: the readings are arguments).

A wall clock (the controller's, or Prometheus's as its `time()` answers) may step: an NTP
correction, an operator's `date -s`, a VM resumed. A monotonic clock never does. Between two
readings taken at the same moments, the wall clock should move as far as the monotonic one; when
the two deltas differ by more than a tolerance, the wall clock stepped by the difference. A
cycle that sees a step takes no action (the time ranges it read may not mean what they say), reads
the request-rate history afresh, and alerts by name for `alert_hold_s` on the monotonic clock.

>>> w = ClockWatch()
>>> w, v = watch(w, ClockReading(wall_s=1000.0, mono_s=5.0), name="the clock", tolerance_s=2.0, alert_hold_s=600.0)
>>> v.stepped_s is None, v.alert is None
(True, True)
>>> w, v = watch(w, ClockReading(wall_s=-2590.0, mono_s=15.0), name="the clock", tolerance_s=2.0, alert_hold_s=600.0)
>>> v.stepped_s
-3600.0
>>> v.alert.startswith("the clock stepped -3600 s")
True
>>> history_from(last_point_s=2000.0, start_s=-1000.0, end_s=1500.0) is None  # read afresh: a point after the end
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class WhichClock(Enum):
    """The wall clocks a cycle reads; the value is how alerts name it."""

    CONTROLLER = "the clock"
    PROMETHEUS = "Prometheus's clock"


@dataclass(frozen=True)
class ClockReading:
    """One reading of a wall clock (unix seconds) and of a monotonic clock, taken together."""

    wall_s: float
    mono_s: float


@dataclass(frozen=True)
class ClockStep:
    step_s: float  # how far the wall clock moved beyond the monotonic one (negative: back)
    at_mono_s: float  # when it was seen (monotonic seconds)


@dataclass(frozen=True)
class ClockWatch:
    """What `watch` keeps between cycles: the last reading and the last step seen."""

    last: ClockReading | None = None
    step: ClockStep | None = None


@dataclass(frozen=True)
class ClockVerdict:
    stepped_s: float | None = None  # a step since the last reading (this cycle takes no action); None: none
    alert: str | None = None  # the standing alert (a step within `alert_hold_s`); None: none


def step_between(prev: ClockReading, now: ClockReading, tolerance_s: float) -> float | None:
    """How far the wall clock stepped between two readings (wall delta minus monotonic delta), or
    None when the two agree within `tolerance_s`.

    >>> step_between(ClockReading(100.0, 0.0), ClockReading(3710.0, 10.0), 2.0)
    3600.0
    >>> step_between(ClockReading(100.0, 0.0), ClockReading(111.5, 10.0), 2.0) is None  # 1.5 s late: no step
    True
    """
    step = (now.wall_s - prev.wall_s) - (now.mono_s - prev.mono_s)
    return step if abs(step) > tolerance_s else None


def watch(state: ClockWatch, reading: ClockReading, *, name: str, tolerance_s: float,
          alert_hold_s: float) -> tuple[ClockWatch, ClockVerdict]:
    """Take one reading of the clock called `name` ("the clock", "Prometheus's clock"): the state
    for the next one and this cycle's verdict (a step now: no action; the alert while it stands)."""
    stepped = None if state.last is None else step_between(state.last, reading, tolerance_s)
    step = ClockStep(stepped, reading.mono_s) if stepped is not None else state.step
    if step is not None and reading.mono_s - step.at_mono_s > alert_hold_s:
        step = None
    alert = None
    if step is not None:
        ago = reading.mono_s - step.at_mono_s
        alert = (f"{name} stepped {step.step_s:+.0f} s ({ago:.0f} s ago; the wall time moved that much more than "
                 "the monotonic clock between two cycles): no action was taken on that cycle and the "
                 "request-rate history was read afresh; the controller's timers run on the monotonic clock")
    return ClockWatch(reading, step), ClockVerdict(stepped, alert)


@dataclass(frozen=True)
class StepSeen:
    clock: WhichClock
    step_s: float


def step_this_cycle(controller_step_s: float | None, prometheus_step_s: float | None) -> StepSeen | None:
    """The step this cycle must not act on (the controller's clock first), or None: act.

    >>> step_this_cycle(None, None) is None
    True
    >>> step_this_cycle(None, -3600.0)
    StepSeen(clock=<WhichClock.PROMETHEUS: "Prometheus's clock">, step_s=-3600.0)
    """
    if controller_step_s is not None:
        return StepSeen(WhichClock.CONTROLLER, controller_step_s)
    if prometheus_step_s is not None:
        return StepSeen(WhichClock.PROMETHEUS, prometheus_step_s)
    return None


def history_from(last_point_s: float | None, start_s: float, end_s: float) -> float | None:
    """Where the next request-rate range query over [`start_s`, `end_s`] starts, given the last
    point already read: at that point (read again, its window may have grown), or None to read
    the whole span afresh: nothing read yet, the points read are older than the span, or newer
    than its end (the clock went back: a range [last, end] would end before it starts).

    >>> history_from(900.0, 0.0, 1000.0)
    900.0
    >>> history_from(None, 0.0, 1000.0) is None, history_from(-5.0, 0.0, 1000.0) is None
    (True, True)
    """
    if last_point_s is None or last_point_s < start_s or last_point_s > end_s:
        return None
    return last_point_s


def range_makes_sense(start_s: float, end_s: float) -> bool:
    """A time range a query may ask for: finite and not ending before it starts.

    >>> range_makes_sense(0.0, 10.0), range_makes_sense(10.0, 0.0), range_makes_sense(0.0, float("nan"))
    (True, False, False)
    """
    return math.isfinite(start_s) and math.isfinite(end_s) and start_s <= end_s
