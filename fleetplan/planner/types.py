"""Value types of the planner: the fleet it sees, the demand it serves, the plan it returns.

All frozen dataclasses; pydantic lives only at the edges (planner/policy.py parses the policy file).
`None` means unknown. Units are in the field names (`_s`, `_ms`, `_rps`, `_usd_h`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.profile import ConfigKey as ConfigKey  # the one configuration identity
from fleetplan.planner.slo import BudgetSlice, ErrorBudget

if TYPE_CHECKING:
    from fleetplan.planner.solve_memo import Solved


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ActionKind(StrEnum):
    BUILD = "build"  # compile a TensorRT-LLM engine (replica carries config + host + GPUs used to build)
    START = "start"  # launch a replica on host/gpu_indices
    DRAIN = "drain"  # stop routing new requests to a replica; it finishes in-flight work
    STOP = "stop"  # terminate a (drained) replica


@dataclass(frozen=True)
class Replica:
    replica_id: str
    config: ConfigKey
    host: str
    gpu_indices: tuple[int, ...]
    state: ReplicaState
    port: int | None = None
    since_s: float | None = None  # when the replica entered `state` (epoch seconds); None: unknown


@dataclass(frozen=True)
class HostInventory:
    name: str
    gpu: GpuType
    gpu_count: int
    # GPUs that share an NVLink domain; a TP group must sit inside one. Empty: the host is one group
    # (PCIe-only hosts such as L40S, where TP runs over PCIe).
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    online: bool = True
    # GPUs busy with something the plan does not place (an engine build, an engine still stopping):
    # new replicas avoid them (planner/act.py held_gpus; the controller would defer a start there)
    held_gpus: tuple[int, ...] = ()

    def groups(self) -> tuple[tuple[int, ...], ...]:
        if self.nvlink_groups:
            return self.nvlink_groups
        return (tuple(range(self.gpu_count)),)


@dataclass(frozen=True)
class EngineBuild:
    """A TensorRT-LLM engine build (ready = cached and usable on every host of that GPU type)."""

    model: str
    engine: Engine
    gpu: GpuType
    tp: int
    precision: Precision
    host: str | None = None
    ready: bool = False
    eta_s: float | None = None  # epoch seconds when an in-progress build is expected to finish
    gpu_indices: tuple[int, ...] = ()  # GPUs of `host` an in-progress build occupies (kept free)

    def config(self) -> ConfigKey:
        return ConfigKey(self.model, self.engine, self.gpu, self.tp, self.precision)


@dataclass(frozen=True)
class Fleet:
    hosts: tuple[HostInventory, ...] = ()
    replicas: tuple[Replica, ...] = ()
    builds: tuple[EngineBuild, ...] = ()


@dataclass(frozen=True)
class ConfigObservation:
    """What one serving configuration of a model did over the observation window: the evidence the
    online correction compares with the profile (planner/correction.py)."""

    config: ConfigKey
    ready_replicas: int  # READY replicas of this config that served in the window
    rate_rps: float | None  # requests per second over those replicas together
    ttft_p99_ms: float | None
    itl_p99_ms: float | None  # per-request mean inter-token time, p99 over requests
    requests: float = 0.0  # completions behind the quantiles (how much evidence the window holds)
    # the bounds (lo, hi) in ms of the histogram bucket holding each p99: the true p99 is inside them
    # (hi = inf: the +Inf bucket). A range with no p99 value is an upper bound (the lowest bucket).
    # None: unknown (e.g. a replay that gives only the point value)
    ttft_p99_range_ms: tuple[float, float] | None = None
    itl_p99_range_ms: tuple[float, float] | None = None
    # the p99's sampling interval (lo, hi) in ms: what a window of as many requests of the same traffic
    # would read, from the quantiles 2 standard deviations of the p99's rank away (planner/evidence.py
    # _p99_ms); wide on a heavy tail. None: unknown (the correction assumes a typical window's noise)
    ttft_p99_sampling_ms: tuple[float, float] | None = None
    itl_p99_sampling_ms: tuple[float, float] | None = None


@dataclass(frozen=True)
class ModelObservation:
    model: str
    rate_rps: float | None = None
    isl: float | None = None  # mean prompt tokens
    osl: float | None = None  # mean output tokens
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    history: tuple[tuple[float, float], ...] = ()  # (t_s, rps) samples, oldest first; may be empty
    # incomplete reading (a scrape target down, a rate window not yet full, no series): no scale-DOWN
    # on it; its rate_rps, when given, is a lower bound that can still raise capacity (core._demands)
    stale: bool = False
    # the length distribution: ((q, tokens), ...) from the engines' prompt/generation-length
    # histograms; empty: only the means are known
    isl_quantiles: tuple[tuple[float, float], ...] = ()
    osl_quantiles: tuple[tuple[float, float], ...] = ()
    configs: tuple[ConfigObservation, ...] = ()  # per serving config, where the engines export it
    peak_rps: float | None = None  # the highest short-window rate within the window (bursts)
    peak_window_s: float = 15.0  # the short window peak_rps is measured over (one scrape interval)
    # the window each `history` rate was read over (s): their Poisson count noise (planner/forecast.py);
    # None: unknown (the forecast then takes the samples' scatter as it is)
    history_window_s: float | None = None
    # the window `rate_rps` was read over (s): its Poisson count noise, the scale-down band
    # (planner/scale_down.py); None: unknown (the band then takes `history_window_s`, else its floor)
    rate_window_s: float | None = None
    # the lowest prompt-length p99 the engines' histogram allows (planner/evidence.py): a coarse
    # bucket is no evidence of long prompts (capacity.extrapolation); None: unknown
    isl_p99_low: float | None = None
    # the share of prompt tokens served from the engines' prefix caches over the window (their
    # prefix-cache counters, planner/prefix.py); None: unknown (the plan assumes none)
    prefix_hit_rate: float | None = None
    # the model's TTFT and per-request TPOT histograms over the window, every replica's summed
    # (cumulative (le seconds, rate) pairs): the share of requests that missed the SLO
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    tpot_buckets: tuple[tuple[float, float], ...] = ()


def _empty_models() -> Mapping[str, ModelObservation]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Observation:
    models: Mapping[str, ModelObservation] = field(default_factory=_empty_models)
    alerts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Correction:
    """The engine speed of one config relative to its profile, learned from observed latency.

    Per latency (TTFT, ITL): the estimate of ln(speed) and its variance (a Kalman filter in log
    space; planner/correction.py). speed < 1: the engine is slower than the profile says, every
    duration is 1/speed longer, and the capacity at the SLO is lower.
    """

    config: ConfigKey
    ttft_log: float = 0.0
    ttft_var: float = 0.0
    itl_log: float = 0.0
    itl_var: float = 0.0
    observations: int = 0  # windows that updated it
    since_s: float | None = None  # since when it has moved the capacity by more than 5% (epoch s)
    updated_s: float | None = None  # the last window that updated it (epoch s)
    observed_ttft_speed: float | None = None  # what the last window alone said
    observed_itl_speed: float | None = None
    applied_ttft_log: float = 0.0  # ln(speed) the plan uses (the estimate, with hysteresis)
    applied_itl_log: float = 0.0
    # the fleet's own regression: the last few windows' (load per replica rps, ln speed, completions)
    # per latency, oldest first (planner/correction.py MAX_POINTS): how the speed moves with load
    ttft_points: tuple[tuple[float, float, float], ...] = ()
    itl_points: tuple[tuple[float, float, float], ...] = ()
    # the SLO's verdict on the windows of the SLO's period, oldest first: (t_s, load per replica rps,
    # missed) of each window whose p99s were clearly within the targets (False) or beyond them (True):
    # where the replicas miss, whatever the profile's shape says (planner/knee.py knee_load)
    slo_windows: tuple[tuple[float, float, bool], ...] = ()
    # (t_s, load per replica rps, TTFT p99 ms, the low end of its sampling interval ms) of the SLO
    # period's windows, oldest first: the replicas' own queue, which bounds a profile used outside its
    # data (planner/knee.py queue_knee)
    ttft_windows: tuple[tuple[float, float, float, float], ...] = ()


@dataclass(frozen=True)
class HeldLengths:
    """The length mix of a model's last reading that showed one (planner/lengths.py): what the plan
    keeps using while the readings show none (stale, idle) instead of falling back to the policy's
    `workload`. `t_s`: when it was read (epoch s)."""

    model: str
    t_s: float
    isl: float | None = None
    osl: float | None = None
    isl_quantiles: tuple[tuple[float, float], ...] = ()
    osl_quantiles: tuple[tuple[float, float], ...] = ()
    isl_p99_low: float | None = None


@dataclass(frozen=True)
class PlannerState:
    """What the planner carries from one cycle to the next (a value: plan() returns the next one).

    surplus_since_s: per config, when its count first exceeded what the plan needed (epoch s);
    a scale-down of that config happens only after policy.scaling.scale_down_delay_s.
    """

    surplus_since_s: tuple[tuple[ConfigKey, float], ...] = ()
    cycle: int = 0
    corrections: tuple[Correction, ...] = ()  # per config, from observed latency (planner/correction.py)
    # (model, t_s, a burst's excess rps over its window's mean, that mean rps), recent (planner/demand.py)
    bursts: tuple[tuple[str, float, float, float], ...] = ()
    lengths: tuple[HeldLengths, ...] = ()  # per model, the last length mix a reading showed
    budget: tuple[BudgetSlice, ...] = ()  # per model, the SLO's ledger over its period (planner/slo.py)
    # the stage-1 problems last solved and their solutions (planner/solve_memo.py): a memo, not a
    # decision: left out of the state's repr, equality and its stored form
    solves: tuple[Solved, ...] = field(default=(), repr=False, compare=False)

    @staticmethod
    def initial() -> PlannerState:
        return PlannerState()

    def surplus_map(self) -> dict[ConfigKey, float]:
        return dict(self.surplus_since_s)

    def correction_map(self) -> dict[ConfigKey, Correction]:
        return {c.config: c for c in self.corrections}


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    replica: Replica  # for BUILD: the build's config + host + GPUs it builds on
    reason: str
    # START: it needs GPUs a replica leaving this cycle still holds (launches once that one stops)
    after_stop: bool = False
    # DRAIN: the model's READY capacity without this replica still covers its required rate, so it
    # need not wait for the replacements still starting (make-before-break, planner/core.py)
    covered: bool = False
    # START: the hosts it may move to when its GPUs are still held (None: any host of its GPU type):
    # those that hold its config's built engine, where only some do (planner/core.py _engine_hosts)
    hosts: frozenset[str] | None = None


@dataclass(frozen=True)
class ConfigCount:
    config: ConfigKey
    replicas: int
    capacity_per_replica_rps: float
    usd_h: float  # all replicas of this config


@dataclass(frozen=True)
class Plan:
    replicas: tuple[Replica, ...]
    counts: tuple[ConfigCount, ...]
    gpus: int
    usd_h: float


@dataclass(frozen=True)
class ConfigExplanation:
    config: ConfigKey
    replicas: int
    capacity_per_replica_rps: float  # max rps at the model's SLO for the observed ISL/OSL mix
    binding: str  # what limits one replica: ttft | itl | memory
    load_per_replica_rps: float  # planned share of the demand
    predicted_ttft_p99_ms: float | None  # at the planned load; None: no profile prediction
    predicted_itl_p99_ms: float | None
    usd_h: float
    # the evidence behind capacity_per_replica_rps (planner/correction.py)
    profile_capacity_rps: float | None = None  # what the profile alone says for the length mix
    capacity_factor: float = 1.0  # capacity_per_replica_rps / profile_capacity_rps
    correction: str = ""  # e.g. "TTFT x0.62 speed (4 windows, since 2026-01-05T00:12Z)"; "": none
    extrapolating: tuple[str, ...] = ()  # why the profile is used outside its data
    observed_ttft_p99_ms: float | None = None  # this config's replicas, last window
    observed_itl_p99_ms: float | None = None
    observed_rps_per_replica: float | None = None
    # the share of requests within the SLO the corrected profile predicts at the planned load, what
    # the last of these replicas adds to it (the share at n replicas minus at n - 1; None: n < 2 or
    # unknown), and the share an idle replica reaches when a target's p99 is out of its reach
    predicted_attainment: float | None = None
    last_replica_attainment: float | None = None
    floor_share: float | None = None
    # the load per replica at which these replicas missed the SLO within the period: capacity_per_replica_rps
    # is held to it (planner/knee.py); None: no such load shown
    knee_rps: float | None = None


class LossReason(StrEnum):
    """Why an allowed config is not in the plan (planner/counterfactual.py)."""

    COST = "cost"  # it alone costs more $/h than the chosen plan
    # not dearer in $/h, but another term of the solver's objective outweighs it:
    TIE = "tie"  # the tie-break for spare capacity
    LEAD_TIME = "lead_time"  # the startup penalty of its new replicas
    CHURN = "churn"  # the churn penalty per replica started/stopped (or held: scale-down delay, fail static)
    BUILD_PENDING = "build_pending"  # cheaper, but its TensorRT-LLM engine is not built yet
    INVENTORY = "inventory"  # not enough usable GPUs of its type / TP groups (or the type is absent)
    BUDGET = "budget"  # would exceed the budget (max_gpus / max_usd_h) left by the other models
    MAX_REPLICAS = "max_replicas"  # needs more replicas than the model's max_replicas
    SLO = "slo"  # no capacity at the model's SLO (or no profile for it)


class FlipSide(StrEnum):
    ABOVE = "above"  # the alternative is cheaper at loads above flip_rps
    BELOW = "below"  # ... below flip_rps


@dataclass(frozen=True)
class Alternative:
    """The best plan for one allowed config the model did not choose: that config alone."""

    config: ConfigKey
    reason: LossReason
    replicas: int | None  # None: no capacity at the SLO
    capacity_per_replica_rps: float | None
    usd_h: float | None  # of `replicas`; None: no capacity
    detail: str
    flip_rps: float | None = None  # demand (rps) at which the $/h order flips; None: not in range
    flip_side: FlipSide | None = None
    cheaper_from_rps: float | None = None  # the demand range, nearest today, where it is cheaper
    cheaper_to_rps: float | None = None  # None with cheaper_from_rps set: up to the inventory limit


@dataclass(frozen=True)
class Relaxation:
    """Re-solve of the plan's count problem with one binding constraint relaxed by one step."""

    constraint: str  # e.g. "max_replicas llama-3-70b", "inventory h100", "budget max_gpus", "slo llama-3-8b"
    step: str  # e.g. "+1 replica", "+1 host (8 GPUs)", "SLO +10%"
    model: str | None  # the model it concerns; None: fleet-wide
    usd_h_before: float
    usd_h_after: float
    unmet_rps_before: float
    unmet_rps_after: float
    detail: str


