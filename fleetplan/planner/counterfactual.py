"""Counterfactuals of a plan, from the solver's own inputs: what else was allowed, why it lost, when
the choice would flip, and what relaxing a binding constraint one step would save or cost.

Pure (no I/O, no clock). Called once per plan by fleetplan.planner.core.plan_with_capacities; the reports
render what is stored with the plan and never recompute it.

- Alternatives (per model, per allowed engine x GPU type x TP not in the plan): that config alone,
  sized by arithmetic on the capacity table the solver used: replicas = max(min_replicas,
  ceil(required / capacity)), limited by max_replicas, the GPUs and TP groups the other models
  leave free and the budget they leave; its $/h; and the reason it lost (LossReason).
- Flip loads: the demand at which the alternative alone becomes cheaper than the chosen configs
  alone. Both are step functions of the demand d, max(min, ceil(d (1 + headroom) / cap)) x price,
  so a scan over their breakpoints is exact (no solver).
- Relaxations: re-solves of the plan's count problem (stage 1, same objective, churn and floors)
  with one binding constraint relaxed one step: max_replicas +1, +1 host of the GPU type whose
  inventory binds, budget +1 host (max_gpus / max_usd_h), and SLO +10% per model (capacities from
  the profiles at the relaxed SLO, given by plan(); skipped by plan_with_capacities without them).
  At most MAX_RESOLVES re-solves, sharing one plan solve's time limit (so they never take longer
  than the plan's own solve may); none when the policy has more than MANY_MODELS models; the
  explanation says so. The re-solves are listed in the explanation's solver reports (stage
  "counterfactual") and not counted in its solve_s. plan(counterfactuals=False) skips all of it
  (replays that act on thousands of plans and never show them).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fleetplan.models.names import GpuType
from fleetplan.models.profile import PerfProfile, ProfileSet
from fleetplan.planner.capacity import CapacityInfo, MixedWorkload, Speeds, best_reach, capacity_table
from fleetplan.planner.counts import (
    CAPACITY_TIEBREAK_USD_H_PER_RPS,
    UNMET_TOL_RPS,
    BindingKind,
    CountProblem,
    CountSolution,
    solve_counts,
    tp_slots,
)
from fleetplan.planner.policy import Effective, Policy, Slo
from fleetplan.planner.types import (
    Alternative,
    ConfigKey,
    Explanation,
    FlipSide,
    HostInventory,
    LossReason,
    ModelExplanation,
    Relaxation,
    SolverReport,
)

__all__ = [
    "MANY_MODELS",
    "MAX_RESOLVES",
    "SLO_RELAX_FACTOR",
    "add_counterfactuals",
    "alternative_to_dict",
    "flip_range",
    "relaxation_to_dict",
    "slo_relaxed_capacities",
]

MAX_RESOLVES = 8  # re-solves per plan for the relaxations
MANY_MODELS = 16  # above this, no re-solves (each would cost about as much as the plan itself)
MAX_FLIP_CELLS = 200_000  # alternatives x 2048 breakpoints scanned per plan for flip loads (at most)
SLO_RELAX_FACTOR = 1.1  # "SLO +10%"
_USD_EPS = 1e-6
# relaxing one of these one step can change nothing while another of them still binds
_SHARED_LIMITS = frozenset({BindingKind.INVENTORY, BindingKind.MAX_GPUS, BindingKind.MAX_USD_H})


@dataclass(frozen=True)
class _Relaxed:
    """One relaxation to re-solve: the limit (None: the SLO), its readable name and step, the model."""

    kind: BindingKind | None
    constraint: str
    step: str
    model: str | None
    problem: CountProblem


def slo_relaxed_capacities(
    policy: Policy,
    profiles: ProfileSet | Mapping[ConfigKey, PerfProfile],
    workloads: Mapping[str, MixedWorkload],
    gpus: Iterable[GpuType],
    factor: float = SLO_RELAX_FACTOR,
    speeds: Mapping[ConfigKey, Speeds] | None = None,
) -> dict[ConfigKey, CapacityInfo]:
    """The capacity table with every model's SLO (TTFT and ITL p99) multiplied by `factor`."""
    # model_construct: a derived SLO, not file input; the file's upper bounds (policy.py) do not apply
    models = [m.model_copy(update={"slo": Slo.model_construct(ttft_p99_ms=m.slo.ttft_p99_ms * factor,
                                                              itl_p99_ms=m.slo.itl_p99_ms * factor)})
              for m in policy.models]
    # a fresh Policy (not model_copy): its cached per-name lookups must see the relaxed models
    relaxed = Policy.model_validate({**dict(policy), "models": tuple(models)})
    table, _ = capacity_table(relaxed, profiles, workloads, gpus, speeds=speeds)
    return table


