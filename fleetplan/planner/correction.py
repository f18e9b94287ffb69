"""Online correction: the fleet's own latency corrects the profiles. Pure.

A plan is a hypothesis; the fleet's latency is the evidence. Each cycle, for every serving config
that served requests in the window, the observed TTFT p99 and per-request ITL p99 at the observed
load per replica are compared with what the profile predicts at that load and length mix. What is
estimated is the engine's SPEED relative to the profile (fleetplan.models.mix.speed_from_latency): the time
scale s at which the profile reproduces the observation. s = 0.7 means every duration is 1/0.7
longer than the profile says (another engine version, a heavier mix than the benchmark, prompts
longer than any benchmark); the capacity at the SLO then falls by more than 30%, since the SLO does
not scale.

Per config and per latency, ln(s) is tracked by a Kalman filter (a value and its variance):

- prior: 0 with sd PRIOR_SD (a fitted profile inside its data) or PRIOR_SD_EXTRAPOLATING (a roofline
  prior, or lengths beyond the data); for a config not observed yet while others of its model are,
  their pooled estimate with the variance widened by SHARED_VAR (`shared_prior`: the length mix and
  the benchmark's errors are shared, what a TP or an engine does differently stays doubt). Once a
  config has its own windows, only they count: a TP4 replica's prefill stalls its decode less than a
  TP1 replica's;
- each window: z = ln(s_observed) with variance OBS_VAR + OBS_VAR_PER_REQUEST / n (a p99 of few
  requests is noise; fewer than MIN_REQUESTS completions: no update); drift DRIFT_VAR per cycle keeps
  it learning; the step per cycle is capped (MAX_STEP_DOWN / MAX_STEP_UP): one noisy window never
  swings the fleet; what the plan applies moves only when the estimate leaves a band around it
  (HYSTERESIS_DOWN / _UP), so configs of nearly equal cost do not flip back and forth;
- applied: a slower engine at once (the plan grows now: feedback, not only the forecast), unless
  a recent window held this load or more at the estimate's speed (then once it persists); a faster
  one only as far as the evidence's lower side (mean - UP_TRUST_SD sd), and, while a profile is used outside
  its data and has not yet been confirmed (sd > CONFIRMED_SD), conservatively at mean - 1 sd.

The state (`Correction` per config) is part of PlannerState: the daemon persists it with every plan,
so a restart keeps it. Worked example: a profile 40% optimistic (s = 1/1.4, ln s = -0.34) sizes the
fleet too small; the first window sees saturated replicas (the slowest speed), the step is capped
at -0.35; the next windows, near the true load, measure z ~ -0.34 with gain ~0.4 and keep it there:
from the second cycle on the plan has the true profile's replica count (tests/unit/planner/
test_correction.py holds "within 5 cycles").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fleetplan.models.config_key import Role
from fleetplan.models.mix import LengthMix, speeds_from_latency
from fleetplan.models.profile import PerfProfile
from fleetplan.planner.capacity import MixedWorkload, Speeds, mix_for
from fleetplan.planner.knee import (
    KneeKind,
    floor_note,
    held_floor,
    knee_load,
    knee_note,
    latency_windows,
    queue_knee,
    slo_missed,
    slo_verdict,
    slo_windows,
)
from fleetplan.planner.types import ConfigKey, Correction, ModelObservation

PRIOR_SD = 0.25
PRIOR_SD_EXTRAPOLATING = 0.7
OBS_VAR = 0.25 ** 2  # one window's p99 ratio wanders ~0.3 in ln on real traces (mooncake, azure)
OBS_VAR_PER_REQUEST = 4.0  # / n: a p99 over 100 requests adds 0.04
DRIFT_VAR = 0.02 ** 2
MAX_STEP_DOWN = 0.35  # ln per cycle: at most x0.70
MAX_STEP_UP = 0.25  # ln per cycle: at most x1.28 (2x pessimistic: applied within ~4-6 windows)
ADAPT = 1.0  # share of a surprise beyond its expected size (innovation^2 - S) added as process noise
BUCKET_VAR_CAP = 0.5  # ln^2: the most a p99's bucket width adds to a window's measurement variance
MAX_POINTS = 8  # (load, speed) points per latency kept for the fleet's own regression
MIN_LOAD_SPREAD = math.log(1.15)  # ln: loads closer than this say nothing of a slope
CONFIRMED_SD = 0.2
MIN_REQUESTS = 20.0
NOTABLE = math.log(1.05)  # a correction that moves the speed by more than 5% is "in force"
SPEED_BOUNDS = (math.log(0.1), math.log(10.0))


def _prior_sd(extrapolating: bool) -> float:
    return PRIOR_SD_EXTRAPOLATING if extrapolating else PRIOR_SD


@dataclass(frozen=True)
class _Reading:
    """One window's evidence on one latency, in ln speed."""

    z: float | None  # the p99's point value; None: only a bound (the lowest bucket)
    z_slow: float | None  # at the top of the p99's bucket: the slowest speed the histogram allows
    z_fast: float | None  # at its bottom: the fastest (None: the bucket starts at 0, no bound)
    var: float  # measurement variance: a window's p99 noise, its completions, its bucket's width


