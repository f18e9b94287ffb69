"""Replay evaluation: every policy on the same trace, side by side, plus the oracle bound.

`evaluate()` runs one FleetSim (fleetplan.sim.des) per policy (fleetplan.sim.baselines) in worker processes, computes
the ground-truth capacity of every candidate config (fleetplan.sim.groundtruth.max_rate_at_slo at the trace's
mean ISL/OSL) for the oracle and the charts, and returns an `Evaluation`; `to_json()`,
`render_table()` and `write_charts()` present it. See docs/evaluate.md for every definition.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from fleetplan.models.mix import QUANTILE_LEVELS, SLO_SHARE, mix_from_quantiles
from fleetplan.models.names import Engine
from fleetplan.models.profile import ProfileSet
from fleetplan.planner.capacity import MixedWorkload, candidate_configs, capacity_table
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey
from fleetplan.sim.baselines import (
    EXTRA_POLICY_NAMES,
    HINDSIGHT_NAMES,
    POLICY_NAMES,
    HpaController,
    StaticController,
    baseline_config,
    inventory,
    max_replicas,
    mean_rate,
    oracle,
    peak_rate,
    restrict_policy,
    smallest_count,
    static_targets,
    trace_mix,
)
from fleetplan.sim.control import ControlSettings, FleetplanController
from fleetplan.sim.core import capacity_at_slo, replay_on_core
from fleetplan.sim.des import (
    Controller,
    Environment,
    FleetSim,
    SimResult,
    SimSettings,
)
from fleetplan.sim.evaluate_yardsticks import run_yardsticks
from fleetplan.sim.graduation import Graduation, graduation
from fleetplan.sim.groundtruth import EngineParams, build_params
from fleetplan.sim.jobs import open_jobs
from fleetplan.sim.slo_periods import MissMinutes, PeriodJudgement
from fleetplan.sim.solve_limits import replay_policy
from fleetplan.sim.traces import Trace, TraceRequest, window_rates

SIMULATED = tuple(p for p in (*POLICY_NAMES, *EXTRA_POLICY_NAMES) if p not in HINDSIGHT_NAMES)
KNOWN = (*POLICY_NAMES, *EXTRA_POLICY_NAMES)


class EvaluateError(ValueError):
    """A trace/policy combination that cannot be evaluated; one clear line."""


@dataclass(frozen=True)
class PolicyFigures:
    name: str
    gpu_hours: float
    cost_usd: float
    slo_attainment: float | None  # None: not simulated (oracle)
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    replica_starts: int
    builds: int
    scale_up_lag_mean_s: float | None
    scale_up_lag_max_s: float | None
    underprovisioned_episodes: int
    unmet_requests: int  # rejected (no READY replica / too long) + unfinished
    unmet_demand_share: float  # integral of max(0, demand - ready capacity) / integral of demand
    arrived: int
    served: int
    mean_gpus: float
    peak_gpus: int
    wall_s: float
    timeline: tuple[tuple[float, float, float, int], ...]  # (t_s, demand_rps, capacity_rps, gpus)
    notes: tuple[str, ...] = ()
    swap_cycles: int = 0
    # GPU-hours of the replicas per config label (engine builds apart: build_gpu_hours)
    gpu_hours_by_config: Mapping[str, float] = field(default_factory=dict)
    gpu_hours_by_role: Mapping[str, float] = field(default_factory=dict)  # aggregated, prefill / decode pools
    build_gpu_hours: float = 0.0
    drain_timeouts: int = 0
    prefix_hit_rate: float | None = None  # the simulated fleet's prefix-cache hit rate (prompt tokens)
    # starts an agent would refuse (GPUs in use, engine not on that host): 0 unless the act path errs
    refused_starts: int = 0
    graduation: Graduation | None = None  # its builds and when each engine served (None: not replayed)
    # the SLO as the policy writes it: every rolling period at its objective (sim/slo_periods.py)
    slo_periods: PeriodJudgement | None = None
    miss_minutes: MissMinutes | None = None  # where its misses fell (sim/slo_periods.py; None: not simulated)

    def gpu_hours_by_engine(self) -> dict[str, float]:
        """Per engine: its replicas' GPU-hours (+ "build": the engine builds')."""
        out: dict[str, float] = {}
        for label, h in self.gpu_hours_by_config.items():
            engine = label.split("/")[1]
            out[engine] = out.get(engine, 0.0) + h
        if self.build_gpu_hours:
            out["build"] = self.build_gpu_hours
        return out

    def to_json(self) -> dict[str, Any]:
        def r(x: float | None, nd: int = 4) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, nd)

        d: dict[str, Any] = {
            "gpu_hours": r(self.gpu_hours), "cost_usd": r(self.cost_usd, 2),
        }
        if self.slo_attainment is not None:
            d.update({
                "slo_attainment": r(self.slo_attainment, 5),
                "ttft_p50_ms": r(self.ttft_p50_ms, 1), "ttft_p99_ms": r(self.ttft_p99_ms, 1),
                "itl_p50_ms": r(self.itl_p50_ms, 2), "itl_p99_ms": r(self.itl_p99_ms, 2),
                "scale_up_lag_mean_s": r(self.scale_up_lag_mean_s, 1),
                "scale_up_lag_max_s": r(self.scale_up_lag_max_s, 1),
                "underprovisioned_episodes": self.underprovisioned_episodes,
                "unmet_requests": self.unmet_requests,
                "arrived": self.arrived, "served": self.served,
                "builds": self.builds,
                "build_gpu_hours": r(self.build_gpu_hours),
                "prefix_cache_hit_rate": r(self.prefix_hit_rate),
                "drain_timeouts": self.drain_timeouts,
                "swap_cycles": self.swap_cycles,
                "refused_starts": self.refused_starts,
                "graduation": None if self.graduation is None else self.graduation.to_json(),
                "slo_periods": None if self.slo_periods is None else self.slo_periods.to_json(),
                "miss_minutes": None if self.miss_minutes is None else self.miss_minutes.to_json(),
                "sim_wall_s": r(self.wall_s, 2),
            })
        d.update({
            "gpu_hours_by_engine": {k: r(v) for k, v in sorted(self.gpu_hours_by_engine().items())},
            "gpu_hours_by_config": {k: r(v) for k, v in sorted(self.gpu_hours_by_config.items())},
            "gpu_hours_by_role": {k: r(v) for k, v in sorted(self.gpu_hours_by_role.items())},
            "replica_starts": self.replica_starts,
            "unmet_demand_share": r(self.unmet_demand_share, 5),
            "mean_gpus": r(self.mean_gpus, 2), "peak_gpus": self.peak_gpus,
        })
        if self.notes:
            d["notes"] = list(self.notes[:10])
        return d


@dataclass(frozen=True)
class Evaluation:
    trace: Mapping[str, Any]
    policies: Mapping[str, PolicyFigures]
    oracle_config: str
    capacities: Mapping[str, float]  # ground-truth max rps per config label
    wall_s: float
    notes: tuple[str, ...] = ()
    # per config label: what the profiles say for the trace's length mix (the planner's view before
    # any observation) and why it extrapolates; the gap to `capacities` is the profile's error
    profile_capacities: Mapping[str, tuple[float, tuple[str, ...]]] = field(default_factory=dict)
    # per config label: the share of the trace's requests that miss the SLO even on an idle replica
    attainment_floors: Mapping[str, float] = field(default_factory=dict)
    best_fixed_fleet: str = ""  # the fleet `best-fixed` held ("" where it did not run)
    found_at: Mapping[str, str] = field(default_factory=dict)  # per yardstick (clairvoyant, hpa-tuned): its setting

    def capacity_gaps(self) -> list[str]:
        """One line per config: profile vs ground-truth capacity per replica at the SLO."""
        out = []
        for label in sorted(set(self.capacities) | set(self.profile_capacities)):
            gt = self.capacities.get(label)
            prof, why = self.profile_capacities.get(label, (None, ()))
            gap = (f"{100.0 * (prof / gt - 1.0):+.0f}%" if prof is not None and gt else "-")
            out.append(f"{label}: profile {'-' if prof is None else format(prof, '.2f')} vs ground truth "
                       f"{'-' if gt is None else format(gt, '.2f')} rps ({gap})"
                       + (f"; extrapolating: {'; '.join(why)}" if why else ""))
        return out

    def to_json(self) -> dict[str, Any]:
        """{"policies": {name: figures}, "trace": {...}}: exactly the two top-level keys of the issue."""
        policies = {name: f.to_json() for name, f in self.policies.items()}
        if "oracle" in policies:
            policies["oracle"]["config"] = self.oracle_config
            policies["oracle"]["ground_truth_capacity_rps"] = {
                k: round(v, 3) for k, v in sorted(self.capacities.items())}
        if "best-fixed" in policies:
            policies["best-fixed"]["fleet"] = self.best_fixed_fleet
        for name, label in self.found_at.items():
            policies[name]["found_at"] = label
        trace = dict(self.trace)
        trace["evaluation_wall_s"] = round(self.wall_s, 2)
        trace["profile_vs_ground_truth_rps"] = {
            label: {"profile": round(prof, 3), "ground_truth": round(self.capacities.get(label, 0.0), 3),
                    "extrapolating": list(why)}
            for label, (prof, why) in sorted(self.profile_capacities.items())}
        trace["attainment_floor"] = {label: {"miss_share_idle": round(v, 5), "max_attainment": round(1.0 - v, 5)}
                                     for label, v in sorted(self.attainment_floors.items())}
        if self.notes:
            trace["notes"] = list(self.notes)
        return {"policies": policies, "trace": trace}


@dataclass(frozen=True)
class EvaluateOptions:
    policies: tuple[str, ...] = POLICY_NAMES
    model: str | None = None  # the model a trace without a model column is served as
    settings: SimSettings = field(default_factory=SimSettings)
    # the daemon's timeouts (ready, ack, drain; fleetplan/harness/replay_settings.py maps them from its config)
    control: ControlSettings = field(default_factory=ControlSettings)
    workers: int = 2  # processes of this machine the replays run in (1: this process)
    hpa_target_fraction: float = 0.8
    # a Ray cluster's address the replays run on instead ("auto", "ray://HOST:10001", "local"; None: this machine)
    ray_address: str | None = None


# ----------------------------------------------------------------------------------------------


def prepare_trace(trace: Trace, policy: Policy, model: str | None) -> Trace:
    """Label every request with a policy model (canonical name); clear error when impossible."""
    aliases = policy.aliases()
    known = {m.name for m in policy.models}
    if model is not None:
        name = aliases.canonical(model)
        if name not in known:
            raise EvaluateError(f"--model {model!r} is not a model of the policy (models: {', '.join(sorted(known))})")
        return trace.as_single_model(name)
    if any(r.model is None for r in trace.requests):
        default = policy.models[0].name
        trace = replace(trace, requests=tuple(r if r.model is not None else replace(r, model=default)
                                              for r in trace.requests))
    out: list[TraceRequest] = []
    for r in trace.requests:
        assert r.model is not None
        name = aliases.canonical(r.model)
        if name not in known:
            raise EvaluateError(
                f"{trace.source}: model {r.model!r} of the trace is not in the policy "
                f"(models: {', '.join(sorted(known))}); pass --model to serve the trace as one model"
            )
        out.append(r if name == r.model else replace(r, model=name))  # its blocks and all else kept
    return replace(trace, requests=tuple(out))


def policy_for_models(policy: Policy, models: Sequence[str]) -> Policy:
    """The policy without the models the trace does not carry (they would get no traffic)."""
    keep = tuple(m for m in policy.models if m.name in set(models))
    return policy.model_copy(update={"models": keep})


def trace_lengths(trace: Trace, model: str) -> list[tuple[int, int]]:
    return [(r.prompt_tokens, r.output_tokens) for r in trace.requests if r.model == model]


def _params(c: ConfigKey) -> EngineParams:
    return build_params(c.engine, c.model, c.gpu, c.tp, c.precision)


def make_environment(policy: Policy) -> Environment:
    cache: dict[ConfigKey, EngineParams] = {}

    def params_for(c: ConfigKey) -> EngineParams:
        p = cache.get(c)
        if p is None:
            p = cache[c] = _params(c)
        return p

    def build_s(c: ConfigKey) -> float | None:
        return policy.build_s(c) if policy.needs_build(c) else None

    return Environment(
        hosts=inventory(policy),
        price_usd_h={g.value: gp.price_usd_h for g, gp in policy.gpu_types.items()},
        params_for=params_for,
        startup_s=policy.startup_s,
        build_s=build_s,
        cached=policy.cached_configs(),
        ttft_slo_ms={m.name: m.slo.ttft_p99_ms for m in policy.models},
        itl_slo_ms={m.name: m.slo.itl_p99_ms for m in policy.models},
        slo_objective={m.name: m.slo.objective for m in policy.models},
        slo_period_s={m.name: m.slo.period_s for m in policy.models},
    )


def make_controller(name: str, trace: Trace, policy: Policy, profiles: ProfileSet,
                    hpa_target_fraction: float = 0.8) -> Controller:
    models = sorted({r.model for r in trace.requests if r.model is not None})
    if name == "fleetplan":
        return FleetplanController(name, policy, profiles)
    if name == "fleetplan-vllm-only":
        return FleetplanController(name, restrict_policy(policy, [Engine.VLLM]), profiles)
    if name == "fleetplan-trtllm-only":
        return FleetplanController(name, restrict_policy(policy, [Engine.TRTLLM]), profiles)
    if name == "fleetplan-no-history":
        return FleetplanController(name, policy, profiles, use_history=False)
    targets: dict[ConfigKey, int] = {}
    hpa_configs: dict[str, ConfigKey] = {}
    hpa_target: dict[str, float] = {}
    hpa_initial: dict[str, int] = {}
    for m in models:
        sub = Trace(trace.source, trace.format, tuple(r for r in trace.requests if r.model == m))
        isl, osl = trace_mix(sub)
        sizing = baseline_config(policy, profiles, m, isl, osl, hpa_target_fraction)
        mp = policy.model(m)
        assert mp is not None
        if name == "static-peak":
            targets.update(static_targets(sizing, peak_rate(sub), mp.headroom))
        elif name == "static-mean":
            targets.update(static_targets(sizing, mean_rate(sub), 0.3))
        elif name == "hpa":
            hpa_configs[m] = sizing.config
            hpa_target[m] = max(1.0, sizing.concurrency_at_target)
            first = sum(1 for r in sub.requests if r.t_s < 60.0) / 60.0
            hpa_initial[m] = max(1, math.ceil(first / (hpa_target_fraction * sizing.capacity_rps)))
        else:
            raise EvaluateError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    if name == "hpa":
        return HpaController(
            name, hpa_configs, hpa_target,
            min_replicas={m.name: max(1, m.min_replicas) for m in policy.models},
            max_replicas={m.name: m.max_replicas for m in policy.models},
            initial=hpa_initial,
        )
    return StaticController(name, targets)


def simulate_policy(name: str, trace: Trace, policy: Policy, profiles: ProfileSet,
                    settings: SimSettings, hpa_target_fraction: float = 0.8,
                    control: ControlSettings | None = None) -> tuple[SimResult, float]:
    """Run one policy (in a worker process); returns the result and its wall time."""
    t0 = time.perf_counter()
    ctl = make_controller(name, trace, policy, profiles, hpa_target_fraction)
    sim = FleetSim(trace, ctl, make_environment(policy), settings, control=control)
    res = sim.run()
    return res, time.perf_counter() - t0


def fixed_count(trace: Trace, policy: Policy, config: ConfigKey, settings: SimSettings,
                capacity_rps: float | None = None, target: float = SLO_SHARE) -> tuple[int, float] | None:
    """The smallest count of `config` that, held fixed for the whole of `trace` (one model's
    requests), serves at least `target` of them within the SLO, and what it reaches; None: no count
    the inventory holds does (in a worker process). A replay per count tried: from the mean rate over
    `capacity_rps` (its ground-truth capacity) where known, else bisection (`smallest_count`)."""
    reached: dict[int, float] = {}

    def reaches(n: int) -> bool:
        res = FleetSim(trace, StaticController("best-fixed", {config: n}), make_environment(policy), settings).run()
        reached[n] = res.slo_attainment
        return res.serves_slo(target)

    start = math.ceil(mean_rate(trace) / capacity_rps) if capacity_rps is not None and capacity_rps > 0 else None
    n = smallest_count(reaches, max_replicas(policy, config), start)
    return None if n is None else (n, reached[n])


def _best_fixed(models: Sequence[str], policy: Policy, counts: Mapping[tuple[str, ConfigKey], tuple[int, float] | None],
                ) -> tuple[dict[ConfigKey, int], list[str], list[str]]:
    """Per model the config whose smallest fixed count reaching the target costs least: (the fleet,
    its description per model, the models no fixed count of any config serves)."""
    fleet: dict[ConfigKey, int] = {}
    labels: list[str] = []
    missing: list[str] = []
    by_model: dict[str, list[tuple[ConfigKey, tuple[int, float]]]] = {}
    for (model, c), found in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if found is not None:
            by_model.setdefault(model, []).append((c, found))
    for m in models:
        best: tuple[float, ConfigKey, int, float] | None = None
        for c, found in by_model.get(m, ()):
            usd = policy.replica_usd_h(c)
            if usd is None:
                continue
            n, att = found
            if best is None or (n * usd, -att) < (best[0], -best[3]):  # a tie: the higher attainment
                best = (n * usd, c, n, att)
        if best is None:
            missing.append(m)
            continue
        _, c, n, att = best
        fleet[c] = n
        labels.append(f"{c.label()} x {n} ({100.0 * att:.2f}% of {m}'s requests alone)")
    return fleet, labels, missing


def ground_truth_capacity(c: ConfigKey, lengths: Sequence[tuple[int, int]], ttft_ms: float, itl_ms: float,
                          seed: int = 0, n: int = 2000, repeats: int = 3) -> float:
    """fleetplan.sim.des.capacity_at_slo on the config's ground-truth engine with the trace's own length mix."""
    try:
        params = _params(c)
    except ValueError:  # does not fit
        return 0.0
    return capacity_at_slo(params, lengths, ttft_ms, itl_ms, seed=seed, n=n, repeats=repeats)


def attainment_floor(c: ConfigKey, lengths: Sequence[tuple[int, int]], ttft_ms: float, itl_ms: float,
                     n: int = 300, seed: int = 0) -> float | None:
    """The share of requests of this length mix that miss the SLO even on an idle replica of the
    config's ground-truth engine (one request at a time): no count of this config serves them."""
    try:
        params = _params(c)
    except ValueError:
        return None
    if not lengths:
        return None
    rng = random.Random(seed)
    limit = params.max_model_len
    pool = [(max(1, int(p)), max(1, int(o))) for p, o in lengths]
    sample = [pool[rng.randrange(len(pool))] for _ in range(n)]
    too_long = sum(1 for p, o in sample if p + o > limit)
    fits = [(p, o) for p, o in sample if p + o <= limit]
    if not fits:
        return 1.0
    arrivals = [(k * 1e5, p, o) for k, (p, o) in enumerate(fits)]  # far apart: every request alone
    ttft, tpot = replay_on_core(params, arrivals, seed=seed)
    miss = too_long + int(np.sum((ttft * 1000.0 > ttft_ms) | (np.nan_to_num(tpot) * 1000.0 > itl_ms)))
    return miss / n


