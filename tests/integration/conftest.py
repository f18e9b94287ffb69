"""Fixtures for integration tests: the lab of real servers (Mosquitto, Prometheus, nginx).

- `lab` (session): a shared Lab with 2 hosts of 8 H100s. Read-mostly: do not restart its servers
  or rely on its routing staying as you left it; tests that mutate use their own.
- `lab_factory` (function): `lab_factory(hosts=4, services=("mosquitto",))` -> a started Lab,
  stopped at teardown (with an orphan check).
- `mosquitto` (module): a MosquittoServer with hosts host-a and host-b.
- `prometheus` (module): a PrometheusServer (1 s scrape of `file_sd_dir/*.json`).
- `nginx` (module): an NginxServer; route with `NginxRouter(nginx.upstreams_path, nginx.reload)`.

Every test under tests/integration/ is marked `integration`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from fleetplan.harness.lab import Lab
from fleetplan.harness.procs import group_pids
from fleetplan.harness.servers import MosquittoServer, NginxServer, PrometheusServer


class _Startable(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> Any: ...


ServerT = TypeVar("ServerT", bound=_Startable)

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


def assert_no_orphans(groups: dict[str, int]) -> None:
    left = {name: group_pids(pgid) for name, pgid in groups.items()}
    left = {name: pids for name, pids in left.items() if pids}
    assert not left, f"processes left after stop: {left}"


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    with Lab(hosts=2, gpus_per_host=8) as the_lab:
        groups = the_lab.process_groups()
        yield the_lab
    assert_no_orphans(groups)


@pytest.fixture
def lab_factory() -> Iterator[Callable[..., Lab]]:
    labs: list[Lab] = []

    def make(**kwargs: Any) -> Lab:
        new = Lab(**kwargs)
        labs.append(new)
        return new.start()

    yield make
    for one in labs:
        groups = one.process_groups()
        one.stop()
        assert_no_orphans(groups)


@pytest.fixture(scope="module")
def _server_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fleetplan-it-") as d:
        yield Path(d)


def _running(server: ServerT) -> Iterator[ServerT]:
    """Start a lab server for a fixture's lifetime; stopped however the tests end."""
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mosquitto(_server_dir: Path) -> Iterator[MosquittoServer]:
    yield from _running(MosquittoServer(_server_dir / "mosquitto", host_names=("host-a", "host-b")))


@pytest.fixture(scope="module")
def prometheus(_server_dir: Path) -> Iterator[PrometheusServer]:
    yield from _running(PrometheusServer(_server_dir / "prometheus"))


@pytest.fixture(scope="module")
def nginx(_server_dir: Path) -> Iterator[NginxServer]:
    yield from _running(NginxServer(_server_dir / "nginx"))