def _kalman(mean: float, var: float, rd: _Reading | None, z_prev: float | None = None,
            held_faster: bool = False) -> tuple[float, float]:
    """One window's update of ln speed (mean, variance).

    - a point value: a Kalman step with the reading's variance; a surprise larger than the filter
      expects adds process noise (the engine changed: the filter must follow it, in both directions):
      at once toward a slower engine (SLO first), toward a faster one only when it persists (the
      previous window's reading `z_prev` lay on the same side; None: the first window). A lone
      slower reading at a load a recent window held at the estimate's speed or faster
      (`held_faster`) is not what a slower engine does (latency rises with load): it is averaged
      like a lone faster one; at a load above all of those it is followed at once. Measured
      (issue 18): mooncake with 2x pessimistic profiles read ITL p99 156 ms at 0.51 rps per
      replica after 34 ms at 0.78 (a long prompt's prefill stalled the others' decode) and the
      fleet doubled for two cycles: 10.68 -> 9.90 GPU-h; over 10 mooncake variants 106.2 -> 99.6
      GPU-h, the lowest attainment 99.00% -> 99.08% (docs/evaluate.md). A lone
      surprise toward faster is a noisy window (long context: a window's ITL p99 depends on whether a
      70k-token prefill landed in it, ln speed wanders by 0.4): it widens that reading's variance
      instead, so such windows are averaged, not followed. Measured (issue 18): damping lone
      surprises in both directions saved 12% GPU-h on mooncake but took its attainment to 99.00%;
      toward faster only, 9.06 GPU-h / 99.26%;
      a capped step absorbs only what it applied (the variance shrinks by the gain actually used, so a
      long way to go is not mistaken for certainty); and a reading whose bucket holds the value the
      estimate predicts is no evidence of a slower engine (no step down);
    - only an upper bound on the latency (the lowest bucket): "at least this fast" (a censored
      measurement): it raises an estimate below the bound (by MAX_STEP_UP per window at most, like a
      point value: the coding-like hours' lowest-bucket ITL windows lifted a TensorRT-LLM estimate
      x2 in one cycle, and the fleet shrank into the next burst) and narrows it, never lowers it.
    """
    if rd is None:
        return mean, var
    if rd.z is None:
        if rd.z_slow is None:
            return mean, var
        # a bound moves the estimate no faster than a point value may (MAX_STEP_UP), and a capped
        # step absorbs only the share of the bound's certainty it applied
        up, up_var = _censored(mean, var, rd.z_slow, rd.var)
        step = up - mean
        if step <= MAX_STEP_UP:
            return up, up_var
        return mean + MAX_STEP_UP, var - (var - up_var) * (MAX_STEP_UP / step)
    nu = rd.z - mean
    surprise = max(0.0, nu * nu - (var + rd.var))
    r = rd.var
    if z_prev is None or (nu < 0 and not held_faster) or (z_prev - mean) * nu > 0:
        var += ADAPT * surprise
    else:
        r += surprise
    k = var / (var + r)
    step = k * nu
    if step < 0 and rd.z_slow is not None and rd.z_fast is not None and rd.z_slow <= mean <= rd.z_fast:
        step = 0.0
    step = max(-MAX_STEP_DOWN, min(MAX_STEP_UP, step))
    k_used = step / nu if abs(nu) > 1e-12 else k
    return mean + step, (1.0 - k_used) * var


def _censored(mean: float, var: float, z_min: float, r: float) -> tuple[float, float]:
    """The estimate after "ln speed >= z_min" measured with noise variance r: the variance of the
    normal prior times the probability of the bound (a probit update); the mean moves up toward the
    bound (at most to it: the bound proves no more), never down.

    >>> m, v = _censored(-0.7, 0.49, 0.0, 0.0625)  # a prior at x0.50, a bound saying "at least x1"
    >>> round(m, 2), round(v, 3)
    (0.0, 0.145)
    >>> _censored(0.5, 0.01, 0.0, 0.0625)[0]  # already above the bound: confirmed, not moved
    0.5
    """
    s = math.sqrt(var + r)
    alpha = (mean - z_min) / s
    cdf = 0.5 * math.erfc(-alpha / math.sqrt(2.0))
    lam = -alpha if alpha < -30.0 else math.exp(-0.5 * alpha * alpha) / math.sqrt(2.0 * math.pi) / cdf
    step = min(var / s * lam, max(0.0, z_min - mean))  # up to the bound, never beyond what it proves
    new_var = var * max(0.0, 1.0 - var / (var + r) * lam * (lam + alpha))
    return mean + step, max(new_var, 1e-6)


RELAX_S = 24 * 3600.0  # without evidence a correction relaxes toward the profile (e-folding time)


def _relaxed(mean: float, var: float, prior_var: float, age_s: float) -> tuple[float, float]:
    """The estimate `age_s` after its last evidence: ln(speed) as a mean-reverting process, so a
    config the plan stopped running (after a slow spell: another engine version, a bad host) is
    tried again within a day instead of never; its variance grows back to the prior's. (Applied
    every cycle, it also pulls a steadily observed estimate toward 0 by ~1% of its size: slower
    relaxation would be the same process with a wider prior.)

    >>> m, v = _relaxed(-0.4, 0.01, 0.0625, 12 * 3600.0)
    >>> round(m, 3), round(v, 4)
    (-0.243, 0.0432)
    """
    k = math.exp(-max(age_s, 0.0) / RELAX_S)
    return mean * k, prior_var + (var - prior_var) * k * k


