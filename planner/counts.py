"""Stage 1: how many replicas of each (model, engine, GPU type, TP, precision), one CP-SAT model.

minimise   $/h + churn (starts + stops) + lead-time penalty (per start) + penalties for unmet demand,
           missed min replicas and missed floors (fail-static / scale-down delay)
subject to capacity >= demand x (1 + headroom)   (soft: slack priced by priority -> best effort)
           TP-slot inventory per GPU type        (exact for TP sizes that divide each other)
           budget: GPUs, $/h                      (hard)
           min (soft) / max (hard) replicas per model, allowed configs (the candidate list)

Integers only (CP-SAT): capacities in milli-rps, money in milli-$/h. Deterministic with one
worker; time-limited; status, objective, bound and gap reported from the solver itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from models.names import GpuType
from planner.types import ConfigKey, SolverReport

_RPS_SCALE = 1000  # milli-rps
_USD_SCALE = 1000  # milli-$/h


@dataclass(frozen=True)
class Candidate:
    config: ConfigKey
    capacity_rps: float  # one replica, at the model's SLO
    usd_h: float  # one replica
    lead_s: float  # time until a new replica serves (startup [+ build])
    binding: str = ""

    @property
    def gpus(self) -> int:
        return self.config.tp


@dataclass(frozen=True)
class ModelDemand:
    model: str
    required_rps: float  # demand x (1 + headroom)
    priority: int
    min_replicas: int
    max_replicas: int | None


@dataclass(frozen=True)
class CountProblem:
    candidates: tuple[Candidate, ...]
    demands: tuple[ModelDemand, ...]
    # per GPU type: TP size -> how many TP groups of that size fit (sum over NVLink groups of floor(n/t))
    slots: Mapping[GpuType, Mapping[int, int]]
    current: Mapping[ConfigKey, int] = field(default_factory=dict)
    floors: Mapping[ConfigKey, int] = field(default_factory=dict)  # soft lower bounds (held replicas)
    max_gpus: int | None = None
    max_usd_h: float | None = None
    churn_cost_usd_h: float = 0.0
    lead_time_cost_usd_h_per_min: float = 0.0
    time_limit_s: float = 2.0
    relative_gap: float = 0.001
    workers: int = 1


@dataclass(frozen=True)
class CountSolution:
    counts: Mapping[ConfigKey, int]
    unmet_rps: Mapping[str, float]
    min_missed: Mapping[str, int]
    report: SolverReport
    binding: tuple[str, ...]


def tp_slots(groups: Sequence[int], tp: int) -> int:
    return sum(g // tp for g in groups)


def _slot_sizes(problem: CountProblem, gpu: GpuType) -> list[int]:
    sizes = {c.config.tp for c in problem.candidates if c.config.gpu == gpu}
    return sorted(sizes)


def solve_counts(problem: CountProblem) -> CountSolution:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    cands = sorted(problem.candidates, key=lambda c: c.config)
    by_model: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        by_model.setdefault(c.config.model, []).append(i)
    demands = {d.model: d for d in problem.demands}

    # upper bounds per variable: from inventory slots and max replicas
    n = []
    ubs: list[int] = []
    for c in cands:
        ub = problem.slots.get(c.config.gpu, {}).get(c.config.tp, 0)
        d = demands.get(c.config.model)
        if d is not None and d.max_replicas is not None:
            ub = min(ub, d.max_replicas)
        if problem.max_gpus is not None:
            ub = min(ub, problem.max_gpus // max(1, c.gpus))
        ubs.append(max(0, ub))
        n.append(m.new_int_var(0, max(0, ub), f"n[{c.config.label()}]"))

    max_cost_per_rps = 0.0
    for c in cands:
        if c.capacity_rps > 0:
            max_cost_per_rps = max(max_cost_per_rps, c.usd_h / c.capacity_rps)
    max_replica_cost = max((c.usd_h for c in cands), default=1.0)
    prio_levels = sorted({d.priority for d in problem.demands})
    prio_rank = {p: r for r, p in enumerate(prio_levels)}

    objective: list[cp_model.LinearExprT] = []
    unmet_vars: dict[str, cp_model.IntVar] = {}
    min_vars: dict[str, cp_model.IntVar] = {}
    for name in sorted(demands):
        d = demands[name]
        idx = by_model.get(name, [])
        req = math.ceil(d.required_rps * _RPS_SCALE)
        u = m.new_int_var(0, max(0, req), f"unmet[{name}]")
        unmet_vars[name] = u
        caps = [round(cands[i].capacity_rps * _RPS_SCALE) for i in idx]
        m.add(sum(caps[k] * n[i] for k, i in enumerate(idx)) + u >= req)
        # unmet demand costs far more than serving it; higher priority levels weigh 4x per level
        per_rps = max(10.0 * max_cost_per_rps, 1.0) * (4 ** prio_rank[d.priority])
        # u is in milli-rps; per_rps $/h per rps == per_rps milli-$/h per milli-rps
        objective.append(u * math.ceil(per_rps))
        if d.min_replicas > 0:
            s = m.new_int_var(0, d.min_replicas, f"minmiss[{name}]")
            min_vars[name] = s
            m.add(sum(n[i] for i in idx) + s >= d.min_replicas)
            objective.append(s * round(100 * max_replica_cost * _USD_SCALE * (1 + prio_rank[d.priority])))
        if d.max_replicas is not None:
            m.add(sum(n[i] for i in idx) <= d.max_replicas)

    # inventory: TP slots per GPU type (nested sizes)
    binding: list[str] = []
    inv_exprs: list[tuple[str, cp_model.LinearExprT, int]] = []
    for gpu in sorted({c.config.gpu for c in cands}):
        sizes = _slot_sizes(problem, gpu)
        for t in sizes:
            terms = [n[i] * (c.gpus // t) for i, c in enumerate(cands)
                     if c.config.gpu == gpu and c.gpus >= t and c.gpus % t == 0]
            terms += [n[i] * math.ceil(c.gpus / t) for i, c in enumerate(cands)
                      if c.config.gpu == gpu and c.gpus >= t and c.gpus % t != 0]
            cap = problem.slots.get(gpu, {}).get(t, 0)
            if terms:
                expr = sum(terms)
                m.add(expr <= cap)
                inv_exprs.append((f"inventory {gpu.value}: TP{t} slots", expr, cap))

    gpu_total = sum(n[i] * c.gpus for i, c in enumerate(cands))
    cost_total = sum(n[i] * round(c.usd_h * _USD_SCALE) for i, c in enumerate(cands))
    if problem.max_gpus is not None:
        m.add(gpu_total <= problem.max_gpus)
        inv_exprs.append(("budget max_gpus", gpu_total, problem.max_gpus))
    if problem.max_usd_h is not None:
        cap_usd = math.floor(problem.max_usd_h * _USD_SCALE)
        m.add(cost_total <= cap_usd)
        inv_exprs.append(("budget max_usd_h", cost_total, cap_usd))
    objective.append(cost_total)

    # churn, lead time, floors
    churn = round(problem.churn_cost_usd_h * _USD_SCALE)
    for i, c in enumerate(cands):
        cur = int(problem.current.get(c.config, 0))
        ub = ubs[i]
        lead = round(problem.lead_time_cost_usd_h_per_min * c.lead_s / 60.0 * _USD_SCALE)
        if churn or lead:
            up = m.new_int_var(0, max(0, ub - cur) if ub > cur else 0, f"start[{c.config.label()}]")
            m.add(up >= n[i] - cur)
            objective.append(up * (churn + lead))
            if cur > 0 and churn:
                down = m.new_int_var(0, cur, f"stop[{c.config.label()}]")
                m.add(down >= cur - n[i])
                objective.append(down * churn)
        floor = int(problem.floors.get(c.config, 0))
        if floor > 0:
            miss = m.new_int_var(0, floor, f"floormiss[{c.config.label()}]")
            m.add(n[i] + miss >= floor)
            objective.append(miss * round(50 * max_replica_cost * _USD_SCALE))
    m.minimize(sum(objective))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = problem.workers
    solver.parameters.max_time_in_seconds = problem.time_limit_s
    solver.parameters.relative_gap_limit = problem.relative_gap
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    status_name = solver.status_name(status)
    counts: dict[ConfigKey, int] = {}
    unmet: dict[str, float] = {}
    missed: dict[str, int] = {}
    objective_value: float | None = None
    bound: float | None = None
    gap: float | None = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for i, c in enumerate(cands):
            v = int(solver.value(n[i]))
            if v:
                counts[c.config] = v
        for name, u in unmet_vars.items():
            val = solver.value(u) / _RPS_SCALE
            if val > 0:
                unmet[name] = val
        for name, s in min_vars.items():
            if solver.value(s):
                missed[name] = int(solver.value(s))
        objective_value = solver.objective_value / _USD_SCALE
        bound = solver.best_objective_bound / _USD_SCALE
        gap = 0.0 if status == cp_model.OPTIMAL else abs(objective_value - bound) / max(abs(objective_value), 1e-9)
        for label, used_expr, cap in inv_exprs:
            used = solver.value(used_expr)
            if cap > 0 and used >= cap:
                binding.append(f"{label}: {_fmt(used, label)}/{_fmt(cap, label)} used")
    report = SolverReport("counts", "cp-sat", status_name, objective_value, bound, gap, solver.wall_time)
    return CountSolution(counts, unmet, missed, report, tuple(binding))


def _fmt(v: int, label: str) -> str:
    if "usd" in label:
        return f"{v / _USD_SCALE:.2f}"
    return str(v)
