"""The pool proxy's upstreams file: parsing, errors naming the field, re-reads, least-outstanding picks."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from fleetplan.controller.pool_proxy import prefill_body
from fleetplan.controller.pool_table import Side, TableError, UpstreamsFile, parse_table
from fleetplan.shared.atomic import atomic_write_text

P = Path("/etc/pools.json")


def test_parse_matches_models_spelling_insensitively_and_drops_duplicate_urls() -> None:
    t = parse_table(P, json.dumps({"models": {"Llama-3.1-8B": {"prefill": ["http://a:1/", "http://a:1"],
                                                               "decode": ["https://b:2"]}}}))
    (pools,) = t.values()
    assert pools.name == "Llama-3.1-8B" and pools.prefill == ("http://a:1",) and pools.decode == ("https://b:2",)


@pytest.mark.parametrize(("doc", "names"), [
    ({"model": {}}, "models must be an object"),
    ({"models": {"m": {"prefill": "http://a:1"}}}, "models.m.prefill must be a list"),
    ({"models": {"m": {"prefill": ["http://a:1/v1"]}}}, "models.m.prefill[0] must be a base URL"),
    ({"models": {"m": {"decode": ["a:1"]}}}, "models.m.decode[0]"),
    ({"models": {"m": {"decode": ["http://a:x"]}}}, "models.m.decode[0] has a bad port"),
    ({"models": {"m": {"prefil": []}}}, "models.m has unknown fields ['prefil']"),
    ({"models": {"m-1": {}, "M 1": {}}}, "names the same model"),
    ({"models": {"m": {"decode": [{"url": "http://a:1", "hots": "h"}]}}}, "models.m.decode[0] has unknown fields ['hots']"),
    ({"models": {"m": {"decode": [{"url": "http://a:1", "host": ""}]}}}, "models.m.decode[0].host must be a host name"),
    ({"models": {"m": {"decode": [{"host": "h"}]}}}, "models.m.decode[0].url must be a URL string"),
])
def test_errors_name_the_file_and_field(doc: object, names: str) -> None:
    with pytest.raises(TableError, match=r"/etc/pools\.json") as err:
        parse_table(P, json.dumps(doc))
    assert names in str(err.value)


def test_refresh_rereads_a_changed_file_and_keeps_the_last_table_when_malformed(tmp_path: Path) -> None:
    f = tmp_path / "u.json"
    atomic_write_text(f, json.dumps({"models": {"m": {"prefill": ["http://a:1"], "decode": ["http://b:1"]}}}))
    up = UpstreamsFile(f)
    up.load()
    assert up.refresh() is False  # unchanged
    atomic_write_text(f, json.dumps({"models": {"m": {"prefill": ["http://a:1", "http://c:1"],
                                                      "decode": ["http://b:1"]}}}))
    os.utime(f, ns=(1, 1))  # a different stamp even within the filesystem's time granularity
    assert up.refresh() is True
    pools = up.pools("M")
    assert pools is not None and pools.prefill == ("http://a:1", "http://c:1")
    atomic_write_text(f, "{not json")
    assert up.refresh() is False
    assert up.pools("m") == pools


def test_pick_is_least_outstanding_and_avoids_the_replica_tried(tmp_path: Path) -> None:
    f = tmp_path / "u.json"
    atomic_write_text(f, json.dumps({"models": {"m": {"prefill": ["http://a:1", "http://b:1"], "decode": []}}}))
    up = UpstreamsFile(f, rng=random.Random(1))
    up.load()
    pools = up.pools("m")
    assert pools is not None
    first = up.pick(pools, Side.PREFILL)
    assert first is not None
    first.outstanding += 3
    second = up.pick(pools, Side.PREFILL)
    assert second is not None and second.url != first.url
    assert all(up.pick(pools, Side.PREFILL, exclude=[second.url]) is first for _ in range(5))
    assert up.pick(pools, Side.DECODE) is None


def test_prefill_leg_asks_one_token_unstreamed_with_remote_decode() -> None:
    leg = prefill_body({"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50,
                        "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 5})
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True


def test_a_rendered_table_reads_back_and_the_file_names_its_generation(tmp_path: Path) -> None:
    from fleetplan.controller.pool_table import ModelPools, render_table, table_generation

    pools = [ModelPools("b", ("http://p:2", "http://p:1"), ("http://d:1",)), ModelPools("a", (), ())]
    text = render_table(pools)
    assert text == render_table(reversed(pools))  # deterministic
    back = parse_table(P, text)
    assert back["b"] == ModelPools("b", ("http://p:1", "http://p:2"), ("http://d:1",))
    assert back["a"] == ModelPools("a", (), ())
    path = tmp_path / "pools.json"
    atomic_write_text(path, text)
    f = UpstreamsFile(path)
    f.load()
    assert f.generation == table_generation(text)
    # hosts: written as {"url", "host"} entries where known, read back; a URL alone has none
    hosted = ModelPools("m", ("http://p:1", "http://p:2"), ("http://d:1",), (("http://d:1", "h1"), ("http://p:1", "h1")))
    back = parse_table(P, render_table([hosted]))["m"]
    assert back == hosted and back.host("http://p:1") == "h1" and back.host("http://p:2") is None
    assert json.loads(render_table([hosted]))["models"]["m"]["decode"] == [{"host": "h1", "url": "http://d:1"}]


def test_a_decode_pick_near_a_prefill_prefers_its_host_within_the_load_bound(tmp_path: Path) -> None:
    from fleetplan.controller.pool_table import ModelPools

    f = UpstreamsFile(tmp_path / "none.json", rng=random.Random(1))
    pools = ModelPools("m", ("http://p:1",), ("http://d:1", "http://d:2"), (("http://d:2", "h2"), ("http://p:1", "h2")))
    picks = [f.pick(pools, Side.DECODE, near="http://p:1") for _ in range(20)]
    assert {up.url for up in picks if up is not None} == {"http://d:2"}  # nothing in flight: beside it
    d2 = picks[0]
    assert d2 is not None
    d2.outstanding = 3  # under ceil(1.25 x (3/2 + 1)) = 4: still beside it
    assert f.pick(pools, Side.DECODE, near="http://p:1") is d2
    d2.outstanding = 4  # at ceil(1.25 x (4/2 + 1)) = 4: the least loaded elsewhere
    other = f.pick(pools, Side.DECODE, near="http://p:1")
    assert other is not None and other.url == "http://d:1"