def profiles_from_ground_truth(configs: Sequence[ConfigKey], lengths: Sequence[tuple[int, int]],
                               ttft_ms: float, itl_ms: float, *, n: int = 1200, seed: int = 1,
                               fractions: Sequence[float] = (0.15, 0.3, 0.5, 0.7, 0.85, 1.0, 1.15),
                               capacities: Mapping[ConfigKey, float] | None = None) -> ProfileSet:
    """What a team would measure: a rate sweep per config on the simulator's ground truth (requests
    drawn from the trace's length mix, like `vllm bench serve` on a custom dataset), fitted with
    fleetplan.models.fit. The sweep spans 15%..115% of the config's ground-truth capacity."""
    from fleetplan.models.bench import BenchmarkPoint, LoadKind
    from fleetplan.models.fit import FitFailure, fit_profile

    profiles = []
    rng = random.Random(seed)
    pool = list(lengths)
    for c in configs:
        try:
            params = _params(c)
        except ValueError:
            continue
        cap = (capacities or {}).get(c) or capacity_at_slo(params, pool, ttft_ms, itl_ms, seed=seed)
        if cap <= 0:
            continue
        fitting = [x for x in pool if x[0] + x[1] <= params.max_model_len] or pool[:1]
        sample = [fitting[rng.randrange(len(fitting))] for _ in range(n)]
        isl = sum(p for p, _ in sample) / n
        osl = sum(o for _, o in sample) / n
        points = []
        for f in fractions:
            rate = cap * f
            t = 0.0
            arr = []
            for p, o in sample:
                t += rng.expovariate(rate)
                arr.append((t, p, o))
            ttft, tpot = replay_on_core(params, arr, seed=seed)
            warm = n // 10
            tt = ttft[warm:] * 1000.0
            tp = tpot[warm:]
            tp = tp[~np.isnan(tp)] * 1000.0
            outs = np.array([o for _, _, o in arr], dtype=float)
            fin = np.array([a[0] for a in arr]) + ttft + np.where(outs > 1, np.nan_to_num(tpot) * (outs - 1), 0.0)
            makespan = float(np.nanmax(fin)) - arr[0][0]
            points.append(BenchmarkPoint(
                source=f"ground-truth sweep {c.label()} @ {rate:.3f} rps", model=c.model, engine=c.engine,
                gpu=c.gpu, tp=c.tp, precision=c.precision, isl=isl, osl=osl, load=LoadKind.RATE,
                rate_rps=rate, request_rps=n / makespan, output_tok_s=float(outs.sum()) / makespan,
                ttft_mean_ms=float(tt.mean()), ttft_p50_ms=float(np.quantile(tt, 0.5)),
                ttft_p99_ms=float(np.quantile(tt, 0.99)),
                tpot_mean_ms=float(tp.mean()), tpot_p50_ms=float(np.quantile(tp, 0.5)),
                tpot_p99_ms=float(np.quantile(tp, 0.99)), series="gt-sweep",
            ))
        key = c
        try:
            prof = fit_profile(key, points, loo=False).profile
        except FitFailure:
            continue
        if prof.data_range is not None:  # requests drawn from the trace: the latencies carry its spread
            prof = replace(prof, data_range=replace(prof.data_range, length_spread=True))
        profiles.append(prof)
    return ProfileSet(tuple(profiles))