# ---- the step cost functions --------------------------------------------------------------------
def _replicas_for(demand_rps: float, headroom: float, cap_rps: float, min_replicas: int) -> int:
    need = demand_rps * (1 + headroom)
    n = math.ceil(need / cap_rps - 1e-9) if need > UNMET_TOL_RPS else 0
    return max(min_replicas, n)


def flip_range(
    demand_rps: float,
    headroom: float,
    min_replicas: int,
    alternative: tuple[float, float],
    chosen: Iterable[tuple[float, float]],
    limit_rps: float,
) -> tuple[float, float] | None:
    """The demand range (lo, hi] nearest `demand_rps` where the alternative alone (capacity per
    replica, $/h per replica) is strictly cheaper than the cheapest of the chosen configs alone;
    None when there is none in (0, limit_rps]. Exact: both are step functions of the demand,
    constant between their breakpoints k x capacity / (1 + headroom)."""
    ch = [c for c in chosen if c[0] > 0]
    if alternative[0] <= 0 or not ch or limit_rps <= 0:
        return None

    def cost(cfg: tuple[float, float], d: float) -> float:
        return _replicas_for(d, headroom, cfg[0], min_replicas) * cfg[1]

    points = {0.0, limit_rps}
    for cap, _ in (alternative, *ch):
        step = cap / (1 + headroom)
        k = 1
        while k * step < limit_rps:
            points.add(k * step)
            k += 1
    pts = sorted(points)
    runs: list[tuple[float, float]] = []
    for a, b in itertools.pairwise(pts):
        if cost(alternative, b) < min(cost(c, b) for c in ch) - _USD_EPS:
            if runs and math.isclose(runs[-1][1], a):
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
    if not runs:
        return None
    return min(runs, key=lambda r: 0.0 if r[0] < demand_rps <= r[1] else min(abs(r[0] - demand_rps),
                                                                              abs(r[1] - demand_rps)))


# ---- alternatives ---------------------------------------------------------------------------------
def _usable(hosts: tuple[HostInventory, ...], drained: frozenset[str]) -> list[HostInventory]:
    return [h for h in hosts if h.online and h.name not in drained]


class _Inventory:
    """TP groups and GPUs of the usable hosts per GPU type (computed once per type and TP size)."""

    def __init__(self, hosts: list[HostInventory]) -> None:
        self.groups: dict[GpuType, list[int]] = {}
        for h in hosts:
            self.groups.setdefault(h.gpu, []).extend(len(g) for g in h.groups())
        self._slots: dict[tuple[GpuType, int], int] = {}
        self._gpus = {g: sum(sizes) for g, sizes in self.groups.items()}

    def has(self, gpu: GpuType) -> bool:
        return gpu in self.groups

    def slots(self, gpu: GpuType, tp: int) -> int:
        k = (gpu, tp)
        if k not in self._slots:
            self._slots[k] = tp_slots(self.groups.get(gpu, []), tp)
        return self._slots[k]

    def gpus(self, gpu: GpuType) -> int:
        return self._gpus.get(gpu, 0)


def _allowed(policy: Policy, model: str) -> list[ConfigKey]:
    m = policy.model(model)
    if m is None:
        return []
    out = []
    for e in sorted(set(m.allowed.engines)):
        if e not in policy.engines:
            continue
        for g in sorted(m.allowed.gpus if m.allowed.gpus is not None else policy.gpu_types):
            for tp in sorted(set(m.allowed.tp)):
                out.append(ConfigKey(model, e, g, tp, m.precision))
    return out


