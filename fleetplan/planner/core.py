"""plan(): observation + fleet + policy + profiles + state -> the fleet to run, and how to get there.

Pure. Steps:
1. the policy at `now_s` (schedules), the usable inventory (online, not drained for maintenance);
2. demand per model (planner/demand.py): max(observed, forecast quantile over the lead time); fail static when the
   observation is stale or unknown: no scale-DOWN for that model (its running replicas are floors),
   while the rate a stale observation still carries is a lower bound that can scale it UP (said in
   the explanation);
3. the capacity table (max rps per replica at the SLO) from the profiles;
4. stage 1 (counts, CP-SAT) for the TARGET (every allowed config, builds included) and, when the
   target needs a TensorRT-LLM engine that is not built yet, for NOW (only ready configs: vLLM
   serves the gap until the build is done);
5. scale-down (planner/scale_down.py): a replica that has not proved itself (its minimum age, its
   config's correction settling) is kept unless its host failed; the band above the required rate
   spans the rate's own Poisson noise; while a surplus config's clock runs, the plan is held - on
   demand (the highest rate level of the last delay) when the rate history covers the delay, else
   on replica counts;
6. stage 2 (placement), re-solving stage 1 with tightened slots if a replica cannot be placed;
7. the diff against the current fleet as ordered actions (make-before-break: a READY replica is not
   drained while its model's replacements start, unless READY capacity without it covers the
   required rate) and the explanation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from fleetplan.models.config_key import Role
from fleetplan.models.mix import mix_from_quantiles
from fleetplan.models.names import GpuType
from fleetplan.models.profile import ProfileSet
from fleetplan.planner.actions import actions as plan_actions
from fleetplan.planner.actions import make_before_break
from fleetplan.planner.capacity import (
    CapacityInfo,
    MixedWorkload,
    Predicted,
    Predictor,
    below_best_reach,
    candidate_configs,
    capacity_table,
    extrapolation,
    mix_for,
    resolve_profiles,
)
from fleetplan.planner.correction import applied_speeds, corrections_tuple, forget, update_corrections
from fleetplan.planner.counterfactual import (
    MANY_MODELS,
    add_counterfactuals,
    slo_relaxed_capacities,
)
from fleetplan.planner.counts import (
    UNMET_TOL_RPS,
    Candidate,
    CountProblem,
    CountSolution,
    ModelDemand,
    solve_counts,
)
from fleetplan.planner.demand import (
    MAX_PLAUSIBLE_RPS,
    Demand,
    canonical_observations,
    model_demands,
    valid_rps,
)
from fleetplan.planner.disagg_counts import pool_load_share, served_rps
from fleetplan.planner.disagg_plan import decode_profiles, explain_pools, pool_capacities, prefer_pools
from fleetplan.planner.evidence import slo_missed_share
from fleetplan.planner.explore import canaries
from fleetplan.planner.lengths import held_note, hold_lengths
from fleetplan.planner.payback import unpaid_builds
from fleetplan.planner.placement import LIVE_STATES, Placement, paired_prefill, place, slots_by_gpu
from fleetplan.planner.plan_json import plan_to_dict, replica_to_dict
from fleetplan.planner.policy import Effective, ModelPolicy, Policy, effective
from fleetplan.planner.prefix import planning_share
from fleetplan.planner.scale_down import (
    YOUNG_CYCLES,
    apply_band,
    hold_surplus,
    min_age_s,
    running_capacity,
    settling,
    unproven_floors,
    young_floors,
)
from fleetplan.planner.slo import BudgetSlice, error_budget, planned_share, record
from fleetplan.planner.solve_memo import Solved, reusable, reused
from fleetplan.planner.types import (
    ConfigCount,
    ConfigExplanation,
    ConfigKey,
    Explanation,
    Fleet,
    HostInventory,
    ModelExplanation,
    ModelObservation,
    Observation,
    Plan,
    PlannerState,
    PlanResult,
    Replica,
    SolverReport,
)
from fleetplan.planner.uncertainty import cost_of_uncertainty, mean_speeds

__all__ = ["MAX_PLAUSIBLE_RPS", "UNKNOWN_CAPACITY_RPS", "plan", "plan_to_dict", "plan_with_capacities",
           "replica_to_dict"]

# the capacity of a config nothing is known about: a candidate for min_replicas, never for demand
UNKNOWN_CAPACITY_RPS = 1e-6
# the share a window is sized for: the capacity model's p99 of TTFT and ITL at the targets (an
# objective or window floor above it is reported, not planned for)
PLANNED_GOOD_SHARE = 0.99

def _inventory(fleet: Fleet, policy: Policy) -> tuple[HostInventory, ...]:
    """The hosts (the fleet's report, else the policy's), minus GPUs busy with engine builds."""
    hosts = fleet.hosts if fleet.hosts else tuple(h.inventory() for h in policy.hosts)
    reserved: dict[str, set[int]] = {}
    for b in fleet.builds:
        if not b.ready and b.host is not None and b.gpu_indices:
            reserved.setdefault(b.host, set()).update(b.gpu_indices)
    out = []
    for h in sorted(hosts, key=lambda h: h.name):
        busy = reserved.get(h.name)
        if busy:
            groups = tuple(tuple(i for i in g if i not in busy) for g in h.groups())
            h = replace(h, nvlink_groups=tuple(g for g in groups if g) or ((),))
        out.append(h)
    return tuple(out)



def workloads_from(observation: Observation, policy: Policy) -> dict[str, MixedWorkload]:
    """Per model the request-length mix: the observed distribution (quantiles of the engines'
    prompt/output length histograms), else the observed means, else the policy's `workload`."""
    obs = canonical_observations(observation, policy)
    out: dict[str, MixedWorkload] = {}
    for m in policy.models:
        o = obs.get(m.name)
        isl = o.isl if o is not None and o.isl is not None and math.isfinite(o.isl) and o.isl > 0 \
            else m.workload.isl
        osl = o.osl if o is not None and o.osl is not None and math.isfinite(o.osl) and o.osl > 0 \
            else m.workload.osl
        isl_q = o.isl_quantiles if o is not None and o.isl_quantiles else m.workload.isl_quantile_pairs()
        osl_q = o.osl_quantiles if o is not None and o.osl_quantiles else m.workload.osl_quantile_pairs()
        mix = None  # the policy's quantiles give the shape; the observed mean, when known, the scale
        if isl_q or osl_q:
            try:
                mix = mix_from_quantiles(isl_q, osl_q, isl_mean=isl, osl_mean=osl)
            except ValueError:
                mix = None
        out[m.name] = MixedWorkload(isl, osl, mix, isl_p99_low=o.isl_p99_low if o is not None else None,
                                    cached_share=planning_share(o.prefix_hit_rate if o is not None else None))
    return out