def candidates_for(policy: Policy, model: str) -> list[ConfigKey]:
    gpus = {h.gpu for h in policy.hosts} or set(policy.gpu_types)
    out = []
    for c in candidate_configs(policy, gpus):
        if c.model != model:
            continue
        try:
            _params(c)
        except ValueError:
            continue
        out.append(c)
    return out


def _tell(progress: Callable[[str], None] | None, line: str) -> None:
    if progress is not None:
        progress(line)


def evaluate(trace: Trace, policy: Policy, profiles: ProfileSet, options: EvaluateOptions | None = None,
             *, trace_info: Mapping[str, Any] | None = None,
             capacities: Mapping[ConfigKey, float] | None = None,
             progress: Callable[[str], None] | None = None) -> Evaluation:
    """Every policy of `options.policies` on `trace`; `capacities`: ground-truth capacities already
    computed (fleetplan.sim.des.capacity_at_slo with the trace's mix), the rest are computed here;
    `progress`: told one line as each job finishes (a long evaluation is not silent)."""
    opts = options or EvaluateOptions()
    t_start = time.perf_counter()
    unknown = [p for p in opts.policies if p not in KNOWN]
    if unknown:
        raise EvaluateError(f"unknown policy {unknown[0]!r}; known: {', '.join(KNOWN)}")
    if not trace.requests:
        raise EvaluateError(f"{trace.source}: the trace has no requests")
    if not policy.hosts:
        raise EvaluateError("the policy lists no hosts: the simulated fleet is the policy's `hosts` inventory")
    trace = prepare_trace(trace, policy, opts.model)
    models = sorted({r.model for r in trace.requests if r.model is not None})
    policy = replay_policy(policy_for_models(policy, models))  # the solve limited by work: a function
    subs = {m: Trace(trace.source, trace.format, tuple(r for r in trace.requests if r.model == m)) for m in models}
    mixes = {m: trace_mix(subs[m]) for m in models}
    cands = {m: candidates_for(policy, m) for m in models}
    sims = [p for p in opts.policies if p in SIMULATED]
    searches = ([(m, c) for m in models for c in cands[m]] if "best-fixed" in opts.policies else [])
    counts: dict[tuple[str, ConfigKey], tuple[int, float] | None] = {}
    results: dict[str, tuple[SimResult, float]] = {}
    known_caps = dict(capacities or {})
    caps: dict[ConfigKey, float] = dict(known_caps)
    with open_jobs(workers=max(1, opts.workers), ray_address=opts.ray_address) as jobs:
        cap_f: dict[ConfigKey, Future[float]] = {}
        sim_f: dict[str, Future[tuple[SimResult, float]]] = {}
        # longest jobs first: fleetplan variants, then the rest, capacities interleaved
        for name in sims:
            sim_f[name] = jobs.submit(simulate_policy, name, trace, policy, profiles, opts.settings,
                                      opts.hpa_target_fraction, opts.control)
        for m in models:
            mp = policy.model(m)
            assert mp is not None
            for c in cands[m]:
                if c in known_caps:
                    continue
                cap_f[c] = jobs.submit(ground_truth_capacity, c, trace_lengths(trace, m),
                                       mp.slo.ttft_p99_ms, mp.slo.itl_p99_ms)
        # a best-fixed search starts from its config's ground-truth capacity: submitted once known
        count_f: dict[tuple[str, ConfigKey], Future[tuple[int, float] | None]] = {}
        what: dict[Future[Any], str] = {
            **{f: f"{name} replayed" for name, f in sim_f.items()},
            **{f: f"ground-truth capacity of {c.label()}" for c, f in cap_f.items()}}

        def search(m: str, c: ConfigKey, cap: float | None) -> None:
            count_f[(m, c)] = f = jobs.submit(fixed_count, subs[m], policy, c, opts.settings, cap)
            what[f] = f"best-fixed count of {c.label()}"

        after_cap = {cap_f[c]: (m, c) for m, c in searches if c in cap_f}  # searched once it is known
        for m, c in searches:
            if c not in cap_f:
                search(m, c, caps.get(c))
        total = len(what) + len(after_cap)
        pending, done = set(what), 0
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in sorted(finished, key=list(what).index):  # in submission order where several finish
                f.result()  # a worker's error surfaces here
                done += 1
                _tell(progress, f"{done}/{total} {what[f]} ({time.perf_counter() - t_start:.0f} s)")
                if f in after_cap:
                    m, c = after_cap[f]
                    search(m, c, f.result())
                    pending.add(count_f[(m, c)])
        for c, f in cap_f.items():
            caps[c] = f.result()
        for key, cf in count_f.items():
            counts[key] = cf.result()
        for name, sf in sim_f.items():
            results[name] = sf.result()

    floors: dict[str, float] = {}
    for m in models:
        mp = policy.model(m)
        assert mp is not None
        for c in cands[m]:
            fl = attainment_floor(c, trace_lengths(trace, m), mp.slo.ttft_p99_ms, mp.slo.itl_p99_ms)
            if fl is not None:
                floors[c.label()] = fl
    notes: list[str] = []
    fixed_label = ""
    if "best-fixed" in opts.policies:
        # with hindsight: per model the cheapest config at the smallest count that, held all along,
        # serves SLO_SHARE of its requests; the fleet of them replayed on the whole trace. What no
        # policy undercuts at that attainment by holding one fleet (the oracle is a bound, this a run)
        fleet, labels, missing = _best_fixed(models, policy, counts)
        if missing:
            notes.append("best-fixed left out: no count of any config held all along serves "
                         f"{100.0 * SLO_SHARE:g}% of the requests of " + ", ".join(missing))
        else:
            need: dict[str, int] = {}
            for c, n in fleet.items():
                need[c.gpu.value] = need.get(c.gpu.value, 0) + n * c.tp
            have: dict[str, int] = {}
            for host in policy.hosts:
                have[host.gpu.value] = have.get(host.gpu.value, 0) + host.gpu_count
            over = sorted(g for g, k in need.items() if k > have.get(g, 0))
            if over:  # each model's fleet was found alone: together they need more than the hosts hold
                notes.append("best-fixed: the models' fleets together need more " + ", ".join(over)
                             + " GPUs than the inventory holds; replayed as the simulator places them")
            t0 = time.perf_counter()
            res = FleetSim(trace, StaticController("best-fixed", fleet), make_environment(policy), opts.settings).run()
            results["best-fixed"] = (res, time.perf_counter() - t0)
            fixed_label = "; ".join(labels)
    yards, yard_notes = run_yardsticks(
        opts.policies, trace, subs, cands, caps, policy, make_environment(policy), opts.settings,
        lambda t: simulate_policy("hpa", trace, policy, profiles, opts.settings, t, opts.control)[0],
        lambda c: max_replicas(policy, c), SLO_SHARE, lambda line: _tell(progress, line))
    results.update({name: (run.result, run.wall_s) for name, run in yards.items()})
    notes.extend(yard_notes)
    figures: dict[str, PolicyFigures] = {}
    for name in opts.policies:
        if name == "oracle" or name not in results:
            continue
        res, wall = results[name]
        figures[name] = _figures(res, wall, caps)
    oracle_label = ""
    # a model no config serves within the SLO even on an idle replica (its requests too long for the
    # SLO) has no lower bound: the oracle is left out, the simulated policies still report
    unbounded = [m for m in models if not any(caps.get(c, 0.0) > 0 for c in cands[m])]
    if "oracle" in opts.policies and unbounded:
        notes.append("oracle left out: no config of " + ", ".join(unbounded) + " meets the SLO for this "
                     "trace's requests even on an idle replica (ground truth), so there is no lower bound")
    if "oracle" in opts.policies and not unbounded:
        price = {g.value: gp.price_usd_h for g, gp in policy.gpu_types.items()}
        total_h = 0.0
        total_cost = 0.0
        starts = 0
        labels = []
        orc_by_config: dict[str, float] = {}
        timeline_acc: dict[float, list[float]] = {}
        gpus_acc: dict[float, int] = {}
        for m in models:
            mp = policy.model(m)
            assert mp is not None
            sub = subs[m]
            o = oracle(sub, cands[m], caps, price, policy.scaling.cycle_s, min_replicas=0)
            total_h += o.gpu_hours
            total_cost += o.cost_usd
            starts += o.replica_starts
            for c, h in o.gpu_hours_by_config:
                orc_by_config[c.label()] = orc_by_config.get(c.label(), 0.0) + h
            labels.append(f"{o.config.label()} @ {o.capacity_rps:.2f} rps/replica")
            rates = window_rates(sub.requests, o.window_s, trace.duration_s)
            for k, n in enumerate(o.gpus_per_window):
                t = k * o.window_s
                acc = timeline_acc.setdefault(t, [0.0, 0.0])
                acc[0] += float(rates[k]) if k < len(rates) else 0.0
                acc[1] += o.capacity_per_window[k]
                gpus_acc[t] = gpus_acc.get(t, 0) + n
        tl = tuple((t, v[0], v[1], gpus_acc[t]) for t, v in sorted(timeline_acc.items()))
        dur_h = trace.duration_s / 3600.0
        figures["oracle"] = PolicyFigures(
            name="oracle", gpu_hours=total_h, cost_usd=total_cost, slo_attainment=None,
            ttft_p50_ms=None, ttft_p99_ms=None, itl_p50_ms=None, itl_p99_ms=None,
            replica_starts=starts, builds=0, scale_up_lag_mean_s=None, scale_up_lag_max_s=None,
            underprovisioned_episodes=0, unmet_requests=0, unmet_demand_share=0.0,
            arrived=len(trace.requests), served=len(trace.requests),
            mean_gpus=total_h / dur_h if dur_h > 0 else 0.0,
            peak_gpus=max((g for *_x, g in tl), default=0), wall_s=0.0, timeline=tl,
            gpu_hours_by_config=orc_by_config,
        )
        oracle_label = "; ".join(labels)
    info = dict(trace_info or {})
    info.update({
        "source": trace.source, "format": trace.format.value, "requests": len(trace.requests),
        "duration_s": round(trace.duration_s, 1),
        "mean_rps": round(len(trace.requests) / trace.duration_s, 3) if trace.duration_s > 0 else None,
        "peak_rps_60s": round(peak_rate(trace), 3),
        "models": models,
        "mean_prompt_tokens": {m: round(mixes[m][0], 1) for m in models},
        "mean_output_tokens": {m: round(mixes[m][1], 1) for m in models},
        # what the replayed daemon read and waited (simulated seconds): its config's, or its defaults
        "replay_settings": {
            **{k: getattr(opts.settings, k) for k in ("window_s", "peak_window_s", "length_window_s", "history_s",
                                                      "history_step_s", "scrape_s", "scrape_delay_s")},
            **asdict(opts.control)},
    })
    return Evaluation(
        trace=info,
        policies=figures,
        oracle_config=oracle_label,
        capacities={c.label(): v for c, v in caps.items()},
        wall_s=time.perf_counter() - t_start,
        notes=tuple(notes),
        profile_capacities=profile_capacities(trace, policy, profiles, models),
        attainment_floors=floors,
        best_fixed_fleet=fixed_label,
        found_at={name: run.label for name, run in yards.items()},
    )


