"""Whatever arrives on the desired topic, parsing either succeeds or raises ProtocolError (one
line); and reconnect backoff is capped and jittered."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetplan.controller.mqtt import Backoff
from fleetplan.controller.protocol import ProtocolError, parse_desired

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
FIELD = (st.none() | st.booleans() | st.integers(-5, 70000) | st.text(max_size=12)
         | st.lists(st.integers(-2, 10), max_size=4))
REPLICA_KEYS = ["replica_id", "template", "model", "engine", "gpu", "tp", "precision", "gpu_indices", "port"]


def _parses_or_protocol_error(payload: bytes) -> None:
    try:
        parse_desired(payload)
    except ProtocolError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(payload: bytes) -> None:
    _parses_or_protocol_error(payload)


@settings(max_examples=100, deadline=None)
@given(JSON)
def test_random_json(value: object) -> None:
    _parses_or_protocol_error(json.dumps(value).encode())


@settings(max_examples=100, deadline=None)
@given(st.integers(), st.lists(st.fixed_dictionaries({k: FIELD for k in REPLICA_KEYS}), max_size=3))
def test_random_replicas(version: int, replicas: list[dict[str, object]]) -> None:
    _parses_or_protocol_error(json.dumps({"version": version, "replicas": replicas}).encode())


def test_backoff_is_capped_and_jittered() -> None:
    backoff = Backoff(initial_s=0.5, max_s=30.0, rng=random.Random(1))
    delays = [backoff.next_delay_s() for _ in range(20)]
    assert 0.25 <= delays[0] <= 0.5
    assert all(d <= 30.0 for d in delays) and max(delays) > 15.0
    assert len(set(delays[-5:])) == 5  # jitter: capped values still differ
    backoff.reset()
    assert backoff.next_delay_s() <= 0.5