def plan(
    observation: Observation,
    fleet: Fleet,
    policy: Policy,
    profiles: ProfileSet,
    state: PlannerState,
    now_s: float,
    counterfactuals: bool = True,
) -> PlanResult:
    """The plan for now, the target once builds are ready, the actions, the explanation. Pure.

    Capacity is the profiles' for the observed length mix, corrected by the fleet's own latency
    (planner/correction.py): the corrections are updated from this observation first, carried in
    the next state, and shown per config in the explanation.
    counterfactuals=False: no what-ifs in the explanation (replays that only act): no alternatives
    or relaxations, no cost of uncertainty, no attainment with one replica fewer."""
    hosts = _inventory(fleet, policy)
    gpus = {h.gpu for h in hosts if h.online}
    canonical = policy.aliases().canonical
    observation, held = hold_lengths(observation, state.lengths, canonical, now_s=now_s)
    workloads = workloads_from(observation, policy)
    chosen = resolve_profiles(policy, profiles, gpus)
    extrap = {c: extrapolation(p, mix_for(p, workloads[c.model]), workloads[c.model].isl_p99_low)
              for c, p in chosen.items()}
    allowed = set(candidate_configs(policy, {h.gpu for h in hosts}))
    # evidence is dropped only for configs the POLICY no longer allows, never because hosts have not
    # reported yet (the first cycles after a restart)
    # a decode pool's own ITL speed is learnt on its profile from its replicas' windows (the pools'
    # other speeds come from the aggregated configs: planner/disagg_plan.py phase_speeds)
    decoding = decode_profiles(policy, chosen)
    corrected = {**chosen, **decoding}
    corrected_extrap = {**extrap, **{c: extrap.get(c.profile_key(), ()) for c in decoding}}
    policy_configs = candidate_configs(policy, policy.gpu_types)
    corrections = update_corrections(forget(state.correction_map(),
                                            {*policy_configs, *(replace(c, role=Role.DECODE) for c in policy_configs)}),
                                     canonical_observations(observation, policy), corrected, workloads,
                                     corrected_extrap, now_s,
                                     {m.name: (m.slo.ttft_p99_ms, m.slo.itl_p99_ms) for m in policy.models},
                                     {m.name: m.slo.period_s for m in policy.models})
    # a decode config's speed only once its own replicas were observed (before: phase_speeds' rule)
    speeds = {c: sp for c, sp in applied_speeds(corrections, corrected, corrected_extrap,
                                                {m.name: m.slo.ttft_p99_ms for m in policy.models}).items()
              if c not in decoding or (c in corrections and corrections[c].observations > 0)}
    observed_configs = {c for c, corr in corrections.items() if corr.observations > 0}
    table, predictor = capacity_table(policy, chosen, workloads, gpus, speeds=speeds,
                                      shares=planned_shares(policy, state.budget, now_s))
    for c in sorted(allowed):
        if not any(k.model == c.model for k in table):
            # no profile and no roofline prior: the floor still runs (min_replicas), flagged
            table[c] = CapacityInfo(UNKNOWN_CAPACITY_RPS, "", (), True, None, "",
                                    ("no profile and no roofline prior for this model: capacity unknown, "
                                     "sized to min_replicas only",))
    relaxed = (slo_relaxed_capacities(policy, chosen, workloads, gpus, speeds=speeds)
               if counterfactuals and len(policy.models) <= MANY_MODELS else None)
    state = replace(state, corrections=corrections_tuple(corrections), lengths=held)
    result = plan_with_capacities(observation, fleet, policy, table, state, now_s, predictor=predictor,
                                  relaxed_capacities=relaxed, counterfactuals=counterfactuals,
                                  pools=pool_capacities(policy, chosen, workloads, speeds, observed_configs))
    means = mean_speeds(corrections)
    observed = {canonical(name) for name in observation.models}
    table_by_model: dict[str, dict[ConfigKey, CapacityInfo]] = {}
    for c, info in table.items():  # one pass: a per-model scan of the table is O(models x table)
        table_by_model.setdefault(c.model, {})[c] = info
    paired = paired_prefill(result.plan.replicas)
    models = []
    for me in result.explanation.models:
        # a held mix is filled in only where the model has a reading
        note = held_note(held, me.model, now_s) if me.model in observed else None
        me = me if note is None else replace(me, notes=(*me.notes, note))
        me = explain_pools(policy, me, result.plan.counts, chosen, workloads, speeds, observed_configs,
                           paired_prefill=paired.get(me.model, 0), compare=counterfactuals)
        if counterfactuals:  # the cost of uncertainty is a what-if too (the fleet if nothing were left to learn)
            u = cost_of_uncertainty(me, policy, table_by_model.get(me.model, {}), speeds, means, chosen, workloads)
            me = replace(me, uncertainty_usd_h=u.usd_h, uncertainty_why=u.why)
        models.append(me)
    return replace(result, explanation=replace(result.explanation, models=tuple(models)))




