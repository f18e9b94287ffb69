"""Stage 1 directly: backends agree, dominated configs pruned, a failed solver never leaves the plan empty."""

from __future__ import annotations

import dataclasses
import math

import pytest
from planner_helpers import H100, TRT, VLLM, key, observe, policy

from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.counts import (
    BindingKind,
    Candidate,
    CountProblem,
    ModelDemand,
    prune_dominated,
    solve_counts,
)
from fleetplan.planner.types import Fleet, PlannerState

CANDS = (
    Candidate(key("a", VLLM, H100, 1), 10.0, 3.0, 60.0),
    Candidate(key("a", TRT, H100, 1), 14.0, 3.0, 45.0),
    Candidate(key("a", VLLM, H100, 2), 19.0, 6.0, 60.0),
    Candidate(key("b", VLLM, H100, 4), 4.0, 12.0, 90.0),
    Candidate(key("b", VLLM, H100, 8), 7.5, 24.0, 90.0),
)
PROBLEM = CountProblem(
    candidates=CANDS,
    demands=(ModelDemand("a", 50.0, 1, 0, None), ModelDemand("b", 10.0, 1, 1, None)),
    slots={H100: {1: 32, 2: 16, 4: 8, 8: 4}},
    relative_gap=0.0,
)


@pytest.mark.parametrize("backend", ["SCIP", "cp-sat"])
def test_backends_find_the_same_optimum(backend: str) -> None:
    sol = solve_counts(dataclasses.replace(PROBLEM, backend=backend))
    assert sol.report.status == "OPTIMAL"
    # a: 4 x TRT tp1 = 56 rps for $12; b: 3 x TP4 = 12 rps for $36 (vs 2 x TP8 = 15 rps for $48)
    assert {(c.model, c.engine.value, c.tp): n for c, n in sol.counts.items()} == {
        ("a", "trtllm", 1): 4, ("b", "vllm", 4): 3}
    assert sol.unmet_rps == {}


def test_dominated_configs_are_pruned_unless_running() -> None:
    kept = {c.config for c in prune_dominated(PROBLEM)}
    assert key("a", VLLM, H100, 1) not in kept  # same slots and price as TRT tp1, less capacity
    assert key("a", VLLM, H100, 2) in kept
    running = dataclasses.replace(PROBLEM, current={key("a", VLLM, H100, 1): 2})
    assert key("a", VLLM, H100, 1) in {c.config for c in prune_dominated(running)}


def test_no_solver_result_falls_back_to_the_rounded_lp() -> None:
    sol = solve_counts(dataclasses.replace(PROBLEM, backend="NO-SUCH-SOLVER"))
    assert sol.report.status.endswith("+LP_ROUNDING")
    cap = {"a": 0.0, "b": 0.0}
    for c, n in sol.counts.items():
        cap[c.model] += n * next(x.capacity_rps for x in CANDS if x.config == c)
    assert cap["a"] >= 50.0 and cap["b"] >= 10.0
    assert sol.report.gap is not None and sol.report.gap < 0.5


def test_invalid_observed_rate_is_unknown_and_fails_static() -> None:
    from planner_helpers import caps

    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)])
    table = caps({key("m8", TRT, H100, 1): 14.0, key("m70", VLLM, H100, 4): 4.0,
                  key("m70", TRT, H100, 4): math.nan})
    r = plan_with_capacities(observe({"m8": math.nan, "m70": 3.0}), Fleet(), p, table,
                             PlannerState.initial(), 1.7e9)
    assert any("not a valid rate" in n for n in r.explanation.models[0].notes)
    assert any("fail static" in n for n in r.explanation.models[0].notes)
    assert any("no usable hosts" in n for n in r.explanation.notes)
    assert r.plan.replicas == ()


@pytest.mark.parametrize("backend", ["SCIP", "cp-sat"])
def test_a_work_limit_replaces_the_clock_and_a_generous_one_still_finds_the_optimum(backend: str) -> None:
    sol = solve_counts(dataclasses.replace(PROBLEM, backend=backend, work_limit=5.0, time_limit_s=1e-6))
    # a wall-clock limit of a microsecond would stop it at once: the work limit alone applies
    assert sol.report.status == "OPTIMAL"
    assert {(c.model, c.engine.value, c.tp): n for c, n in sol.counts.items()} == {
        ("a", "trtllm", 1): 4, ("b", "vllm", 4): 3}


def test_binding_limits_are_typed_by_kind_and_subject_and_keep_their_readable_text() -> None:
    # a: at most 2 replicas (it needs 4 of its best)
    capped = solve_counts(dataclasses.replace(
        PROBLEM, demands=(ModelDemand("a", 50.0, 1, 0, 2), ModelDemand("b", 10.0, 1, 1, None))))
    assert [(b.kind, b.subject, b.text) for b in capped.binding] == [
        (BindingKind.MAX_REPLICAS, "a", "max_replicas a: 2/2 used")]
    assert capped.binds(BindingKind.MAX_REPLICAS, "a") and not capped.binds(BindingKind.MAX_REPLICAS, "b")
    assert not capped.binds(BindingKind.INVENTORY) and not capped.binds(BindingKind.MAX_GPUS)
    # a GPU budget below the 16 GPUs of the optimum
    budget = solve_counts(dataclasses.replace(PROBLEM, max_gpus=8))
    assert [(b.kind, b.subject, b.text) for b in budget.binding] == [
        (BindingKind.MAX_GPUS, None, "budget max_gpus: 8/8 used")]
    assert budget.binds(BindingKind.MAX_GPUS) and not budget.binds(BindingKind.MAX_USD_H)
    # the inventory's text names its GPU type and TP groups; its subject is the GPU type alone
    full = solve_counts(dataclasses.replace(PROBLEM, slots={H100: {1: 2, 2: 1, 4: 1, 8: 0}}))
    inv = [b for b in full.binding if b.kind is BindingKind.INVENTORY]
    assert inv and all(b.subject == "h100" and b.text.startswith("inventory h100: TP") for b in inv)
