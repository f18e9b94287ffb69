"""The share of requests that missed the SLO, bounded by the engines' own histograms
(planner/evidence.py `share_above`, `slo_missed_share`), carried to the plan's explanation and the
explain report."""

from __future__ import annotations

import json
import math
from types import MappingProxyType

import pytest
from planner_helpers import hosts, key, policy

from fleetplan.controller.report import render_explain
from fleetplan.planner import cycle
from fleetplan.planner.core import plan_to_dict, plan_with_capacities
from fleetplan.planner.evidence import Evidence, ReplicaSeries, interpret, share_above, slo_missed_share
from fleetplan.planner.observation import Interpreted, ModelMetrics
from fleetplan.planner.types import Fleet, ModelObservation, Observation, PlannerState, Replica, ReplicaState

INF = math.inf
M = "m8"
KEY = key(M)
NOW = 10_000.0
# vLLM's edges around the targets: TTFT (s) and per-request TPOT (s)
TTFT = ((0.25, 95.0), (0.5, 98.0), (0.75, 99.0), (1.0, 99.5), (2.5, 100.0), (INF, 100.0))
TPOT = ((0.025, 40.0), (0.05, 99.0), (0.075, 100.0), (INF, 100.0))


def test_a_target_on_a_bucket_edge_reads_one_share() -> None:
    assert share_above(TTFT, 1.0) == pytest.approx((0.005, 0.005))
    assert share_above(TTFT, 0.5) == pytest.approx((0.02, 0.02))
    assert share_above(TTFT, 10.0) == (0.0, 0.0)


def test_a_target_inside_a_bucket_reads_its_bounds() -> None:
    # 30 ms inside (25, 50] ms: the 59% in that bucket may all have met it, or all missed it
    assert share_above(TPOT, 0.03) == pytest.approx((0.01, 0.60))
    # above the highest finite edge: the +Inf bucket's share is a miss only "perhaps"
    assert share_above(((1.0, 9.0), (INF, 10.0)), 2.0) == pytest.approx((0.0, 0.1))


def test_no_observations_is_unknown_not_zero() -> None:
    assert share_above((), 1.0) is None
    assert share_above(((1.0, 0.0), (INF, 0.0)), 1.0) is None
    assert slo_missed_share((), (), 1.0, 0.05) is None


def test_missed_share_is_at_least_either_histogram_and_at_most_both() -> None:
    assert slo_missed_share(TTFT, TPOT, 0.5, 0.05) == pytest.approx((0.02, 0.03))
    assert slo_missed_share(TTFT, (), 0.5, 0.05) == pytest.approx((0.02, 0.02))
    slow = ((0.5, 0.0), (INF, 10.0))
    assert slo_missed_share(slow, slow, 0.5, 0.05) == (1.0, 1.0)  # capped at every request


def _rep(rid: str, since_s: float) -> Replica:
    return Replica(rid, KEY, "h00", (int(rid[-1]),), ReplicaState.READY, 8000, since_s)


def test_every_replica_counts_also_one_that_joined_mid_window() -> None:
    # the config's latency evidence takes only replicas READY for the whole window; what the
    # model's requests met counts every replica that served them
    fast = ReplicaSeries(5.0, ((0.5, 5.0), (1.0, 5.0), (INF, 5.0)), ((0.05, 5.0), (INF, 5.0)))
    slow = ReplicaSeries(5.0, ((0.5, 0.0), (1.0, 4.0), (INF, 5.0)), ((0.05, 5.0), (INF, 5.0)))
    ev = Evidence(60.0, replicas=MappingProxyType({"r0": fast, "r1": slow}))
    me = interpret(M, ev, (_rep("r0", 0.0), _rep("r1", NOW - 10.0)), NOW, stale=False)
    assert [c.ready_replicas for c in me.configs] == [1]
    assert slo_missed_share(me.ttft, me.tpot, 1.0, 0.05) == pytest.approx((0.1, 0.1))  # 1 of 10 per second
    assert interpret(M, ev, (_rep("r0", 0.0),), NOW, stale=True).ttft == ()


def _policy() -> object:
    return policy(models=(M,), model_extra={M: {"slo": {"ttft_p99_ms": 500, "itl_p99_ms": 30},
                                                "allowed": {"tp": [1], "engines": ["vllm"]}}})


def test_the_plan_and_the_explain_report_carry_it() -> None:
    from fleetplan.planner.capacity import CapacityInfo

    p = _policy()
    fleet = Fleet(hosts(1), (_rep("r0", 0.0),))
    # the observation as the daemon builds it from Prometheus' answers and the engines' series
    series = ReplicaSeries(2.0, tuple((le, 2.0 * c / 100.0) for le, c in TTFT),
                           tuple((le, 2.0 * c / 100.0) for le, c in TPOT))
    ev = Evidence(60.0, replicas=MappingProxyType({"r0": series}))
    view = Interpreted({M: ModelMetrics(model=M, rate_rps=2.0, stale=False)}, {}, (), True)
    obs, _ = cycle.observation_from(view, ev, [M], fleet.replicas, NOW)
    r = plan_with_capacities(obs, fleet, p, {KEY: CapacityInfo(4.0, "ttft")}, PlannerState.initial(), NOW)  # type: ignore[arg-type]
    share = r.explanation.models[0].observed_missed_share
    assert share == pytest.approx((0.02, 0.62))  # TTFT: 2% above 500 ms; ITL: 1-60% (30 ms inside (25, 50] ms)
    doc = json.loads(json.dumps(plan_to_dict(r)))
    assert doc["explanation"]["models"][0]["observed_missed_share"] == pytest.approx([0.02, 0.62])
    text = render_explain({"plan": doc}, M) or ""
    assert "missed the SLO (TTFT or ITL), last window: 2.00-62.00% of requests (above the 1%" in text
    # stale: unknown, and the report says nothing rather than 0%
    stale = Observation({M: ModelObservation(M, 2.0, stale=True, ttft_buckets=series.ttft, tpot_buckets=series.tpot)})
    r2 = plan_with_capacities(stale, fleet, p, {KEY: CapacityInfo(4.0, "ttft")}, PlannerState.initial(), NOW)  # type: ignore[arg-type]
    assert r2.explanation.models[0].observed_missed_share is None
    assert "missed the SLO" not in (render_explain({"plan": plan_to_dict(r2)}, M) or "")