def _young(policy: Policy, fleet: Fleet, usable: set[str], demands: dict[str, Demand],
           capacities: Mapping[ConfigKey, CapacityInfo], current: Mapping[ConfigKey, int], state: PlannerState,
           now_s: float) -> dict[ConfigKey, int]:
    """CountProblem.young: per config the replicas no saving takes away - those not yet proven
    (planner/scale_down.py `unproven_floors`: never drained, whatever the demand) and those started a
    few cycles ago (`young_floors`: not swapped away unless the demand fell). A note names the
    unproven replicas of a model whose running capacity exceeds what it plans for."""
    unproven = unproven_floors(fleet, usable, now_s,
                               lambda c: min_age_s(policy, c, demands[c.model].rate_window_s
                                                   if c.model in demands else None),
                               settling(state.correction_map(), current))
    young = young_floors(fleet, usable, demands, capacities, current, now_s, YOUNG_CYCLES * policy.scaling.cycle_s)
    cap_now = running_capacity(current, capacities)
    for c, u in unproven.items():
        young[c] = max(young.get(c, 0), u.floor)
        d = demands.get(c.model)
        info = capacities.get(c)
        if d is not None and d.known and info is not None and \
                cap_now.get(c.model, 0.0) - max(d.required_rps, d.plan_rps or 0.0) >= info.max_rps:
            until = "once READY" if u.until_s is None else f"for {max(0.0, u.until_s - now_s):.0f} s more"
            demands[c.model] = replace(d, notes=(*d.notes, f"{c.label()}: not yet proven, kept {until} "
                                                 f"(never drained before, unless its host fails): "
                                                 + ", ".join(u.replicas)),
                                       held_unproven=(*d.held_unproven, *u.replicas))
    return young


def _ready_configs(policy: Policy, fleet: Fleet) -> frozenset[ConfigKey]:
    ready = set(policy.cached_configs())
    for b in fleet.builds:
        if b.ready:
            ready.add(b.config())
    return frozenset(ready)


def _engine_hosts(policy: Policy, fleet: Fleet, usable: Sequence[HostInventory]) -> dict[ConfigKey, frozenset[str]]:
    """The configs whose built engine only some usable hosts hold: config -> those hosts. An agent
    refuses a replica of an engine it does not hold (controller/protocol.py `check_desired`), and an
    engine is built on one host's GPUs: until the others hold it (a shared engine cache, or builds of
    their own), its replicas run there only. The policy's `cached_builds` are stored on every host;
    a ready build that names no host counts everywhere too."""
    everywhere = set(policy.cached_configs())
    where: dict[ConfigKey, set[str]] = {}
    for b in fleet.builds:
        if b.ready:
            if b.host is None:
                everywhere.add(b.config())
            else:
                where.setdefault(b.config(), set()).add(b.host)
    out: dict[ConfigKey, frozenset[str]] = {}
    for c, held in where.items():
        if c in everywhere:
            continue
        of_type = {h.name for h in usable if h.gpu == c.gpu}
        if not of_type <= held:
            out[c] = frozenset(held & of_type)
    return out


def _spread_builds(policy: Policy, fleet: Fleet, usable: Sequence[HostInventory], counts: Mapping[ConfigKey, int],
                   cands: Sequence[Candidate], engine_hosts: Mapping[ConfigKey, frozenset[str]],
                   max_counts: Mapping[ConfigKey, int], demands: Mapping[str, Demand],
                   now_s: float) -> list[ConfigKey]:
    """The configs to build on one more host: the target runs as many replicas as the hosts holding
    the engine hold, another usable host of that GPU type does not hold it, no build of it runs, and
    the engine everywhere would pay its build back at the recent rates (planner/payback.py, the
    capped config serving what it holds and the cheapest other config the rest)."""
    building = {b.config() for b in fleet.builds if not b.ready}
    out: list[ConfigKey] = []
    for c, cap in sorted(max_counts.items()):
        if counts.get(c, 0) < cap or c in building or policy.build_s(c) is None:
            continue
        if not any(h.gpu == c.gpu and h.name not in engine_hosts[c] for h in usable):
            continue
        capped = next((x for x in cands if x.config == c), None)
        d = demands.get(c.model)
        if capped is None or d is None:
            continue
        wide = replace(capped, max_count=None, build_s=policy.build_s(c) or 0.0)
        ready = [x for x in cands if x.config.model == c.model and x.build_s <= 0]
        if not unpaid_builds(policy, [*ready, wide], {c.model: d.required_rps}, {c.model: d.history}, now_s):
            out.append(c)
    return out


