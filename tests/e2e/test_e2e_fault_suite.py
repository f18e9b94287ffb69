"""A fast subset of the fault suite (bench/faults.py runs all of it), with load flowing: an agent
kill -9, a Prometheus kill -9 restarted with an empty TSDB, nginx killed and restarted, a lying
status. Goals (issues 11, 19): no duplicate engine, no orphan, no scale-down caused by the fault,
no unexplained failed request, and the fleet settled again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleetplan.harness.fault_suite import FaultSuite, summary
from fleetplan.harness.prom_proxy import PromProxy
from fleetplan.harness.rig_tools import ISL, MODEL, OSL, K, Load, policy_doc, ready_replicas, wait_until


async def _run(rig, controller_factory, over: dict[str, Any], faults: list[str],  # type: ignore[no-untyped-def]
               settings: dict[str, Any] | None = None, **suite_kw: Any) -> tuple[list[Any], str]:
    """The suite's `faults` on a controller with `policy_doc(**over)` (and the controller `settings`)
    under 0.8 simulated rps: 2 replicas with a margin (about 1.15 rps required against 1.45 for
    two), away from a sizing boundary, so that a scale-down can only be the fault's (an under-read
    demand)."""
    ctrl = controller_factory(policy_doc(**over), **(settings or {})).start()
    await wait_until(lambda: ready_replicas(ctrl.report()), 40, "the first replica ready")
    load = Load(rig.lab.nginx_url, MODEL, speed=K, isl=ISL, osl=OSL)
    load.start(0.8)
    suite = FaultSuite(rig, ctrl, load, seconds=6.0, recover_timeout_s=30.0, policy_over=over, **suite_kw)
    await suite.start()
    try:
        assert await suite.settle(timeout_s=60) is None, "the fleet did not settle under load"
        results = await suite.run(faults)
    finally:
        await suite.close()
        await load.stop()
    return results, summary(results) + "\n" + "\n".join(f"{r.name}: {'; '.join(r.notes)}" for r in results)


async def test_agent_kill9_prometheus_empty_router_kill_and_a_lying_status_under_load(  # type: ignore[no-untyped-def]
        rig, controller_factory) -> None:
    """One controller, four faults in a row (one start and settle for all: the test command's time).
    An agent kill -9 and a Prometheus kill -9 restarted with an empty TSDB: no request fails (neither
    kills a process a request runs on). Issue 19: nginx kill -9'ed and started again as a new process
    (the controller alerts and routes through the new master), and a status claiming 24 GPUs for an
    8-GPU host (alerted, no replica on GPU 8 or above); requests sent while nginx is down are
    explained, nothing else fails."""
    over = {"min_replicas": 1, "max_replicas": 4, "hosts": [(h.name, 8) for h in rig.lab.hosts]}
    results, table = await _run(rig, controller_factory, over,
                                ["agent_kill9", "prometheus_empty", "router_kill_restart", "lying_status"],
                                hold_s=3.0, router_hold_s=3.0)
    by_name = {r.name: r for r in results}
    for r in results:
        assert r.sent > 50, table
        assert r.recover_s is not None, table
        assert (r.duplicates, r.orphans, r.scale_downs, r.unexplained) == (0, 0, 0, 0), table
    for name in ("agent_kill9", "prometheus_empty"):
        assert by_name[name].failed == 0, table
    assert any("router alert after" in n for n in by_name["router_kill_restart"].notes), table
    assert any("inventory alert raised" in n for n in by_name["lying_status"].notes), table


async def test_a_prometheus_answering_the_wrong_shape_under_load(  # type: ignore[no-untyped-def]
        rig, controller_factory, tmp_path: Path) -> None:
    """Issue 36: the controller's Prometheus (a proxy in front of the lab's) answers every query
    `{"status":"success","data":null}` for 5 s: an alert naming Prometheus and the query within a
    cycle, no cycle with an error, the cycle period kept, the demand known within 2 cycles of
    healing, no request failed, no scale-down."""
    proxy = PromProxy(tmp_path / "proxy", rig.lab.prometheus.url).start()
    try:
        over = {"min_replicas": 1, "max_replicas": 4}
        results, table = await _run(rig, controller_factory, over, ["prometheus_wrong_shape"],
                                    settings={"prometheus_url": proxy.url}, prom_proxy=proxy, sick_s=5.0)
    finally:
        proxy.stop()
    (r,) = results
    assert r.sent > 50 and r.failed == 0, table
    assert r.missed == [] and r.goals_met, table
    assert any(n.startswith("alert after") and "prometheus at" in n and "query" in n for n in r.notes), table
