"""Scale guards for the counterfactuals of a plan (planner/counterfactual.py).

The counterfactuals are explained per model and per allowed config; each lookup into the count
problem (its candidates, its running configs, its demands) must be built once per plan, not once
per model or alternative. Rebuilding the candidate map inside the per-model objective terms made
the plan 2.1x slower at 10,000 hosts / 500 models (bench/solve_scale.py): 1.2 s of 2.5 s went to
hashing the same 8,694 candidates 500 times. These tests count passes, not seconds, so they hold on
a loaded machine.
"""

from __future__ import annotations

from typing import Any

import pytest
from planner_helpers import TRT, VLLM, caps, hosts, key, observe, policy

from fleetplan.planner import core
from fleetplan.planner.counterfactual import MANY_MODELS, add_counterfactuals
from fleetplan.planner.counts import Candidate, CountProblem
from fleetplan.planner.types import Fleet, PlannerState

NOW = 1_700_000_000.0


class _Counted(tuple[Candidate, ...]):
    """The problem's candidates, counting the passes over them."""

    passes = 0

    def __iter__(self) -> Any:
        type(self).passes += 1
        return super().__iter__()


def _passes_over_candidates(n_models: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    names = [f"m{j:03d}" for j in range(n_models)]
    table = caps({key(m, e, tp=tp): (8.0 + j % 5) * tp ** 0.9 * (1.3 if e is TRT else 1.0)
                  for j, m in enumerate(names) for e in (VLLM, TRT) for tp in (1, 2, 4)})
    p = policy(models=names, tps={m: [1, 2, 4] for m in names},
               cached=[(m, "h100", tp) for m in names for tp in (1, 2, 4)])
    real = add_counterfactuals
    seen: dict[str, int] = {}

    def counted(explanation: Any, policy_: Any, eff: Any, problem: CountProblem, *a: Any, **kw: Any) -> Any:
        _Counted.passes = 0
        problem = CountProblem(**{**problem.__dict__, "candidates": _Counted(problem.candidates)})
        out = real(explanation, policy_, eff, problem, *a, **kw)
        seen["passes"] = _Counted.passes
        seen["alternatives"] = sum(len(m.alternatives) for m in out.models)
        return out

    monkeypatch.setattr(core, "add_counterfactuals", counted)
    rates = {m: 5.0 + 7.0 * (j % 4) for j, m in enumerate(names)}
    fleet = Fleet(hosts(n_models * 2))
    first = core.plan_with_capacities(observe(rates), fleet, p, table, PlannerState.initial(), NOW)
    assert seen["alternatives"] > n_models  # every model has alternatives: the per-model paths ran
    # the next cycle, with the plan running: churn and objective-term reasons are explained too
    running = Fleet(fleet.hosts, replicas=first.plan.replicas)
    core.plan_with_capacities(observe({m: r * 0.9 for m, r in rates.items()}), running, p, table,
                              first.next_state, NOW + 60)
    return seen["passes"], seen["alternatives"]


@pytest.mark.parametrize("n_models", [MANY_MODELS + 4, 4 * (MANY_MODELS + 4)])
def test_counterfactuals_pass_over_the_candidates_a_fixed_number_of_times(
        n_models: int, monkeypatch: pytest.MonkeyPatch) -> None:
    passes, alternatives = _passes_over_candidates(n_models, monkeypatch)
    assert alternatives >= n_models
    assert passes <= 2, f"{passes} passes over the candidates for {n_models} models: one per model is quadratic"
