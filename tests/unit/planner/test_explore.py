"""Exploration (issue 18.3): a config never measured, planned at the conservative prior, runs as one
canary replica when its profile promises a cheaper fleet than the trial costs; once measured, the
solver keeps it or not on what it learned; the policy bounds it (explore_max_gpus, 0: never)."""

from __future__ import annotations

from dataclasses import replace

from planner_helpers import TRT, hosts, key, observe, policy

from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.explore import EXPLORE_WINDOWS
from fleetplan.planner.types import Correction, Fleet, PlannerState

NOW = 1_700_000_000.0
TP1, TP4 = key("m8", TRT, tp=1), key("m8", TRT, tp=4)
CACHED = [("m8", "h100", 1), ("m8", "h100", 4)]
# TP1 measured (what it does: 1 rps for $3/h); TP4 at x0.5 until observed (3 rps for $12/h: $4 per rps,
# worse than TP1's $3), its profile as fitted 8 rps ($1.50 per rps)
CAPS = {TP1: CapacityInfo(1.0, "itl", profile_rps=2.5), TP4: CapacityInfo(3.0, "itl", profile_rps=8.0)}


def measured(config: object, windows: int) -> Correction:
    return Correction(config, 0.0, 0.01, -0.9, 0.01, observations=windows)  # type: ignore[arg-type]


def counts(r: object) -> dict[object, int]:
    return {c.config: c.replicas for c in r.plan.counts}  # type: ignore[attr-defined]


def run(windows_tp4: int, explore_max_gpus: int = 8) -> object:
    corr = [measured(TP1, 12)] + ([measured(TP4, windows_tp4)] if windows_tp4 else [])
    state = replace(PlannerState.initial(), corrections=tuple(corr))
    return plan_with_capacities(observe({"m8": 6.0}), Fleet(hosts(2), ()),
                                policy(models=("m8",), tps={"m8": [1, 4]}, cached=CACHED,
                                       scaling={"explore_max_gpus": explore_max_gpus}),
                                CAPS, state, NOW)


def test_an_unmeasured_config_promising_a_cheaper_fleet_runs_one_canary_until_measured() -> None:
    r = run(0)
    assert counts(r) == {TP1: 3, TP4: 1}  # 6 rps: one TP4 canary (at its conservative 3 rps) + 3 TP1
    note = " ".join(next(m for m in r.explanation.models if m.model == "m8").notes)  # type: ignore[attr-defined]
    assert "exploring m8/trtllm/h100x4" in note and "canary" in note
    # without the trial, the solver would never pick TP4 at its conservative capacity
    assert counts(run(0, explore_max_gpus=0)) == {TP1: 6}
    assert counts(run(0, explore_max_gpus=2)) == {TP1: 6}  # a TP4 canary is larger than the policy allows
    # measured: no floor any more; its own (here unchanged) capacity decides
    assert counts(run(EXPLORE_WINDOWS)) == {TP1: 6}
    assert counts(run(EXPLORE_WINDOWS - 1)) == {TP1: 3, TP4: 1}
