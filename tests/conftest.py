"""Shared test fixtures. The public data the tests read travels with the repository in data/
(data/SOURCES.md: origin, license, what each file is); FLEETPLAN_DATA=DIR points them at other data."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_DATA = REPO_ROOT / "data"
DATA_ENV = "FLEETPLAN_DATA"


def data_dir() -> Path:
    """The data folder the tests read: $FLEETPLAN_DATA when set, else the repository's data/."""
    override = os.environ.get(DATA_ENV)
    return Path(override).resolve() if override else REPO_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The data folder (`data_dir()`). It is part of the repository, so a missing folder is an error,
    never a skip."""
    d = data_dir()
    if not (d / "benchmarks").is_dir() or not (d / "traces").is_dir():
        raise FileNotFoundError(f"data folder {d} has no benchmarks/ and traces/ (the repository's data/, "
                                f"or ${DATA_ENV})")
    return d


_CAPACITIES: dict[tuple[Any, ...], float] = {}


@pytest.fixture
def ground_truth_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleetplan.sim.evaluate.ground_truth_capacity` computed once per config, length mix, SLO and
    draw in the session, then reused. It is a pure function of its arguments (seeded draws on the
    ground-truth engine), and it is 95% of what `evaluate` spends on a short day's replay (two configs
    x three draws x a bisection of 2,000-request replays): a test replaying the same day several
    times (the demo's replay, then its recorded command) pays for it once."""
    from fleetplan.sim import evaluate

    real = evaluate.ground_truth_capacity

    @functools.wraps(real)
    def once(c: Any, lengths: Sequence[tuple[int, int]], ttft_ms: float, itl_ms: float,
             seed: int = 0, n: int = 2000, repeats: int = 3) -> float:
        key = (c, tuple((int(p), int(o)) for p, o in lengths), ttft_ms, itl_ms, seed, n, repeats)
        if key not in _CAPACITIES:
            _CAPACITIES[key] = real(c, lengths, ttft_ms, itl_ms, seed=seed, n=n, repeats=repeats)
        return _CAPACITIES[key]

    monkeypatch.setattr(evaluate, "ground_truth_capacity", once)
