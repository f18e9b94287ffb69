"""The policy file: what the operator wants (SLOs, allowed configs, prices, budget, schedules).

Parsed from YAML text with pydantic (extra keys forbidden). Pure: the caller reads the file and
passes its text; `load_policy_text(text, source)` returns a frozen `Policy` or raises `PolicyError`
whose message has one line per problem naming the file, the key path and the offending value.

Schedules are cron-style overrides evaluated with APScheduler 3's CronTrigger on a datetime built
from the `now_s` the caller passes in (the planner never reads the clock).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fleetplan.models.names import (
    Engine,
    GpuType,
    ModelAliases,
    Precision,
    UnknownNameError,
    parse_engine,
    parse_gpu,
    parse_precision,
)
from fleetplan.planner.brakes import BrakeLimits, Mode
from fleetplan.planner.policy_yaml import MAX_POLICY_BYTES as MAX_POLICY_BYTES  # re-exported
from fleetplan.planner.policy_yaml import PolicyError as PolicyError
from fleetplan.planner.policy_yaml import load_policy_yaml as load_policy_yaml
from fleetplan.planner.slo import ObjectiveKind
from fleetplan.planner.types import ConfigKey, HostInventory


def _engine(v: Any) -> Engine:
    if isinstance(v, Engine):
        return v
    try:
        return parse_engine(str(v))
    except UnknownNameError as exc:
        raise ValueError(str(exc)) from None


def _gpu(v: Any) -> GpuType:
    if isinstance(v, GpuType):
        return v
    try:
        return parse_gpu(str(v))
    except UnknownNameError as exc:
        raise ValueError(str(exc)) from None


def _precision(v: Any) -> Precision:
    if isinstance(v, Precision):
        return v
    try:
        return parse_precision(str(v))
    except UnknownNameError as exc:
        raise ValueError(str(exc)) from None


EngineName = Annotated[Engine, BeforeValidator(_engine)]
GpuName = Annotated[GpuType, BeforeValidator(_gpu)]
PrecisionName = Annotated[Precision, BeforeValidator(_precision)]

# Names that reach engines, paths, metric labels and MQTT: a canonical model name is one argv item
# (e.g. "meta-llama/Llama-3.1-8B-Instruct"), the same pattern the wire protocol accepts
# (controller/protocol.py MODEL_PATTERN; controller/routing.py also refuses a trailing '/'): no
# whitespace, shell metacharacters, leading '-', '..' or '//'.
# fullmatch, not match: "$" also matches before a trailing newline.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:+-]{0,199}$"
# aliases are only looked up (other spellings engines report), so a space is allowed: "Llama 3.1 8B"
ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._/:+-]{0,199}$"
# host names are MQTT topic levels (controller/protocol.py HOST_PATTERN): no '/', '+', '#'
HOST_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
_MODEL_RE = re.compile(MODEL_NAME_PATTERN)
_ALIAS_RE = re.compile(ALIAS_PATTERN)
_HOST_RE = re.compile(HOST_NAME_PATTERN)
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

# Upper bounds for values no deployment has: they catch a typo (an extra three zeros) or a value a
# solver or timer cannot represent, before it reaches the planner.
MAX_REPLICAS = 10_000  # per model
MAX_GPUS = 1_000_000
MAX_SLO_TTFT_MS = 3_600_000.0  # 1 h
MAX_SLO_ITL_MS = 60_000.0  # 1 min per token
MAX_SLO_PERIOD_S = 31 * 86_400.0  # an SLO's rolling period: up to a month
MAX_TOKENS = 10_000_000.0  # mean or quantile prompt/output length
MAX_DURATION_S = 366 * 86_400.0  # delays, startup/build times, schedule windows
MAX_USD_H = 1e9
MAX_PRICE_USD_H = 10_000.0  # per GPU-hour


def _model_name(v: str) -> str:
    if not _MODEL_RE.fullmatch(v) or ".." in v or "//" in v or v.endswith("/"):
        raise ValueError("a model name is 1-200 characters of A-Z a-z 0-9 . _ / : + -, starts with a letter "
                         "or digit, has no '..' or '//' and does not end in '/' (it is passed to engines, "
                         "used in paths and routed by nginx)")
    return v


def _alias(v: str) -> str:
    if not _ALIAS_RE.fullmatch(v):
        raise ValueError("an alias is 1-200 characters of A-Z a-z 0-9 space . _ / : + -, starting with a "
                         "letter or digit")
    return v


def _host_name(v: str) -> str:
    if not _HOST_RE.fullmatch(v):
        raise ValueError("a host name is 1-63 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit")
    return v


def _no_control(v: str) -> str:
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in v):
        raise ValueError("control characters (newline, NUL, ...) are not allowed")
    return v


ModelName = Annotated[str, AfterValidator(_model_name)]
AliasName = Annotated[str, AfterValidator(_alias)]  # a canonical name or an alias
HostName = Annotated[str, AfterValidator(_host_name)]
PlainText = Annotated[str, AfterValidator(_no_control)]
Seconds = Annotated[float, Field(ge=0, le=MAX_DURATION_S)]
ReplicaCount = Annotated[int, Field(ge=0, le=MAX_REPLICAS)]


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` in any number is refused ("Input should be a finite number")
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Slo(_Strict):
    """A model's SLO in the ratio form (planner/slo.py): a request is good when its TTFT <= `ttft_ms`
    and its per-request ITL <= `itl_ms`; `objective` of the requests over a rolling `period_s` are
    good. The targets may be written `ttft_p99_ms` / `itl_p99_ms` (the older spelling: targets at a
    99% objective, the default); the attributes keep that name."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    ttft_p99_ms: float = Field(gt=0, le=MAX_SLO_TTFT_MS, validation_alias=AliasChoices("ttft_ms", "ttft_p99_ms"))
    itl_p99_ms: float = Field(gt=0, le=MAX_SLO_ITL_MS, validation_alias=AliasChoices("itl_ms", "itl_p99_ms"))
    objective: float = Field(default=0.99, ge=0.5, lt=1.0)  # the share of good requests
    period_s: float = Field(default=3600.0, ge=60.0, le=MAX_SLO_PERIOD_S)  # rolling
    # the share of good requests below which the plan never goes in any window; None: the objective
    window_floor: float | None = Field(default=None, ge=0.5, lt=1.0)
    kind: ObjectiveKind = ObjectiveKind.PERIOD  # every_window: the objective in each window

    @model_validator(mode="after")
    def _floor_le_objective(self) -> Slo:
        if self.window_floor is not None and self.window_floor > self.objective:
            raise ValueError(f"window_floor {self.window_floor!r} is above the objective {self.objective!r}: "
                             "a window may not have to do better than the period")
        return self

    @property
    def floor(self) -> float:
        """The per-window floor in force: `window_floor`, else the objective."""
        return self.objective if self.window_floor is None else self.window_floor