def _candidates(
    policy: Policy,
    capacities: Mapping[ConfigKey, CapacityInfo],
    gpus: set[GpuType],
    ready: frozenset[ConfigKey],
    now_only: bool,
    max_counts: Mapping[ConfigKey, int],
) -> list[Candidate]:
    out: list[Candidate] = []
    for key in sorted(capacities):
        info = capacities[key]
        m = policy.model(key.model)
        price = policy.price_usd_h(key.gpu)
        if m is None or price is None or key.gpu not in gpus or not valid_rps(info.max_rps):
            continue
        # capacity 0: the SLO is out of reach for this length mix even unloaded. Still a candidate
        # for min_replicas (best effort beats an outage), never for demand (as an unknown capacity)
        max_rps = info.max_rps if info.max_rps > 0 else UNKNOWN_CAPACITY_RPS
        if key.engine not in m.allowed.engines or key.tp not in m.allowed.tp:
            continue
        if m.allowed.gpus is not None and key.gpu not in m.allowed.gpus:
            continue
        lead = policy.startup_s(key)
        build = 0.0
        if policy.needs_build(key) and key not in ready:
            if now_only:
                continue
            build = policy.build_s(key) or 0.0
        out.append(Candidate(key, max_rps, price * key.tp, lead, info.binding, build, max_counts.get(key)))
    return out


def _best_reach_only(cands: list[Candidate], capacities: Mapping[ConfigKey, CapacityInfo],
                     demands: dict[str, Demand] | None = None) -> tuple[list[Candidate], dict[ConfigKey, float]]:
    """(`cands` with the configs that fall short of the best reach among them (planner/capacity.py
    `below_best_reach`) left for min_replicas only, those configs); `demands`: where the model's
    note says so. The best is taken over the candidates of this plan: while the config that
    reaches most awaits its engine build, the plan for now serves with the best of the ready ones."""
    below = below_best_reach(capacities, (c.config for c in cands))
    if not below:
        return cands, below
    if demands is not None:
        by_model: dict[str, list[ConfigKey]] = {}
        for c in sorted(below):
            by_model.setdefault(c.model, []).append(c)
        for model, short in by_model.items():
            if model in demands:
                listed = ", ".join(f"{c.label()} ({100.0 * (capacities[c].floor_share or 0.0):.1f}%)" for c in short)
                note = (f"no config meets the SLO for this length mix even idle; the best reaches "
                        f"{100.0 * below[short[0]]:.1f}% of requests, so these serve no demand (no count of them "
                        f"reaches that): {listed}")
                demands[model] = replace(demands[model], notes=(*demands[model].notes, note))
    return [replace(c, capacity_rps=UNKNOWN_CAPACITY_RPS) if c.config in below else c for c in cands], below


def _count_problem(
    policy: Policy,
    eff: Effective,
    cands: list[Candidate],
    demands: Mapping[str, Demand],
    slots: Mapping[GpuType, Mapping[int, int]],
    current: Mapping[ConfigKey, int],
    floors: Mapping[ConfigKey, int],
    young: Mapping[ConfigKey, int],
) -> CountProblem:
    md = tuple(
        ModelDemand(m.name, max(demands[m.name].required_rps, demands[m.name].plan_rps or 0.0), m.priority,
                    eff.min_replicas.get(m.name, 0),
                    eff.max_replicas.get(m.name))
        for m in policy.models
    )
    s = policy.scaling
    return CountProblem(
        candidates=tuple(cands), demands=md, slots=slots, current=current, floors=floors, young=young,
        max_gpus=eff.budget.max_gpus, max_usd_h=eff.budget.max_usd_h,
        churn_cost_usd_h=s.churn_cost_usd_h, lead_time_cost_usd_h_per_min=s.lead_time_cost_usd_h_per_min,
        time_limit_s=policy.solver.time_limit_s, relative_gap=policy.solver.relative_gap,
        workers=policy.solver.workers, backend=policy.solver.backend, work_limit=policy.solver.work_limit,
    )


@dataclass
class _Solver:
    """Stage 1 for one cycle: a problem whose demand in replicas has not fallen since an earlier
    cycle solved it reuses that solution (planner/solve_memo.py); `solved`: the next state's anchors."""

    anchors: tuple[Solved, ...]
    tolerance: Mapping[str, float]
    solved: list[Solved]

    def __call__(self, problem: CountProblem) -> CountSolution:
        anchor = reusable(problem, self.anchors, self.tolerance)
        if anchor is not None:
            if not any(a is anchor for a in self.solved):
                self.solved.append(anchor)
            return reused(anchor)
        sol = solve_counts(problem)
        self.solved.append(Solved(problem, sol))
        return sol


