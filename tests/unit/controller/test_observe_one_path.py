"""The daemon's observation is the replay's: `Observer.snapshot` reads Prometheus and hands the
readings to planner/cycle.py `observe` (router_down included), the path the replay takes with its
simulated Prometheus; the planner's input is `Observed.for_fleet` in both."""

from __future__ import annotations

from typing import Any

import httpx

from fleetplan.controller.observe import Observer, PromClient, to_observation
from fleetplan.planner.cycle import observe

ROUTER_DOWN = "the router is down or was within the rate window: requests did not reach the engines"


def _client() -> PromClient:
    """A Prometheus at time 100 whose request counters say model m completes 2 req/s."""

    def handler(request: httpx.Request) -> httpx.Response:
        q = request.url.params.get("query", "")
        data: dict[str, Any]
        if q == "time()":
            data = {"resultType": "scalar", "result": [100.0, "100"]}
        elif request.url.path.endswith("query_range"):
            data = {"resultType": "matrix", "result": []}
        elif "request_success" in q:
            data = {"resultType": "vector", "result": [{"metric": {"model": "m"}, "value": [100.0, "2"]}]}
        else:
            data = {"resultType": "vector", "result": []}
        return httpx.Response(200, json={"status": "success", "data": data})

    client = PromClient("http://p:9090")
    client._client = httpx.AsyncClient(base_url="http://p:9090", transport=httpx.MockTransport(handler))
    return client


async def test_the_daemon_and_the_replay_read_the_same_readings_the_same_way() -> None:
    client = _client()
    try:
        observer = Observer(client)
        readings = await observer.fetch(with_history=False)
        for router_down in (False, True):
            snap = await observer.snapshot(["m"], now_s=500.0, with_history=False, router_down=router_down)
            replay = observe(readings, None, ["m"], now_s=500.0, rules=observer.config.rules(),
                             router_down=router_down)
            assert snap.models == replay.interpreted.models and snap.alerts == replay.interpreted.alerts
            planner, _ = replay.for_fleet(None)
            assert to_observation(snap, ["m"]) == planner
            m = planner.models["m"]
            assert m.rate_rps == 2.0
            # a router that was down: the rate is a lower bound, the model fails static in both worlds
            assert m.stale is router_down
            assert (ROUTER_DOWN in snap.models["m"].reasons) is router_down
    finally:
        await client.aclose()