class AllowedConfigs(_Strict):
    engines: tuple[EngineName, ...] = (Engine.VLLM, Engine.TRTLLM)
    tp: tuple[int, ...] = (1, 2, 4, 8)
    gpus: tuple[GpuName, ...] | None = None  # None: every GPU type the inventory has

    @field_validator("tp")
    @classmethod
    def _tp_positive(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for t in v:
            if t < 1 or t > 64:
                raise ValueError(f"TP size {t} out of range 1..64")
        return v


class WorkloadMix(_Strict):
    isl: float = Field(gt=0, le=MAX_TOKENS)  # mean prompt tokens
    osl: float = Field(gt=0, le=MAX_TOKENS)  # mean output tokens
    # the distribution, as quantiles {q: tokens} (e.g. {0.5: 2400, 0.9: 27000, 0.99: 85000}): p99
    # TTFT is set by the long prompts, so capacity is computed for the mix, not for the mean
    isl_quantiles: dict[float, float] | None = None
    osl_quantiles: dict[float, float] | None = None

    @field_validator("isl_quantiles", "osl_quantiles")
    @classmethod
    def _quantiles(cls, v: dict[float, float] | None) -> dict[float, float] | None:
        if v is None:
            return v
        last = 0.0
        for q in sorted(v):
            if not 0.0 < q < 1.0:
                raise ValueError(f"quantile level {q!r} must be between 0 and 1 (exclusive)")
            if not (math.isfinite(v[q]) and 0 < v[q] <= MAX_TOKENS):
                raise ValueError(f"quantile {q!r}: tokens {v[q]!r} must be a positive number up to {MAX_TOKENS:g}")
            if v[q] < last:
                raise ValueError(f"quantile {q!r}: tokens {v[q]!r} below a lower quantile's {last!r}")
            last = v[q]
        return v

    def isl_quantile_pairs(self) -> tuple[tuple[float, float], ...]:
        return tuple(sorted((self.isl_quantiles or {}).items()))

    def osl_quantile_pairs(self) -> tuple[tuple[float, float], ...]:
        return tuple(sorted((self.osl_quantiles or {}).items()))


class Disaggregation(_Strict):
    """Whether the planner may serve a model with disaggregated prefill and decode pools (a prefill
    pool sized at the TTFT target, a decode pool at the ITL target: planner/disagg_plan.py). Off by
    default: the agents start pools only where the engines' KV connector is set up."""

    allowed: bool = False


class ModelPolicy(_Strict):
    name: ModelName
    aliases: tuple[AliasName, ...] = ()
    slo: Slo
    priority: int = Field(default=1, ge=0, le=100)  # higher = served first when capacity is short
    min_replicas: ReplicaCount = 0
    max_replicas: ReplicaCount | None = None
    allowed: AllowedConfigs = AllowedConfigs()
    precision: PrecisionName = Precision.BF16
    headroom: float = Field(default=0.2, ge=0, le=10)
    workload: WorkloadMix  # default ISL/OSL mix when the observation does not report one
    # draining: the longest request a replica may still be serving (the engines' max output
    # tokens); the drain waits for it at the SLO's pace (planner.act.drain_deadline_s).
    # drain_timeout_s overrides that; neither: the controller's drain_timeout_s setting
    max_output_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    drain_timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    disaggregation: Disaggregation = Disaggregation()

    @model_validator(mode="after")
    def _min_le_max(self) -> ModelPolicy:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class LaunchTemplate(_Strict):
    command: PlainText = Field(min_length=1)
    # placeholders: {model} {hf_model} {tp} {port} {gpu_indices} {precision} {engine_dir}
    args: tuple[PlainText, ...] = ()
    env: Mapping[str, PlainText] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: Mapping[str, str]) -> Mapping[str, str]:
        for name in v:
            if not _ENV_KEY_RE.fullmatch(name):
                raise ValueError(f"environment variable name {name!r} must match [A-Za-z_][A-Za-z0-9_]*")
        return v