def _reading(prof: PerfProfile, mix: LengthMix, rps: float, p99_ms: float | None,
             range_ms: tuple[float, float] | None, requests: float, *, itl: bool,
             sampling_ms: tuple[float, float] | None = None) -> _Reading | None:
    """One latency's reading in ln speed: the point value, its bucket's bounds, its variance.

    The variance: a window's p99 wanders with the load's fluctuation (OBS_VAR) and with which
    requests the window happened to hold: the p99's sampling interval (`sampling_ms`, planner/
    evidence.py _p99_ms: +-2 sd of its rank) mapped to ln speed, where the histograms give it, else
    OBS_VAR_PER_REQUEST / completions; plus its bucket's width (the value may sit anywhere in it)."""
    # the p99, its bucket's bounds and its sampling interval's ends, inverted together (one pass)
    rng, smp = range_ms or (math.nan, math.nan), sampling_ms or (math.nan, math.nan)
    z, z_slow, z_fast, s_slow, s_fast = _log_speeds(
        prof, mix, rps, (p99_ms, _bound(rng[1]), _bound(rng[0]), _bound(smp[1]), _bound(smp[0])), itl=itl)
    if range_ms is None:
        z_slow = z_fast = None
    elif z is None:
        z_fast = None
    if z is None and z_slow is None:
        return None
    var = OBS_VAR + _sampling_var(s_slow, s_fast, requests)
    if z is not None and z_slow is not None and z_fast is not None:
        var += min((z_fast - z_slow) ** 2 / 12.0, BUCKET_VAR_CAP)  # uniform over the bucket
    return _Reading(z, z_slow, z_fast, var)


def _bound(ms: float) -> float | None:
    """A latency bound (a bucket's edge, a sampling interval's end); None: an open bound (0, NaN, or
    the +Inf bucket)."""
    return ms if math.isfinite(ms) and ms > 0 else None


SAMPLING_VAR_CAP = 1.0  # ln^2: the most a p99's sampling interval adds (a window then counts ~1/16 of a typical one)


def _sampling_var(z_slow: float | None, z_fast: float | None, requests: float) -> float:
    """The variance of a window's p99 from the requests it happened to hold, in ln speed: from the
    ln speeds at its sampling interval's ends where the histograms give them."""
    if z_slow is not None and z_fast is not None:
        return min(((z_fast - z_slow) / 4.0) ** 2, SAMPLING_VAR_CAP)  # +-2 sd
    return OBS_VAR_PER_REQUEST / max(requests, 1.0)


def _evidence(config: ConfigKey, prof: PerfProfile, o: ModelObservation | None,
              w: MixedWorkload | None) -> tuple[_Reading | None, _Reading | None, float] | None:
    """(the TTFT reading, the ITL reading, the load per replica) of this window, or None."""
    if o is None or o.stale or w is None:
        return None
    ev = next((c for c in o.configs if c.config == config), None)
    if ev is None or ev.ready_replicas < 1 or ev.rate_rps is None or ev.requests < MIN_REQUESTS:
        return None
    if not (math.isfinite(ev.rate_rps) and ev.rate_rps >= 0):
        return None
    mix: LengthMix = mix_for(prof, w)
    per_replica = ev.rate_rps / ev.ready_replicas
    r_t = _reading(prof, mix, per_replica, ev.ttft_p99_ms, ev.ttft_p99_range_ms, ev.requests, itl=False,
                   sampling_ms=ev.ttft_p99_sampling_ms)
    r_i = _reading(prof, mix, per_replica, ev.itl_p99_ms, ev.itl_p99_range_ms, ev.requests, itl=True,
                   sampling_ms=ev.itl_p99_sampling_ms)
    if r_t is None and r_i is None:
        return None
    return r_t, r_i, per_replica


def _widened(rd: _Reading | None, factor: float) -> _Reading | None:
    return rd if rd is None or factor == 1.0 else replace(rd, var=rd.var * factor)


def _last_z(points: Sequence[tuple[float, float, float]]) -> float | None:
    return points[-1][1] if points else None


def _held_faster(points: Sequence[tuple[float, float, float]], load: float, mean: float) -> bool:
    """A recent window at this load per replica or a higher one read no slower than the estimate: a
    slower reading now is not (yet) what a slower engine does, since latency rises with load; a
    window at a load above every recent one that held has no such witness.

    >>> _held_faster([(0.78, 0.64, 47.0)], 0.51, 0.6), _held_faster([(0.78, 0.64, 47.0)], 0.9, 0.6)
    (True, False)
    """
    return any(x >= load and z >= mean for x, z, _ in points if math.isfinite(z))


def _points(prev: tuple[tuple[float, float, float], ...], rd: _Reading | None, load: float,
            requests: float) -> tuple[tuple[float, float, float], ...]:
    if rd is None or rd.z is None or not load > 0:
        return prev
    return (*prev, (load, rd.z, requests))[-MAX_POINTS:]


@dataclass(frozen=True)
class _Fit:
    """The weighted regression of ln speed on ln load over the last windows (weights: 1 / the
    variance a window of that many completions is assumed to have)."""

    n: int
    sw: float  # the weights' sum
    xbar: float
    sxx: float
    beta: float  # the slope; 0 when the loads are too close together to show one
    spread: bool  # the loads spread by MIN_LOAD_SPREAD or more
    resid: float  # weighted squared residuals around the line (around the mean without a spread)
    x_top: float
    z_top: float  # the line at the highest load

    @property
    def dof(self) -> int:
        return self.n - (2 if self.spread else 1)


