"""The closed loop on the lab: a real controller process, real agents, simulated engines.

Every test gets its own Rig (Mosquitto, Prometheus, nginx, 2 simulated hosts x 8 H100, one agent
per host) and runs `fleetplan controller` as a subprocess (so it can be kill -9'ed) against it,
with the simulated clock 20x faster than wall time: a 30 s control cycle takes 1.5 s, a 40 s
engine startup 2 s. The tools (ControllerProc, policy_doc, Load, wait_until, ...) live in
fleetplan/harness/rig_tools.py, shared with bench/faults.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetplan.harness.demo import EngineOptions, Rig
from fleetplan.harness.rig_tools import MAX_NUM_SEQS, PROFILES, ControllerProc, K, policy_doc

pytestmark = pytest.mark.e2e


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    if not PROFILES.exists():
        pytest.skip(f"{PROFILES} missing (python -m tests.e2e.make_profiles)")
    r = Rig(tmp_path / "rig", hosts=2, gpus_per_host=8,
            engine=EngineOptions(time_scale=K, startup_s=40.0, build_s=200.0, max_num_seqs=MAX_NUM_SEQS))
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def controller_factory(rig: Rig, tmp_path: Path) -> Iterator[Callable[..., ControllerProc]]:
    made: list[ControllerProc] = []

    def make(policy: dict[str, Any] | None = None, **settings: Any) -> ControllerProc:
        work = tmp_path / f"ctrl{len(made)}"
        work.mkdir()
        c = ControllerProc(rig, work, policy or policy_doc(), **settings)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
