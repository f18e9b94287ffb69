"""The controller routes a disaggregated model through the pool proxy (controller/executor.py over a
real state store): the proxy's upstreams file lists the model's ready prefill and decode replicas
and is written BEFORE nginx is reloaded with the proxy in the model's upstream; on the way back the
proxy leaves the upstream BEFORE the file loses the model's pools, which stay listed while they
drain (the requests the proxy took finish both legs). Without a proxy configured, a policy allowing
pools is refused naming the field and the setting."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from fleetplan.controller.daemon import Controller, ControllerSettings
from fleetplan.controller.pool_table import ModelPools, parse_table, render_table
from fleetplan.controller.protocol import parse_status
from fleetplan.controller.state import StateStore
from fleetplan.planner.act_types import ActionStatus, NewReplica, Note, Phase, ReplicaRow, SetPhase
from fleetplan.planner.policy import PolicyError
from fleetplan.planner.records import Drained

PROXY = "127.0.0.1:9099"
POLICY = """
version: 1
gpu_types: {h100: {price_usd_h: 2.0}}
hosts: [{name: h1, gpu: h100, gpu_count: 8}]
engines:
  vllm: {launch: {command: vllm}, startup: {default_s: 30}}
models:
  - {name: m, slo: {ttft_p99_ms: 600, itl_p99_ms: 10}, allowed: {engines: [vllm], tp: [1]},
     workload: {isl: 4096, osl: 32}, disaggregation: {allowed: true}}
"""


class Router:
    """nginx as the executor sees it; records each table with the proxy's file as it was then."""

    def __init__(self, pools_path: Path) -> None:
        self.pools_path = pools_path
        self.applied: list[tuple[dict[str, list[str]], dict[str, ModelPools]]] = []

    def apply(self, endpoints: Mapping[str, Sequence[str]]) -> bool:
        table = parse_table(self.pools_path, self.pools_path.read_text()) if self.pools_path.exists() else {}
        self.applied.append(({m: sorted(e) for m, e in endpoints.items()}, dict(table)))
        return True


def _controller(tmp_path: Path, *, proxy: bool = True, proxy_up: bool = True) -> Controller:
    (tmp_path / "policy.yaml").write_text(POLICY)
    routing: dict[str, Any] = {"pool_proxy": {"upstreams_path": str(tmp_path / "pools.json"), "address": PROXY,
                                              "load_timeout_s": 0.3}}
    settings = ControllerSettings.model_validate({"routing": routing if proxy else {},
                                                  "default_host_address": "10.0.0.1"})
    c = Controller(settings=settings, policy_path=tmp_path / "policy.yaml", profiles_path=None,
                   store=StateStore(tmp_path / "s.db"))
    c.load_policy(initial=True)
    c.executor.router = Router(tmp_path / "pools.json")
    if proxy_up:  # the proxy took every table written (its /health generation): what it was asked
        asked: list[str] = []

        async def serves(text: str) -> bool:
            asked.append(text)
            return True

        c.executor._proxy_serves = serves  # type: ignore[method-assign]
        c.proxy_asked = asked  # type: ignore[attr-defined]
    c.link.connected.set()
    c.executor.connected_wall = c.wall() - 3600
    return c


def _start(c: Controller, role: str, gpu: int) -> str:
    now = c.wall()
    template = "vllm" if role == "aggregated" else f"vllm-{role}"
    row = ReplicaRow("", "h1", "m", "vllm", "h100", 1, "bf16", (gpu,), 18000 + gpu, template, Phase.DESIRED,
                     "planned", now, now, None, None, role)
    c.store.apply([NewReplica(row, Note("start", ActionStatus.PUBLISHED, "test", "", "", "h1", "m"))], 1)
    return next(r.replica_id for r in c.store.active_replicas() if r.port == 18000 + gpu)