def _fmt(x: float) -> str:
    return f"{x:.1f}"


class _Problem:
    """Lookups into the count problem, built once per plan (not once per model or alternative:
    at 500 models x 18 configs the per-call rebuilds made the counterfactuals cost more than the
    solve)."""

    def __init__(self, problem: CountProblem) -> None:
        self.problem = problem
        self.cands = {c.config: c for c in problem.candidates}
        self.current: dict[str, list[ConfigKey]] = {}  # model -> its running configs (problem.current's order)
        for c, k in problem.current.items():
            if k > 0:
                self.current.setdefault(c.model, []).append(c)
        self.required: dict[str, float] = {}  # model -> required rps (its first demand)
        for d in problem.demands:
            self.required.setdefault(d.model, d.required_rps)


def _terms(lookup: _Problem, model: str, counts: Mapping[ConfigKey, int]) -> dict[LossReason, float]:
    """The solver's objective terms besides $/h (planner/counts.py) for `counts` of one model:
    the spare-capacity tie-break, the startup (lead-time) penalty and the churn penalty."""
    problem, cands = lookup.problem, lookup.cands
    tie = lead = churn = 0.0
    configs = set(counts) | set(lookup.current.get(model, ()))
    for c in configs:
        n, cur = counts.get(c, 0), problem.current.get(c, 0)
        cand = cands.get(c)
        if cand is not None:
            tie -= n * min(CAPACITY_TIEBREAK_USD_H_PER_RPS * cand.capacity_rps, 0.01 * cand.usd_h)
            lead += max(0, n - cur) * problem.lead_time_cost_usd_h_per_min * cand.lead_s / 60.0
        churn += abs(n - cur) * problem.churn_cost_usd_h
    return {LossReason.TIE: tie, LossReason.LEAD_TIME: lead, LossReason.CHURN: churn}


def _objective_reason(lookup: _Problem, me: ModelExplanation, key: ConfigKey, n: int, usd: float,
                      chosen: Mapping[ConfigKey, int]) -> tuple[LossReason, str]:
    """Why an alternative that is not dearer in $/h lost: the objective term that outweighs it."""
    problem = lookup.problem
    alt = _terms(lookup, me.model, {key: n})
    ch = _terms(lookup, me.model, chosen)
    obj_alt = usd + sum(alt.values())
    obj_ch = me.usd_h + sum(ch.values())
    head = (f"same ${usd:.2f}/h" if abs(usd - me.usd_h) <= _USD_EPS else f"${usd:.2f}/h vs ${me.usd_h:.2f}/h")
    if obj_alt <= obj_ch + _USD_EPS:
        return LossReason.COST, (f"{head}, objective {obj_alt:.3f} vs {obj_ch:.3f} alone; the joint solve "
                                 "(shared inventory, relative gap) kept the chosen mix")
    reason = max(alt, key=lambda r: alt[r] - ch[r])
    what = {LossReason.TIE: "the tie-break for spare capacity",
            LossReason.LEAD_TIME: "the startup penalty of its new replicas",
            LossReason.CHURN: "the churn penalty per replica started or stopped"}[reason]
    if reason is LossReason.CHURN and problem.churn_cost_usd_h > 0:
        moves = (round(alt[reason] / problem.churn_cost_usd_h), round(ch[reason] / problem.churn_cost_usd_h))
        what += f", {moves[0]} vs {moves[1]} starts/stops"
    return reason, (f"{head}; in the solver's objective {obj_alt:.3f} vs {obj_ch:.3f} $/h: {what} "
                    f"({alt[reason]:+.3f} vs {ch[reason]:+.3f} $/h)")