def _fit(points: Sequence[tuple[float, float, float]]) -> _Fit | None:
    pts = [(math.log(x), z, 1.0 / (OBS_VAR + OBS_VAR_PER_REQUEST / max(n, 1.0)))
           for x, z, n in points if x > 0 and math.isfinite(z)]
    if len(pts) < 3:
        return None
    sw = sum(w for _, _, w in pts)
    xbar = sum(x * w for x, _, w in pts) / sw
    zbar = sum(z * w for _, z, w in pts) / sw
    sxx = sum(w * (x - xbar) ** 2 for x, _, w in pts)
    spread = max(x for x, _, _ in pts) - min(x for x, _, _ in pts) >= MIN_LOAD_SPREAD and sxx > 0
    beta = sum(w * (x - xbar) * (z - zbar) for x, z, w in pts) / sxx if spread else 0.0
    resid = sum(w * (z - zbar - beta * (x - xbar)) ** 2 for x, z, w in pts)
    x_top = max(x for x, _, _ in pts)
    return _Fit(len(pts), sw, xbar, sxx, beta, spread, resid, x_top, zbar + beta * (x_top - xbar))


def _line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float, float] | None:
    """The weighted regression of ln speed on ln load: (slope, the slope's standard error, its value
    at the highest load seen, one standard error there); None: fewer than 3 windows or loads too
    close together."""
    f = _fit(points)
    if f is None or not f.spread:
        return None
    scale = max(f.resid / f.dof, 1.0)
    se = math.sqrt(scale * (1.0 / f.sw + (f.x_top - f.xbar) ** 2 / f.sxx))
    return f.beta, math.sqrt(scale / f.sxx), f.z_top, se


MAX_SCATTER = 4.0  # the most the windows' own scatter widens a window's variance (its sd x2)


def scatter(points: Sequence[tuple[float, float, float]]) -> float:
    """How much more the last windows' speeds scatter than a window's assumed variance allows: their
    weighted residual variance (around their mean; around the line on load when their loads spread)
    per degree of freedom, between 1 and MAX_SCATTER; 1 with fewer than 4 windows.

    Why: a window's p99 on long-context traffic depends on whether a 70k-token prefill landed in it
    (ln speed wanders by ~0.6, not the assumed 0.25); a filter told 0.25 reads every such window as
    the engine changing and follows it, and the plan swaps configs on noise (Mooncake long-context:
    TP1 capacity read 0.24-0.98 rps against a true 0.56). Windows that scatter this much are
    weighed as the noise they show (an adaptive measurement variance); steady traffic keeps 1, so a
    profile that is wrong is learned as fast as before.

    >>> scatter([(1.0, -0.3, 300), (1.0, -0.32, 300), (1.0, -0.29, 300), (1.0, -0.31, 300)])  # agree
    1.0
    >>> scatter([(1.0, -0.9, 300), (1.0, 0.3, 300), (1.0, -0.8, 300), (1.0, 0.2, 300)])  # +-0.6
    4.0
    """
    f = _fit(points)
    if f is None or f.n < 4:
        return 1.0
    return min(max(f.resid / f.dof, 1.0), MAX_SCATTER)


def regression_floor(points: Sequence[tuple[float, float, float]]) -> float | None:
    """The fleet's own regression when the speed the profile explains RISES with load: the latency
    moves less with load per replica than the profile says (a load-independent part: prefill stalls
    of long prompts, a slow tokenizer, a network hop), so the lower loads of a larger fleet read as
    an ever slower engine while the latency itself stays put. Replicas that do not lower the latency
    buy no SLO: a slower engine is applied no further than the line at the highest load seen (-1
    standard error), so a miss that capacity does not fix stops growing the fleet. None: no rise
    beyond two standard errors of the slope (a noisy rise must not cap a slower engine: 40%
    optimistic profiles on mooncake fell to 98.97% with any rise taken).

    >>> regression_floor([(1.0, -0.5, 300), (2.0, -0.5, 300), (3.0, -0.5, 300)]) is None  # flat
    True
    >>> round(regression_floor([(0.5, -0.9, 300), (1.0, -0.5, 300), (2.0, -0.1, 300)]), 2)  # -0.1 - 1 se
    -0.35
    """
    line = _line(points)
    if line is None or line[0] <= 2.0 * line[1]:
        return None  # no rise, or one the windows' scatter explains (long context: +-0.4 in ln)
    _, _, top, se = line
    return top - se


def regression_cap(points: Sequence[tuple[float, float, float]]) -> float | None:
    """The fleet's own regression of ln speed on ln load per replica (weighted by completions): when
    the speed the profile explains FALLS with load (the engine slows toward its knee faster than the
    profile says), a speed is trusted only as far as the line says at the highest load seen
    (+1 standard error), not extrapolated to the loads a smaller fleet would carry: the fleet shrinks as
    it shows, window by window, that the higher load holds. This holds for a faster engine and for a
    slower one whose estimate relaxes at low load after the knee was seen (the coding-like hour:
    a replica missed at 6.5 rps read x0.33, windows at 3.2 rps read x0.55 and the fleet stepped back
    down to the load that missed every five minutes). None: no such slope shown (fewer than 3
    windows, loads too close together, or a flat/rising line).

    >>> regression_cap([(1.0, 0.7, 300), (2.0, 0.7, 300), (3.0, 0.7, 300)]) is None  # flat: the shape holds
    True
    >>> round(regression_cap([(1.0, 0.7, 300), (2.0, 0.4, 300), (3.0, 0.22, 300)]), 2)  # 0.22 + 1 se
    0.46
    """
    line = _line(points)
    if line is None or line[0] >= 0:
        return None
    _, _, top, se = line
    return top + se