def _solve_and_place(
    problem: CountProblem,
    hosts: tuple[HostInventory, ...],
    current: tuple[Replica, ...],
    drained: frozenset[str],
    reports: list[SolverReport],
    engine_hosts: Mapping[ConfigKey, frozenset[str]],
    solve: Callable[[CountProblem], CountSolution] = solve_counts,
) -> tuple[CountSolution, Placement]:
    """Stage 1 then stage 2; when a replica does not fit, tighten that TP slot count and re-solve."""
    sol = solve(problem)
    reports.append(sol.report)
    placement = place(sol.counts, hosts, current, drained, engine_hosts)
    for _ in range(3):
        if not placement.unplaced:
            break
        slots = {g: dict(d) for g, d in problem.slots.items()}
        for c, k in placement.unplaced.items():
            used = sum(n * (cc.tp // c.tp) for cc, n in sol.counts.items()
                       if cc.gpu == c.gpu and cc.tp >= c.tp and cc.tp % c.tp == 0)
            slots.setdefault(c.gpu, {})[c.tp] = max(0, used - k)
        problem = CountProblem(**{**problem.__dict__, "slots": slots})
        sol = solve(problem)
        reports.append(sol.report)
        placement = place(sol.counts, hosts, current, drained, engine_hosts)
    reports.append(SolverReport("placement", "best-fit-decreasing", "OK" if not placement.unplaced
                                else "UNPLACED", None, None, None, 0.0))
    return sol, placement


def plan_with_capacities(
    observation: Observation,
    fleet: Fleet,
    policy: Policy,
    capacities: Mapping[ConfigKey, CapacityInfo],
    state: PlannerState,
    now_s: float,
    predictor: Predictor | None = None,
    relaxed_capacities: Mapping[ConfigKey, CapacityInfo] | None = None,
    counterfactuals: bool = True,
    pools: Mapping[ConfigKey, CapacityInfo] | None = None,
) -> PlanResult:
    """plan() with the capacity table given (tests, benchmarks, what-if); `relaxed_capacities`: the
    table at SLO +10% for the counterfactuals (planner/counterfactual.py), None: not evaluated.
    `pools`: the disaggregated pools' configs and capacities (planner/disagg_plan.py): candidates of
    the count solve and the plan, nothing else reads them (a pool replica serves no rate alone)."""
    eff = effective(policy, now_s)
    hosts = _inventory(fleet, policy)
    drained = eff.drain_hosts
    usable = [h for h in hosts if h.online and h.name not in drained]
    gpus = {h.gpu for h in usable}
    demands, bursts = model_demands(observation, policy, now_s, state)
    ready = _ready_configs(policy, fleet)
    if pools:  # where a model's pools reach its SLO, its aggregated configs that cannot serve no demand
        capacities = prefer_pools(capacities, pools)
    with_pools = {**capacities, **pools} if pools else capacities
    if pools:  # a pool runs its configuration's engine: built when the aggregated one is
        ready = ready | {c for c in pools if c.profile_key() in ready}
    usable_names = {h.name for h in usable}

    current: dict[ConfigKey, int] = {}
    for r in fleet.replicas:
        if r.state in LIVE_STATES and r.host in usable_names:
            current[r.config] = current.get(r.config, 0) + 1

    tp_sizes = sorted({k.tp for k in capacities})
    slots = slots_by_gpu(hosts, tp_sizes, drained)
    engine_hosts = _engine_hosts(policy, fleet, usable)
    # an engine whose every holder is offline or drained is built again on a usable host
    ready = ready - {c for c, held in engine_hosts.items() if not held}
    engine_hosts = {c: held for c, held in engine_hosts.items() if held}
    max_counts = {c: slots_by_gpu([h for h in usable if h.name in held], [c.tp]).get(c.gpu, {}).get(c.tp, 0)
                  for c, held in engine_hosts.items()}
    floors: dict[ConfigKey, int] = {}
    for c, k in current.items():
        d = demands.get(c.model)
        if d is not None and not d.known:
            floors[c] = k  # fail static: no scale-down; a lower-bound demand may still add replicas

    reports: list[SolverReport] = []
    notes: list[str] = []
    known_models = {m.name for m in policy.models}
    aliases = policy.aliases()
    ignored = sorted(n for n in observation.models if aliases.canonical(n) not in known_models)
    if ignored:
        notes.append("observations for models not in the policy ignored: " + ", ".join(ignored))
    if eff.active_schedules:
        notes.append("active schedules: " + ", ".join(eff.active_schedules))
    if drained:
        notes.append("maintenance (drained hosts): " + ", ".join(sorted(drained)))
    if not usable:
        notes.append("no usable hosts: every host is offline or drained")
    # one pass over the capacity table (per-model scans of it cost 0.5 s at 500 models, bench/solve_scale.py)
    rps_by_model: dict[str, list[float]] = {}
    for c, i in with_pools.items():
        rps_by_model.setdefault(c.model, []).append(i.max_rps)
    unknown = {m.name for m in policy.models
               if m.name in rps_by_model and all(r <= UNKNOWN_CAPACITY_RPS for r in rps_by_model[m.name])}
    for name in sorted(unknown):
        d = demands[name]
        out_of_reach = any(r == 0.0 for r in rps_by_model[name])
        why = ("no allowed config meets the SLO at this length mix, even unloaded: only min_replicas run "
               "(best effort; relax the SLO or allow larger TP)" if out_of_reach else
               "no capacity data (no profile, no roofline prior): only min_replicas run; benchmark "
               "this model (fleetplan models fit) to size it to its demand")
        demands[name] = replace(d, required_rps=0.0, notes=(*d.notes, why))

    apply_band(demands, current, capacities, policy.scaling.scale_down_band, UNKNOWN_CAPACITY_RPS,
               policy.scaling.scale_down_delay_s)
    # exploration: a canary of a config never measured whose profile promises a cheaper fleet
    trials = canaries(policy, capacities, state.correction_map(),
                      {m: d.required_rps for m, d in demands.items() if d.known and m not in unknown}, ready)
    for name, canary in trials.items():
        floors[canary.config] = max(floors.get(canary.config, 0), 1)
        demands[name] = replace(demands[name], notes=(*demands[name].notes, canary.note()))
    young = _young(policy, fleet, usable_names, demands, capacities, current, state, now_s)
    # where no config reaches the SLO, only those that reach the most serve demand (before the
    # payback check: a build that reaches more is not priced against replicas that reach less)
    target_cands, below_reach = _best_reach_only(
        _candidates(policy, with_pools, gpus, ready, now_only=False, max_counts=max_counts), capacities, demands)
    # a build is a one-off cost: started only where the recent traffic's savings pay it back
    unpaid = (unpaid_builds(policy, target_cands, {m: d.required_rps for m, d in demands.items()},
                            {m: d.history for m, d in demands.items()}, now_s,
                            keep=(c for c, k in (*floors.items(), *young.items()) if k > 0))
              if any(c.build_s > 0 for c in target_cands) else {})
    if unpaid:
        target_cands = [c for c in target_cands if c.config not in unpaid]
        for c, note in sorted(unpaid.items()):
            if note:
                demands[c.model] = replace(demands[c.model], notes=(*demands[c.model].notes, note))
    target_problem = _count_problem(policy, eff, target_cands, demands, slots, current, floors, young)
    # no tolerance: only a problem whose demand in replicas did not fall reuses (its solved fleet is
    # still the optimum); the rate's noise as a tolerance held costlier fleets (planner/solve_memo.py)
    solver = _Solver(state.solves, {}, [])
    target_sol, target_place = _solve_and_place(target_problem, hosts, fleet.replicas, drained, reports,
                                                  engine_hosts, solver)

    needs_build = sorted(c for c in target_sol.counts if policy.needs_build(c) and c not in ready)
    spread = _spread_builds(policy, fleet, usable, target_sol.counts, target_cands, engine_hosts, max_counts,
                            demands, now_s)
    for c in spread:
        notes.append(f"{c.label()}: the target fills the hosts that hold its engine "
                     f"({', '.join(sorted(engine_hosts[c]))}): building it on one more host")
    now_problem, now_sol, now_place = target_problem, target_sol, target_place
    if needs_build or any(c.build_s > 0 for c in target_cands):
        # the plan for now has only ready engines to choose from: also where the target took none
        # of the builds, since the scale-down hold below re-solves this problem for a higher rate,
        # where an engine still building may be the cheaper one (it would start replicas of an
        # engine that does not exist yet). What falls short among the ready configs falls short
        # among all of them (a superset: its best reach is at least theirs): below_reach holds it.
        now_cands, _ = _best_reach_only(_candidates(policy, with_pools, gpus, ready, now_only=True,
                                                    max_counts=max_counts), capacities)
        now_problem = _count_problem(policy, eff, now_cands, demands, slots, current, floors, young)
    if needs_build:
        now_sol, now_place = _solve_and_place(now_problem, hosts, fleet.replicas, drained, reports, engine_hosts,
                                              solver)
        notes.append("engine builds pending for " + ", ".join(c.label() for c in needs_build)
                     + ": the plan for now serves with ready engines, the target switches once built")

    # scale-down delay: hold surplus replicas until the surplus has persisted for the delay
    held = hold_surplus(policy, demands, current, capacities, state.surplus_map(), below_reach, now_s,
                        now_problem, now_sol, now_place,
                        lambda p: _solve_and_place(p, hosts, fleet.replicas, drained, reports, engine_hosts, solver))
    now_problem, now_sol, now_place, surplus_next = held.problem, held.solution, held.placement, held.surplus_since_s
    if held.note is not None:
        notes.append(held.note)

    # the target continues from the now-plan's placement
    if now_place is not target_place:
        target_place = place(target_sol.counts, hosts, now_place.replicas, drained, engine_hosts)

    now_plan = _make_plan(now_place, with_pools, policy)
    target_plan = now_plan if target_place is now_place else _make_plan(target_place, with_pools, policy)
    actions = plan_actions(fleet, now_place, target_sol, needs_build, policy, hosts, drained, ready, engine_hosts,
                           spread)
    actions, held_mbb = make_before_break(actions, fleet, now_place, capacities, demands, hosts)
    if held_mbb:
        notes.append("make-before-break: kept serving until their replacements are READY: " + ", ".join(
            f"{m} x{n}" for m, n in sorted(held_mbb.items())))
    limit = policy.scaling.max_actions_per_cycle
    act, deferred = actions[:limit], actions[limit:]
    if deferred:
        notes.append(f"{len(deferred)} actions deferred to later cycles (max {limit} per cycle)")

    explanation = _explain(policy, demands, now_sol, target_sol, now_place, target_place, with_pools,
                           predictor, reports, now_plan, target_plan, notes, observation, counterfactuals)
    if counterfactuals:
        # a config short of the best reach is explained as what it is: out of the SLO's reach
        cf_caps = {**capacities, **{c: replace(capacities[c], max_rps=0.0) for c in below_reach}} \
            if below_reach else capacities
        explanation = add_counterfactuals(explanation, policy, eff, now_problem, now_sol, ready, hosts, cf_caps,
                                          relaxed_capacities)
    ledger, explanation = _budgets(policy, state, explanation, now_s, capacities)
    next_state = PlannerState(tuple(sorted(surplus_next.items())), state.cycle + 1, state.corrections, bursts,
                              state.lengths, ledger, tuple(solver.solved))
    return PlanResult(now_plan, target_plan, next_state, explanation, tuple(act), tuple(deferred))


def planned_shares(policy: Policy, ledger: Sequence[BudgetSlice], now_s: float) -> dict[str, float]:
    """Per model whose policy lets the planner spend its error budget (a window floor below the
    objective), the good share this window is sized for (planner/slo.py planned_share), from the
    ledger as the last cycle left it."""
    out: dict[str, float] = {}
    for m in policy.models:
        budget = error_budget(ledger, m.name, now_s, m.slo.kind, m.slo.objective, m.slo.period_s, m.slo.floor)
        share = planned_share(m.slo.objective, m.slo.floor, budget, PLANNED_GOOD_SHARE)
        if share is not None:
            out[m.name] = share
    return out


def _budgets(policy: Policy, state: PlannerState, explanation: Explanation, now_s: float,
             capacities: Mapping[ConfigKey, CapacityInfo]) -> tuple[tuple[BudgetSlice, ...], Explanation]:
    """The SLO ledger after this cycle's readings (planner/slo.py: the window's rate and missed share,
    a stale model's none) and each model's error budget in its explanation."""
    ledger: list[BudgetSlice] = []
    models = []
    # the share the capacities were sized for (capacity_table), as they say: a table given to
    # plan_with_capacities without it spent nothing
    spending = {c.model: i.planned_share for c, i in capacities.items() if i.planned_share is not None}
    for me in explanation.models:
        m = policy.model(me.model)
        if m is None:
            models.append(me)
            continue
        read = me.observed_rps if me.observed_missed_share is not None else None
        mine = record(state.budget, m.name, now_s, read, me.observed_missed_share, m.slo.period_s,
                      policy.scaling.cycle_s)
        ledger.extend(mine)
        budget = error_budget(mine, m.name, now_s, m.slo.kind, m.slo.objective, m.slo.period_s, m.slo.floor)
        notes = me.notes
        share = spending.get(m.name)
        if share is not None:
            before = error_budget(state.budget, m.name, now_s, m.slo.kind, m.slo.objective, m.slo.period_s,
                                  m.slo.floor)
            left = 100 * before.budget_left[0] if before is not None else 0.0
            notes = (*notes, f"error budget spent: this window sized for {100 * share:.2f}% good requests, not "
                             f"the p99 targets ({left:.0f}% of the budget left at least; objective "
                             f"{100 * m.slo.objective:g}%, window floor {100 * m.slo.floor:g}%)")
        if max(m.slo.objective, m.slo.floor) > PLANNED_GOOD_SHARE:
            notes = (*notes, f"objective {100 * m.slo.objective:g}% (window floor {100 * m.slo.floor:g}%): each "
                             "window is sized for the p99 of TTFT and ITL at the targets, not above; the error "
                             "budget shows what that keeps")
        models.append(replace(me, error_budget=budget, notes=notes))
    return tuple(ledger), replace(explanation, models=tuple(models))


def _make_plan(placement: Placement, capacities: Mapping[ConfigKey, CapacityInfo], policy: Policy) -> Plan:
    counts: dict[ConfigKey, int] = {}
    for r in placement.replicas:
        counts[r.config] = counts.get(r.config, 0) + 1
    cc = []
    total = 0.0
    for c in sorted(counts):
        price = (policy.replica_usd_h(c) or 0.0) * counts[c]
        total += price
        info = capacities.get(c)
        cc.append(ConfigCount(c, counts[c], info.max_rps if info else 0.0, price))
    gpus = sum(len(r.gpu_indices) for r in placement.replicas)
    return Plan(placement.replicas, tuple(cc), gpus, total)


def _explain(
    policy: Policy,
    demands: Mapping[str, Demand],
    now_sol: CountSolution,
    target_sol: CountSolution,
    now_place: Placement,
    target_place: Placement,
    capacities: Mapping[ConfigKey, CapacityInfo],
    predictor: Predictor | None,
    reports: list[SolverReport],
    now_plan: Plan,
    target_plan: Plan,
    notes: list[str],
    observation: Observation,
    counterfactuals: bool = True,
) -> Explanation:
    models: list[ModelExplanation] = []
    obs = canonical_observations(observation, policy)
    workloads = workloads_from(observation, policy)
    binding: list[str] = [b.text for b in now_sol.binding]
    counts_by_model = _counts_by_model(now_place)
    tcounts_by_model = counts_by_model if target_place is now_place else _counts_by_model(target_place)
    models_with_capacity = {c.model for c in capacities}
    per_replica = {c: i.max_rps for c, i in capacities.items()}
    for m in policy.models:
        d = demands[m.name]
        counts = counts_by_model.get(m.name, {})
        tcounts = tcounts_by_model.get(m.name, {})
        cap = served_rps(counts, per_replica).get(m.name, 0.0)  # a pool family: its weaker pool's capacity
        tcap = served_rps(tcounts, per_replica).get(m.name, 0.0)
        configs = []
        usd = 0.0
        for c in sorted(counts):
            n = counts[c]
            info = capacities.get(c)
            per = info.max_rps if info else 0.0
            load = d.demand_rps * (per / cap if c.role is Role.AGGREGATED
                                   else pool_load_share(counts, per_replica, c)) if cap > 0 else 0.0
            pred = predictor(c, load) if predictor is not None and n > 0 else Predicted()
            ttft, itl = _finite(pred.ttft_p99_ms), _finite(pred.itl_p99_ms)  # JSON: no NaN/inf
            last = None
            if counterfactuals and predictor is not None and n > 1 and pred.attainment is not None:
                fewer = predictor(c, load * n / (n - 1)).attainment  # the same load on one replica fewer
                last = pred.attainment - fewer if fewer is not None else None
            price = (policy.replica_usd_h(c) or 0.0) * n
            usd += price
            o = obs.get(m.name)
            ev = next((x for x in o.configs if x.config == c), None) if o is not None else None
            base = info.profile_rps if info is not None else None
            configs.append(ConfigExplanation(
                c, n, per, info.binding if info else "", load, ttft, itl, price,
                profile_capacity_rps=base,
                capacity_factor=per / base if base else 1.0,
                correction=info.correction if info else "",
                extrapolating=info.extrapolating if info else (),
                observed_ttft_p99_ms=ev.ttft_p99_ms if ev is not None else None,
                observed_itl_p99_ms=ev.itl_p99_ms if ev is not None else None,
                observed_rps_per_replica=(ev.rate_rps / ev.ready_replicas if ev is not None and ev.rate_rps
                                          is not None and ev.ready_replicas > 0 else None),
                predicted_attainment=_finite(pred.attainment), last_replica_attainment=_finite(last),
                floor_share=info.floor_share if info else None, knee_rps=info.knee_rps if info else None))

        mnotes = list(d.notes)
        unmet = max(0.0, d.required_rps - cap)
        if unmet > UNMET_TOL_RPS:
            mnotes.append(f"best effort: {unmet:.2f} rps of the required {d.required_rps:.2f} rps unmet "
                          f"(priority {m.priority})")
            binding.append(f"demand of {m.name} not met: inventory/budget/max_replicas")
        if m.name in now_sol.min_missed:
            mnotes.append(f"min_replicas missed by {now_sol.min_missed[m.name]}")
        if m.name not in models_with_capacity:
            mnotes.append("no capacity data (profile) for any allowed config")
        if configs:
            main_cfg = max(configs, key=lambda x: (x.replicas * x.capacity_per_replica_rps, x.config))
            slo = {"ttft": f"TTFT p99 {m.slo.ttft_p99_ms:g} ms", "itl": f"ITL p99 {m.slo.itl_p99_ms:g} ms",
                   "memory": "KV-cache memory"}.get(main_cfg.binding, main_cfg.binding or "unknown")
            binding.append(f"{m.name}: replica capacity limited by {slo} ({main_cfg.config.label()})")
        models.append(ModelExplanation(
            m.name, d.observed_rps, d.forecast_rps, d.demand_rps, m.headroom, d.required_rps, cap, tcap,
            unmet if unmet > UNMET_TOL_RPS else 0.0, m.slo.ttft_p99_ms, m.slo.itl_p99_ms, usd, tuple(configs),
            tuple(mnotes), workloads[m.name].length_mix().describe(),
            observed_missed_share=_missed_share(obs.get(m.name), m), fail_static=not d.known,
            held_unproven=d.held_unproven))
    solve_s = sum(r.wall_s for r in reports)
    main = now_sol.report
    return Explanation(tuple(models), tuple(dict.fromkeys(binding)), tuple(reports), main.objective, main.gap,
                       solve_s, now_plan.usd_h, target_plan.usd_h, tuple(notes))


def _missed_share(o: ModelObservation | None, m: ModelPolicy) -> tuple[float, float] | None:
    """The share of the window's requests that missed the model's SLO, bounded by the engines'
    histograms (planner/evidence.py `slo_missed_share`); None: stale or nothing observed."""
    if o is None or o.stale:
        return None
    return slo_missed_share(o.ttft_buckets, o.tpot_buckets, m.slo.ttft_p99_ms / 1000.0, m.slo.itl_p99_ms / 1000.0)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _counts_by_model(p: Placement) -> dict[str, dict[ConfigKey, int]]:
    """Per model, the replicas per config of a placement."""
    out: dict[str, dict[ConfigKey, int]] = {}
    for r in p.replicas:
        by_config = out.setdefault(r.config.model, {})
        by_config[r.config] = by_config.get(r.config, 0) + 1
    return out