def _report(c: Controller, ready: Sequence[str]) -> None:
    by_id = {r.replica_id: r for r in c.store.replicas((Phase.DESIRED, Phase.DRAINING, Phase.REMOVED))}
    reps = [{"replica_id": rid, "template": by_id[rid].template, "model": "m", "engine": "vllm", "gpu": "h100",
             "tp": 1, "precision": "bf16", "gpu_indices": list(by_id[rid].gpu_indices), "port": by_id[rid].port,
             "state": "ready", **({} if by_id[rid].role == "aggregated" else {"role": by_id[rid].role})}
            for rid in ready]
    doc = {"host": "h1", "online": True, "gpu": "h100", "gpu_count": 8, "nvlink_groups": [list(range(8))],
           "port_range": [18000, 18099], "templates": ["vllm", "vllm-prefill", "vllm-decode"],
           "updated_s": time.time(), "replicas": reps}
    c.hosts.on_status("h1", parse_status(json.dumps(doc).encode(), host="h1"))


def _route(c: Controller) -> tuple[dict[str, list[str]], dict[str, ModelPools]]:
    """The routing update; the nginx table it applied and the proxy's file after it."""
    asyncio.run(c.executor.update_routing())
    path = c.settings.routing.pool_proxy.upstreams_path  # type: ignore[union-attr]
    router = c.executor.router
    assert isinstance(router, Router)
    return router.applied[-1][0], {p.name: p for p in parse_table(path, path.read_text()).values()}


def _url(c: Controller, rid: str) -> str:
    row = c.store.get_replica(rid)
    assert row is not None
    return f"http://10.0.0.1:{row.port}"