def update_corrections(
    previous: Mapping[ConfigKey, Correction],
    observations: Mapping[str, ModelObservation],
    profiles: Mapping[ConfigKey, PerfProfile],
    workloads: Mapping[str, MixedWorkload],
    extrapolating: Mapping[ConfigKey, tuple[str, ...]],
    now_s: float,
    slos: Mapping[str, tuple[float, float]] | None = None,
    periods_s: Mapping[str, float] | None = None,
) -> dict[ConfigKey, Correction]:
    """The corrections after this cycle's windows; a config without evidence keeps its estimate,
    and what the plan applies of it relaxes toward the profile (RELAX_S). `slos`: per model its
    (TTFT, ITL) p99 targets in ms, which a slower estimate inside the deadband must explain a miss
    of to be applied (`_slower_shown`), and by which each window's verdict is kept (`knee_load`) for
    the model's SLO period (`periods_s`; None: the last MAX_SLO_WINDOWS); None: the deadband alone."""
    out: dict[ConfigKey, Correction] = dict(previous)
    for config, prof in sorted(profiles.items()):
        extra = bool(extrapolating.get(config))
        var0 = _prior_sd(extra) ** 2
        prev = out.get(config)
        period_s = (periods_s or {}).get(config.model)
        evidence = _evidence(config, prof, observations.get(config.model), workloads.get(config.model))
        if evidence is None:
            if prev is not None and prev.observations and prev.updated_s is not None:
                a_t, a_i = _applied_logs(prev, extra, var0, now_s)
                out[config] = replace(prev, applied_ttft_log=a_t, applied_itl_log=a_i,
                                      slo_windows=slo_windows(prev.slo_windows, None, 0.0, now_s, period_s),
                                      ttft_windows=latency_windows(prev.ttft_windows, None, None, 0.0, now_s, period_s, 0.0))
            continue
        r_t, r_i, load = evidence
        if prev is None or prev.observations == 0:
            prev = shared_prior(config, previous, var0)
        age_s = now_s - prev.updated_s if prev.updated_s is not None else 0.0
        t0, tv0 = _relaxed(prev.ttft_log, prev.ttft_var, var0, age_s)
        i0, iv0 = _relaxed(prev.itl_log, prev.itl_var, var0, age_s)
        t_log, t_var = _kalman(t0, tv0 + DRIFT_VAR, _widened(r_t, scatter(prev.ttft_points)),
                               _last_z(prev.ttft_points), _held_faster(prev.ttft_points, load, t0))
        i_log, i_var = _kalman(i0, iv0 + DRIFT_VAR, _widened(r_i, scatter(prev.itl_points)),
                               _last_z(prev.itl_points), _held_faster(prev.itl_points, load, i0))
        notable = abs(t_log) > NOTABLE or abs(i_log) > NOTABLE
        since = (prev.since_s if prev.since_s is not None else now_s) if notable else None
        ev = next(c for c in observations[config.model].configs if c.config == config)
        nxt = Correction(config, t_log, t_var, i_log, i_var, prev.observations + 1, since, now_s,
                         math.exp(r_t.z) if r_t is not None and r_t.z is not None else None,
                         math.exp(r_i.z) if r_i is not None and r_i.z is not None else None,
                         prev.applied_ttft_log, prev.applied_itl_log,
                         _points(prev.ttft_points, r_t, load, ev.requests),
                         _points(prev.itl_points, r_i, load, ev.requests))
        # a miss the profile predicts at this load (a heavy tail, an overloaded fleet) leaves the
        # estimate near the profile's speed, so only one it does not predict passes the band
        slo = (slos or {}).get(config.model)
        missed = (False, False) if slo is None else (
            slo_missed(ev.ttft_p99_ms, ev.ttft_p99_sampling_ms, slo[0]),
            slo_missed(ev.itl_p99_ms, ev.itl_p99_sampling_ms, slo[1]))
        a_t, a_i = _applied_logs(nxt, extra, var0, now_s, first=prev.observations == 0, missed=missed)
        # a decode replica's TTFT waits on the prefill pool and the transfer: its ITL alone is its own
        own_ttft = config.role is not Role.DECODE
        verdict = None if slo is None else slo_verdict(ev.ttft_p99_ms if own_ttft else None,
                                                       ev.ttft_p99_sampling_ms if own_ttft else None,
                                                       ev.itl_p99_ms, ev.itl_p99_sampling_ms, slo)
        out[config] = replace(nxt, applied_ttft_log=a_t, applied_itl_log=a_i,
                              slo_windows=slo_windows(prev.slo_windows, verdict, load, now_s, period_s),
                              ttft_windows=latency_windows(prev.ttft_windows, ev.ttft_p99_ms if own_ttft else None,
                                                           ev.ttft_p99_sampling_ms, load, now_s, period_s,
                                                           ev.requests))
    return out


