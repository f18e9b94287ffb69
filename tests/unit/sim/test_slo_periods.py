"""The replay judged by the SLO the policy writes: every rolling period at its objective."""

from __future__ import annotations

import numpy as np

from fleetplan.sim.slo_periods import judge, miss_minutes


def _day(misses_at: slice, rate_rps: float = 1.0, span_s: float = 86_400.0) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(0.0, span_s, 1.0 / rate_rps)
    met = np.ones(t.size, dtype=bool)
    met[misses_at] = False
    return t, met


def test_a_day_that_misses_one_hour_fails_the_hourly_slo_though_the_day_passes() -> None:
    # 3% of one afternoon hour missed: 99.9% of the day, 97% of that hour
    t, met = _day(slice(50_000, 50_108))
    j = judge(t, np.zeros(t.size, dtype=int), met, ["m"], {"m": 0.99}, {"m": 3600.0}, 86_400.0)
    assert met.mean() > 0.998
    assert not j.met and j.worst_model == "m"
    assert 0.96 < j.worst_share < 0.975
    assert 46_400.0 <= j.worst_start_s <= 50_000.0  # the worst window holds the misses
    assert j.windows == 12 * 23 + 1 and j.windows_met < j.windows
    # the same day under a day-long period: one window per day, the day's share
    d = judge(t, np.zeros(t.size, dtype=int), met, ["m"], {"m": 0.99}, {"m": 86_400.0}, 86_400.0)
    assert d.met and d.windows == 1 and abs(d.worst_share - met.mean()) < 1e-9


def test_a_trace_no_longer_than_the_period_is_one_window_of_the_whole_trace() -> None:
    t, met = _day(slice(0, 20), span_s=3600.0)
    j = judge(t, np.zeros(t.size, dtype=int), met, ["m"], {"m": 0.99}, {"m": 3600.0}, float(t[-1]))
    assert j.windows == 1 and abs(j.worst_share - met.mean()) < 1e-12 and j.met


def test_each_model_is_held_to_its_own_objective_and_the_worst_gap_is_reported() -> None:
    t = np.arange(0.0, 7200.0, 0.5)
    models = (np.arange(t.size) % 2).astype(int)  # a and b alternate
    met = np.ones(t.size, dtype=bool)
    b_idx = np.nonzero(models == 1)[0]
    met[b_idx[:30]] = False  # b: 30 of its 3,600 first-hour requests missed (99.17%)
    ok = judge(t, models, met, ["a", "b"], {"a": 0.99, "b": 0.99}, {"a": 3600.0, "b": 3600.0}, 7200.0)
    strict = judge(t, models, met, ["a", "b"], {"a": 0.99, "b": 0.995}, {"a": 3600.0, "b": 3600.0}, 7200.0)
    assert ok.met and not strict.met and strict.worst_model == "b" and strict.objective == 0.995


def test_no_requests_is_met() -> None:
    j = judge(np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=bool), ["m"], {"m": 0.99}, {"m": 3600.0}, 0.0)
    assert j.met and j.windows == 0 and j.worst_share == 1.0


def test_the_misses_of_one_burst_are_shown_in_its_minutes_and_spread_misses_are_not() -> None:
    # a burst: 600 misses in minutes 48-49 of an hour at 8 rps, plus one every 10 minutes
    t = np.arange(0.0, 3600.0, 0.125)
    met = np.ones(t.size, dtype=bool)
    burst = (t >= 2880.0) & (t < 2955.0)
    met[burst] = False
    met[::4800] = False
    mm = miss_minutes(t, met)
    assert mm.misses == int(burst.sum()) + 6
    assert [m for m, _ in mm.worst[:2]] == [2880.0, 2940.0]  # the burst's minutes, most first
    assert mm.worst_share > 0.98
    assert mm.describe().startswith(f"{mm.misses} misses, 99% of them in the 3 worst minutes (0:48 480, 0:49 120")
    # the same number of misses spread over the hour: no minute holds more than a few of them
    spread = np.ones(t.size, dtype=bool)
    spread[:: t.size // mm.misses] = False
    assert miss_minutes(t, spread).worst_share < 0.1
    assert miss_minutes(t, np.ones(t.size, dtype=bool)).describe() == "no miss"
