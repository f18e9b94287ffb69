"""A lab process whose free port another process took before it bound it moves to another port
(fleetplan/harness/procs.py retry_if_port_taken): the lab's servers and the controller's report API."""

from __future__ import annotations

import pytest

from fleetplan.harness.procs import retry_if_port_taken


class Taken(Exception):
    pass


def test_a_taken_port_moves_and_starts_again_and_the_last_failure_propagates() -> None:
    ports = [5000]
    tried: list[int] = []

    def start() -> int:
        tried.append(ports[0])
        if ports[0] < 5002:
            raise Taken(f"port {ports[0]} in use")
        return ports[0]

    def move() -> None:
        ports[0] += 1

    assert retry_if_port_taken(start, lambda e: isinstance(e, Taken), move, tries=3) == 5002
    assert tried == [5000, 5001, 5002]
    ports[0], tried[:] = 5000, []
    with pytest.raises(Taken, match="port 5001"):
        retry_if_port_taken(start, lambda e: isinstance(e, Taken), move, tries=2)
    assert tried == [5000, 5001]


def test_another_failure_is_not_retried() -> None:
    calls: list[int] = []

    def start() -> None:
        calls.append(1)
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config"):
        retry_if_port_taken(start, lambda e: isinstance(e, Taken), lambda: None, tries=3)
    assert calls == [1]