@dataclass(frozen=True)
class ModelPools:
    """A model's disaggregated prefill and decode pools in the plan, and the comparison that chose
    them (planner/disagg_plan.py): the cheapest aggregated fleet and the cheapest pair of pools alone
    at the plan's demand, and the nearest points where the other would win (None: none in range)."""

    prefill: tuple[ConfigCount, ...]
    decode: tuple[ConfigCount, ...]
    capacity_rps: float  # what the pools carry together: per family the weaker pool's capacity
    aggregated_usd_h: float | None  # the cheapest aggregated fleet alone (None: no aggregated config)
    pair_usd_h: float | None  # the cheapest pair of pools alone (None: no pair)
    flip_rate_rps: float | None  # the demand at which aggregated serving would win
    flip_isl_scale: float | None  # the factor on every prompt's length at which it would
    flip_link_gb_s: float | None  # the KV link line rate (GB/s per GPU) at which it would
    link_gb_s: float  # the link the pools' capacities assume (the hosts' own: NVLink or PCIe)
    # prefill replicas of the plan placed on a host with a decode replica of their family (their KV
    # moves over the host's link); the others' KV moves over the network (planner/placement.py)
    paired_prefill: int

    def replicas(self) -> tuple[int, int]:
        return sum(c.replicas for c in self.prefill), sum(c.replicas for c in self.decode)

    def ratio(self) -> str:
        """prefill:decode replicas, e.g. '6:1'."""
        p, d = self.replicas()
        return f"{p}:{d}"