def trace_workload(trace: Trace, model: str) -> MixedWorkload:
    """The model's length mix in the trace, as the controller would observe it (quantiles + means)."""
    lengths = np.array(trace_lengths(trace, model), dtype=float)
    isl, osl = lengths[:, 0], lengths[:, 1]
    mix = mix_from_quantiles([(q, float(np.quantile(isl, q))) for q in QUANTILE_LEVELS],
                             [(q, float(np.quantile(osl, q))) for q in QUANTILE_LEVELS],
                             isl_mean=float(isl.mean()), osl_mean=float(osl.mean()))
    return MixedWorkload(float(isl.mean()), float(osl.mean()), mix)


def profile_capacities(trace: Trace, policy: Policy, profiles: ProfileSet,
                       models: Sequence[str]) -> dict[str, tuple[float, tuple[str, ...]]]:
    """Per config: the profiles' capacity for the trace's mix (no correction) and why it extrapolates."""
    gpus = {h.gpu for h in policy.hosts} or set(policy.gpu_types)
    workloads = {m: trace_workload(trace, m) for m in models}
    table, _ = capacity_table(policy, profiles, workloads, gpus)
    return {c.label(): (info.profile_rps or info.max_rps, info.extrapolating) for c, info in table.items()
            if c.model in workloads}


