"""Fitting PerfProfiles to benchmark points: least squares on log errors, with a roofline prior.

Every point contributes log(predicted / observed) for each statistic it reports (TTFT and ITL
mean/p50/p99; output throughput for closed-loop and saturation points). The parameters are fitted
in log space (all positive) with scipy's trust-region least squares; a weak pull towards the prior
(the roofline parameters of fleetplan.models.hardware when the architecture is known, else a guess from the
data) keeps parameters the data cannot see at physical values. Its weight is fixed, so it matters
where data are thin and fades as points are added.

Saturated points (offered rate not achieved, `qps=INF`, offline max-throughput runs) only inform the
saturation throughput: their latencies measure the benchmark's backlog, not the server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares, nnls

from fleetplan.models.bench import BenchmarkPoint, LoadKind
from fleetplan.models.profile import (
    ConfigKey,
    DataRange,
    FitError,
    PerfParams,
    PerfProfile,
    closed_loop_capped,
    closed_loop_shift,
    itl_p99_gap,
    kv_capacity_tokens,
    latency_terms,
    memory_x,
    roofline_params,
    work_terms,
)

Array = NDArray[np.float64]

SATURATED_FRACTION = 0.9  # achieved / offered below this: the point is past saturation
_N_PARAMS = 19
_STALL = 15  # itl_stall_weight
_SYNC = 16  # closed_loop_sync
_KV = _N_PARAMS  # log KV-cache tokens
_SYNC_PRIOR = 0.3
_SYNC_START = 0.3
_SYNC_OFF = 1e-6
_SYNC_GAIN = 0.5
_QUEUE_TAIL_PRIOR = 0.5
_GAP_P99_FACTOR_PRIOR = 1.2
_STALL_PRIOR = 1.0
_OFFSET_PARAMS = (8, 10)  # ttft_p99_factor, itl_p99_factor: fitted as log(f - 1), f > 1
_FRACTION_PARAMS = (7, 9, 16, 17)  # ttft/itl_p50_factor (median <= mean), closed_loop_sync, queue_tail: logit
_RHO_CLIP = 0.995
_PRIOR_WEIGHT_ROOFLINE = 0.3
_PRIOR_WEIGHT_GUESS = 0.05
_METRICS = ("ttft_mean", "ttft_p50", "ttft_p99", "itl_mean", "itl_p50", "itl_p99", "output")


class FitFailure(ValueError):
    """No profile can be fitted from the given points (the message says why)."""


SATURATED_TTFT_FACTOR = 5.0  # ... and TTFT this many times the series' lowest: a growing backlog


def _ttft_any(p: BenchmarkPoint) -> float | None:
    for v in (p.ttft_mean_ms, p.ttft_p50_ms, p.ttft_p99_ms):
        if v is not None:
            return v
    return None


def saturation_flags(points: Sequence[BenchmarkPoint]) -> list[bool]:
    """Which points are past saturation: offline/unbounded runs; open-loop runs offered at least 90%
    of the saturation rate measured in their series (a `qps=INF` row); open-loop runs that did not achieve the offered rate AND
    whose TTFT shows a backlog (a short benchmark also falls short of the offered rate while it
    drains its last requests; that alone is no saturation)."""
    lowest: dict[str, float] = {}
    best_rps: dict[str, float] = {}
    for p in points:
        t = _ttft_any(p)
        if t is not None and p.load is not LoadKind.MAX:
            lowest[p.series] = min(lowest.get(p.series, math.inf), t)
        if p.request_rps is not None and p.load is LoadKind.MAX:  # a measured saturation rate
            best_rps[p.series] = max(best_rps.get(p.series, 0.0), p.request_rps)
    flags = []
    for p in points:
        if p.load is LoadKind.MAX:
            flags.append(True)
            continue
        if (p.load is LoadKind.RATE and p.rate_rps is not None
                and p.rate_rps >= SATURATED_FRACTION * best_rps.get(p.series, math.inf)):
            flags.append(True)  # offered at >= 90% of the series' measured saturation rate
            continue
        short = (p.load is LoadKind.RATE and p.rate_rps is not None and p.request_rps is not None
                 and p.request_rps < SATURATED_FRACTION * p.rate_rps)
        t = _ttft_any(p)
        backlog = t is None or t > SATURATED_TTFT_FACTOR * lowest.get(p.series, math.inf)
        flags.append(short and backlog)
    return flags


@dataclass(frozen=True)
class _Data:
    isl: Array
    osl: Array
    mode: Array  # 0 rate, 1 concurrency, 2 saturation
    load: Array  # rate in req/ms, or clients
    obs: Array  # (n, 7) observed, NaN where absent
    gap: Array  # 1.0 where the ITL p99 is over all token gaps (ITL), 0.0 where per request (TPOT)

    def subset(self, idx: Sequence[int] | Array) -> _Data:
        i = np.asarray(idx, dtype=int)
        return _Data(self.isl[i], self.osl[i], self.mode[i], self.load[i], self.obs[i], self.gap[i])

    def has_gap_p99(self) -> bool:
        return bool(np.any((self.gap > 0) & np.isfinite(self.obs[:, 5])))


def _data(points: Sequence[BenchmarkPoint], saturated: Sequence[bool] | None = None) -> _Data:
    n = len(points)
    isl, osl, mode, load = (np.zeros(n) for _ in range(4))
    obs = np.full((n, len(_METRICS)), np.nan)
    gap = np.zeros(n)
    flags = saturation_flags(points) if saturated is None else saturated
    for i, (p, sat) in enumerate(zip(points, flags, strict=True)):
        isl[i], osl[i] = p.isl, max(p.osl, 1.0)
        gap[i] = 1.0 if p.itl_p99_ms is not None else 0.0
        if sat:
            mode[i], load[i] = 2, 0.0
        elif p.load is LoadKind.RATE:
            assert p.rate_rps is not None
            mode[i], load[i] = 0, p.rate_rps / 1000.0
        else:
            assert p.concurrency is not None
            mode[i], load[i] = 1, p.concurrency
        values: list[float | None] = [None] * 6
        if not sat:
            values = [p.ttft_mean_ms, p.ttft_p50_ms, p.ttft_p99_ms,
                      p.itl_like_mean_ms, p.itl_like_p50_ms, p.itl_like_p99_ms]
        out = p.output_tok_s if (sat or p.load is LoadKind.CONCURRENCY) else None
        for j, v in enumerate([*values, out]):
            if v is not None and v > 0:
                obs[i, j] = v
    return _Data(isl, osl, mode, load, obs, gap)


def _params_from_phi(phi: Array) -> tuple[PerfParams, float]:
    """phi: log of the 11 PerfParams (p99 factors as log(f - 1)) and log of the KV-cache tokens."""
    values = np.exp(np.clip(phi, -60.0, 40.0))
    for j in _OFFSET_PARAMS:
        values[j] = 1.0 + values[j]
    for j in _FRACTION_PARAMS:
        values[j] = 1.0 / (1.0 + 1.0 / values[j])
    return PerfParams.from_tuple([float(v) for v in values[:_N_PARAMS]]), float(values[_N_PARAMS])


def _params_for(phi: Array, d: _Data) -> tuple[PerfParams, float]:
    """The fitted parameters; without per-gap ITL p99 in the data the stall term stays off (its
    prior value is only a starting point)."""
    params, kv = _params_from_phi(phi)
    if not d.has_gap_p99():
        params = replace(params, itl_stall_weight=0.0)
    else:
        params = replace(params, itl_p99_load=0.0)
    if not np.any((d.mode == 0) & np.isfinite(d.obs[:, 0:3]).any(axis=1)):
        params = replace(params, queue_tail=0.0)  # no open-loop TTFT: nothing to see the tail
    if params.closed_loop_sync < 1e-3 or not np.any((d.mode == 1) & np.isfinite(d.obs[:, 0:6]).any(axis=1)):
        params = replace(params, closed_loop_sync=0.0)  # off, or no closed-loop latencies to see it
    return params, kv


def _phi_from_params(p: PerfParams, kv_tokens: float) -> Array:
    values = np.array([*p.as_tuple(), kv_tokens], dtype=float)
    for j in _OFFSET_PARAMS:
        values[j] = max(values[j] - 1.0, 1e-3)
    for j in _FRACTION_PARAMS:
        f = min(max(values[j], 1e-3), 0.999)
        values[j] = f / (1.0 - f)
    return np.asarray(np.log(np.maximum(values, 1e-30)), dtype=float)


def _predict_array(params: PerfParams, kv_tokens: float, d: _Data) -> Array:
    """Predicted statistics for every point, shape (n, 7); saturation beyond rho_clip is clipped."""
    isl, osl = d.isl, d.osl
    _, work = work_terms(params, isl, osl)
    x_cap = _RHO_CLIP / work
    b_max = kv_tokens / np.maximum(isl + osl, 1.0)
    x_cap = np.minimum(x_cap, memory_x(params, isl, osl, b_max))
    x_closed, wait = closed_loop_capped(params, isl, osl, np.maximum(d.load, 1e-9), x_cap)
    x = np.where(d.mode == 0, d.load, np.where(d.mode == 1, x_closed, x_cap))
    x = np.minimum(x, x_cap)
    itl, ttft_mean, ttft_p50, ttft_p99, _ = latency_terms(params, isl, osl, x)
    if params.queue_tail > 0.0 and np.any(d.mode == 1):  # the M/M/1 tail is an open-loop shape
        _, _, c50, c99, _ = latency_terms(replace(params, queue_tail=0.0), isl, osl, x)
        ttft_p50 = np.where(d.mode == 1, c50, ttft_p50)
        ttft_p99 = np.where(d.mode == 1, c99, ttft_p99)
    # closed loop near a full KV cache: the clients the batch cannot hold queue for a slot
    queued = np.where(d.mode == 1, np.maximum(wait, 0.0), 0.0)
    if params.closed_loop_sync > 0.0:  # closed loop in waves: prefill moves from the ITL to the TTFT
        itl_wave, moved = closed_loop_shift(params, isl, osl, x, itl)
        itl = np.where(d.mode == 1, itl_wave, itl)
        queued = queued + np.where(d.mode == 1, moved, 0.0)
    out = np.empty((len(isl), len(_METRICS)))
    out[:, 0] = ttft_mean + queued
    out[:, 1] = ttft_p50 + queued
    out[:, 2] = ttft_p99 + queued
    out[:, 3] = itl
    out[:, 4] = itl * params.itl_p50_factor
    out[:, 5] = np.where(d.gap > 0, itl_p99_gap(replace(params, itl_p99_load=0.0), isl, osl, x, itl),
                         itl_p99_gap(replace(params, itl_stall_weight=0.0), isl, osl, x, itl))
    out[:, 6] = x * 1000.0 * osl
    return out


def _guess(points: Sequence[BenchmarkPoint], d: _Data) -> PerfParams:
    """A data-driven starting point when the architecture is unknown (no roofline prior)."""
    itl = d.obs[:, 3:6]
    itl_min = float(np.nanmin(itl)) if np.isfinite(itl).any() else math.nan
    ttft = d.obs[:, 0:3]
    s0 = 0.7 * itl_min if math.isfinite(itl_min) else 20.0
    p_isl = 0.5 * s0 / 100.0
    if np.isfinite(ttft).any():
        j = int(np.nanargmin(np.nanmin(np.where(np.isfinite(ttft), ttft, np.inf), axis=1)))
        t = float(np.nanmin(ttft[j]))
        p_isl = max(0.6 * t / max(d.isl[j], 1.0), 1e-6)
    per_seq = s0 / 100.0
    sat = np.isfinite(d.obs[:, 6]) & (d.mode == 2)
    if sat.any():
        w_obs = d.osl[sat] * 1000.0 / d.obs[sat, 6]
        per_seq_est = (w_obs - p_isl * d.isl[sat]) / np.maximum(d.osl[sat] - 1.0, 1.0)
        per_seq = max(float(np.median(per_seq_est)), 1e-6)
    isl_max = float(max(d.isl.max(), 1.0))
    ctx = float(np.median(d.isl + d.osl / 2.0))
    return PerfParams(
        s0_ms=s0, s1_ms=0.5 * per_seq, s2_ms=0.5 * per_seq / max(ctx, 1.0), p0_ms=s0,
        p1_ms=p_isl, p2_ms=p_isl / (4.0 * isl_max), q=1.0,
    )


def _work_estimate(d: _Data, base: PerfParams) -> PerfParams:
    """Start values for the work terms from saturation throughputs: W = osl/throughput is linear in
    (p0, p1, p2, s1, s2), solved by non-negative least squares in relative terms."""
    sat = np.isfinite(d.obs[:, 6]) & (d.mode == 2)
    if int(sat.sum()) < 2:
        return base
    isl, osl = d.isl[sat], d.osl[sat]
    w_obs = osl * 1000.0 / d.obs[sat, 6]
    cols = np.stack([np.ones_like(isl), isl, isl * isl, osl - 1.0, (isl + osl / 2.0) * (osl - 1.0)], axis=1)
    scale = cols.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(cols / scale / w_obs[:, None], np.ones_like(w_obs))
    coef = coef / scale
    old = base.as_tuple()
    floors = (old[3], old[4], old[5], old[1], old[2])
    p0, p1, p2, s1, s2 = (max(float(c), 1e-3 * f) for c, f in zip(coef, floors, strict=True))
    return PerfParams(base.s0_ms, s1, s2, p0, p1, p2, *old[6:])


def _solve(d: _Data, phi0: Array, prior: Array, weight: Array, max_nfev: int = 400) -> Array:
    mask = np.isfinite(d.obs)
    log_obs = np.log(np.where(mask, d.obs, 1.0))

    def residuals(phi: Array) -> Array:
        pred = _predict_array(*_params_from_phi(phi), d)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.log(pred) - log_obs
        r = np.where(np.isfinite(r), r, 10.0)
        return np.concatenate([r[mask], weight * (phi - prior)])

    result = least_squares(residuals, phi0, method="trf", loss="soft_l1", f_scale=0.5,
                           max_nfev=max_nfev, x_scale=1.0)
    return np.asarray(result.x, dtype=float)


def _cost(d: _Data, phi: Array, prior: _Prior) -> float:
    mask = np.isfinite(d.obs)
    pred = _predict_array(*_params_from_phi(phi), d)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log(pred) - np.log(np.where(mask, d.obs, 1.0))
    r = np.where(np.isfinite(r), r, 10.0)[mask]
    soft = 2.0 * 0.25 * (np.sqrt(1.0 + (r / 0.5) ** 2) - 1.0)  # soft_l1 with f_scale 0.5
    return float(soft.sum() + np.sum((prior.weight * (phi - prior.phi)) ** 2))


def _solve_multistart(d: _Data, prior: _Prior) -> tuple[Array, _Prior]:
    """The KV-cache size only matters once the batch reaches it, where the gradient starts: try
    several starting sizes (the prior's and smaller ones) and keep the best fit.

    Closed-loop waves (closed_loop_sync) are one more degree of freedom that noisy sweeps use to
    chase scatter: the fit starts with them off and keeps them only when they halve the cost
    (a sweep whose clients really move in waves: TTFT several times what prefill explains).
    Returns the parameters and the prior they were fitted under (for refits on subsets)."""
    closed = bool(np.any((d.mode == 1) & np.isfinite(d.obs[:, 0:6]).any(axis=1)))
    base = _sync_off(prior) if closed else prior
    best: Array | None = None
    best_cost = math.inf
    for shrink in (1.0, 0.25, 1.0 / 16.0, 1.0 / 64.0):
        start = base.start.copy()
        start[_KV] += math.log(shrink)
        phi = _solve(d, start, base.phi, base.weight)
        cost = _cost(d, phi, base)
        if cost < best_cost:
            best, best_cost = phi, cost
    assert best is not None
    if closed:
        start = best.copy()
        start[_SYNC] = _logit(_SYNC_START)
        phi = _solve(d, start, prior.phi, prior.weight)
        if _cost(d, phi, prior) < _SYNC_GAIN * best_cost:
            return phi, prior
    return best, base


def _logit(f: float) -> float:
    return math.log(f / (1.0 - f))


def _sync_off(prior: _Prior) -> _Prior:
    """The prior with closed-loop waves pinned off (a tiny value the final parameters round to 0)."""
    phi, weight, start = prior.phi.copy(), prior.weight.copy(), prior.start.copy()
    phi[_SYNC] = start[_SYNC] = _logit(_SYNC_OFF)
    weight[_SYNC] = 100.0
    return _Prior(phi, weight, start, prior.note)


def _primary(values: Array, cols: Sequence[int]) -> Array:
    """Per point, the first reported of the given columns (mean, else p50, else p99); NaN if none."""
    out = np.full(values.shape[0], np.nan)
    for c in reversed(cols):
        out = np.where(np.isfinite(values[:, c]), values[:, c], out)
    return out


def _mape(errors: list[float]) -> float | None:
    return float(np.mean(errors)) if errors else None


@dataclass(frozen=True)
class FitReport:
    profile: PerfProfile
    points_used: int
    saturated_points: int


def _range(points: Sequence[BenchmarkPoint], d: _Data) -> DataRange:
    rates = [p.rate_rps for p in points if p.load is LoadKind.RATE and p.rate_rps is not None]
    concs = [p.concurrency for p in points if p.load is LoadKind.CONCURRENCY and p.concurrency is not None]
    return DataRange(
        latency_points=int(np.isfinite(d.obs[:, 0:6]).any(axis=1).sum()),
        isl=(min(p.isl for p in points), max(p.isl for p in points)),
        osl=(min(p.osl for p in points), max(p.osl for p in points)),
        rate_rps=(min(rates), max(rates)) if rates else None,
        concurrency=(min(concs), max(concs)) if concs else None,
    )


def _kv_guess(d: _Data) -> float:
    """Without an architecture: a KV cache comfortably above the largest load in the data."""
    tokens = np.where(d.mode == 1, d.load * (d.isl + d.osl), 0.0)
    rate_tokens = np.where(d.mode == 0, d.load * 1000.0 * (d.isl + d.osl) * 0.1, 0.0)  # ~0.1 s in flight
    return float(max(4.0 * max(tokens.max(initial=0.0), rate_tokens.max(initial=0.0)), 1e5))


@dataclass(frozen=True)
class _Prior:
    phi: Array
    weight: Array  # per parameter
    start: Array
    note: str


def _prior_for(key: ConfigKey, points: Sequence[BenchmarkPoint], d: _Data) -> _Prior:
    params = roofline_params(key)
    kv = kv_capacity_tokens(key)
    if params is not None and kv is not None and kv > 0:
        weight = np.full(_N_PARAMS + 1, _PRIOR_WEIGHT_ROOFLINE)
        note = "prior: roofline (weight bytes / HBM bandwidth; KV cache from HBM size)"
    else:
        params = _work_estimate(d, _guess(points, d))
        kv = _kv_guess(d)
        weight = np.full(_N_PARAMS + 1, _PRIOR_WEIGHT_GUESS)
        note = "prior: data-driven guess (architecture unknown)"
    params = replace(params, itl_stall_weight=_STALL_PRIOR, closed_loop_sync=_SYNC_PRIOR,
                     queue_tail=_QUEUE_TAIL_PRIOR, itl_p99_load=0.3)
    if d.has_gap_p99():  # the stalls explain the long gaps: the rest is step-time noise
        params = replace(params, itl_p99_factor=_GAP_P99_FACTOR_PRIOR)
    phi = _phi_from_params(params, kv)
    start_params = _work_estimate(d, params)
    ttft = d.obs[:, 0:3]
    if np.isfinite(ttft).any():  # log-space steps are tiny from a tiny start: begin the front-end
        # latency at a third of the lowest TTFT seen (the prior's centre stays where it is)
        floor = float(np.nanmin(ttft))
        start_params = replace(start_params, ttft_fixed_ms=max(start_params.ttft_fixed_ms, floor / 3.0))
    start = _phi_from_params(start_params, kv)
    return _Prior(phi, weight, start, note)


def fit_profile(key: ConfigKey, points: Sequence[BenchmarkPoint], *, loo: bool = True) -> FitReport:
    """Fit one profile to the points of one configuration; LOO error unless loo=False."""
    if not points:
        raise FitFailure(f"{key.label()}: no points")
    d = _data(points)
    if not np.isfinite(d.obs).any():
        raise FitFailure(f"{key.label()}: the points report no usable statistic")
    prior = _prior_for(key, points, d)
    phi, prior = _solve_multistart(d, prior)
    fit_error = _loo(d, phi, prior) if loo else None
    params, kv = _params_for(phi, d)
    profile = PerfProfile(
        key=key, params=params, kv_tokens=kv, source="fit",
        fit_error=fit_error, data_range=_range(points, d), notes=(prior.note,),
    )
    return FitReport(profile, len(points), int((d.mode == 2).sum()))


def _loo(d: _Data, phi: Array, prior: _Prior) -> FitError:
    n = len(d.isl)
    ttft_err: list[float] = []
    itl_err: list[float] = []
    out_err: list[float] = []
    if n >= 2:
        for i in range(n):
            train = d.subset([j for j in range(n) if j != i])
            if not np.isfinite(train.obs).any():
                continue
            phi_i = _solve(train, phi.copy(), prior.phi, prior.weight, max_nfev=200)
            _collect(d.subset([i]), _params_for(phi_i, train), ttft_err, itl_err, out_err)
    return FitError(points=n, ttft_mape=_mape(ttft_err), itl_mape=_mape(itl_err),
                    throughput_mape=_mape(out_err))


def _collect(test: _Data, fitted: tuple[PerfParams, float], ttft_err: list[float], itl_err: list[float],
             out_err: list[float]) -> None:
    """Append absolute percentage errors of fitted parameters on held-out points."""
    pred = _predict_array(*fitted, test)
    for errs, cols in ((ttft_err, (0, 1, 2)), (itl_err, (3, 4, 5)), (out_err, (6,))):
        obs_p = _primary(test.obs, cols)
        pred_p = _primary(np.where(np.isfinite(test.obs), pred, np.nan), cols)
        ok = np.isfinite(obs_p) & np.isfinite(pred_p)
        errs.extend((100.0 * np.abs(pred_p[ok] - obs_p[ok]) / obs_p[ok]).tolist())


HOLDOUT_METRICS = ("ttft", "ttft_p99", "itl", "itl_p99", "throughput", "saturation_throughput")


def holdout_errors(key: ConfigKey, train: Sequence[BenchmarkPoint], test: Sequence[BenchmarkPoint],
                   test_saturated: Sequence[bool] | None = None) -> dict[str, list[float]]:
    """Fit on `train`, predict `test`: absolute percentage errors per metric (HOLDOUT_METRICS).

    ttft / itl: the mean where reported, else the median (ITL: else TPOT), points below saturation;
    throughput: closed-loop points below saturation; saturation_throughput: saturated points.
    `test_saturated` (default: judged from `test` alone) says which test points are saturated.
    """
    d_train = _data(train)
    d_test = _data(test, test_saturated)
    prior = _prior_for(key, train, d_train)
    phi, prior = _solve_multistart(d_train, prior)
    pred = _predict_array(*_params_for(phi, d_train), d_test)
    out: dict[str, list[float]] = {m: [] for m in HOLDOUT_METRICS}

    def ape(cols: Sequence[int], mask: NDArray[np.bool_]) -> list[float]:
        obs_p = _primary(d_test.obs, cols)
        pred_p = _primary(np.where(np.isfinite(d_test.obs), pred, np.nan), cols)
        ok = np.isfinite(obs_p) & np.isfinite(pred_p) & mask
        return [float(v) for v in 100.0 * np.abs(pred_p[ok] - obs_p[ok]) / obs_p[ok]]

    everywhere = np.ones(len(d_test.isl), dtype=bool)
    out["ttft"] = ape((0, 1, 2), everywhere)
    out["ttft_p99"] = ape((2,), everywhere)
    out["itl"] = ape((3, 4, 5), everywhere)
    out["itl_p99"] = ape((5,), everywhere)
    out["throughput"] = ape((6,), d_test.mode == 1)
    out["saturation_throughput"] = ape((6,), d_test.mode == 2)
    return out


def group_points(points: Iterable[BenchmarkPoint]) -> dict[ConfigKey, list[BenchmarkPoint]]:
    groups: dict[ConfigKey, list[BenchmarkPoint]] = {}
    for p in points:
        groups.setdefault(p.key, []).append(p)
    return groups
