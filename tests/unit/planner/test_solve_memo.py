"""A stage-1 problem that did not move beyond the rate's noise reuses the last solution (planner/solve_memo.py)."""

from __future__ import annotations

import dataclasses

from planner_helpers import H100, TRT, VLLM, key

from fleetplan.planner.counts import Candidate, CountProblem, ModelDemand, solve_counts
from fleetplan.planner.solve_memo import Solved, reusable, reused

A1 = key("a", VLLM, H100, 1)
A2 = key("a", TRT, H100, 1)
ANCHOR_PROBLEM = CountProblem(
    candidates=(Candidate(A1, 4.0, 3.0, 60.0),),
    demands=(ModelDemand("a", 10.0, 1, 0, None),),
    slots={H100: {1: 32}},
    relative_gap=0.0,
)
ANCHOR = Solved(ANCHOR_PROBLEM, solve_counts(ANCHOR_PROBLEM))


def _at(rps: float, cap: float = 4.0) -> CountProblem:
    return dataclasses.replace(ANCHOR_PROBLEM, candidates=(Candidate(A1, cap, 3.0, 60.0),),
                               demands=(ModelDemand("a", rps, 1, 0, None),))


def test_the_worked_example() -> None:
    assert ANCHOR.solution.counts == {A1: 3}
    assert reusable(_at(9.8), [ANCHOR], {"a": 0.05}) is ANCHOR
    assert reusable(_at(9.0), [ANCHOR], {"a": 0.05}) is None  # a 10% fall: solved again
    assert solve_counts(_at(9.0)).counts == {A1: 3}  # (which here keeps 3 too)
    assert solve_counts(_at(7.9)).counts == {A1: 2}


def test_a_rise_the_fleet_still_meets_reuses_without_noise_and_one_it_does_not_solves() -> None:
    assert reusable(_at(11.5), [ANCHOR], {}) is ANCHOR
    assert reusable(_at(12.5), [ANCHOR], {"a": 0.5}) is None  # 3 x 4 rps no longer meets it
    assert reusable(_at(9.99), [ANCHOR], {}) is None  # no noise known: any fall solves


def test_a_capacity_that_grew_beyond_the_noise_solves_again() -> None:
    # 10 rps in replicas of 4.8 rps is 2.08 replicas, 17% fewer than 2.5: a cheaper fleet may exist
    assert reusable(_at(10.0, cap=4.8), [ANCHOR], {"a": 0.05}) is None
    assert solve_counts(_at(10.0, cap=5.0)).counts == {A1: 2}
    assert reusable(_at(10.0, cap=4.1), [ANCHOR], {"a": 0.05}) is ANCHOR


def test_any_discrete_change_solves_again() -> None:
    more = dataclasses.replace(_at(10.0), candidates=(Candidate(A1, 4.0, 3.0, 60.0), Candidate(A2, 6.0, 3.0, 45.0)))
    assert reusable(more, [ANCHOR], {"a": 0.5}) is None
    assert reusable(dataclasses.replace(_at(10.0), current={A1: 3}), [ANCHOR], {"a": 0.5}) is None
    assert reusable(dataclasses.replace(_at(10.0), young={A1: 1}), [ANCHOR], {"a": 0.5}) is None
    assert reusable(dataclasses.replace(_at(10.0), slots={H100: {1: 8}}), [ANCHOR], {"a": 0.5}) is None
    assert reusable(dataclasses.replace(_at(10.0), max_gpus=8), [ANCHOR], {"a": 0.5}) is None


def test_an_anchor_with_unmet_demand_is_not_reused() -> None:
    short = dataclasses.replace(ANCHOR_PROBLEM, slots={H100: {1: 2}})
    anchor = Solved(short, solve_counts(short))
    assert anchor.solution.unmet_rps
    assert reusable(dataclasses.replace(short, demands=(ModelDemand("a", 10.0, 1, 0, None),)), [anchor],
                    {"a": 0.5}) is None


def test_a_reused_solution_says_so_and_costs_no_solver_time() -> None:
    sol = reused(ANCHOR)
    assert sol.counts == ANCHOR.solution.counts
    assert sol.report.backend.endswith("(reused)") and sol.report.wall_s == 0.0