class TimeOverride(_Strict):
    model: ModelName | None = None  # None: any model
    gpu: GpuName | None = None  # None: any GPU type
    tp: int | None = Field(default=None, ge=1, le=64)
    seconds: Seconds


class TimeTable(_Strict):
    default_s: Seconds
    overrides: tuple[TimeOverride, ...] = ()

    def lookup(self, model: str, gpu: GpuType, tp: int) -> float:
        best: tuple[int, float] | None = None
        for o in self.overrides:
            if o.model is not None and o.model != model:
                continue
            if o.gpu is not None and o.gpu != gpu:
                continue
            if o.tp is not None and o.tp != tp:
                continue
            specificity = (o.model is not None) * 4 + (o.gpu is not None) * 2 + (o.tp is not None)
            if best is None or specificity > best[0]:
                best = (specificity, o.seconds)
        return self.default_s if best is None else best[1]


class CachedBuild(_Strict):
    model: ModelName
    gpu: GpuName
    tp: int = Field(ge=1, le=64)
    precision: PrecisionName = Precision.BF16


class EnginePolicy(_Strict):
    launch: LaunchTemplate
    startup: TimeTable  # seconds from launch to ready (weights load, warm-up)
    build: TimeTable | None = None  # TRT-LLM engine build seconds; None: no build step (vLLM)
    cached_builds: tuple[CachedBuild, ...] = ()
    engine_dir: PlainText = "/var/lib/fleetplan/engines/{model}-{gpu}-tp{tp}-{precision}"  # built engines
    # names of the agent's allowlisted templates (config/agent*.yaml) the controller asks for;
    # None: the engine's name ("vllm", "trtllm") for launch, "<engine>-build" for builds
    agent_template: str | None = None
    agent_build_template: str | None = None

    @model_validator(mode="after")
    def _placeholders_known(self) -> EnginePolicy:
        known = {"model", "hf_model", "tp", "port", "gpu_indices", "precision", "gpu", "engine", "engine_dir",
                 "replica_id", "host"}
        for text in (self.launch.command, *self.launch.args, *self.launch.env.values(), self.engine_dir):
            for name in re.findall(r"{([^{}]*)}", text):
                if name not in known:
                    raise ValueError(f"unknown placeholder {{{name}}} in {text!r}; known: {sorted(known)}")
        return self


class GpuTypePolicy(_Strict):
    price_usd_h: float = Field(ge=0, le=MAX_PRICE_USD_H)  # per GPU


