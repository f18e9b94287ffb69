"""controller/routing.py rendering and files (nginx itself is exercised in tests/integration/test_lab_nginx.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetplan.controller.routing import (
    NginxReloadError,
    NginxRouter,
    RoutingError,
    ScrapeTarget,
    read_generation,
    render_nginx_upstreams,
    routing_generation,
    upstream_name,
    write_endpoints_json,
    write_file_sd,
)


def test_render_is_deterministic_and_order_free() -> None:
    a = render_nginx_upstreams({"m1": ["127.0.0.1:2", "127.0.0.1:1"], "m2": []})
    b = render_nginx_upstreams({"m2": [], "m1": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"]})
    assert a == b
    assert read_generation(a) == routing_generation({"m1": ["127.0.0.1:1", "127.0.0.1:2"], "m2": []})
    assert read_generation(render_nginx_upstreams({"m1": ["127.0.0.1:1"]})) != read_generation(a)


def test_one_upstream_per_model_with_replicas() -> None:
    text = render_nginx_upstreams({"m1": ["127.0.0.1:1", "127.0.0.1:2"], "idle": []})
    assert sum(line.startswith("upstream ") for line in text.splitlines()) == 1
    assert f"upstream {upstream_name('m1')} {{" in text
    assert "server 127.0.0.1:1 " in text and "server 127.0.0.1:2 " in text
    assert '"idle" -;' in text  # known model, no replica: 503
    assert upstream_name("a/b") != upstream_name("a_b")


@pytest.mark.parametrize("bad", ["", "-x", "a b", "a;b", "a{b}", "../etc", "a//b", "a/", "$x", "a'b"])
def test_unroutable_model_names_are_rejected(bad: str) -> None:
    with pytest.raises(RoutingError, match="model name"):
        render_nginx_upstreams({bad: []})


@pytest.mark.parametrize("bad", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "h:1; evil", "http://h:1"])
def test_bad_endpoints_are_rejected(bad: str) -> None:
    with pytest.raises(RoutingError, match="endpoint"):
        render_nginx_upstreams({"m": [bad]})


def test_file_sd_labels_and_trtllm_metrics_path(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    write_file_sd(
        path,
        [
            ScrapeTarget("127.0.0.1:8001", "llama", "vllm", "host-a", "r1"),
            ScrapeTarget("127.0.0.1:8002", "llama", "trtllm", "host-b", "r2"),
        ],
    )
    groups = json.loads(path.read_text())
    assert groups == [
        {
            "targets": ["127.0.0.1:8001"],
            "labels": {"model": "llama", "engine": "vllm", "host": "host-a", "replica": "r1"},
        },
        {
            "targets": ["127.0.0.1:8002"],
            "labels": {
                "model": "llama",
                "engine": "trtllm",
                "host": "host-b",
                "replica": "r2",
                "__metrics_path__": "/prometheus/metrics",
            },
        },
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["engines.json"]  # no temp file left


def test_endpoints_json(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    write_endpoints_json(path, {"m": ["127.0.0.1:2", "127.0.0.1:1"], "idle": []})
    doc = json.loads(path.read_text())
    assert doc["models"]["m"] == {"endpoints": ["127.0.0.1:1", "127.0.0.1:2"], "path_prefix": "/m/m/"}
    assert doc["models"]["idle"]["endpoints"] == []
    assert doc["generation"] == routing_generation({"m": ["127.0.0.1:1", "127.0.0.1:2"], "idle": []})


def test_router_restores_the_previous_file_when_reload_fails(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.conf"
    reloads: list[str] = []

    def reload() -> None:
        reloads.append(path.read_text())
        if len(reloads) == 2:
            raise NginxReloadError("nginx -t failed: boom")

    router = NginxRouter(path, reload)
    assert router.apply({"m": ["127.0.0.1:1"]})
    first = path.read_text()
    assert not router.apply({"m": ["127.0.0.1:1"]})  # unchanged: no reload
    with pytest.raises(NginxReloadError, match="boom"):
        router.apply({"m": ["127.0.0.1:2"]})
    assert path.read_text() == first
    assert len(reloads) == 2 and "127.0.0.1:2" in reloads[1]
