"""Shared test fixtures. The public data the tests read travels with the repository in data/
(data/SOURCES.md: origin, license, what each file is); FLEETPLAN_DATA=DIR points them at other data."""

from __future__ import annotations

import os
from pathlib import Path

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
