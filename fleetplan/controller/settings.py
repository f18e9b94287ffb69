"""The controller's own settings file (`--config`, YAML; the policy is a separate file)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.routing import HEADER_RE, RoutingError, validate_endpoint

MAX_RANGE_POINTS = 11_000  # Prometheus refuses a range query of more points per series


class PoolProxySettings(BaseModel):
    """The pool proxy in front of disaggregated models' prefill and decode pools (`fleetplan
    pool-proxy`, controller/pool_proxy.py): the controller writes its upstreams file and puts its
    address in a pooled model's nginx upstream."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    upstreams_path: Path  # the proxy's --upstreams file (written atomically by the controller)
    address: str  # host:port nginx sends a pooled model's requests to (where the proxy listens)
    # wall seconds the controller waits for the proxy to serve a new table (its /health generation)
    # before a model's upstream gets the proxy; past it the model's pools are not routed (alert)
    load_timeout_s: float = Field(default=5.0, gt=0)

    @field_validator("address")
    @classmethod
    def _address_valid(cls, v: str) -> str:
        try:
            return validate_endpoint(v)
        except RoutingError as exc:
            raise ValueError(str(exc)) from None


class RoutingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nginx_upstreams_path: Path | None = None
    nginx_reload_command: tuple[str, ...] | None = None  # argv, e.g. ["nginx", "-s", "reload"]
    endpoints_path: Path | None = None
    file_sd_path: Path | None = None
    # the router's front (e.g. http://127.0.0.1:8080): probed every cycle at /-/fleetplan/routing
    # (down: alert, fleetplan_router_up 0; back: the routing table re-applied)
    router_url: str | None = None
    # model -> a request header carrying a session/conversation id (e.g. X-Session-Id): nginx hashes
    # it on a consistent-hash ring so a conversation's turns reach the replica holding its prefix
    # cache (controller/routing.py); models not named: least_conn
    affinity_headers: dict[str, str] = Field(default_factory=dict)
    # the pool proxy of disaggregated models (None: a policy allowing pools is refused)
    pool_proxy: PoolProxySettings | None = None

    @field_validator("affinity_headers")
    @classmethod
    def _headers_valid(cls, v: dict[str, str]) -> dict[str, str]:
        for model, header in v.items():
            if not HEADER_RE.match(header):
                raise ValueError(f"affinity header {header!r} for model {model!r}: expected letters, digits "
                                 "and '-' (e.g. X-Session-Id)")
        return v


class RetentionSettings(BaseModel):
    """How long the state store keeps its history and how large it may grow
    (controller/state_retention.py; what the reports, audit and brakes need is always kept)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keep_days: float = Field(default=7.0, gt=0)  # decisions, actions, cycles, acks, cleared alerts
    keep_plans_days: float = Field(default=1.0, gt=0)  # plan and observation documents
    max_mb: float = Field(default=1024.0, gt=0)  # live size of the database file, MiB
    rows_per_cycle: int = Field(default=2000, ge=1)  # deleted per cycle at most, 200 per transaction


class ControllerSettings(BaseModel):
    """The controller's own config (YAML, `--config`); the policy is a separate file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_url: str = "http://127.0.0.1:9090"
    mqtt: MqttSettings = MqttSettings()
    routing: RoutingSettings = RoutingSettings()
    retention: RetentionSettings = RetentionSettings()
    lab_dir: Path | None = None  # take Prometheus, MQTT, nginx and paths from a lab's lab.json
    host_addresses: dict[str, str] = Field(default_factory=dict)  # host -> address engines listen on
    default_host_address: str | None = None  # None: the host name itself
    default_port_range: tuple[int, int] = (8100, 8199)
    ack_timeout_s: float = Field(default=10.0, gt=0)  # wall seconds
    ready_timeout_s: float = Field(default=600.0, gt=0)  # wall seconds
    drain_timeout_s: float = Field(default=120.0, gt=0)  # wall seconds
    stop_deadline_s: float = Field(default=30.0, gt=0)  # SIGTERM: the current step finishes within this
    drain_settle_s: float = Field(default=1.0, ge=0)  # after the reload, before trusting "0 running"
    drain_poll_s: float = Field(default=0.5, gt=0)
    host_offline_grace_s: float = Field(default=60.0, ge=0)  # wall; an agent gone longer = host offline
    observe_window_s: float = Field(default=60.0, gt=0)  # wall seconds of rate() windows
    # bursts: the highest completion rate over sub-windows this long within the rate window (wall
    # seconds; at least two scrape intervals)
    peak_window_s: float = Field(default=30.0, gt=0)
    # the request-length histograms' window (wall seconds): a p99 needs a few hundred requests
    length_window_s: float = Field(default=600.0, gt=0)
    # request-rate history for the forecast (wall seconds), in steps of 30 s as the replay
    # (`fleetplan evaluate`) reads it: the forecast's level, trend and margin come from the last
    # hour's samples, and 5-minute steps (the default until issue 18) took azure x4 from 99.54% to
    # 97.23% SLO attainment in the replay. One day: 2,880 points per model, as many as the 8 days
    # at 5 minutes were. Daily seasonality needs >= 2 days (history_s: 259200 fits it; 3 days at
    # 30 s is 8,640 points per model and cycle: at 1,000 hosts / 50 models the steady cycle went
    # from 0.39 to 0.73 s and the peak RSS from 179 to 325 MB, docs/controller.md)
    history_s: float = Field(default=86400.0, gt=0)
    history_step_s: float = Field(default=30.0, gt=0)
    cycle_s: float | None = None  # override the policy's scaling.cycle_s (simulated seconds)
    # wall seconds within which each Prometheus query, and the whole observation, must be answered
    # (body included); late: the cycle fails static with an alert naming the query. None: from the
    # cycle period (controller/clocks.py observe_deadlines: the observation half a period, 2-30 s;
    # each query 0.4 of a period, 2-10 s)
    prometheus_query_deadline_s: float | None = Field(default=None, gt=0)
    observe_deadline_s: float | None = Field(default=None, gt=0)
    # the wall clock (the controller's, Prometheus's) moving this much more or less than the
    # monotonic clock between two cycles is a step: alerted, no action on that cycle
    clock_step_tolerance_s: float = Field(default=2.0, gt=0)
    report_token_file: Path | None = None
    # names the token-less report API answers to besides the loopback ones (the Host header; "name"
    # for any port, "name:port" for one), e.g. an /etc/hosts alias used through an SSH tunnel
    report_hosts: tuple[str, ...] = ()
    # report API reads (/api/report, /plan, /metrics, ...): at most this many in flight (beyond: 503
    # + Retry-After), answered at most report_max_rps a second in arrival order (controller/report_gate.py)
    report_max_concurrent: int = Field(default=256, ge=1)
    report_max_rps: float = Field(default=50.0, gt=0)


    @model_validator(mode="after")
    def _history_fits_one_query(self) -> ControllerSettings:
        points = self.history_s / self.history_step_s
        if points > MAX_RANGE_POINTS:
            raise ValueError(f"history_s {self.history_s:g} / history_step_s {self.history_step_s:g} = "
                             f"{points:.0f} points: Prometheus answers at most {MAX_RANGE_POINTS} per range "
                             f"query; raise history_step_s to {self.history_s / MAX_RANGE_POINTS:.0f} or more, "
                             "or shorten history_s")
        return self


class SettingsError(ValueError):
    """A controller config that cannot be read or is not valid; the message names the file, the
    field and the value. The daemon's entry point turns it into its exit; `fleetplan evaluate` and
    the demo into theirs."""


def load_settings(path: str | Path | None) -> ControllerSettings:
    """The controller config at `path` (the defaults when None); SettingsError when it cannot be used."""
    if path is None:
        return ControllerSettings()
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"{p}: cannot read controller config: {exc}") from None
    try:
        return ControllerSettings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if not loc:  # a rule across fields: its message names them
            raise SettingsError(f"{p}: {err['msg'].removeprefix('Value error, ')}") from None
        raise SettingsError(f"{p}: {loc} = {err.get('input')!r}: {err['msg']}") from None