class HostPolicy(_Strict):
    name: HostName
    gpu: GpuName
    gpu_count: int = Field(ge=1, le=64)
    nvlink_groups: tuple[tuple[int, ...], ...] = ()  # empty: all GPUs of the host form one group

    @model_validator(mode="after")
    def _groups_valid(self) -> HostPolicy:
        seen: set[int] = set()
        for g in self.nvlink_groups:
            for i in g:
                if i < 0 or i >= self.gpu_count:
                    raise ValueError(f"GPU index {i} outside 0..{self.gpu_count - 1}")
                if i in seen:
                    raise ValueError(f"GPU index {i} in two NVLink groups")
                seen.add(i)
        return self

    def inventory(self) -> HostInventory:
        return HostInventory(self.name, self.gpu, self.gpu_count, self.nvlink_groups, True)


class Scaling(_Strict):
    cycle_s: float = Field(default=60.0, gt=0, le=86_400)  # control-loop period
    scale_down_delay_s: Seconds = 600.0  # surplus must persist this long
    max_actions_per_cycle: int = Field(default=8, ge=1, le=MAX_REPLICAS)
    churn_cost_usd_h: float = Field(default=0.5, ge=0, le=MAX_USD_H)  # objective penalty per replica started/stopped
    lead_time_cost_usd_h_per_min: float = Field(default=0.02, ge=0, le=MAX_USD_H)  # per minute of startup of a new replica
    forecast_quantile: float = Field(default=0.9, gt=0, lt=1)
    # exploration (planner/explore.py): the most GPUs one canary replica of a config never measured
    # may use; 0 (the default, opt-in: on the traces measured it did not pay, docs/evaluate.md): never
    explore_max_gpus: int = Field(default=0, ge=0, le=MAX_GPUS)
    # hysteresis (planner/scale_down.py apply_band): a model scales down only when the smaller fleet
    # still covers its required rate x (1 + band), the margin at most half a replica; the band is the
    # rate's Poisson noise over its window, at least this floor; 0: the noise alone
    scale_down_band: float = Field(default=0.1, ge=0, le=1)
    # a replica is not drained before it has served (READY) this long, nor while its config's latency
    # correction settles (planner/scale_down.py); None: max(60 s, its startup time, the rate window)
    min_replica_age_s: Seconds | None = None
    # blast-radius limits (planner/brakes.py; None: no limit): what may change per hour / per cycle
    max_gpus_started_per_hour: int | None = Field(default=None, ge=0, le=MAX_GPUS)
    max_gpus_stopped_per_hour: int | None = Field(default=None, ge=0, le=MAX_GPUS)
    max_drains_per_host_per_cycle: int | None = Field(default=None, ge=0, le=64)
    min_ready_capacity_fraction: float | None = Field(default=None, ge=0, le=1)  # never drained at once

    def brake_limits(self) -> BrakeLimits:
        return BrakeLimits(self.max_gpus_started_per_hour, self.max_gpus_stopped_per_hour,
                           self.max_drains_per_host_per_cycle, self.min_ready_capacity_fraction)


class Budget(_Strict):
    max_gpus: int | None = Field(default=None, ge=0, le=MAX_GPUS)
    max_usd_h: float | None = Field(default=None, ge=0, le=MAX_USD_H)


class SolverSettings(_Strict):
    time_limit_s: float = Field(default=10.0, gt=0, le=3_600)
    relative_gap: float = Field(default=0.005, ge=0, le=1)
    workers: int = Field(default=1, ge=1, le=64)  # CP-SAT: >1 is faster but not bit-for-bit deterministic
    backend: Literal["SCIP", "cp-sat"] = "SCIP"  # stage-1 solver (placement is always exact packing)
    # a limit on the solver's work instead of time_limit_s (planner/counts.py: units of about a second
    # of one core; no clock read): the same plan on a busy machine as on an idle one. None: the clock
    work_limit: float | None = Field(default=None, gt=0, le=3_600)


class ScheduleOverride(_Strict):
    min_replicas: Mapping[AliasName, ReplicaCount] = Field(default_factory=dict)
    max_replicas: Mapping[AliasName, ReplicaCount] = Field(default_factory=dict)
    budget: Budget | None = None
    drain_hosts: tuple[HostName, ...] = ()  # maintenance window: plan nothing on these hosts