@dataclass(frozen=True)
class ModelExplanation:
    model: str
    observed_rps: float | None
    forecast_rps: float | None
    demand_rps: float  # what the plan serves (max of observed and forecast, or the fail-static floor)
    headroom: float
    required_rps: float  # demand x (1 + headroom)
    capacity_rps: float  # planned (now)
    target_capacity_rps: float  # after pending builds
    unmet_rps: float  # required - capacity when the plan is short (best effort), else 0
    slo_ttft_p99_ms: float
    slo_itl_p99_ms: float
    usd_h: float
    configs: tuple[ConfigExplanation, ...]
    notes: tuple[str, ...]  # fail static, forecast method, lead-time fallback, ...
    length_mix: str = ""  # the ISL/OSL mix capacity was computed for
    alternatives: tuple[Alternative, ...] = ()  # the allowed configs not chosen (planner/counterfactual.py)
    # $/h spent above the fleet the corrected profiles would need with no uncertainty left, and why
    # (planner/uncertainty.py); None: not computed
    uncertainty_usd_h: float | None = None
    uncertainty_why: tuple[str, ...] = ()
    # the share of the last window's requests that missed the SLO (TTFT or ITL), as the engines'
    # histograms bound it: (at least, at most); None: no histogram observations
    observed_missed_share: tuple[float, float] | None = None
    # the SLO over its rolling period from the budget ledger (planner/slo.py): good share, budget left;
    # None: no request counted yet
    error_budget: ErrorBudget | None = None
    fail_static: bool = False  # its demand is unknown (no, stale or partial readings): never scaled down
    pools: ModelPools | None = None  # disaggregated pools in the plan (None: aggregated replicas only)
    # replicas kept above the demand's need until they are proven (never drained before): a scale-down
    # is due when their time ends, whatever the demand does
    held_unproven: tuple[str, ...] = ()


@dataclass(frozen=True)
class SolverReport:
    stage: str  # "counts" | "placement"
    backend: str  # e.g. "cp-sat", "greedy"
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | ...
    objective: float | None
    best_bound: float | None
    gap: float | None  # relative (objective - bound) / max(|objective|, 1e-9)
    wall_s: float  # as reported by the solver itself (planner reads no clock)


@dataclass(frozen=True)
class Explanation:
    models: tuple[ModelExplanation, ...]
    binding_constraints: tuple[str, ...]  # e.g. "inventory h100: 64/64 GPUs", "budget usd_h: 120/120"
    solver: tuple[SolverReport, ...]
    objective: float | None
    gap: float | None
    solve_s: float  # sum of the solvers' own wall times
    usd_h: float
    target_usd_h: float
    notes: tuple[str, ...]
    relaxations: tuple[Relaxation, ...] = ()  # what relaxing a binding constraint one step does



@dataclass(frozen=True)
class PlanResult:
    plan: Plan  # the replicas to run now
    target: Plan  # what the plan converges to once pending engine builds are ready
    next_state: PlannerState
    explanation: Explanation
    actions: tuple[Action, ...]
    deferred_actions: tuple[Action, ...] = ()  # beyond max_actions_per_cycle or the scale-down delay