def test_the_proxy_joins_a_models_upstream_once_its_file_lists_both_pools_and_leaves_it_first(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    router = c.executor.router
    assert isinstance(router, Router)
    try:
        agg = _start(c, "aggregated", 0)
        pre, dec = _start(c, "prefill", 1), _start(c, "decode", 2)
        _report(c, [agg, pre])  # the decode replica still starts: no route through the proxy
        nginx, table = _route(c)
        assert nginx == {"m": ["10.0.0.1:18000"]}
        assert table == {"m": ModelPools("m", (_url(c, pre),), (), ((_url(c, pre), "h1"),))}

        _report(c, [agg, pre, dec])  # both pools ready: the file lists them when nginx gets the proxy
        nginx, table = _route(c)
        assert nginx == {"m": ["10.0.0.1:18000", PROXY]}
        # each URL with its host (the proxy's decode pick prefers the prefill's host)
        pools = ModelPools("m", (_url(c, pre),), (_url(c, dec),), tuple(sorted(((_url(c, pre), "h1"), (_url(c, dec), "h1")))))
        assert router.applied[-1][1] == {"m": pools} and table == {"m": pools}
        assert c.executor.routed == {agg, pre, dec}
        # before nginx got the proxy, the controller saw the proxy serve that table (once: joining)
        assert [parse_table(tmp_path, t)["m"] for t in c.proxy_asked] == [pools]  # type: ignore[attr-defined]

        # the way back: aggregated replicas serve, the pools drain; nginx drops the proxy while the
        # file still lists the pools, which stay listed while they drain
        agg2 = _start(c, "aggregated", 3)
        c.store.apply([SetPhase(agg, Phase.DRAINING), SetPhase(pre, Phase.DRAINING), SetPhase(dec, Phase.DRAINING)],
                      2)
        _report(c, [agg, agg2, pre, dec])
        nginx, table = _route(c)
        assert nginx == {"m": ["10.0.0.1:18003"]}
        assert router.applied[-1][1] == {"m": pools} and table == {"m": pools}
        # drained: the file empties (nginx unchanged)
        c.store.apply([Drained(pre, False, 0.0, 30.0), Drained(dec, False, 0.0, 30.0)], None)
        nginx, table = _route(c)
        assert nginx == {"m": ["10.0.0.1:18003"]} and table == {}
    finally:
        c.store.close()


def test_a_proxy_that_does_not_take_the_table_gets_no_request_and_is_alerted(tmp_path: Path) -> None:
    from fleetplan.planner.act_types import AlertKey, AlertKind

    c = _controller(tmp_path, proxy_up=False)  # nothing listens at PROXY
    try:
        agg, pre, dec = _start(c, "aggregated", 0), _start(c, "prefill", 1), _start(c, "decode", 2)
        _report(c, [agg, pre, dec])
        nginx, table = _route(c)
        assert nginx == {"m": ["10.0.0.1:18000"]}  # the aggregated replica still serves
        assert table["m"].decode and c.executor.proxied == frozenset()
        alert = c.runtime_alerts[AlertKey(AlertKind.ROUTING, "pool-proxy")]
        assert f"pool proxy http://{PROXY}/health does not serve the table" in alert and "0.3 s" in alert
        # the same table is asked once more on the next update, not waited for again
        t0 = time.monotonic()
        nginx, _ = _route(c)
        assert nginx == {"m": ["10.0.0.1:18000"]} and time.monotonic() - t0 < 0.25

        async def serves(text: str) -> bool:  # the proxy is back and took the table
            return True

        c.executor._proxy_serves = serves  # type: ignore[method-assign]
        nginx, _ = _route(c)
        assert nginx == {"m": ["10.0.0.1:18000", PROXY]}
        assert AlertKey(AlertKind.ROUTING, "pool-proxy") not in c.runtime_alerts
    finally:
        c.store.close()


def test_a_decode_pool_lost_takes_the_proxy_out_of_the_upstream_before_the_file_loses_it(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    router = c.executor.router
    assert isinstance(router, Router)
    try:
        pre, dec = _start(c, "prefill", 1), _start(c, "decode", 2)
        _report(c, [pre, dec])
        nginx, table = _route(c)
        assert nginx == {"m": [PROXY]}
        both = table["m"]
        _report(c, [pre])  # the decode engine failed
        nginx, table = _route(c)
        assert nginx == {"m": []}  # a known model with no replica: nginx answers 503 itself
        assert router.applied[-1][1] == {"m": both}  # the file changed only after nginx dropped the proxy
        assert table == {"m": ModelPools("m", (_url(c, pre),), (), ((_url(c, pre), "h1"),))}
    finally:
        c.store.close()


def test_a_controller_restarted_keeps_the_previous_file_until_nginx_is_rewritten(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    path = tmp_path / "pools.json"
    old = ModelPools("m", ("http://10.0.0.9:18001",), ("http://10.0.0.9:18002",))
    path.write_text(render_table([old]))  # a previous controller's, with the proxy maybe in nginx
    router = c.executor.router
    assert isinstance(router, Router)
    try:
        agg = _start(c, "aggregated", 0)
        _report(c, [agg])
        nginx, table = _route(c)
        assert nginx == {"m": ["10.0.0.1:18000"]}
        assert router.applied[-1][1] == {"m": old} and table == {}
    finally:
        c.store.close()


def test_without_a_proxy_a_policy_allowing_pools_is_refused_naming_field_and_setting(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as err:
        _controller(tmp_path, proxy=False)
    msg = str(err.value)
    assert "models[0].disaggregation.allowed = true" in msg and "routing.pool_proxy" in msg
    with pytest.raises(PolicyError):
        _controller_source(tmp_path).read()


def _controller_source(tmp_path: Path) -> Any:
    from fleetplan.controller.metrics import ControllerMetrics
    from fleetplan.controller.policy_source import PolicySource

    return PolicySource(tmp_path / "policy.yaml", None, StateStore(tmp_path / "s2.db"), ControllerMetrics(), {})


def test_the_proxy_setting_names_a_bad_address(tmp_path: Path) -> None:
    from fleetplan.controller.settings import SettingsError, load_settings

    cfg = tmp_path / "controller.yaml"
    cfg.write_text("routing: {pool_proxy: {upstreams_path: /run/pools.json, address: 'proxy'}}\n")
    with pytest.raises(SettingsError, match=r"routing\.pool_proxy\.address = 'proxy'.*host:port"):
        load_settings(cfg)
    cfg.write_text(f"routing: {{pool_proxy: {{upstreams_path: /run/pools.json, address: '{PROXY}'}}}}\n")
    assert load_settings(cfg).routing.pool_proxy is not None