class Schedule(_Strict):
    name: PlainText = Field(min_length=1, max_length=200)
    cron: str = Field(min_length=1)  # crontab "min hour day month day_of_week", e.g. "0 8 * * mon-fri"
    duration_s: float = Field(gt=0, le=MAX_DURATION_S)  # the override holds this long after each cron fire time
    override: ScheduleOverride

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, v: str) -> str:
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(v, timezone=UTC)
        except ValueError as exc:
            raise ValueError(f"invalid cron expression: {exc}") from None
        return v


_TZ_RE = re.compile(r"^UTC(?:([+-])(\d{1,2}):(\d{2}))?$")


class Policy(_Strict):
    version: int = 1
    mode: Mode = Mode.ACTIVE  # advisory: plan, report, export metrics, act on nothing
    timezone: str = "UTC"  # UTC or a fixed offset "UTC+02:00" (schedules are evaluated in it)
    gpu_types: Mapping[GpuName, GpuTypePolicy]
    hosts: tuple[HostPolicy, ...] = ()  # used when agents do not report inventory
    models: tuple[ModelPolicy, ...] = Field(min_length=1)
    engines: Mapping[EngineName, EnginePolicy]
    scaling: Scaling = Scaling()
    budget: Budget = Budget()
    solver: SolverSettings = SolverSettings()
    schedules: tuple[Schedule, ...] = ()

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        if not _TZ_RE.match(v):
            raise ValueError("timezone must be 'UTC' or a fixed offset like 'UTC+02:00'")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> Policy:
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate model names: {dup}")
        hosts = [h.name for h in self.hosts]
        duph = sorted({n for n in hosts if hosts.count(n) > 1})
        if duph:
            raise ValueError(f"duplicate host names: {duph}")
        self._lookups()  # raises on conflicting aliases; derived now, so a policy in use never changes
        for m in self.models:
            for e in m.allowed.engines:
                if e not in self.engines:
                    raise ValueError(f"model {m.name!r} allows engine {e.value!r} missing from engines")
            for g in m.allowed.gpus or ():
                if g not in self.gpu_types:
                    raise ValueError(f"model {m.name!r} allows GPU {g.value!r} missing from gpu_types")
        for h in self.hosts:
            if h.gpu not in self.gpu_types:
                raise ValueError(f"host {h.name!r} has GPU {h.gpu.value!r} missing from gpu_types")
        return self

    # ---- helpers used by the planner -------------------------------------------------------
    def _lookups(self) -> tuple[dict[str, ModelPolicy], ModelAliases]:
        """The models by name and their aliases, derived from `models` once, at validation. Why not
        lazily: a policy is pickled by a process pool's feeder thread while the caller goes on using
        it (sim/evaluate.py), and a lookup filled in meanwhile changed its __dict__ under the pickler
        ("dictionary changed size during iteration"). A `model_copy` with other models carries the
        source's entry: it is derived again for the copy's own models (matched by identity)."""
        derived = self.__dict__.get("_derived")
        if derived is None or derived[0] is not self.models:
            derived = (self.models, {m.name: m for m in self.models},
                       ModelAliases.build({m.name: m.aliases for m in self.models}))
            self.__dict__["_derived"] = derived  # frozen fields untouched: a derived value, as a cache
        return derived[1], derived[2]

    def aliases(self) -> ModelAliases:
        return self._lookups()[1]

    def model(self, name: str) -> ModelPolicy | None:
        # a canonical name is its own canonical (ModelAliases.build refuses a clash): skip the
        # spelling key, which a plan at 500 models computed ~10k times (bench/solve_scale.py)
        by_name, aliases = self._lookups()
        m = by_name.get(name)
        return m if m is not None else by_name.get(aliases.canonical(name))

    def price_usd_h(self, gpu: GpuType) -> float | None:
        g = self.gpu_types.get(gpu)
        return None if g is None else g.price_usd_h

    def replica_usd_h(self, config: ConfigKey) -> float | None:
        """$/h of one replica of `config`: its GPU type's price x its TP; None: the type has no price."""
        price = self.price_usd_h(config.gpu)
        return None if price is None else price * config.tp

    def startup_s(self, config: ConfigKey) -> float:
        e = self.engines.get(config.engine)
        return 0.0 if e is None else e.startup.lookup(config.model, config.gpu, config.tp)

    def build_s(self, config: ConfigKey) -> float | None:
        e = self.engines.get(config.engine)
        if e is None or e.build is None:
            return None
        return e.build.lookup(config.model, config.gpu, config.tp)

    def agent_templates(self, *, build: bool = False) -> dict[str, str]:
        """Engine -> the agent template the controller names in a desired replica (or build): the
        policy's `agent_template` / `agent_build_template`; engines without one are absent (the act
        core then uses the engine's name, or "<engine>-build")."""
        out = {}
        for engine, e in self.engines.items():
            name = e.agent_build_template if build else e.agent_template
            if name is not None:
                out[engine.value] = name
        return out

    def needs_build(self, config: ConfigKey) -> bool:
        e = self.engines.get(config.engine)
        return e is not None and e.build is not None

    def cached_configs(self) -> frozenset[ConfigKey]:
        out: set[ConfigKey] = set()
        for engine, e in self.engines.items():
            for b in e.cached_builds:
                out.add(ConfigKey(b.model, engine, b.gpu, b.tp, b.precision))
        return frozenset(out)

    def tzinfo(self) -> dt_timezone:
        m = _TZ_RE.match(self.timezone)
        if m is None or m.group(1) is None:
            return UTC
        sign = 1 if m.group(1) == "+" else -1
        return dt_timezone(sign * timedelta(hours=int(m.group(2)), minutes=int(m.group(3))))