def _applied_logs(c: Correction, extra: bool, var0: float, now_s: float, *,
                  first: bool = False, missed: tuple[bool, bool] | None = None) -> tuple[float, float]:
    """What the plan applies of an estimate at `now_s` (relaxed since its last evidence): the
    conservative side while extrapolating, the deadband inside the data, hysteresis on top.
    `missed`: this window's TTFT / ITL p99 missed the SLO beyond its noise (`slo_missed`); None: no
    window this cycle (the estimate relaxes toward the profile, through the band)."""
    age_s = now_s - c.updated_s if c.updated_s is not None else 0.0
    t_log, t_var = _relaxed(c.ttft_log, c.ttft_var, var0, age_s)
    i_log, i_var = _relaxed(c.itl_log, c.itl_var, var0, age_s)
    cand_t = _capped(_applied(t_log, t_var, extra and t_var > CONFIRMED_SD ** 2,
                              _agreement_sd(c.ttft_points, age_s)), c.ttft_points)
    cand_i = _capped(_applied(i_log, i_var, extra and i_var > CONFIRMED_SD ** 2,
                              _agreement_sd(c.itl_points, age_s)), c.itl_points)
    shown_t = missed is not None and _slower_shown(cand_t, missed[0], c.applied_ttft_log)
    shown_i = missed is not None and _slower_shown(cand_i, missed[1], c.applied_itl_log)
    a_t = _hysteresis(None if first else c.applied_ttft_log, _deadband(cand_t, extra or shown_t))
    a_i = _hysteresis(None if first else c.applied_itl_log, _deadband(cand_i, extra or shown_i))
    return a_t, a_i


def _slower_shown(candidate: float, missed: bool, applied: float) -> bool:
    """A slower engine the SLO itself shows passes the deadband: the replicas missed the SLO at a
    load their profile says they hold (the fit error the band allows for does not explain a miss),
    and once applied it stays while the estimate stays slower. The band is for windows that wander
    around a profile that holds; a replica that misses the SLO below its planned capacity is not one
    of them (TensorRT-LLM near its KV-memory limit read TTFT x0.83 = 740 ms against 500 ms for
    20 minutes, inside the band, and the fleet never grew: 92.7% attainment). Only a speed applied
    inside the band (one a miss showed) is held so; an estimate back within NOTABLE of the profile
    falls into the band again, as does one that was applied beyond the band and came back into it."""
    return candidate < -NOTABLE and (missed or -TRUSTED_BAND <= applied < 0.0)


MIN_AGREEMENT_SD = 0.02  # ln: windows agreeing more closely than this still leave this much doubt


def _agreement_sd(points: Sequence[tuple[float, float, float]], age_s: float) -> float | None:
    """How sure the windows themselves make the estimate: the standard error of the mean of the last
    windows' speeds (their own scatter / sqrt(n)), where at least 3 agree and the evidence is fresh.
    The filter assumes every window's p99 wanders OBS_VAR; windows that agree far better than that
    (a steady load, many requests) shrink the doubt to what they show, so after enough windows the
    applied speed approaches the estimate. None: not enough windows (the filter's sd stands)."""
    zs = [z for _, z, _ in points if math.isfinite(z)]
    if len(zs) < 3 or age_s > RELAX_S / 24:
        return None
    mean = sum(zs) / len(zs)
    sd = math.sqrt(sum((z - mean) ** 2 for z in zs) / (len(zs) - 1))
    return max(sd / math.sqrt(len(zs)), MIN_AGREEMENT_SD)


def _capped(applied: float, points: Sequence[tuple[float, float, float]]) -> float:
    """A faster engine no further than the fleet's own regression supports (`regression_cap`); a
    slower one no further than the line at the highest load seen when the latency does not follow
    the load (`regression_floor`), and, when the speed falls with load, no faster than that line
    either (`regression_cap`: an estimate learnt at the knee that relaxes as windows at half the
    load read faster is the same extrapolation to the loads a smaller fleet would carry)."""
    if applied < 0.0:
        floor = regression_floor(points)
        if floor is not None:
            return max(applied, min(floor, 0.0))
        cap = regression_cap(points)
        return applied if cap is None else min(applied, cap)
    if applied == 0.0:
        return applied
    cap = regression_cap(points)
    return applied if cap is None else min(applied, max(cap, 0.0))


# ln: a profile used inside its data is not corrected within its fit error plus a window's p99 noise:
# LOO MAPE of the fitted benchmark profiles is 5-15% on mean latencies (docs/models.md), a p99 fits
# worse, and one window's p99 ratio wanders ~0.3-0.4 in ln at moderate load (mooncake, azure)
TRUSTED_BAND = 0.25


def _deadband(candidate: float, extrapolating: bool) -> float:
    """A profile used inside its data is trusted within its fit error: the p99 of one window moves
    with load fluctuations and sample noise by about that much (docs/models.md: LOO TTFT/ITL errors
    ~10-20%); beyond it, or while extrapolating, the evidence is applied in full.

    Measured (issue 18): narrowing the band where windows agree (2 standard errors) took the demo's
    day from 9.84 to 6.18 GPU-h (its profiles are half the truth: ITL x1.2 over 40 windows) but
    azure with exact profiles from 99.59% to 97.4-98.1% SLO attainment: a window's p99 at moderate
    load reads x1.1-1.2 faster than the profile's p99 there too, and the capacity at the knee does
    not follow. Speed seen at low load does not identify the knee; the band stays.
    """
    if extrapolating or abs(candidate) > TRUSTED_BAND:
        return candidate
    return 0.0


HYSTERESIS_DOWN = 0.04  # ln: a slower engine is applied once the estimate is 4% below what is applied
HYSTERESIS_UP = 0.04  # ln: a faster one once it is 4% above (estimates wander; configs must not flip)


def _hysteresis(applied: float | None, candidate: float) -> float:
    """What the plan applies: the previous value unless the estimate left a band around it, so that
    a wandering estimate does not make the fleet flip between configs of nearly equal cost."""
    if applied is None or candidate < applied - HYSTERESIS_DOWN or candidate > applied + HYSTERESIS_UP:
        return candidate
    return applied


