"""Stage 1: how many replicas of each (model, engine, GPU type, TP, precision), one MILP.

minimise   $/h + churn (starts + stops) + lead-time penalty (per start) + penalties for unmet demand,
           missed min replicas and missed floors (fail-static / scale-down delay)
subject to capacity >= demand x (1 + headroom)   (soft: slack priced by priority -> best effort)
           TP-slot inventory per GPU type        (exact for TP sizes that divide each other)
           budget: GPUs, $/h                      (hard)
           min (soft) / max (hard) replicas per model, allowed configs (the candidate list)

The model is built backend-neutral and solved by SCIP through pywraplp (default: single thread,
deterministic) or CP-SAT (integers only: capacities in milli-rps, money in milli-$/h; deterministic
with one worker). Dominated configs are pruned first (exact); the LP relaxation (GLOP) rounded per
model is a warm start and the fallback when the solver returns nothing. Status, objective, bound and
gap are reported from the solver itself (the planner reads no clock).

Limits: `time_limit_s` of wall-clock time (the daemon's: a plan on time), or, when `work_limit` is
given, a limit on the solver's work and no clock at all (the replay's: a solve that stops at its limit
stops at the same point on a busy machine as on an idle one, so the same problem gets the same
counts). A work unit is about one second of one core: CP-SAT's deterministic time
(`max_deterministic_time`; several workers interleave their search, deterministic whatever their
number), SCIP's branch-and-bound nodes (`limits/totalnodes`, SCIP_NODES_PER_WORK per unit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from fleetplan.models.names import GpuType
from fleetplan.planner.disagg_counts import (
    POOL_TIE_SHARE,
    Family,
    families,
    family_of,
    family_rates,
    gpus_per_rps,
)
from fleetplan.planner.types import ConfigKey, SolverReport

_RPS_SCALE = 1000  # milli-rps
_USD_SCALE = 1000  # milli-$/h
UNMET_TOL_RPS = 1e-3  # demand is met to within this
CAPACITY_TIEBREAK_USD_H_PER_RPS = 1e-3
# SCIP branch-and-bound nodes per work unit (about a second of one core on stage-1 models)
SCIP_NODES_PER_WORK = 1000


@dataclass(frozen=True)
class Candidate:
    config: ConfigKey
    capacity_rps: float  # one replica, at the model's SLO
    usd_h: float  # one replica
    lead_s: float  # time until a new replica serves (startup)
    binding: str = ""
    build_s: float = 0.0  # > 0: the engine must be built first (a one-off cost for the config)
    # at most this many replicas (None: no own limit): the TP groups of the hosts that hold the
    # config's built engine, where only some do (an agent refuses a replica of an engine it lacks)
    max_count: int | None = None

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
    # softer ones: replicas started a few cycles ago (planner/core.py _young_floors). A miss costs the
    # replica's $/h (the start thrown away), so no saving takes them away, and demand does: a floor
    # that outranks demand left 1 rps unmet under a GPU budget the young replica's GPUs were needed for
    young: Mapping[ConfigKey, int] = field(default_factory=dict)
    max_gpus: int | None = None
    max_usd_h: float | None = None
    churn_cost_usd_h: float = 0.0
    lead_time_cost_usd_h_per_min: float = 0.0
    time_limit_s: float = 2.0
    relative_gap: float = 0.001
    workers: int = 1
    backend: str = "SCIP"  # "SCIP" (pywraplp) | "cp-sat"
    # a limit on the solver's work instead of its wall-clock time (see the module docstring); None:
    # time_limit_s
    work_limit: float | None = None


class BindingKind(Enum):
    """Which hard limit of the count problem a solution uses up."""

    MAX_REPLICAS = "max_replicas"  # a model's max_replicas (subject: the model)
    INVENTORY = "inventory"  # the TP groups of a GPU type (subject: the GPU type's value)
    MAX_GPUS = "budget max_gpus"  # the policy's GPU budget (no subject)
    MAX_USD_H = "budget max_usd_h"  # the policy's $/h budget (no subject)


@dataclass(frozen=True)
class Limit:
    """A hard limit row of the model: its kind, what it limits and its readable name."""

    kind: BindingKind
    subject: str | None
    label: str  # e.g. "inventory h100: TP2 groups"


@dataclass(frozen=True)
class Binding:
    """A hard limit the solution uses up: compared by kind and subject; `text` is what a reader sees.

    >>> b = Binding(BindingKind.INVENTORY, "h100", "inventory h100: TP1 groups: 16/16 used")
    >>> b.kind is BindingKind.INVENTORY, b.subject, b.text
    (True, 'h100', 'inventory h100: TP1 groups: 16/16 used')
    """

    kind: BindingKind
    subject: str | None
    text: str


@dataclass(frozen=True)
class CountSolution:
    counts: Mapping[ConfigKey, int]
    unmet_rps: Mapping[str, float]
    min_missed: Mapping[str, int]
    report: SolverReport
    binding: tuple[Binding, ...]

    def binds(self, kind: BindingKind, subject: str | None = None) -> bool:
        """Whether a limit of `kind` (and `subject`, where given) binds in this solution."""
        return any(b.kind is kind and (subject is None or b.subject == subject) for b in self.binding)


def tp_slots(groups: Sequence[int], tp: int) -> int:
    return sum(g // tp for g in groups)


def _slot_sizes(problem: CountProblem, gpu: GpuType) -> list[int]:
    sizes = {c.config.tp for c in problem.candidates if c.config.gpu == gpu}
    return sorted(sizes)


@dataclass
class _Model:
    """A backend-neutral MILP: integer replica counts and continuous slacks."""

    names: list[str] = field(default_factory=list)
    ubs: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    scale: list[int] = field(default_factory=list)  # CP-SAT: integer units per real unit
    rows: list[tuple[list[tuple[int, float]], float | None, float | None, Limit | None]] = field(
        default_factory=list)
    obj: dict[int, float] = field(default_factory=dict)
    pools: list[tuple[int, Family]] = field(default_factory=list)  # r_f variables, their pool family
    caps: list[float] = field(default_factory=list)  # the candidates' capacities (rps per replica)

    def var(self, name: str, ub: float, integer: bool = True, scale: int = 1) -> int:
        self.names.append(name)
        self.ubs.append(max(0.0, ub))
        self.integer.append(integer)
        self.scale.append(scale)
        return len(self.names) - 1

    def row(self, terms: list[tuple[int, float]], lo: float | None, hi: float | None,
            limit: Limit | None = None) -> None:
        self.rows.append((terms, lo, hi, limit))

    def cost(self, v: int, c: float) -> None:
        if c:
            self.obj[v] = self.obj.get(v, 0.0) + c


@dataclass(frozen=True)
class _Raw:
    status: str
    values: list[float] | None
    objective: float | None
    bound: float | None
    wall_s: float


def prune_dominated(problem: CountProblem) -> list[Candidate]:
    """Drop a candidate when another of the same model, GPU type and TP (same slots) is at least as
    good in every objective term and constraint: no more $/h, no less capacity, no longer lead time.
    Exact (the optimum is unchanged); candidates running now or with a floor are always kept."""
    keep: list[Candidate] = []
    groups: dict[tuple[str, GpuType, int, str], list[Candidate]] = {}
    for c in sorted(problem.candidates, key=lambda c: c.config):  # a pool's replica stands in for no other's
        groups.setdefault((c.config.model, c.config.gpu, c.config.tp, c.config.role.value), []).append(c)
    for group in groups.values():
        for c in group:
            if problem.current.get(c.config, 0) or problem.floors.get(c.config, 0) or problem.young.get(c.config, 0):
                keep.append(c)
                continue
            dominated = False
            for o in group:
                if o is c:
                    continue
                if (o.usd_h <= c.usd_h and o.capacity_rps >= c.capacity_rps and o.lead_s <= c.lead_s
                        and o.build_s <= c.build_s and (o.max_count is None or (
                            c.max_count is not None and o.max_count >= c.max_count))):
                    strictly = (o.usd_h < c.usd_h or o.capacity_rps > c.capacity_rps or o.lead_s < c.lead_s
                                or o.build_s < c.build_s)
                    if strictly or o.config < c.config:
                        dominated = True
                        break
            if not dominated:
                keep.append(c)
    return sorted(keep, key=lambda c: c.config)


def _build(problem: CountProblem) -> tuple[_Model, list[Candidate], dict[str, int], dict[str, int]]:
    mdl = _Model()
    cands = prune_dominated(problem)
    demands = {d.model: d for d in problem.demands}
    by_model: dict[str, list[int]] = {}
    serving: dict[str, list[int]] = {}  # the aggregated candidates: they serve the model's rate directly
    for i, c in enumerate(cands):
        ub = problem.slots.get(c.config.gpu, {}).get(c.config.tp, 0)
        if c.max_count is not None:
            ub = min(ub, c.max_count)
        d = demands.get(c.config.model)
        if d is not None and d.max_replicas is not None:
            ub = min(ub, d.max_replicas)
        if problem.max_gpus is not None:
            ub = min(ub, problem.max_gpus // max(1, c.gpus))
        if problem.max_usd_h is not None and c.usd_h > 0:
            ub = min(ub, int(problem.max_usd_h // c.usd_h))
        v = mdl.var(f"n[{c.config.label()}]", ub)
        assert v == i
        by_model.setdefault(c.config.model, []).append(i)
        if family_of(c.config) is None:
            serving.setdefault(c.config.model, []).append(i)
    fams = families([c.config for c in cands])
    caps = mdl.caps = [c.capacity_rps for c in cands]
    pair_gpr = gpus_per_rps(fams, caps, [c.gpus for c in cands]) if fams else {}

    max_replica_cost = max((c.usd_h for c in cands), default=1.0)
    prio_rank = {p: min(r, 4) for r, p in enumerate(sorted({d.priority for d in problem.demands}))}
    # Unmet demand: penalty per rps = base x 8^rank x (GPUs per rps of the model's best config).
    # Per GPU, serving any model of one priority level then saves the same, and each higher level
    # (up to 4) 8x more, so short capacity goes to higher priorities first. `base` makes leaving
    # even UNMET_TOL_RPS unmet cost more than the model's dearest replica: demand is met whenever
    # it can be (to within UNMET_TOL_RPS).
    gpr: dict[str, float] = {}
    base = 1.0
    for name, idx in by_model.items():
        g = min((cands[i].gpus / cands[i].capacity_rps for i in serving.get(name, []) if cands[i].capacity_rps > 0),
                default=0.0)
        if name in pair_gpr:
            g = min(g, pair_gpr[name]) if g > 0 else pair_gpr[name]
        if g > 0:
            gpr[name] = g
            dearest = max(cands[i].usd_h for i in idx)
            base = max(base, dearest / (UNMET_TOL_RPS * g))

    # a missed min_replicas / floor replica costs more than the unmet demand any replica could serve:
    # floors (policy minimums, fail-static holds) outrank demand
    floor_weight = 2.0 * max_replica_cost + 2.0 * max(
        (base * gpr.get(c.config.model, 1.0) * (8 ** max(prio_rank.values(), default=0)) * c.capacity_rps
         for c in cands), default=1.0)
    unmet: dict[str, int] = {}
    minmiss: dict[str, int] = {}
    for name in sorted(demands):
        d = demands[name]
        idx = by_model.get(name, [])
        if d.required_rps > UNMET_TOL_RPS:
            shares = []  # r_f: the rate each pool family carries (planner/disagg_counts.py)
            for f in (f for f in fams if f.key.model == name):
                r = mdl.var(f"pools[{f.key.label()}]", d.required_rps, integer=False, scale=_RPS_SCALE)
                for pool in (f.prefill, f.decode):
                    mdl.row([(i, caps[i]) for i in pool] + [(r, -1.0)], 0.0, None)
                shares.append((r, 1.0))
                mdl.pools.append((r, f))
            u = mdl.var(f"unmet[{name}]", d.required_rps, integer=False, scale=_RPS_SCALE)
            unmet[name] = u
            mdl.row([(i, caps[i]) for i in serving.get(name, [])] + shares + [(u, 1.0)], d.required_rps, None)
            mdl.cost(u, base * gpr.get(name, 1.0) * (8 ** prio_rank[d.priority]))
        if d.min_replicas > 0:
            s = mdl.var(f"minmiss[{name}]", d.min_replicas)
            minmiss[name] = s
            mdl.row([(i, 1.0) for i in idx] + [(s, 1.0)], d.min_replicas, None)
            mdl.cost(s, floor_weight * (1 + prio_rank[d.priority]))
        if d.max_replicas is not None and idx:
            mdl.row([(i, 1.0) for i in idx], None, d.max_replicas,
                    Limit(BindingKind.MAX_REPLICAS, name, f"max_replicas {name}"))

    for gpu in sorted({c.config.gpu for c in cands}):
        for t in _slot_sizes(problem, gpu):
            terms = [(i, float(math.ceil(c.gpus / t))) for i, c in enumerate(cands)
                     if c.config.gpu == gpu and c.gpus >= t]
            if terms:
                cap = problem.slots.get(gpu, {}).get(t, 0)
                mdl.row(terms, None, cap,
                        Limit(BindingKind.INVENTORY, gpu.value, f"inventory {gpu.value}: TP{t} groups"))
    if problem.max_gpus is not None:
        mdl.row([(i, float(c.gpus)) for i, c in enumerate(cands)], None, problem.max_gpus,
                Limit(BindingKind.MAX_GPUS, None, "budget max_gpus"))
    if problem.max_usd_h is not None:
        mdl.row([(i, c.usd_h) for i, c in enumerate(cands)], None, problem.max_usd_h,
                Limit(BindingKind.MAX_USD_H, None, "budget max_usd_h"))
    for i, c in enumerate(cands):
        # $/h, minus a tie-break that prefers more spare capacity for the same money (a pool replica:
        # plus one that prefers aggregated serving, planner/disagg_counts.py)
        mdl.cost(i, c.usd_h - min(CAPACITY_TIEBREAK_USD_H_PER_RPS * c.capacity_rps, 0.01 * c.usd_h)
                 if family_of(c.config) is None else c.usd_h * (1.0 + POOL_TIE_SHARE))
        if c.build_s > 0 and problem.lead_time_cost_usd_h_per_min > 0:
            y = mdl.var(f"build[{c.config.label()}]", 1)
            mdl.row([(y, max(1.0, mdl.ubs[i])), (i, -1.0)], 0.0, None)
            mdl.cost(y, problem.lead_time_cost_usd_h_per_min * c.build_s / 60.0)

    for i, c in enumerate(cands):
        cur = int(problem.current.get(c.config, 0))
        ub = int(mdl.ubs[i])
        lead = problem.lead_time_cost_usd_h_per_min * c.lead_s / 60.0
        per_start = problem.churn_cost_usd_h + lead
        if per_start > 0 and ub > cur:
            if cur == 0:
                mdl.cost(i, per_start)  # none running: every replica is a start (exact; no start variable)
            else:
                up = mdl.var(f"start[{c.config.label()}]", ub - cur)
                mdl.row([(up, 1.0), (i, -1.0)], -cur, None)
                mdl.cost(up, per_start)
        if cur > 0 and problem.churn_cost_usd_h > 0:
            down = mdl.var(f"stop[{c.config.label()}]", cur)
            mdl.row([(down, 1.0), (i, 1.0)], cur, None)
            mdl.cost(down, problem.churn_cost_usd_h)
        for kind, bounds, weight in (("floormiss", problem.floors, floor_weight), ("youngmiss", problem.young, c.usd_h)):
            floor = int(bounds.get(c.config, 0))
            if floor > 0:
                miss = mdl.var(f"{kind}[{c.config.label()}]", floor)
                mdl.row([(i, 1.0), (miss, 1.0)], floor, None)
                mdl.cost(miss, weight)
    return mdl, cands, unmet, minmiss


def _solve_cpsat(mdl: _Model, problem: CountProblem, hint: list[float] | None) -> _Raw:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    xs = [m.new_int_var(0, math.floor(ub * sc + 1e-9) if integer else math.ceil(ub * sc), name)
          for name, ub, integer, sc in zip(mdl.names, mdl.ubs, mdl.integer, mdl.scale, strict=True)]
    for terms, lo, hi, _ in mdl.rows:
        row_scale = max((mdl.scale[v] for v, _ in terms), default=1)
        if any(abs(c - round(c)) > 1e-9 for _, c in terms):
            row_scale = max(row_scale, _USD_SCALE)
        expr = sum(round(c * row_scale / mdl.scale[v]) * xs[v] for v, c in terms)
        if lo is not None:
            m.add(expr >= math.ceil(lo * row_scale - 1e-9))
        if hi is not None:
            m.add(expr <= math.floor(hi * row_scale + 1e-9))
    m.minimize(sum(round(c * _USD_SCALE / mdl.scale[v]) * xs[v] for v, c in sorted(mdl.obj.items())))
    if hint is not None:
        for x, v, sc in zip(xs, hint, mdl.scale, strict=True):
            m.add_hint(x, math.ceil(v * sc - 1e-9))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = problem.workers
    if problem.work_limit is None:
        solver.parameters.max_time_in_seconds = problem.time_limit_s
    else:
        solver.parameters.max_deterministic_time = problem.work_limit
        solver.parameters.interleave_search = problem.workers > 1  # deterministic for any worker count
    solver.parameters.relative_gap_limit = problem.relative_gap
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Raw(name, None, None, None, solver.wall_time)
    values = [solver.value(x) / sc for x, sc in zip(xs, mdl.scale, strict=True)]
    return _Raw(name, values, solver.objective_value / _USD_SCALE, solver.best_objective_bound / _USD_SCALE,
                solver.wall_time)


def _proto(mdl: _Model) -> Any:
    """`mdl` as one MPModelProto: bulk field copies (per-coefficient pywraplp calls took 0.2 s at
    500 models, bench/solve_scale.py), loaded as it is by every pywraplp backend."""
    from ortools.linear_solver import linear_solver_pb2

    proto = linear_solver_pb2.MPModelProto()
    for name, ub, is_int in zip(mdl.names, mdl.ubs, mdl.integer, strict=True):
        proto.variable.add(name=name, lower_bound=0.0, upper_bound=ub, is_integer=is_int)
    for v, c in mdl.obj.items():
        proto.variable[v].objective_coefficient = c
    for terms, lo, hi, _ in mdl.rows:
        row = proto.constraint.add()
        if lo is not None:
            row.lower_bound = lo
        if hi is not None:
            row.upper_bound = hi
        row.var_index.extend(v for v, _ in terms)
        row.coefficient.extend(c for _, c in terms)
    return proto


def _linear_solver(proto: Any, backend: str) -> Any:
    """The model `proto` in a pywraplp solver of `backend` (an LP backend relaxes the integer
    variables); None when this OR-Tools lacks the backend."""
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        return None
    why = solver.LoadModelFromProto(proto)
    if why:
        raise ValueError(f"{backend} rejected the stage-1 model: {why}")
    return solver


def _solve_mip(solver: Any, mdl: _Model, problem: CountProblem, backend: str, hint: list[float] | None) -> _Raw:
    from ortools.linear_solver import pywraplp

    xs = solver.variables()
    obj = solver.Objective()
    if hint is not None:
        solver.SetHint(xs, hint)
    if problem.work_limit is None:
        solver.SetTimeLimit(max(1, int(problem.time_limit_s * 1000)))
    elif backend == "SCIP":
        nodes = max(1, math.ceil(problem.work_limit * SCIP_NODES_PER_WORK))
        if not solver.SetSolverSpecificParametersAsString(f"limits/totalnodes = {nodes}\n"):
            raise ValueError(f"SCIP refused limits/totalnodes = {nodes}")
    else:
        raise ValueError(f"backend {backend}: no limit on work (work_limit is for SCIP and cp-sat)")
    if backend == "SCIP":
        solver.SetNumThreads(1)
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, problem.relative_gap)
    status = solver.Solve(params)
    names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
             pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
             pywraplp.Solver.ABNORMAL: "ABNORMAL", pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED"}
    name = names.get(status, str(status))
    wall = solver.wall_time() / 1000.0
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return _Raw(name, None, None, None, wall)
    values = [x.solution_value() for x in xs]
    values = [round(v) if integer else v for v, integer in zip(values, mdl.integer, strict=True)]
    return _Raw(name, values, obj.Value(), obj.BestBound(), wall)


def _lp_relaxation(proto: Any) -> tuple[list[float], float, float] | None:
    """The LP relaxation (GLOP): values, objective (a lower bound), wall seconds. Not CLP, though it
    solves stage 1's LP 10x faster (0.03 s against 0.3 s at 500 models): it crashed the process
    (SIGSEGV in Solve) on a 7-variable model from the planner's property tests, one run in five,
    a model it solved alone."""
    from ortools.linear_solver import pywraplp

    try:
        solver = _linear_solver(proto, "GLOP")
    except ValueError:  # a number the solver cannot take: no hint (solve_counts reports the failure)
        return None
    if solver is None or solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return [x.solution_value() for x in solver.variables()], solver.Objective().Value(), solver.wall_time() / 1000.0


def _complete(mdl: _Model, n_values: list[int]) -> list[float] | None:
    """Extend replica counts with the smallest feasible slacks (a row's last auxiliary variable; the
    pool families' rates r_f first, what the counts let them carry); None when a constraint is violated."""
    ncand = len(n_values)
    values: list[float] = [float(v) for v in n_values] + [0.0] * (len(mdl.names) - ncand)
    for (r, _), rate in zip(mdl.pools, family_rates([f for _, f in mdl.pools], mdl.caps, values), strict=True):
        values[r] = min(rate, mdl.ubs[r])
    for terms, lo, _hi, _ in mdl.rows:
        aux = [(v, c) for v, c in terms if v >= ncand]
        if lo is not None and aux and aux[-1][1] > 0:
            v, c = aux[-1]
            rest = sum(cc * values[vv] for vv, cc in terms if vv != v)
            need = (lo - rest) / c
            if need > values[v]:
                values[v] = float(math.ceil(need - 1e-9)) if mdl.integer[v] else need
    for v, ub in enumerate(mdl.ubs):
        if values[v] > ub + 1e-6:
            return None
    for terms, lo, hi, _ in mdl.rows:
        act = sum(c * values[v] for v, c in terms)
        if (lo is not None and act < lo - 1e-6) or (hi is not None and act > hi + 1e-6):
            return None
    return values


def _round(problem: CountProblem, mdl: _Model, cands: list[Candidate], lp: list[float]) -> list[float] | None:
    """A feasible integer solution near the LP optimum: floor, then cover each model's residual
    demand with the cheapest config that still fits (priority order), then min replicas."""
    n = [math.floor(x + 1e-6) for x in lp[: len(cands)]]
    sizes = {g: _slot_sizes(problem, g) for g in {c.config.gpu for c in cands}}
    used: dict[tuple[GpuType, int], int] = {}
    gpus = 0
    usd = 0.0
    count: dict[str, int] = {}

    def add(i: int, k: int) -> None:
        nonlocal gpus, usd
        c = cands[i]
        for t in sizes[c.config.gpu]:
            if t <= c.gpus:
                used[(c.config.gpu, t)] = used.get((c.config.gpu, t), 0) + k * math.ceil(c.gpus / t)
        gpus += k * c.gpus
        usd += k * c.usd_h
        count[c.config.model] = count.get(c.config.model, 0) + k

    def fits(i: int, k: int) -> bool:
        c = cands[i]
        if n[i] + k > mdl.ubs[i] + 1e-9:
            return False
        d = demands.get(c.config.model)
        if d is not None and d.max_replicas is not None and count.get(c.config.model, 0) + k > d.max_replicas:
            return False
        for t in sizes[c.config.gpu]:
            if t <= c.gpus:
                cap = problem.slots.get(c.config.gpu, {}).get(t, 0)
                if used.get((c.config.gpu, t), 0) + k * math.ceil(c.gpus / t) > cap:
                    return False
        if problem.max_gpus is not None and gpus + k * c.gpus > problem.max_gpus:
            return False
        return problem.max_usd_h is None or usd + k * c.usd_h <= problem.max_usd_h + 1e-9

    demands = {d.model: d for d in problem.demands}
    for i, k in enumerate(n):
        if k:
            add(i, k)
    by_model: dict[str, list[int]] = {}
    pooled: dict[str, float] = {}  # per model, the rate its pool families carry at the floored counts
    for (_, f), rate in zip(mdl.pools, family_rates([f for _, f in mdl.pools], mdl.caps, n),
                            strict=True):
        pooled[f.key.model] = pooled.get(f.key.model, 0.0) + rate
    for i, c in enumerate(cands):
        if family_of(c.config) is None:  # the residual is covered by aggregated replicas
            by_model.setdefault(c.config.model, []).append(i)
    for d in sorted(problem.demands, key=lambda d: (-d.priority, d.model)):
        idx = by_model.get(d.model, [])
        for _ in range(64):
            r = d.required_rps - pooled.get(d.model, 0.0) - sum(cands[i].capacity_rps * n[i] for i in idx)
            if r <= 1e-9:
                break
            best: tuple[float, int, int] | None = None
            for i in idx:
                c = cands[i]
                k = math.ceil(r / c.capacity_rps - 1e-9)
                if fits(i, k):
                    cost = k * (c.usd_h + problem.churn_cost_usd_h
                                + problem.lead_time_cost_usd_h_per_min * c.lead_s / 60.0)
                    if best is None or cost < best[0]:
                        best = (cost, i, k)
            if best is None:  # cannot cover: add the best capacity-per-$ replica that fits, repeat
                fitting = [i for i in idx if fits(i, 1)]
                if not fitting:
                    break
                best = (0.0, max(fitting, key=lambda i: cands[i].capacity_rps / max(cands[i].usd_h, 1e-9)), 1)
            n[best[1]] += best[2]
            add(best[1], best[2])
        while count.get(d.model, 0) < d.min_replicas:
            fitting = [i for i in idx if fits(i, 1)]
            if not fitting:
                break
            i = min(fitting, key=lambda i: cands[i].usd_h)
            n[i] += 1
            add(i, 1)
    return _complete(mdl, n)


def solve_counts(problem: CountProblem) -> CountSolution:
    mdl, cands, unmet_vars, min_vars = _build(problem)
    backend = problem.backend
    hint: list[float] | None = None
    proto = _proto(mdl)
    lp = _lp_relaxation(proto)
    if lp is not None:
        hint = _round(problem, mdl, cands, lp[0])
    try:
        if backend == "cp-sat":
            raw = _solve_cpsat(mdl, problem, hint)
        else:
            mip = _linear_solver(proto, backend)
            raw = (_Raw(f"NO_SOLVER_{backend}", None, None, None, 0.0) if mip is None
                   else _solve_mip(mip, mdl, problem, backend, hint))
    except (TypeError, OverflowError, ValueError) as exc:
        # a number the backend cannot represent (CP-SAT bounds are int64): a failed solve, not a crash
        raw = _Raw(f"ERROR_{type(exc).__name__}", None, None, None, 0.0)
    if raw.values is None and hint is not None:
        # no solution within the time limit: the rounded LP solution is feasible; use it
        obj = sum(c * hint[v] for v, c in mdl.obj.items())
        raw = _Raw(f"{raw.status}+LP_ROUNDING", hint, obj, lp[1] if lp is not None else None, raw.wall_s)
    if raw.values is None:
        # nothing feasible found at all (should not happen: every constraint has slack; numbers the
        # solvers cannot represent do it): keep the current fleet where the candidates allow it, topped
        # up to min_replicas where it fits (demand aside: it is what the solver could not handle)
        keep = [float(min(problem.current.get(c.config, 0), int(mdl.ubs[i]))) for i, c in enumerate(cands)]
        floors_only = replace(problem, demands=tuple(replace(d, required_rps=0.0) for d in problem.demands))
        raw = _Raw(f"{raw.status}+KEPT_CURRENT", _round(floors_only, mdl, cands, keep) or
                   _complete(mdl, [int(k) for k in keep]) or
                   keep + [0.0] * (len(mdl.names) - len(cands)), None, None, raw.wall_s)
    counts: dict[ConfigKey, int] = {}
    unmet: dict[str, float] = {}
    missed: dict[str, int] = {}
    binding: list[Binding] = []
    gap: float | None = None
    if raw.values is not None:
        vals = raw.values
        for i, c in enumerate(cands):
            k = round(vals[i])
            if k > 0:
                counts[c.config] = k
        for name, u in unmet_vars.items():
            if vals[u] > UNMET_TOL_RPS:
                unmet[name] = vals[u]
        for name, s in min_vars.items():
            if round(vals[s]) > 0:
                missed[name] = round(vals[s])
        if raw.objective is not None and raw.bound is not None:
            gap = max(0.0, raw.objective - raw.bound) / max(abs(raw.objective), 1e-9)
        for terms, _lo, hi, limit in mdl.rows:
            if limit is not None and hi is not None and hi > 0:
                used = sum(c * vals[v] for v, c in terms)
                if used >= hi - 1e-6:
                    unit = (f"{used:.2f}/{hi:.2f} $/h" if limit.kind is BindingKind.MAX_USD_H
                            else f"{used:.0f}/{hi:.0f}")
                    binding.append(Binding(limit.kind, limit.subject, f"{limit.label}: {unit} used"))
    report = SolverReport("counts", backend.lower(), raw.status, raw.objective, raw.bound, gap, raw.wall_s)
    return CountSolution(counts, unmet, missed, report, tuple(binding))


