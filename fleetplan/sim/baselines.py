"""The policies compared by `fleetplan evaluate`, and the oracle lower bound.

- fleetplan: planner.plan() every policy.scaling.cycle_s on what Prometheus would show (forecast +
  optimizer); its actions are applied as issued (START, BUILD, DRAIN, STOP = graceful stop).
- fleetplan-vllm-only / fleetplan-trtllm-only: the same with every model restricted to one engine.
- static-peak: the baseline config (below) sized once for the trace's peak 60 s arrival rate with
  the model's headroom: ceil(peak x (1 + headroom) / capacity per replica).
- static-mean: the same for the trace's mean rate x 1.3.
- hpa: Kubernetes HorizontalPodAutoscaler semantics on the baseline config: every 15 s (sync
  period) desired = ceil(current x metric / target), no change within 10% tolerance, scale-up
  stabilisation 0 s, scale-down stabilisation 300 s (the highest recommendation of the last 5
  minutes wins), scale-up at most max(4 pods, 100%) per 15 s. Metric: requests in the engine per
  READY replica (vllm:num_requests_running + vllm:num_requests_waiting, as scraped); target: the
  concurrency one replica holds at 80% of its SLO capacity (the profile's prediction at that
  rate, Little's law; where the profile saturates at that rate, Little's law on the SLO's latency
  budget, TTFT + output x ITL). Pods still starting count in `current` but not in the metric.
- oracle: per window (the policy's cycle period) ceil(true arrival rate / ground-truth max rate of
  one replica at the SLO) replicas of the config with the lowest $ per unit of ground-truth
  capacity (the last partial replica's worth on whichever config covers it cheapest); perfect
  foresight, zero lead time; only GPU-hours and cost (a bound, not a run).

The baseline config of the static and HPA policies is the one a team would pick from its
benchmarks: the lowest $/h per rps of profile capacity among the configs that can start at t=0
(no TensorRT-LLM engine build pending).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fleetplan.models import profile as mp
from fleetplan.models.names import Engine
from fleetplan.models.profile import ProfileSet
from fleetplan.planner.capacity import MixedWorkload, capacity_table
from fleetplan.planner.counts import tp_slots
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey, HostInventory
from fleetplan.sim.des import ControllerView, Decision
from fleetplan.sim.search import smallest_count as smallest_count  # evaluate's best-fixed search
from fleetplan.sim.traces import Trace, iter_rates, window_rates

POLICY_NAMES: tuple[str, ...] = (
    "fleetplan", "fleetplan-vllm-only", "fleetplan-trtllm-only", "static-peak", "static-mean", "hpa",
    "best-fixed", "hpa-tuned", "clairvoyant", "oracle",
)
# with hindsight, not policies: they are searched for or bounded on the trace itself (sim/evaluate.py)
HINDSIGHT_NAMES: tuple[str, ...] = ("best-fixed", "hpa-tuned", "clairvoyant", "oracle")
# selectable with --policies, not run by default: fleetplan without the rate history (its forecast
# then only sees the current rate), to separate the forecast's effect from the optimizer's
EXTRA_POLICY_NAMES: tuple[str, ...] = ("fleetplan-no-history",)


def restrict_policy(policy: Policy, engines: Sequence[Engine]) -> Policy:
    """The policy with every model allowed only `engines` (and only those engines declared)."""
    models = tuple(
        m.model_copy(update={"allowed": m.allowed.model_copy(
            update={"engines": tuple(e for e in m.allowed.engines if e in engines)})})
        for m in policy.models
    )
    return policy.model_copy(update={"models": models})


def inventory(policy: Policy) -> tuple[HostInventory, ...]:
    return tuple(sorted((h.inventory() for h in policy.hosts), key=lambda h: h.name))


def max_replicas(policy: Policy, config: ConfigKey) -> int:
    """How many replicas of `config` the inventory holds at most: per host of its GPU type, its GPUs
    (within NVLink groups where the host lists them) in whole TP groups."""
    return sum(tp_slots([len(g) for g in h.groups()], config.tp) for h in inventory(policy) if h.gpu == config.gpu)


# ----------------------------------------------------------------------------------------------


@dataclass
class StaticController:
    name: str
    targets: Mapping[ConfigKey, int]
    period_s: float = 3600.0

    def decide(self, view: ControllerView) -> Decision:
        return Decision(targets=self.targets)


@dataclass
class HpaController:
    """Kubernetes HPA (autoscaling/v2 defaults) on one config per model."""

    name: str
    configs: Mapping[str, ConfigKey]  # model -> the deployment's config
    target_per_replica: Mapping[str, float]  # model -> target requests in engine per replica
    min_replicas: Mapping[str, int]
    max_replicas: Mapping[str, int | None]
    initial: Mapping[str, int] = field(default_factory=dict)  # replicas at t = 0 (warm start)
    period_s: float = 15.0
    tolerance: float = 0.10
    down_window_s: float = 300.0
    up_window_s: float = 0.0
    _recs: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    _current: dict[str, int] = field(default_factory=dict)

    def decide(self, view: ControllerView) -> Decision:
        targets: dict[ConfigKey, int] = {}
        for model, config in self.configs.items():
            live = [r for r in view.fleet.replicas if r.config == config and r.state.value in ("starting", "ready")]
            current = len(live)
            loads = [view.replica_load[r.replica_id] for r in live if r.replica_id in view.replica_load]
            if not loads:
                if current == 0:
                    desired = max(1, self.min_replicas.get(model, 1), self.initial.get(model, 0))
                else:
                    desired = current
            else:
                avg = sum(x.running + x.waiting for x in loads) / len(loads)
                ratio = avg / self.target_per_replica[model]
                if abs(ratio - 1.0) <= self.tolerance:
                    desired = current
                else:
                    # unready pods: 0 usage when scaling up (HPA's rule for missing metrics)
                    usage = sum(x.running + x.waiting for x in loads)
                    desired = math.ceil(usage / self.target_per_replica[model]) if ratio > 1 else math.ceil(
                        ratio * len(loads))
                    if ratio > 1 and desired < current:
                        desired = current
            lo = max(1, self.min_replicas.get(model, 1))
            hi = self.max_replicas.get(model)
            desired = max(lo, desired if hi is None else min(hi, desired))
            recs = self._recs.setdefault(model, [])
            recs.append((view.t_s, desired))
            recs[:] = [(t, d) for t, d in recs if t >= view.t_s - max(self.down_window_s, self.up_window_s)]
            if desired < current:
                desired = min(current, max(d for t, d in recs if t >= view.t_s - self.down_window_s))
            elif desired > current:
                ups = [d for t, d in recs if t >= view.t_s - self.up_window_s] or [desired]
                desired = max(current, min(ups))
                if current > 0:  # scale-up policy: max(4 pods, 100%) per period (not the initial rollout)
                    desired = min(desired, current + max(4, current))
            targets[config] = desired
        return Decision(targets=targets)


# ----------------------------------------------------------------------------------------------
# Sizing helpers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaselineSizing:
    config: ConfigKey
    capacity_rps: float  # profile capacity per replica at the SLO
    concurrency_at_target: float  # requests in one replica at target_fraction x capacity (profile)
    usd_h: float


def baseline_config(policy: Policy, profiles: ProfileSet, model: str, isl: float, osl: float,
                    target_fraction: float = 0.8) -> BaselineSizing:
    """The lowest $/h per unit of profile capacity among configs that can start at t = 0."""
    m = policy.model(model)
    if m is None:
        raise ValueError(f"model {model!r} is not in the policy")
    gpus = {h.gpu for h in policy.hosts}
    table, _ = capacity_table(policy, profiles, {m.name: MixedWorkload(isl, osl)}, gpus)
    cached = policy.cached_configs()
    best: BaselineSizing | None = None
    for c, info in sorted(table.items()):
        if c.model != m.name or info.max_rps <= 0:
            continue
        if policy.needs_build(c) and c not in cached:
            continue
        price = (policy.price_usd_h(c.gpu) or 0.0) * c.tp
        if best is None or price / info.max_rps < best.usd_h / best.capacity_rps - 1e-12:
            conc = _concurrency(profiles, policy, c, isl, osl, target_fraction * info.max_rps)
            best = BaselineSizing(c, info.max_rps, conc, price)
    if best is None:
        raise ValueError(f"no config of model {model!r} has a capacity at its SLO from the profiles")
    return best


def _concurrency(profiles: ProfileSet, policy: Policy, c: ConfigKey, isl: float, osl: float, rate: float) -> float:
    prof = profiles.get(c.model, c.engine, c.gpu, c.tp, c.precision) or mp.roofline_profile(c)
    if prof is None:
        return 1.0
    try:
        pred = mp.predict(prof, mp.Workload(isl=isl, osl=osl), rate_rps=rate)
        conc = float(pred.concurrency)
    except (ValueError, ArithmeticError):
        conc = math.nan
    if not math.isfinite(conc):
        # the profile cannot say (saturated at that rate on its own terms): a team would use Little's
        # law on the SLO's latency budget; an infinite target froze the HPA at its first size
        m = policy.model(c.model)
        if m is None:
            return 1.0
        conc = rate * (m.slo.ttft_p99_ms + osl * m.slo.itl_p99_ms) / 1000.0
    return max(1.0, conc)


def peak_rate(trace: Trace, window_s: float = 60.0) -> float:
    rates = iter_rates(trace.requests, window_s, max(trace.duration_s, window_s))
    return float(rates.max()) if len(rates) else 0.0


def mean_rate(trace: Trace) -> float:
    return len(trace.requests) / trace.duration_s if trace.duration_s > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# Oracle
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OracleResult:
    gpu_hours: float
    cost_usd: float
    config: ConfigKey  # the cheapest config per unit of ground-truth capacity (the bulk)
    capacity_rps: float  # its ground-truth capacity, one replica at the SLO
    replicas_per_window: tuple[int, ...]
    gpus_per_window: tuple[int, ...]
    capacity_per_window: tuple[float, ...]
    window_s: float
    replica_starts: int
    gpu_hours_by_config: tuple[tuple[ConfigKey, float], ...] = ()


def _window_fleet(r: float, usable: Sequence[ConfigKey], best: ConfigKey, cap: Mapping[ConfigKey, float],
                  price: Mapping[ConfigKey, float], min_replicas: int) -> dict[ConfigKey, int]:
    """The cheapest of: one config for the whole window, or the bulk on `best` + the remainder on
    whichever config covers it cheapest (so that a small demand is not rounded up to a big replica)."""
    def single(x: float) -> tuple[float, dict[ConfigKey, int]]:
        opts = []
        for c in usable:
            n = max(1, math.ceil(x / cap[c] - 1e-9))
            opts.append((n * price[c], c.tp * n, c, n))
        cost, _g, c, n = min(opts, key=lambda o: (o[0], o[1], o[2]))
        return cost, {c: n}

    if r <= 0:
        return {best: min_replicas} if min_replicas > 0 else {}
    cands = [single(r)]
    bulk = math.floor(r / cap[best] + 1e-9)
    if bulk > 0:
        rem = r - bulk * cap[best]
        fleet = {best: bulk}
        cost = bulk * price[best]
        if rem > 1e-9:
            c2, f2 = single(rem)
            cost += c2
            for c, n in f2.items():
                fleet[c] = fleet.get(c, 0) + n
        cands.append((cost, fleet))
    cost, fleet = min(cands, key=lambda x: (x[0], sum(c.tp * n for c, n in x[1].items())))
    if sum(fleet.values()) < min_replicas:
        fleet[best] = fleet.get(best, 0) + min_replicas - sum(fleet.values())
    return fleet


def oracle(
    trace: Trace,
    configs: Sequence[ConfigKey],
    gt_capacity: Mapping[ConfigKey, float],
    price_usd_h: Mapping[str, float],
    window_s: float,
    min_replicas: int = 0,
) -> OracleResult:
    """Per window ceil(true demand / ground-truth capacity per replica) on the cheapest config per
    unit of capacity, the last partial replica's worth of demand on whichever config serves it
    cheapest; perfect foresight, zero lead time."""
    usable = [c for c in configs if gt_capacity.get(c, 0.0) > 0]
    if not usable:
        raise ValueError("oracle: no config has a ground-truth capacity at the SLO")
    price = {c: price_usd_h.get(c.gpu.value, 0.0) * c.tp for c in usable}
    best = min(usable, key=lambda c: (price[c] / gt_capacity[c], c))
    duration = trace.duration_s
    rates = window_rates(trace.requests, window_s, duration)
    reps: list[int] = []
    gpus: list[int] = []
    caps: list[float] = []
    gpu_s = 0.0
    cost = 0.0
    starts = 0
    prev: dict[ConfigKey, int] = {}
    by_config: dict[ConfigKey, float] = {}
    for k, r in enumerate(rates):
        fleet = _window_fleet(float(r), usable, best, gt_capacity, price, min_replicas)
        span = min(window_s, max(0.0, duration - k * window_s))
        g = sum(c.tp * n for c, n in fleet.items())
        for c, n in fleet.items():
            by_config[c] = by_config.get(c, 0.0) + c.tp * n * span / 3600.0
        gpu_s += g * span
        cost += sum(price[c] * n for c, n in fleet.items()) * span / 3600.0
        reps.append(sum(fleet.values()))
        gpus.append(g)
        caps.append(sum(gt_capacity[c] * n for c, n in fleet.items()))
        if k > 0:
            starts += sum(max(0, n - prev.get(c, 0)) for c, n in fleet.items())
        prev = fleet
    return OracleResult(gpu_s / 3600.0, cost, best, gt_capacity[best], tuple(reps), tuple(gpus), tuple(caps),
                        window_s, starts, tuple(sorted(by_config.items())))


def model_slo(policy: Policy, model: str) -> tuple[float, float]:
    m = policy.model(model)
    if m is None:
        raise ValueError(f"model {model!r} is not in the policy")
    return m.slo.ttft_p99_ms, m.slo.itl_p99_ms


def trace_mix(trace: Trace) -> tuple[float, float]:
    n = len(trace.requests)
    if n == 0:
        return 1.0, 1.0
    return (sum(r.prompt_tokens for r in trace.requests) / n, sum(r.output_tokens for r in trace.requests) / n)


def static_targets(sizing: BaselineSizing, rate_rps: float, headroom: float) -> dict[ConfigKey, int]:
    return {sizing.config: max(1, math.ceil(rate_rps * (1.0 + headroom) / sizing.capacity_rps - 1e-9))}

