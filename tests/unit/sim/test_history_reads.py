"""The request-rate history the replay's Prometheus answers and the planner reads, cycle after cycle:
the points kept from one cycle to the next and the fast paths for ordered points read the same
floats as reading everything afresh."""

from __future__ import annotations

import math
import random

from fleetplan.planner.forecast import recent_level_max
from fleetplan.planner.observation import ObserveRules, Readings, Series, _history
from fleetplan.sim.promsim import Counters, PromSim


def _prom(history_s: float) -> PromSim:
    return PromSim(window_s=60.0, scrape_s=15.0, delay_s=5.0, history_s=history_s, history_step_s=30.0,
                   peak_window_s=30.0, epoch0_s=1_767_571_200.0, length_window_s=600.0)


def _scraped(until_s: float, history_s: float, read_every_s: float | None) -> tuple[PromSim, list[float]]:
    """A target whose completions follow a bumpy rate, scraped every 15 s up to `until_s`; read
    every `read_every_s` (None: never) as the replay's cycles read it."""
    rng = random.Random(7)
    prom = _prom(history_s)
    prom.set_targets([("r1", "m")])
    c = Counters()
    reads = []
    t = 0.0
    while t <= until_s:
        c.completed += rng.randint(0, 40) * (2.0 if math.sin(t / 900.0) > 0 else 1.0)
        prom.scrape(t, {"r1": (c, 0.0, 0.0, 0.0)})
        if read_every_s is not None and t > 0 and t % read_every_s == 0:
            reads.append(t)
            prom.readings(t)
        t += 15.0
    return prom, reads


def test_history_kept_across_cycles_reads_as_a_fresh_one() -> None:
    # a history shorter than the run: the kept points slide; cycles on whole seconds and in between
    for history_s, until_s in ((3_600.0, 9_000.0), (86_400.0, 5_400.0)):
        cycled, _ = _scraped(until_s, history_s, read_every_s=60.0)
        fresh, _ = _scraped(until_s, history_s, read_every_s=None)
        for t in (until_s, until_s + 0.5):
            assert cycled.readings(t).history == fresh.readings(t).history
            assert cycled.readings(t).history[0].points  # the test reads something


def test_history_in_order_reads_as_out_of_order() -> None:
    # Prometheus answers a range query in time order (the fast path); the same points shuffled (the
    # general path, which sorts them) are the same history, to the last bit
    rng = random.Random(3)
    wall = 1_767_571_200.0 + 86_400.0
    pts = [(wall - 30.0 * k, rng.choice([rng.random() * 9.0, 0.0, math.nan, math.inf])) for k in range(400, -1, -1)]
    rules = ObserveRules(window_s=60.0, time_scale=2.0, history_s=12_000.0, history_window_s=60.0)
    shuffled = pts[:]
    rng.shuffle(shuffled)

    def read(points: list[tuple[float, float]]) -> dict[str, tuple[tuple[float, float], ...]]:
        return _history(Readings(wall_s=wall, history=(Series({"model": "m"}, tuple(points)),)), rules, 5_000.0,
                        lambda labels: labels.get("model"))

    ordered = read(pts)
    assert repr(ordered) == repr(read(shuffled))
    assert len(ordered["m"]) == sum(math.isfinite(v) for _, v in pts)
    # a series that begins inside the span: its first window's points are left out either way
    late = read(pts[300:])
    assert repr(late) == repr(read(list(reversed(pts[300:]))))
    assert len(late["m"]) < sum(math.isfinite(v) for _, v in pts[300:])


def test_recent_level_max_reads_shuffled_history_as_ordered() -> None:
    rng = random.Random(5)
    now = 10_000.0
    hist = [(now - 30.0 * k, rng.choice([rng.random() * 9.0, -1.0, math.nan, 4.0])) for k in range(100, -1, -1)]
    shuffled = hist[:]
    rng.shuffle(shuffled)
    for span in (0.0, 60.0, 900.0, 2_000.0, 5_000.0):
        a = recent_level_max(hist, 3.0, now, span)
        assert repr(a) == repr(recent_level_max(shuffled, 3.0, now, span))
    assert recent_level_max(hist, 3.0, now, 900.0) is not None
    assert recent_level_max(hist, 3.0, now, 5_000.0) is None  # the history does not reach back that far


def test_the_history_sums_each_targets_rate_as_prometheus_sums_rate_by_model() -> None:
    """`sum by (model) (rate(...))`: each target's rate from its own samples, summed. r1 serves 2 rps
    scraped on the grid, r2 3 rps scraped 7 s later in each interval; r2 first seen at 300 s with 900
    completions already counted (its engine ran before Prometheus found it): a first sample is no
    increase, so the rate around 300 s is 2 rps and then 5 rps, never a 900-request jump."""
    prom = PromSim(window_s=60.0, scrape_s=15.0, delay_s=0.0, history_s=3600.0, history_step_s=30.0,
                   peak_window_s=30.0, epoch0_s=0.0, length_window_s=600.0, offsets=15)
    prom.set_targets([("r1", "m"), ("r2", "m")])
    c1, c2 = Counters(), Counters()
    t = 0.0
    while t <= 600.0:
        if t % 15.0 == 0.0:
            c1.completed = 2.0 * t
            prom.scrape(t, {"r1": (c1, 0.0, 0.0, 0.0)})
        if t >= 300.0 and t % 15.0 == 7.0:
            c2.completed = 900.0 + 3.0 * (t - 300.0)
            prom.scrape(t, {"r2": (c2, 0.0, 0.0, 0.0)})
        t += 1.0
    points = dict(prom.readings(600.0).history[0].points)
    assert max(points.values()) < 5.5, points
    assert abs(points[300.0] - 2.0) < 0.01 and abs(points[600.0] - 5.0) < 0.01, points
