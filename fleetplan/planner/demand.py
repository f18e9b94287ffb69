"""Per model, the demand a plan serves: the observed rate, its forecast over the lead time, the
short bursts it must absorb, and what fail static leaves of it. Pure.

`model_demands` is step 2 of `planner.core.plan` (see its docstring); the scale-down rules that
read these demands live in planner/scale_down.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fleetplan.planner.forecast import forecast_rate, recent_level_max
from fleetplan.planner.policy import ModelPolicy, Policy
from fleetplan.planner.types import ConfigKey, ModelObservation, Observation, PlannerState

__all__ = ["MAX_PLAUSIBLE_RPS", "POISSON_Z", "Demand", "burst_need_rps", "bursts", "canonical_observations",
           "model_demands", "valid_rps"]

# A rate above this is a broken counter, not demand (no fleet this plans serves a million requests
# per second of one model), and the count model's numbers break down long before 1e300 (SCIP's
# infinity is 1e20, CP-SAT counts milli-rps in int64): such a rate is invalid, i.e. unknown.
MAX_PLAUSIBLE_RPS = 1e6


def valid_rps(rps: float) -> bool:
    return math.isfinite(rps) and 0.0 <= rps <= MAX_PLAUSIBLE_RPS


@dataclass(frozen=True)
class Demand:
    model: str
    observed_rps: float | None
    forecast_rps: float | None
    demand_rps: float
    required_rps: float
    known: bool
    notes: tuple[str, ...]
    hold_rps: float | None = None  # highest rate level over the scale-down delay (None: no history)
    plan_rps: float | None = None  # what the solver sizes for, when above required_rps (hysteresis)
    history: tuple[tuple[float, float], ...] = ()  # the observed rate history, valid samples only
    rate_window_s: float | None = None  # the window observed_rps was read over (None: unknown)
    # replicas kept above what the demand needs only because they are not yet proven (never drained):
    # the plan will shed them when their proving time ends (planner/core.py `_young`)
    held_unproven: tuple[str, ...] = ()



def canonical_observations(observation: Observation, policy: Policy) -> dict[str, ModelObservation]:
    aliases = policy.aliases()
    out: dict[str, ModelObservation] = {}
    for name, obs in sorted(observation.models.items()):
        out[aliases.canonical(name)] = obs
    return out


# the highest of a window's few short-window rates sits about this many Poisson standard deviations
# above the mean on steady traffic: a peak within it is noise, not a burst
POISSON_Z = 3.0


def burst_need_rps(peak_rps: float, window_s: float, ttft_slo_ms: float) -> float:
    """The least capacity that serves a burst within the TTFT SLO: a burst at `peak_rps` for
    `window_s` on capacity C leaves a backlog (peak - C) x window that drains at C; its last request
    waits backlog / C <= SLO  <=>  C >= peak x window / (window + SLO).

    >>> round(burst_need_rps(40.0, 15.0, 1000.0), 2)   # 4x a 10 rps mean, chat SLO: keep ~3.75x
    37.5
    >>> round(burst_need_rps(40.0, 15.0, 15000.0), 2)  # long-context SLO: the queue absorbs half
    20.0
    """
    return peak_rps * window_s / (window_s + ttft_slo_ms / 1000.0)


def bursts(o: ModelObservation | None, m: ModelPolicy, state: PlannerState, now_s: float,
           keep_s: float, level_rps: float, span_s: float) -> tuple[float, tuple[tuple[float, float, float], ...]]:
    """(the capacity that drains the largest burst of the last `keep_s` on top of `level_rps`, this
    model's burst memory for the next state: (t_s, excess rps, the level rps then) per burst).

    A burst stands above the level on both sides within `span_s` (the lead time, a cycle and a rate
    window: what lasts longer is chased like any level): its excess is the highest rate of the last
    `span_s` (the history's samples and this window's short-window peak, each less its Poisson
    noise) over the higher of the rate now and the rate `span_s` before. A step up (the rate stays) and a step down (the
    rate was as high before) leave none. It is remembered as that excess over that rate, not as the
    capacity it needed: a burst rides on the level, and the level moves (a 24 rps peak over an 8 rps
    level comes back over 12 rps as 28). When the level falls below the one it stood over, the excess
    shrinks with the square root of the ratio, as the fluctuation of a sum of independent clients
    does (a tenth of the clients: a third of the excess); it never grows past what was seen. Why: a
    plateau's noise read at 2 rps (+0.2) would otherwise stand whole over the 0.1 rps that follows
    it, for the whole period. A remembered one whose level plus half its excess the rate holds
    `span_s` later was the edge of a ramp, and is dropped.

    >>> m = ModelPolicy.model_validate({"name": "m", "slo": {"ttft_ms": 500, "itl_ms": 50},
    ...                                 "workload": {"isl": 2000, "osl": 30}})
    >>> o = ModelObservation("m", rate_rps=8.0, peak_rps=32.0, peak_window_s=15.0)
    >>> need, mem = bursts(o, m, PlannerState(), 1000.0, 3600.0, 8.0, 150.0)
    >>> round(need, 1), [(t, round(x, 1), lv) for t, x, lv in mem]   # 32 - 3 sd of a 15 s count: 27.6 = 8 + 19.6
    (26.7, [(1000.0, 19.6, 8.0)])
    >>> later = PlannerState(bursts=tuple(("m", t, x, lv) for t, x, lv in mem))
    >>> round(bursts(ModelObservation("m", rate_rps=12.0), m, later, 3000.0, 3600.0, 12.0, 150.0)[0], 1)
    30.6
    >>> round(bursts(ModelObservation("m", rate_rps=2.0), m, later, 3000.0, 3600.0, 2.0, 150.0)[0], 1)  # a quarter of the level: half the excess
    11.4
    >>> bursts(ModelObservation("m", rate_rps=12.0), m, later, 4700.0, 3600.0, 12.0, 150.0)[0]  # past the period
    0.0
    >>> bursts(ModelObservation("m", rate_rps=30.0), m, later, 1200.0, 3600.0, 30.0, 150.0)[0]  # it stayed: a ramp
    0.0
    >>> h = ((800.0, 8.0), (880.0, 8.0), (940.0, 30.0), (970.0, 30.0))  # 60 s rates: a minute at 30 rps
    >>> after = ModelObservation("m", rate_rps=8.0, peak_rps=9.0, history=h, history_window_s=60.0)
    >>> round(bursts(after, m, PlannerState(), 1000.0, 3600.0, 8.0, 150.0)[1][0][1], 1)  # 30 - 3 sd - 8
    19.9
    >>> down = ModelObservation("m", rate_rps=8.0, peak_rps=9.0, history=((800.0, 30.0), (940.0, 30.0)),
    ...                         history_window_s=60.0)
    >>> bursts(down, m, PlannerState(), 1000.0, 3600.0, 8.0, 150.0)  # as high before it: a step down
    (0.0, ())
    """
    rate = o.rate_rps if o is not None and o.rate_rps is not None and valid_rps(o.rate_rps) else None
    known = o is not None and not o.stale and rate is not None
    past = tuple((t, v, lv) for name, t, v, lv in state.bursts if name == m.name and now_s - t < keep_s
                 and valid_rps(v) and valid_rps(lv)
                 and not (known and rate is not None and now_s - t >= span_s and rate >= lv + v / 2.0))
    window_s = o.peak_window_s if o is not None and o.peak_window_s > 0 else None
    if o is not None:
        # a short window's rate of Poisson arrivals scatters by sqrt(rate / window): capacity at the
        # SLO (models/mix.py) is already sized for Poisson arrivals, so only the excess is a burst
        highs = [_less_noise(r, o.history_window_s) for t, r in o.history
                 if now_s - span_s < t <= now_s and valid_rps(r)]
        if o.peak_rps is not None and valid_rps(o.peak_rps) and window_s is not None:
            highs.append(_less_noise(o.peak_rps, window_s))
        level = rate if rate is not None else level_rps
        before = _rate_before(o, now_s - span_s)
        base = max(level, before) if before is not None else level
        top = max(highs, default=0.0)
        if top > base:
            past = (*past, (now_s, top - base, base))
    # a stored level of 0 (a store from before levels were kept): unknown, the excess rides whole
    excess = max((v * min(1.0, math.sqrt(level_rps / lv)) if lv > 0 else v for _, v, lv in past), default=0.0)
    if excess <= 0:
        return 0.0, past
    top = level_rps + excess
    # without a window's length (no observation) the burst is kept whole: no queue absorbs part of it
    return (burst_need_rps(top, window_s, m.slo.ttft_p99_ms) if window_s is not None else top), past


def _less_noise(rps: float, window_s: float | None) -> float:
    """A window's rate less POISSON_Z of its Poisson scatter (the window unknown: as read)."""
    return rps - POISSON_Z * math.sqrt(rps / window_s) if window_s else rps


def _rate_before(o: ModelObservation, edge_s: float) -> float | None:
    """The history's latest rate read at or before `edge_s`; None: no such sample."""
    before = [r for t, r in o.history if t <= edge_s and valid_rps(r)]
    return before[-1] if before else None


def model_demands(observation: Observation, policy: Policy, now_s: float,
             state: PlannerState | None = None) -> tuple[dict[str, Demand], tuple[tuple[str, float, float, float], ...]]:
    """Per model what the plan serves, and the burst memory for the next state."""
    obs = canonical_observations(observation, policy)
    out: dict[str, Demand] = {}
    memory: list[tuple[str, float, float, float]] = []
    for m in policy.models:
        keep_s = max(policy.scaling.scale_down_delay_s, 2 * policy.scaling.cycle_s, m.slo.period_s)
        o = obs.get(m.name)
        notes: list[str] = []
        if o is not None and o.rate_rps is not None and not valid_rps(o.rate_rps):
            notes.append(f"observed rate {o.rate_rps!r} is not a valid rate (negative, not finite or above "
                         f"{MAX_PLAUSIBLE_RPS:g} rps); treated as unknown")
            o = replace(o, rate_rps=None)
        if o is not None and o.peak_rps is not None and not valid_rps(o.peak_rps):
            notes.append(f"observed peak rate {o.peak_rps!r} is not a valid rate; ignored")
            o = replace(o, peak_rps=None)
        if o is not None and not all(map(valid_rps, [r for _, r in o.history])):
            bad = [r for _, r in o.history if not valid_rps(r)]
            notes.append(f"{len(bad)} rate sample(s) in the history are not valid rates (e.g. {bad[0]!r}); "
                         "ignored")
            o = replace(o, history=tuple((t, r) for t, r in o.history if valid_rps(r)))
        known = o is not None and not o.stale and o.rate_rps is not None
        lead = max((policy.startup_s(ConfigKey(m.name, e, g, t, m.precision))
                    for e in m.allowed.engines for g in (m.allowed.gpus or tuple(policy.gpu_types))
                    for t in m.allowed.tp), default=0.0)
        horizon = lead + policy.scaling.cycle_s
        # a burst is what rises and falls back before capacity started for it serves: within the
        # horizon, plus the window a rate is read over (it smears the burst's edges by that much)
        burst_span = horizon + ((o.history_window_s or o.rate_window_s or 0.0) if o is not None else 0.0)
        if not known:
            # Fail static means no scale-DOWN on missing data, not no scaling: the floors keep every
            # running replica of this model (plan_with_capacities), and a stale model's rate, when
            # one was read, is a LOWER BOUND (the targets that are up, a window not yet full:
            # planner/observation.py) that still raises capacity when it exceeds what runs - a lost
            # host is replaced on the evidence that remains. No forecast on it: the history of a
            # window that is filling up ramps towards the true rate and would extrapolate past it.
            why = "no observation" if o is None else ("stale observation" if o.stale else "request rate unknown")
            lower = o.rate_rps if o is not None and o.rate_rps is not None else None
            if lower is None:
                notes.append(f"fail static: {why}; no scale-down for this model")
            else:
                notes.append(f"fail static: {why}; no scale-down for this model; the {lower:.2f} rps read is a "
                             "lower bound: it can raise capacity, never lower it")
            demand = max(0.0, lower or 0.0)
            # the burst memory outlives a stale cycle (a start inside a burst makes the next reading
            # stale), and a stale peak, like the rate, is a lower bound that may raise capacity
            burst, mem = bursts(o, m, state or PlannerState.initial(), now_s, keep_s, demand, burst_span)
            memory.extend((m.name, t, v, lv) for t, v, lv in mem)
            required = demand * (1 + m.headroom)
            if burst > required:
                notes.append(f"bursts: short-window peaks need {burst:.2f} rps of capacity to drain within the "
                             f"TTFT SLO (above {required:.2f}); kept for {keep_s:.0f} s")
                required = burst
            out[m.name] = Demand(m.name, lower, None, demand, required, False, tuple(notes),
                                 history=o.history if o is not None else ())
            continue
        assert o is not None and o.rate_rps is not None
        fc = forecast_rate(o.history, o.rate_rps, now_s, horizon, policy.scaling.forecast_quantile,
                           sample_window_s=o.history_window_s)
        demand = max(o.rate_rps, fc.rate_rps)
        notes.append(f"forecast {fc.method}: q{policy.scaling.forecast_quantile:g} over {horizon:.0f} s "
                     f"= {fc.rate_rps:.2f} rps")
        hold = recent_level_max(o.history, o.rate_rps, now_s, policy.scaling.scale_down_delay_s)
        if hold is not None:
            hold = max(demand, hold + fc.margin_rps)  # what the forecast said at that level
        required = demand * (1 + m.headroom)
        burst, mem = bursts(o, m, state or PlannerState.initial(), now_s, keep_s, demand, burst_span)
        memory.extend((m.name, t, v, lv) for t, v, lv in mem)
        if burst > required:
            # bursts shorter than the lead time cannot be chased: keep what drains them within the SLO
            notes.append(f"bursts: short-window peaks need {burst:.2f} rps of capacity to drain within the "
                         f"TTFT SLO (above demand x (1 + headroom) = {required:.2f}); kept for {keep_s:.0f} s")
            required = burst
        out[m.name] = Demand(m.name, o.rate_rps, fc.rate_rps, demand, required, True, tuple(notes), hold,
                             history=o.history,
                             rate_window_s=o.rate_window_s if o.rate_window_s is not None else o.history_window_s)
    return out, tuple(memory)