@dataclass(frozen=True)
class Effective:
    """The policy as it applies at one instant, after the active schedules' overrides."""

    min_replicas: Mapping[str, int]
    max_replicas: Mapping[str, int | None]
    budget: Budget
    drain_hosts: frozenset[str]
    active_schedules: tuple[str, ...]


def schedule_active(schedule: Schedule, now_s: float, tz: dt_timezone = UTC) -> bool:
    """True when a cron fire time of `schedule` lies in (now - duration, now]. Pure."""
    from apscheduler.triggers.cron import CronTrigger

    trigger = CronTrigger.from_crontab(schedule.cron, timezone=tz)
    now = datetime.fromtimestamp(now_s, tz)
    start = now - timedelta(seconds=schedule.duration_s)
    fire = trigger.get_next_fire_time(None, start + timedelta(microseconds=1))
    return fire is not None and fire <= now


def effective(policy: Policy, now_s: float) -> Effective:
    """Apply the schedules active at `now_s` (later schedules win over earlier ones)."""
    tz = policy.tzinfo()
    mins: dict[str, int] = {m.name: m.min_replicas for m in policy.models}
    maxs: dict[str, int | None] = {m.name: m.max_replicas for m in policy.models}
    budget = policy.budget
    drain: set[str] = set()
    active: list[str] = []
    aliases = policy.aliases()
    for s in policy.schedules:
        if not schedule_active(s, now_s, tz):
            continue
        active.append(s.name)
        for name, n in s.override.min_replicas.items():
            mins[aliases.canonical(name)] = n
        for name, n in s.override.max_replicas.items():
            maxs[aliases.canonical(name)] = n
        if s.override.budget is not None:
            budget = s.override.budget
        drain.update(s.override.drain_hosts)
    for name in list(mins):
        mx = maxs.get(name)
        if mx is not None and mins[name] > mx:
            mins[name] = mx
    return Effective(mins, maxs, budget, frozenset(drain), tuple(active))


def format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            out += " (key)"
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            text = str(part)
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
                text = repr(text[:40])  # a key with ':', ' = ', quotes or a newline: quoted, one line
            out += ("." if out else "") + text
    return out or "(top level)"


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_policy_dict(data: Any, source: str) -> Policy:
    if not isinstance(data, dict):
        raise PolicyError(source, [f"(top level) = {short_repr(data)}: expected a mapping of policy keys"])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = []
        errors = exc.errors()
        locs = [tuple(e["loc"]) for e in errors]
        for err in errors:
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            if err["type"] == "too_short" and any(o[: len(err["loc"])] == tuple(err["loc"]) and o != tuple(
                    err["loc"]) for o in locs):
                continue  # "at least 1 item" only because the item itself was invalid
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                problems.append(f"{format_loc(loc)}: required key missing")
            elif isinstance(err.get("input"), dict) and err["type"] == "value_error":
                problems.append(f"{format_loc(loc)}: {msg}")
            else:
                problems.append(f"{format_loc(loc)} = {short_repr(err.get('input'))}: {msg}")
        raise PolicyError(source, problems) from None


def load_policy_text(text: str, source: str) -> Policy:
    """Parse and validate a policy YAML document. Raises PolicyError (one line per problem)."""
    return load_policy_dict(load_policy_yaml(text, source), source)
