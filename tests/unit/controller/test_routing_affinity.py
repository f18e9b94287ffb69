"""nginx affinity routing (controller/routing.py): consistent hashing on a session header, off by default."""

from __future__ import annotations

import pytest

from fleetplan.controller.routing import render_nginx_upstreams, upstream_name


def test_off_by_default() -> None:
    table = {"m1": ["127.0.0.1:1", "127.0.0.1:2"]}
    assert render_nginx_upstreams(table) == render_nginx_upstreams(table, affinity={})
    assert "hash " not in render_nginx_upstreams(table)


def test_session_header_hash() -> None:
    table = {"m1": ["127.0.0.1:1", "127.0.0.1:2"], "m2": ["127.0.0.1:3"], "idle": []}
    text = render_nginx_upstreams(table, affinity={"m1": "X-Session-Id", "idle": "X-Session-Id"})
    block = text.split(f"upstream {upstream_name('m1')} {{")[1].split("}")[0]
    assert "hash $fleetplan_affinity_x_session_id consistent;" in block and "least_conn" not in block
    other = text.split(f"upstream {upstream_name('m2')} {{")[1].split("}")[0]
    assert "least_conn;" in other
    assert text.count("map $http_x_session_id $fleetplan_affinity_x_session_id {") == 1
    assert '"" $request_id;' in text  # no header: spread at random, not all on one point
    with pytest.raises(ValueError, match="affinity header"):
        render_nginx_upstreams(table, affinity={"m1": "bad header;"})