def _log_speeds(prof: PerfProfile, mix: LengthMix, rps: float, observed_ms: Sequence[float | None], *,
                itl: bool) -> list[float | None]:
    """ln speed (clamped to SPEED_BOUNDS) of each observed latency at this load; None where it is
    no latency (None, NaN, <= 0: inf stays, a saturated replica is evidence of a slow engine)."""
    usable = [j for j, ms in enumerate(observed_ms) if ms is not None and not math.isnan(ms) and ms > 0]
    out: list[float | None] = [None] * len(observed_ms)
    try:
        speeds = speeds_from_latency(prof, mix, rps, [float(observed_ms[j] or 0.0) for j in usable], itl=itl)
    except (ValueError, ArithmeticError):
        return out
    for j, s in zip(usable, speeds, strict=True):
        if s is not None:
            out[j] = min(max(math.log(s), SPEED_BOUNDS[0]), SPEED_BOUNDS[1])
    return out


UP_TRUST_SD = 0.5  # a faster engine is trusted up to mean - 0.5 sd (the evidence's lower side)


def _applied(mean: float, var: float, conservative: bool, agreement_sd: float | None = None) -> float:
    sd = math.sqrt(max(var, 0.0))
    if agreement_sd is not None:
        sd = min(sd, agreement_sd)
    if conservative:
        return mean - sd
    return mean if mean <= 0.0 else max(0.0, mean - UP_TRUST_SD * sd)


def applied_speeds(
    corrections: Mapping[ConfigKey, Correction],
    configs: Mapping[ConfigKey, PerfProfile],
    extrapolating: Mapping[ConfigKey, tuple[str, ...]],
    ttft_slo_ms: Mapping[str, float] | None = None,
) -> dict[ConfigKey, Speeds]:
    """The speeds the plan uses per config (absent: the profile as fitted), with a readable note.
    `ttft_slo_ms`: per model its TTFT target, by which a profile outside its data is held to its
    replicas' own queue (`knee.queue_knee`); None: not held."""
    out: dict[ConfigKey, Speeds] = {}
    for config in sorted(configs):
        corr = corrections.get(config)
        extra = bool(extrapolating.get(config))
        if corr is None or corr.observations == 0:
            corr = shared_prior(config, corrections, _prior_sd(extra) ** 2)
            if not extra and corr.ttft_log == 0.0 and corr.itl_log == 0.0:
                continue  # a fitted profile inside its data, no sibling observed: trusted until observed
        conservative_t = extra and corr.ttft_var > CONFIRMED_SD ** 2
        conservative_i = extra and corr.itl_var > CONFIRMED_SD ** 2
        if corr.observations:
            st, si = math.exp(corr.applied_ttft_log), math.exp(corr.applied_itl_log)
        else:
            st = math.exp(_applied(corr.ttft_log, corr.ttft_var, conservative_t))
            si = math.exp(_applied(corr.itl_log, corr.itl_var, conservative_i))
        knee = knee_load(corr.slo_windows)
        held = max((x for _, x, missed in corr.slo_windows if not missed), default=None)
        floor = held_floor(corr.slo_windows)
        # a profile outside its data may read the right speed at the loads seen and still put the knee
        # too far out (its queue grows too slowly): the replicas' own TTFT curve bounds it
        target = (ttft_slo_ms or {}).get(config.model)
        queue = queue_knee(corr.ttft_windows, target) if extra and target is not None else None
        if queue is not None and floor is not None:
            queue = max(queue, floor)  # what the replicas held stands
        kind = KneeKind.MISSES
        if queue is not None and (knee is None or queue < knee):
            knee, kind = queue, KneeKind.QUEUE
        # a profile outside its data (a roofline prior, lengths beyond the benchmark) is no evidence of
        # what a replica carries above the loads it was seen at, whatever speed it is corrected to
        seen_bound = trusted_load(corr)
        unproven = extra and corr.observations > 0 and seen_bound > 0
        if abs(math.log(st)) < 1e-9 and abs(math.log(si)) < 1e-9 and knee is None and not unproven:
            if held is not None:  # the profile as fitted; what it held bounds a sibling's knee
                out[config] = Speeds(held_rps=held, floor_rps=floor)
            continue
        trusted = seen_bound if st > 1.0 or si > 1.0 or unproven else None
        note = describe(corr, st, si, conservative_t or conservative_i)
        if trusted is not None:
            note += (f"; the profile is outside its data: trusted up to {trusted:.2f} rps per replica" if unproven
                     else f"; faster than the profile trusted up to {trusted:.2f} rps per replica")
        if knee is not None:
            note += f"; {knee_note(knee, kind)}"
        elif floor is not None:
            note += f"; {floor_note(floor)}"
        out[config] = Speeds(st, si, note, trusted, knee, held, floor_rps=floor, profile_proven=not unproven,
                             knee_kind=kind)
    return out


TRUST_GROWTH = 2.0  # a faster engine carries at most this x the highest load per replica it was seen at


