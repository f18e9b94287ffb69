"""The prefix-cache hit rate from the engines' counters (planner/prefix.py)."""

from __future__ import annotations

import math

import pytest

from fleetplan.planner.prefix import MIN_QUERY_TOKENS, hit_rate, hit_rate_from_rates, planning_share


def test_hit_rate() -> None:
    assert hit_rate(100_000, 36_600) == pytest.approx(0.366)
    assert hit_rate(100_000, 0) == 0.0
    assert hit_rate(100_000, 101_000) == 1.0  # scrape skew within 2 %
    assert hit_rate(100_000, 110_000) is None  # not a pair of the same window
    assert hit_rate(MIN_QUERY_TOKENS - 1, 10) is None  # too few tokens
    assert hit_rate(0, 0) is None
    assert hit_rate(None, 10) is None and hit_rate(1e6, None) is None
    assert hit_rate(math.nan, 10) is None and hit_rate(1e6, -5) is None
    assert hit_rate(500, 250, min_query_tokens=100) == 0.5


def test_from_rates_and_planning_share() -> None:
    assert hit_rate_from_rates(2000.0, 500.0, 300.0) == pytest.approx(0.25)
    assert hit_rate_from_rates(10.0, 5.0, 300.0) is None  # 3000 tokens in the window
    assert hit_rate_from_rates(2000.0, 500.0, 0.0) is None
    assert planning_share(None) == 0.0 and planning_share(0.4) == 0.4 and planning_share(math.nan) == 0.0
