"""Steps of a wall clock and what a cycle does about them (planner/clockstep.py), without servers."""

from __future__ import annotations

import pytest

from fleetplan.planner.clockstep import (
    ClockReading,
    ClockWatch,
    WhichClock,
    history_from,
    range_makes_sense,
    step_between,
    step_this_cycle,
    watch,
)

KW = {"name": "the clock", "tolerance_s": 2.0, "alert_hold_s": 600.0}


def _run(readings: list[tuple[float, float]]) -> list[tuple[float | None, str | None]]:
    state, out = ClockWatch(), []
    for wall, mono in readings:
        state, v = watch(state, ClockReading(wall, mono), **KW)  # type: ignore[arg-type]
        out.append((v.stepped_s, v.alert))
    return out


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0, -5.0, 30.0])
def test_a_step_either_way_is_seen_once_and_named_with_its_size(step_s: float) -> None:
    # cycles 10 s apart on the monotonic clock; the wall clock steps between the 2nd and the 3rd
    out = _run([(1000.0, 0.0), (1010.0, 10.0), (1020.0 + step_s, 20.0), (1030.0 + step_s, 30.0)])
    assert [s for s, _ in out] == [None, None, step_s, None]
    assert out[1][1] is None
    for _, alert in out[2:]:
        assert alert is not None and alert.startswith(f"the clock stepped {step_s:+.0f} s")
        assert "no action was taken" in alert


def test_late_cycles_and_small_slews_are_not_steps() -> None:
    # a cycle 25 s late moves both clocks alike; 1.5 s of disagreement is within the tolerance
    out = _run([(1000.0, 0.0), (1035.0, 35.0), (1046.5, 45.0), (1056.5, 55.0)])
    assert out == [(None, None)] * 4


def test_the_alert_stands_for_its_hold_then_clears() -> None:
    out = _run([(0.0, 0.0), (-3590.0, 10.0), (-3000.0, 600.0), (-2989.0, 611.0)])
    assert out[1][0] == -3600.0 and out[2][1] is not None  # 590 s after the step: still alerted
    assert out[3] == (None, None)  # 601 s after: cleared


def test_the_step_is_the_wall_delta_minus_the_monotonic_delta() -> None:
    assert step_between(ClockReading(100.0, 50.0), ClockReading(40.0, 60.0), 2.0) == -70.0
    assert step_between(ClockReading(100.0, 50.0), ClockReading(111.9, 60.0), 2.0) is None


@pytest.mark.parametrize(("last", "expected"), [
    (None, None),  # nothing read yet: the whole span
    (500.0, 500.0),  # the steps since the last point (read again)
    (-10.0, None),  # what was read is older than the span
    (1500.0, None),  # after the end: the clock went back; [last, end] would end before it starts
    (1000.0, 1000.0),  # exactly at the end: one point, read again
])
def test_history_is_read_afresh_when_what_was_read_does_not_fit_the_span(last: float | None,
                                                                         expected: float | None) -> None:
    assert history_from(last, 0.0, 1000.0) == expected


def test_a_range_ending_before_it_starts_makes_no_sense() -> None:
    assert range_makes_sense(0.0, 0.0) and range_makes_sense(-3600.0, 0.0)
    assert not range_makes_sense(3600.0, 0.0)
    assert not range_makes_sense(float("-inf"), 0.0)


def test_a_cycle_acts_only_when_neither_clock_stepped() -> None:
    assert step_this_cycle(None, None) is None
    own = step_this_cycle(-3600.0, 5.0)
    assert own is not None and own.clock is WhichClock.CONTROLLER and own.step_s == -3600.0
    prom = step_this_cycle(None, 3600.0)
    assert prom is not None and prom.clock is WhichClock.PROMETHEUS and prom.step_s == 3600.0