def trusted_load(corr: Correction) -> float:
    """How much load per replica a correction toward a FASTER engine, or any observed config whose
    profile is used outside its data, is trusted for: TRUST_GROWTH x the highest load per replica
    among its recent windows (0 without any: nothing beyond the profile).
    Why: latency seen at low load says little about the knee (the demo's day: ITL x1.27 seen at
    0.5-1.3 rps per replica made the capacity 2.55 rps, the truth is 1.66); the fleet shrinks as its
    replicas show, window by window, that the higher load holds (2x: a fleet of n replicas may step to n - 1
    for any n >= 2; 1.5x held the demo at 3 replicas where 2 serve, the fixed point n >= 3). A
    profile outside its data has no shape to trust either: benchmark-fitted mooncake (a roofline
    prior for vLLM TP2, 2.1x the truth) read a vLLM TP2 canary's TTFT at 0.33 rps per replica as
    x0.85 of the prior, counted it at 1.84 rps (the truth: 1.06) and moved the fleet onto it, and
    off it again when it missed: 33 starts in a steady hour.

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType("h100"), 4, Precision.BF16)
    >>> trusted_load(Correction(k, itl_points=((0.6, 0.2, 80.0), (1.2, 0.25, 150.0))))
    2.4
    """
    loads = [x for x, _, _ in (*corr.ttft_points, *corr.itl_points) if x > 0]
    return TRUST_GROWTH * max(loads) if loads else 0.0


SHARED_VAR = 0.25 ** 2  # ln^2: how far one config's error may stand from its siblings' (TP, engine)


def shared_prior(config: ConfigKey, corrections: Mapping[ConfigKey, Correction], var0: float) -> Correction:
    """The estimate for a config not observed yet: what the observed configs of its model share
    (their estimates pooled, weighted by 1/variance), its variance the pooled estimate's own (at most
    the prior's, `var0`) widened by how far one config's error may stand from its siblings'
    (SHARED_VAR). Why: the length mix stretches every config of a model alike, and profiles fitted
    from one benchmark err alike (the demo's day: vLLM and TRT-LLM profiles both half the truth;
    benchmark-fitted mooncake: the roofline prior 1.8-2.2x the truth for all four configs), so the
    running config's evidence moves the others; SHARED_VAR keeps what a TP or an engine does
    differently (a TP4 replica's prefill stalls its decode less than a TP1's) as doubt, which the
    plan's conservative side and a canary (planner/explore.py) resolve. The prior's variance is not
    added again: the siblings have measured the shared error it stands for, and a roofline prior's
    (0.7 ln) left an unobserved config at x0.48 of what its siblings showed, out of every plan (the
    azure day at 1M requests: TensorRT-LLM TP4 at 0.0-0.8 rps per replica for seven hours while
    three TP4 replicas, once run, served where two TP8 did). No sibling observed: the prior (0, var0).

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> v = ConfigKey("m", Engine.VLLM, GpuType("h100"), 4, Precision.BF16)
    >>> t = ConfigKey("m", Engine.TRTLLM, GpuType("h100"), 4, Precision.BF16)
    >>> seen = {v: Correction(v, -0.1, 0.01, 0.3, 0.01, observations=18)}
    >>> p = shared_prior(t, seen, 0.0625)
    >>> round(p.ttft_log, 2), round(p.itl_log, 2), round(p.itl_var, 4), p.observations
    (-0.1, 0.3, 0.0725, 0)
    """
    wt = mt = wi = mi = 0.0
    for c, k in corrections.items():
        if c.model != config.model or c == config or k.observations == 0 or c.role is not config.role:
            continue  # a decode pool's ITL has no prefill in it: no sibling of another role speaks for it
        wt += 1.0 / max(k.ttft_var, 1e-6)
        mt += k.ttft_log / max(k.ttft_var, 1e-6)
        wi += 1.0 / max(k.itl_var, 1e-6)
        mi += k.itl_log / max(k.itl_var, 1e-6)
    if wt == 0.0:
        return Correction(config, 0.0, var0, 0.0, var0, 0, None, None)
    # the doubt: the pooled estimate's own (never more than the prior's) plus how far one config may stand
    # from it; the prior's whole variance again would count the profiles' shared error twice
    return Correction(config, mt / wt, min(var0, 1.0 / wt) + SHARED_VAR, mi / wi, min(var0, 1.0 / wi) + SHARED_VAR,
                      0, None, None)


def describe(corr: Correction, ttft_speed: float, itl_speed: float, conservative: bool) -> str:
    """e.g. 'engine speed vs profile: TTFT x0.71, ITL x0.95 (4 windows; since t=...)'."""
    parts = [f"TTFT x{ttft_speed:.2f}", f"ITL x{itl_speed:.2f}"]
    if corr.observations == 0:
        shared = corr.ttft_log != 0.0 or corr.itl_log != 0.0
        src = "not observed yet: " + ("shared from the model's observed configs" if shared else "")
        src += ("; " if shared and conservative else "") + ("conservative while extrapolating" if conservative else "")
    else:
        src = f"{corr.observations} windows"
        if conservative:
            src += ", not yet confirmed: conservative"
    return f"engine speed vs profile: {', '.join(parts)} ({src})"


def corrections_tuple(corrections: Mapping[ConfigKey, Correction]) -> tuple[Correction, ...]:
    return tuple(corrections[c] for c in sorted(corrections))


def forget(corrections: Mapping[ConfigKey, Correction], keep: set[ConfigKey]) -> dict[ConfigKey, Correction]:
    """Corrections of configs the policy still allows (a removed config's evidence is dropped)."""
    return {c: v for c, v in corrections.items() if c in keep}


__all__ = ["applied_speeds", "corrections_tuple", "describe", "forget", "regression_cap", "regression_floor",
           "shared_prior",
           "trusted_load", "update_corrections"]