class _Placed:
    """The GPUs and $/h of every model's chosen configs, summed once per plan; each model's
    alternatives see the totals without that model (what the other models leave)."""

    def __init__(self, models: tuple[ModelExplanation, ...]) -> None:
        self.models = models
        self.total: dict[GpuType, int] = {}
        self.own: dict[str, dict[GpuType, int]] = {}
        for o in models:
            own = self.own.setdefault(o.model, {})
            for c in o.configs:
                g = c.config.gpu
                self.total[g] = self.total.get(g, 0) + c.config.tp * c.replicas
                own[g] = own.get(g, 0) + c.config.tp * c.replicas

    def gpus_by_type_without(self, model: str) -> dict[GpuType, int]:
        """GPUs per type of the other models' chosen configs (exact: integers)."""
        own = self.own.get(model, {})
        return {g: n - own.get(g, 0) for g, n in self.total.items()}

    def usd_without(self, model: str) -> float:
        """$/h of the other models' chosen configs, summed in the explanation's order (a float sum:
        the same terms in the same order as always, so a budget's floor does not move by rounding)."""
        return sum(c.usd_h for o in self.models if o.model != model for c in o.configs)


def _alternatives(
    me: ModelExplanation,
    policy: Policy,
    eff: Effective,
    lookup: _Problem,
    everyone: _Placed,
    inv: _Inventory,
    ready: frozenset[ConfigKey],
    capacities: Mapping[ConfigKey, CapacityInfo],
    with_flips: bool,
    allowed: list[ConfigKey],
    reach: Mapping[str, float],
) -> tuple[Alternative, ...]:
    m = policy.model(me.model)
    if m is None:
        return ()
    problem = lookup.problem
    chosen = {c.config: c for c in me.configs if c.replicas > 0}
    required = lookup.required.get(me.model, me.required_rps)
    min_rep = eff.min_replicas.get(me.model, 0)
    max_rep = eff.max_replicas.get(me.model)
    other_gpus_by_type = everyone.gpus_by_type_without(me.model)
    other_gpus = sum(other_gpus_by_type.values())
    budget = eff.budget
    other_usd = everyone.usd_without(me.model) if budget.max_usd_h is not None else 0.0
    chosen_counts = {c: x.replicas for c, x in chosen.items()}
    chosen_cfgs = [c for c in chosen if c in capacities]
    chosen_steps = [(capacities[c].max_rps, policy.replica_usd_h(c) or 0.0) for c in chosen_cfgs]

    def limit(key: ConfigKey, unit: float) -> float:
        """How many replicas of `key` the whole usable inventory, max_replicas and budget allow."""
        n = float(inv.slots(key.gpu, key.tp))
        if max_rep is not None:
            n = min(n, max_rep)
        if budget.max_gpus is not None:
            n = min(n, budget.max_gpus // key.tp)
        if budget.max_usd_h is not None and unit > 0:
            n = min(n, math.floor(budget.max_usd_h / unit + 1e-9))
        return n

    out: list[Alternative] = []
    for key in allowed:
        if key in chosen:
            continue
        label = f"{key.engine.value} {key.gpu.value} TP{key.tp}"
        price = policy.price_usd_h(key.gpu)
        info = capacities.get(key)
        if price is None:
            continue
        unit = price * key.tp
        if not inv.has(key.gpu):
            out.append(Alternative(key, LossReason.INVENTORY, None, info.max_rps if info else None, None,
                                   f"{label}: no usable {key.gpu.value} host"))
            continue
        if info is None or not (math.isfinite(info.max_rps) and info.max_rps > 0):
            why = (f"the SLO is out of its reach for this length mix: an idle replica meets it for "
                   f"{100.0 * info.floor_share:.2f}% of requests, another config reaches "
                   + (f"{100.0 * reach[key.model]:.2f}%" if key.model in reach else "more")
                   if info is not None and info.floor_share is not None else "or no profile")
            out.append(Alternative(key, LossReason.SLO, None, None, None,
                                   f"{label}: no capacity at the SLO (TTFT p99 {m.slo.ttft_p99_ms:g} ms, "
                                   f"ITL p99 {m.slo.itl_p99_ms:g} ms) {why}"))
            continue
        cap = info.max_rps
        need = max(min_rep, math.ceil(required / cap - 1e-9) if required > UNMET_TOL_RPS else 0)
        fit_inv = min(inv.slots(key.gpu, key.tp), (inv.gpus(key.gpu) - other_gpus_by_type.get(key.gpu, 0)) // key.tp)
        fit_budget: float = math.inf
        if budget.max_gpus is not None:
            fit_budget = min(fit_budget, (budget.max_gpus - other_gpus) // key.tp)
        if budget.max_usd_h is not None:
            fit_budget = min(fit_budget, math.floor((budget.max_usd_h - other_usd) / unit + 1e-9))
        reason: LossReason | None = None
        n = need
        if max_rep is not None and need > max_rep:
            reason, n = LossReason.MAX_REPLICAS, max_rep
            why = f"needs {need} replicas for {_fmt(required)} rps; max_replicas {max_rep}"
        if reason is None and need > fit_inv:
            reason, n = LossReason.INVENTORY, max(0, fit_inv)
            why = (f"needs {need} x TP{key.tp} on {key.gpu.value}; {max(0, fit_inv)} fit beside the other "
                   "models")
        if reason is None and need > fit_budget:
            reason, n = LossReason.BUDGET, max(0, int(fit_budget))
            why = f"needs {need} replicas (${need * unit:.2f}/h); the budget left allows {max(0, int(fit_budget))}"
        usd = n * unit
        diff = usd - me.usd_h
        if reason is None:
            if diff > _USD_EPS:
                reason = LossReason.COST
                why = f"${usd:.2f}/h for {n} replica(s) vs ${me.usd_h:.2f}/h chosen (+${diff:.2f}/h)"
            elif policy.needs_build(key) and key not in ready:
                reason = LossReason.BUILD_PENDING
                b_s = policy.build_s(key) or 0.0
                why = (f"${usd:.2f}/h for {n} replica(s) (vs ${me.usd_h:.2f}/h) but its engine is not built "
                       f"(build ~{b_s:.0f} s)")
            elif any(problem.floors.get(c, 0) for c in chosen):
                reason = LossReason.CHURN
                why = (f"${usd:.2f}/h vs ${me.usd_h:.2f}/h, but the running replicas are held (scale-down delay "
                       "or fail static)")
            else:
                reason, why = _objective_reason(lookup, me, key, n, usd, chosen_counts)
        flip = None
        if with_flips and chosen_steps:
            lim = min(limit(key, unit), max(limit(c, u) for c, (_, u) in zip(chosen_cfgs, chosen_steps, strict=True)))
            lim_rps = lim * cap / (1 + m.headroom) if math.isfinite(lim) else math.inf
            if not math.isfinite(lim_rps):
                lim_rps = max(4 * me.demand_rps, 64 * cap / (1 + m.headroom))
            smallest = min([cap] + [c for c, _ in chosen_steps]) / (1 + m.headroom)
            lim_rps = min(lim_rps, 2048 * smallest)
            flip = flip_range(me.demand_rps, m.headroom, min_rep, (cap, unit), chosen_steps, lim_rps)
        alt = Alternative(key, reason, n, cap, usd, f"{label}: {why}")
        if flip is not None:
            lo, hi = flip
            if lo < me.demand_rps <= hi:
                alt = replace(alt, cheaper_from_rps=lo, cheaper_to_rps=hi)
            else:
                side = FlipSide.ABOVE if lo >= me.demand_rps else FlipSide.BELOW
                alt = replace(alt, flip_rps=lo if side is FlipSide.ABOVE else hi, flip_side=side,
                              cheaper_from_rps=lo, cheaper_to_rps=hi)
        out.append(alt)
    return tuple(out)


# ---- relaxations ------------------------------------------------------------------------------------
def _usd_unmet(problem: CountProblem, sol: CountSolution) -> tuple[float, float]:
    unit = {c.config: c.usd_h for c in problem.candidates}
    usd = sum(unit.get(c, 0.0) * n for c, n in sol.counts.items())
    return usd, sum(sol.unmet_rps.values())


def _relaxed_problems(
    policy: Policy,
    problem: CountProblem,
    solution: CountSolution,
    usable: list[HostInventory],
    models: tuple[ModelExplanation, ...],
    relaxed_capacities: Mapping[ConfigKey, CapacityInfo] | None,
) -> list[_Relaxed]:
    out: list[_Relaxed] = []
    for d in problem.demands:
        if d.max_replicas is not None and solution.binds(BindingKind.MAX_REPLICAS, d.model):
            demands = tuple(replace(x, max_replicas=d.max_replicas + 1) if x.model == d.model else x
                            for x in problem.demands)
            out.append(_Relaxed(BindingKind.MAX_REPLICAS, f"max_replicas {d.model}", "+1 replica", d.model,
                                replace(problem, demands=demands)))
    for gpu in sorted({h.gpu for h in usable}):
        if solution.binds(BindingKind.INVENTORY, gpu.value):
            host = max((h for h in usable if h.gpu == gpu), key=lambda h: (h.gpu_count, h.name))
            groups = [len(g) for g in host.groups()]
            slots = {g: dict(s) for g, s in problem.slots.items()}
            for t in list(slots.get(gpu, {})):
                slots[gpu][t] += tp_slots(groups, t)
            out.append(_Relaxed(BindingKind.INVENTORY, f"inventory {gpu.value}",
                                f"+1 host ({host.gpu_count} GPUs, like {host.name})", None,
                                replace(problem, slots=slots)))
    if usable:
        host = max(usable, key=lambda h: (h.gpu_count, h.name))
        if problem.max_gpus is not None and solution.binds(BindingKind.MAX_GPUS):
            out.append(_Relaxed(BindingKind.MAX_GPUS, "budget max_gpus", f"+1 host ({host.gpu_count} GPUs)", None,
                                replace(problem, max_gpus=problem.max_gpus + host.gpu_count)))
        price = policy.price_usd_h(host.gpu) or 0.0
        if problem.max_usd_h is not None and solution.binds(BindingKind.MAX_USD_H):
            out.append(_Relaxed(BindingKind.MAX_USD_H, "budget max_usd_h",
                                f"+1 host (+${price * host.gpu_count:.2f}/h)", None,
                                replace(problem, max_usd_h=problem.max_usd_h + price * host.gpu_count)))
    if relaxed_capacities is not None:
        def rank(me: ModelExplanation) -> tuple[int, str]:
            mp = policy.model(me.model)
            return (-(mp.priority if mp is not None else 0), me.model)

        ranked = sorted(models, key=rank)
        for me in ranked:
            if not any(c.binding in ("ttft", "itl") for c in me.configs):
                continue
            cands = []
            for c in problem.candidates:
                info = relaxed_capacities.get(c.config)
                if c.config.model == me.model and info is not None and math.isfinite(info.max_rps) \
                        and info.max_rps > 0:
                    c = replace(c, capacity_rps=info.max_rps)
                cands.append(c)
            pct = round((SLO_RELAX_FACTOR - 1) * 100)
            out.append(_Relaxed(None, f"slo {me.model}",
                                f"SLO +{pct}% (TTFT p99 {me.slo_ttft_p99_ms * SLO_RELAX_FACTOR:g} ms, "
                                f"ITL p99 {me.slo_itl_p99_ms * SLO_RELAX_FACTOR:g} ms)", me.model,
                                replace(problem, candidates=tuple(cands))))
    return out


def add_counterfactuals(
    explanation: Explanation,
    policy: Policy,
    eff: Effective,
    problem: CountProblem,
    solution: CountSolution,
    ready: frozenset[ConfigKey],
    hosts: tuple[HostInventory, ...],
    capacities: Mapping[ConfigKey, CapacityInfo],
    relaxed_capacities: Mapping[ConfigKey, CapacityInfo] | None = None,
    solve: Callable[[CountProblem], CountSolution] = solve_counts,
) -> Explanation:
    """The explanation with `alternatives` per model and `relaxations` (see the module doc)."""
    usable = _usable(hosts, eff.drain_hosts)
    inv = _Inventory(usable)
    notes = list(explanation.notes)
    allowed = {me.model: _allowed(policy, me.model) for me in explanation.models}
    n_alts = sum(len(a) for a in allowed.values())
    with_flips = n_alts * 2048 <= MAX_FLIP_CELLS
    if not with_flips:
        notes.append(f"counterfactuals: flip loads skipped ({n_alts} alternatives; too many to scan)")
    lookup = _Problem(problem)
    placed = _Placed(explanation.models)
    reach = best_reach(capacities, capacities)
    models = tuple(
        replace(me, alternatives=_alternatives(me, policy, eff, lookup, placed, inv, ready, capacities, with_flips,
                                               allowed[me.model], reach))
        for me in explanation.models)

    relaxations: list[Relaxation] = []
    reports: list[SolverReport] = []
    if len(policy.models) > MANY_MODELS:
        notes.append(f"counterfactuals: relaxation re-solves skipped ({len(policy.models)} models > "
                     f"{MANY_MODELS}: they would cost more than the plan)")
    else:
        todo = _relaxed_problems(policy, problem, solution, usable, models, relaxed_capacities)
        if relaxed_capacities is None:
            notes.append("counterfactuals: SLO +10% not evaluated (no profiles: capacity table given)")
        if len(todo) > MAX_RESOLVES:
            notes.append(f"counterfactuals: {len(todo) - MAX_RESOLVES} relaxations skipped "
                         f"(at most {MAX_RESOLVES} re-solves per plan)")
            todo = todo[:MAX_RESOLVES]
        base_usd, base_unmet = _usd_unmet(problem, solution)
        share = problem.time_limit_s / max(1, len(todo))  # all re-solves within one plan solve's limit
        for todo_one in todo:
            constraint, step, model = todo_one.constraint, todo_one.step, todo_one.model
            relaxed = replace(todo_one.problem, time_limit_s=share, work_limit=None if problem.work_limit is None
                              else problem.work_limit / max(1, len(todo)))
            sol = solve(relaxed)
            reports.append(replace(sol.report, stage="counterfactual"))
            usd, unmet = _usd_unmet(relaxed, sol)
            d_usd, d_unmet = usd - base_usd, unmet - base_unmet
            parts = []
            if abs(d_usd) > _USD_EPS:
                parts.append(f"{'saves' if d_usd < 0 else 'costs'} ${abs(d_usd):.2f}/h")
            if abs(d_unmet) > UNMET_TOL_RPS:
                parts.append(f"{'serves' if d_unmet < 0 else 'leaves'} {abs(d_unmet):.2f} rps "
                             f"{'more' if d_unmet < 0 else 'more unmet'}")
            detail = f"{constraint} {step}: " + (", ".join(parts) if parts else "no change"
                                                  + (" (another constraint still binds)"
                                                     if todo_one.kind in _SHARED_LIMITS else ""))
            if sol.report.status != "OPTIMAL":
                detail += f" (re-solve {sol.report.status}, gap {sol.report.gap if sol.report.gap is not None else '?'})"
            relaxations.append(Relaxation(constraint, step, model, base_usd, usd, base_unmet, unmet, detail))
    solver = explanation.solver + tuple(reports)
    return replace(explanation, models=models, relaxations=tuple(relaxations), solver=solver,
                   notes=tuple(notes))


# ---- JSON ------------------------------------------------------------------------------------------
def alternative_to_dict(a: Alternative) -> dict[str, Any]:
    return {"model": a.config.model, "engine": a.config.engine.value, "gpu": a.config.gpu.value,
            "tp": a.config.tp, "precision": a.config.precision.value, "usd_h": a.usd_h,
            "reason": a.reason.value, "replicas": a.replicas,
            "capacity_per_replica_rps": a.capacity_per_replica_rps, "flip_rps": a.flip_rps,
            "flip_side": a.flip_side.value if a.flip_side is not None else None,
            "cheaper_from_rps": a.cheaper_from_rps, "cheaper_to_rps": a.cheaper_to_rps, "detail": a.detail}


def relaxation_to_dict(r: Relaxation) -> dict[str, Any]:
    return {"constraint": r.constraint, "step": r.step, "model": r.model, "usd_h_before": r.usd_h_before,
            "usd_h_after": r.usd_h_after, "usd_h_delta": r.usd_h_after - r.usd_h_before,
            "unmet_rps_before": r.unmet_rps_before, "unmet_rps_after": r.unmet_rps_after,
            "unmet_rps_delta": r.unmet_rps_after - r.unmet_rps_before, "detail": r.detail}
