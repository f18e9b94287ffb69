"""The replay is a function of its inputs: a fleet of many models, GPU types and hosts whose solves stop
at their limit gives the same evaluation on a quiet machine with one worker process as beside a CPU
hog with two (the replay limits the solver's work, not its wall-clock time: sim/solve_limits.py)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

import fleetplan.planner.core as core
from fleetplan.models.profile import ProfileSet, roofline_profile
from fleetplan.planner.capacity import candidate_configs
from fleetplan.planner.counts import CountProblem, CountSolution, solve_counts
from fleetplan.planner.policy import Policy, load_policy_text
from fleetplan.sim.evaluate import EvaluateOptions, candidates_for, evaluate
from fleetplan.sim.solve_limits import replay_policy
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

SMALL = ["llama-3.1-8b", "llama-3-8b", "llama-3.1-8b-instruct", "llama-3-8b-instruct", "meta-llama-3-8b"]
BIG = ["llama-3.1-70b", "llama-3-70b", "llama-3.1-70b-instruct", "llama-3-70b-instruct", "llama-3.3-70b"]
GPUS = {"h100": 3.0, "h200": 3.8, "a100": 1.8, "l40s": 1.1}
# CP-SAT stopped after 0.02 units of work: short of optimal on this fleet's problems (asserted below);
# relative_gap 0: nothing but the limit stops it
SOLVER = "{time_limit_s: 0.02, relative_gap: 0.0, backend: cp-sat, workers: 1}"


def _policy_text() -> str:
    hosts = [f"  - {{name: {g}-{k}, gpu: {g}, gpu_count: {4 if g == 'l40s' else 8}}}"
             for g in GPUS for k in range(4)]
    models = [f"""  - name: {m}
    slo: {{ttft_p99_ms: {2000 if m in BIG else 800}, itl_p99_ms: {100 if m in BIG else 60}}}
    min_replicas: 1
    allowed: {{engines: [vllm], tp: [{'4, 8' if m in BIG else '1, 2, 4'}],
               gpus: [{', '.join(g for g in GPUS if not (m in BIG and g == 'l40s'))}]}}
    workload: {{isl: 800, osl: 200}}""" for m in SMALL + BIG]
    return f"""version: 1
gpu_types: {{{', '.join(f'{g}: {{price_usd_h: {p}}}' for g, p in GPUS.items())}}}
hosts:
{chr(10).join(hosts)}
engines:
  vllm: {{launch: {{command: vllm}}, startup: {{default_s: 60}}}}
scaling: {{cycle_s: 30, scale_down_delay_s: 60}}
solver: {SOLVER}
models:
{chr(10).join(models)}
"""


def _trace(duration_s: float = 60.0, seed: int = 0) -> Trace:
    """Poisson arrivals per model, each model's rate doubling half way (the plans change)."""
    rng = random.Random(seed)
    out = []
    for m in SMALL + BIG:
        rate, t = 0.1 + 0.3 * rng.random(), 0.0
        while (t := t + rng.expovariate(rate * (2.0 if t > duration_s / 2 else 1.0))) < duration_s:
            out.append(TraceRequest(t, max(1, int(rng.lognormvariate(6.5, 0.7))),
                                    max(2, int(rng.lognormvariate(5.0, 0.6))), m))
    out.sort(key=lambda r: r.t_s)
    return Trace("many-models", TraceFormat.BURSTGPT, tuple(out))


def _slow_profiles(policy: Policy, factor: float = 30.0) -> ProfileSet:
    """The roofline priors, every step `factor` x slower: the plans need many replicas per model, so
    the solver has a packing to search (the simulated engines stay as fast as they are)."""
    out = []
    for c in candidate_configs(policy, set(policy.gpu_types)):
        p = roofline_profile(c)
        assert p is not None
        k = p.params
        out.append(replace(p, params=replace(k, s0_ms=k.s0_ms * factor, s1_ms=k.s1_ms * factor, s2_ms=k.s2_ms * factor,
                                             p0_ms=k.p0_ms * factor, p1_ms=k.p1_ms * factor, p2_ms=k.p2_ms * factor)))
    return ProfileSet(tuple(out))


def _figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The evaluation without the run's own wall-clock measurements (how long it took, not what it found)."""
    trace = {k: v for k, v in doc["trace"].items() if k != "evaluation_wall_s"}
    policies = {n: {k: v for k, v in p.items() if k != "sim_wall_s"} for n, p in doc["policies"].items()}
    return {"trace": trace, "policies": policies}


def test_a_replay_whose_solves_hit_their_limit_is_the_same_on_a_busy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy_text(_policy_text(), "many-models.yaml")
    trace = _trace()
    profiles = _slow_profiles(policy)
    # ground-truth capacities given (their search is not what this test is about; any numbers will do)
    caps = {c: 1.0 for m in SMALL + BIG for c in candidates_for(policy, m)}
    # the replay gives the solver as many units of work as the policy gives it seconds; the daemon keeps the clock
    assert replay_policy(policy).solver.work_limit == policy.solver.time_limit_s and policy.solver.work_limit is None
    statuses: Counter[str] = Counter()

    def counted(problem: CountProblem) -> CountSolution:
        sol = solve_counts(problem)
        statuses[sol.report.status] += 1
        return sol

    monkeypatch.setattr(core, "solve_counts", counted)  # the in-process run's solves (workers=1)
    opts = EvaluateOptions(policies=("fleetplan",), workers=1)
    quiet = evaluate(trace, policy, profiles, opts, capacities=caps).to_json()
    # the case is one where the limit binds: solves stopped short of optimal
    assert sum(n for status, n in statuses.items() if status != "OPTIMAL") > 0, statuses
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = evaluate(trace, policy, profiles, EvaluateOptions(policies=("fleetplan",), workers=2),
                        capacities=caps).to_json()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert quiet["policies"]["fleetplan"]["arrived"] == len(trace.requests) > 100
    assert _figures(quiet) == _figures(busy)