def _q(a: np.ndarray, q: float) -> float | None:
    return float(np.quantile(a, q)) if a.size else None


def _figures(res: SimResult, wall: float, caps: Mapping[ConfigKey, float]) -> PolicyFigures:
    tl: list[tuple[float, float, float, int]] = []
    lags: list[float] = []
    start: float | None = None
    unmet = 0.0
    total = 0.0
    for p in res.timeline:
        cap = sum(n * caps.get(c, 0.0) for c, n in p.ready)
        tl.append((p.t_s, p.demand_rps, cap, p.gpus))
        total += p.demand_rps
        unmet += max(0.0, p.demand_rps - cap)
        short = p.demand_rps > cap + 1e-9
        if short and start is None:
            start = p.t_s
        elif not short and start is not None:
            lags.append(p.t_s - start)
            start = None
    if start is not None and tl:
        lags.append(tl[-1][0] - start)
    dur_h = res.duration_s / 3600.0
    return PolicyFigures(
        name=res.policy,
        gpu_hours=res.gpu_hours,
        cost_usd=res.cost_usd,
        slo_attainment=res.slo_attainment,
        slo_periods=res.judged,
        miss_minutes=res.misses,
        ttft_p50_ms=_q(res.ttft_ms, 0.5),
        ttft_p99_ms=_q(res.ttft_ms, 0.99),
        itl_p50_ms=_q(res.itl_ms, 0.5),
        itl_p99_ms=_q(res.itl_ms, 0.99),
        replica_starts=res.replica_starts,
        builds=res.builds,
        scale_up_lag_mean_s=float(np.mean(lags)) if lags else 0.0,
        scale_up_lag_max_s=float(np.max(lags)) if lags else 0.0,
        underprovisioned_episodes=len(lags),
        unmet_requests=res.rejected + res.unfinished,
        unmet_demand_share=unmet / total if total > 0 else 0.0,
        arrived=res.arrived,
        served=res.served,
        mean_gpus=res.gpu_hours / dur_h if dur_h > 0 else 0.0,
        peak_gpus=max((g for *_x, g in tl), default=0),
        wall_s=wall,
        timeline=tuple(tl),
        notes=res.notes,
        swap_cycles=res.swap_cycles,
        gpu_hours_by_config={c.label(): h for c, h in res.gpu_hours_by_config},
        gpu_hours_by_role={role.value: h for role, h in res.gpu_hours_by_role},
        build_gpu_hours=res.build_gpu_hours,
        drain_timeouts=res.drain_timeouts,
        prefix_hit_rate=res.prefix_hit_rate,
        refused_starts=res.placement_conflicts,
        graduation=graduation(res.timeline, res.build_windows) if res.timeline else None,
    )


def parse_policy_list(text: str | None) -> tuple[str, ...]:
    if not text:
        return POLICY_NAMES
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    for n in names:
        if n not in KNOWN:
            raise EvaluateError(f"--policies: unknown policy {n!r}; known: {', '.join(KNOWN)}")
    return names



# the presentation lives in evaluate_report.py; these names are part of this module's interface
from fleetplan.sim.evaluate_report import goals as goals  # noqa: E402
from fleetplan.sim.evaluate_report import render_table as render_table  # noqa: E402
from fleetplan.sim.evaluate_report import write_charts as write_charts  # noqa: E402
