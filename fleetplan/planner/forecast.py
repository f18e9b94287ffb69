"""Demand forecast over the lead-time horizon: a quantile of the request rate. Pure (numpy only).

forecast = level + shape rise over the horizon + q-quantile of the short-horizon residuals, where
- level: the mean rate of the last `LEVEL_S` seconds (the history samples there and the current
  rate): it follows the observed rate down after a peak within ~LEVEL_S, never stuck on old peaks;
- shape (chosen by how much history there is):
  - "seasonal": >= 2 days of history: linear trend + daily harmonics (24 h, 12 h, 8 h), least
    squares over the whole history; the rise is max over the horizon of fit(now + tau) - fit(now);
  - "trend": >= 8 samples over >= 5 min and the slope of a line fitted to the last `TREND_S`
    seconds is positive and significant (> `TREND_T` standard errors) and the rate of the last
    `LEVEL_S` is at least that span's mean: rise = slope x horizon (a falling trend is not
    extrapolated: the level follows the rate down; nor a step up and back down, which fits a
    rising line but has the rate below the line's span);
  - "level": enough history but no significant trend: rise = 0;
  - "current": fewer than `MIN_SAMPLES` history samples: the current rate alone;
- residuals: for every pair of history samples (t_i, t_j) with 0 < t_j - t_i <= horizon in the
  last `RESID_S` seconds, r = y_j - level_i - (shape(t_j) - shape(t_i)): how far the rate came above
  the level it had, within the horizon. Their q-quantile (not the mean) is the safety margin; it
  is computed over recent pairs only, so a past peak does not keep the forecast up, and it is
  capped by the largest rise seen in two separate (not neighbouring) horizon windows once the rate
  has given back at least half of the rise it discounts, so one step (1 -> 10 rps and back) never holds the
  margin after it, however short the history (a step's pairs
  outnumber q's tail when the history is only a few horizons long: the q0.9 alone remembered a
  10 rps step for the whole hour).
The planner serves max(current, forecast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from statistics import NormalDist

import numpy as np

DAY_S = 86400.0
LEVEL_S = 90.0  # the level is the mean rate of this trailing span
TREND_S = 900.0  # the trend is fitted on this trailing span
TREND_T = 3.0  # a trend is used only when |slope| exceeds this many standard errors
RESID_S = 3600.0  # residual pairs from this trailing span
MIN_SAMPLES = 4  # fewer history samples: the current rate alone


@dataclass(frozen=True)
class Forecast:
    rate_rps: float
    method: str  # seasonal | trend | level | current | none
    horizon_s: float
    quantile: float
    level_rps: float | None = None
    rise_rps: float = 0.0  # the shape's rise over the horizon
    margin_rps: float = 0.0  # the residual quantile


def _design(t: np.ndarray) -> np.ndarray:
    cols = [np.ones_like(t), t / DAY_S]
    for k in (1, 2, 3):
        w = 2.0 * math.pi * k * t / DAY_S
        cols += [np.sin(w), np.cos(w)]
    return np.stack(cols, axis=1)


def _levels(t: np.ndarray, y: np.ndarray, span_s: float) -> np.ndarray:
    """Per sample, the mean of the samples in (t_i - span, t_i] (a trailing mean)."""
    c = np.concatenate(([0.0], np.cumsum(y)))
    lo = np.searchsorted(t, t - span_s, side="right")
    hi = np.arange(1, len(t) + 1)
    return np.asarray((c[hi] - c[lo]) / np.maximum(hi - lo, 1), dtype=float)


def _slopes(t: np.ndarray, y: np.ndarray, span_s: float, t_crit: float) -> np.ndarray:
    """Per sample, the least-squares slope over (t_i - span, t_i], or 0 where it is not significant
    (|slope| <= t_crit standard errors, or fewer than 5 samples)."""
    def cs(a: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(a)))

    tt = t - t[-1]  # centred near the recent samples (numerics)
    c1, ct, cy, ctt, cty, cyy = (cs(np.ones_like(tt)), cs(tt), cs(y), cs(tt * tt), cs(tt * y), cs(y * y))
    lo = np.searchsorted(t, t - span_s, side="right")
    hi = np.arange(1, len(t) + 1)
    n = c1[hi] - c1[lo]
    st, sy = ct[hi] - ct[lo], cy[hi] - cy[lo]
    n_safe = np.maximum(n, 1.0)
    sxx = (ctt[hi] - ctt[lo]) - st * st / n_safe
    sxy = (cty[hi] - cty[lo]) - st * sy / n_safe
    syy = (cyy[hi] - cyy[lo]) - sy * sy / n_safe
    ok = (n >= 5) & (sxx > 1e-9)
    b = np.where(ok, sxy / np.where(ok, sxx, 1.0), 0.0)
    rss = np.maximum(syy - b * sxy, 0.0)
    se = np.sqrt(rss / np.maximum(n - 2, 1.0) / np.where(ok, sxx, 1.0))
    sig = ok & (np.abs(b) > t_crit * se)
    return np.asarray(np.where(sig, b, 0.0), dtype=float)


def forecast_rate(
    history: Sequence[tuple[float, float]],
    current_rps: float | None,
    now_s: float,
    horizon_s: float,
    quantile: float = 0.9,
    *,
    sample_window_s: float | None = None,
) -> Forecast:
    """The q-quantile of the request rate over (now, now + horizon]. `sample_window_s`: the window
    each history rate was read over; the margin then leaves out their Poisson count noise
    (`_without_count_noise`). None: the residuals are taken as they are."""
    # in numpy: a day at 30 s steps is 2,880 samples per model and cycle, 3 days 8,640 (a Python sort
    # of them took half of the forecast's time: 8.8 -> 4.7 ms per call at 8,640)
    raw = np.fromiter(chain.from_iterable(history), dtype=float, count=2 * len(history)).reshape(-1, 2)
    with np.errstate(invalid="ignore"):
        raw = raw[np.isfinite(raw).all(axis=1) & (raw[:, 1] >= 0) & (raw[:, 0] <= now_s)]
    raw = raw[np.lexsort((raw[:, 1], raw[:, 0]))]  # by time, then rate: as sorted() on the pairs
    cur = current_rps if current_rps is not None else (float(raw[-1, 1]) if len(raw) else None)
    if cur is None:
        return Forecast(0.0, "none", horizon_s, quantile)
    if len(raw) < MIN_SAMPLES:
        return Forecast(float(cur), "current", horizon_s, quantile, float(cur))
    t = raw[:, 0] - now_s
    y = raw[:, 1]
    if current_rps is not None and t[-1] < -1.0:
        t = np.append(t, 0.0)  # the current rate is the newest sample
        y = np.append(y, float(current_rps))
    h = max(horizon_s, 0.0)
    span = float(t[-1] - t[0])

    # the shape: daily seasonality with >= 2 days, else a significant linear trend, else flat
    method = "level"
    shape = np.zeros_like(t)
    rise = 0.0
    if span >= 2 * DAY_S and len(t) >= 48:
        coef, *_ = np.linalg.lstsq(_design(t), y, rcond=None)
        shape = _design(t) @ coef
        tf = np.linspace(0.0, h, max(2, min(60, int(h / 60.0) + 2)))
        fut = _design(tf) @ coef
        rise = max(0.0, float(np.max(fut) - fut[0]))
        method = "seasonal"
    else:
        recent = t >= t[-1] - TREND_S
        b = 0.0 if len(t) < 8 or span < 300.0 else float(_slopes(t[recent], y[recent], TREND_S + 1.0, TREND_T)[-1])
        # a falling trend is not extrapolated (the level follows the rate down), nor a rising line
        # the rate no longer follows: a step up and back down fits a rising line over 15 min, but the
        # rate now is below that span's mean
        if b > 0.0 and float(np.mean(y[t >= -LEVEL_S])) >= float(np.mean(y[recent])):
            shape = b * t
            rise = max(0.0, b * h)
            method = "trend"

    levels = _levels(t, y, LEVEL_S)
    level = float(levels[-1])

    # residuals: the rate within the horizon after t_i, above the level at t_i (shape change removed)
    keep = t >= t[-1] - RESID_S
    tk, yk, lk, sk = t[keep], y[keep], levels[keep], shape[keep]
    resid: list[np.ndarray] = []
    windows: list[np.ndarray] = []  # per pair, the horizon-long window its first sample falls in
    if h > 0:
        for d in range(1, len(tk)):
            dt = tk[d:] - tk[:-d]
            ok = (dt > 0) & (dt <= h + 1e-9)
            if not ok.any():
                if float(dt.min()) > h:
                    break
                continue
            r = yk[d:] - lk[:-d] - (sk[d:] - sk[:-d])
            resid.append(r[ok])
            windows.append(np.floor((tk[:-d][ok] - tk[0]) / h).astype(np.int64))
    margin = 0.0
    if resid:
        allr = np.concatenate(resid)
        if len(allr) >= 4:
            margin = max(0.0, float(np.quantile(allr, quantile)))
            if sample_window_s is not None and sample_window_s > 0:
                # the pairs' own mean rate sets their count noise (the level is one noisy 90 s)
                margin = _without_count_noise(margin, allr, float(np.mean(yk)), sample_window_s, quantile)
            recurring = _recurring_rise(allr, np.concatenate(windows))
            # a one-off rise that took the rate to where it still is stays (a new level, maybe still
            # climbing: the safe side); once the rate has given back at least half of it (more than
            # noise around a new level), it no longer holds the forecast (and the scale-down) up
            if recurring < margin and level + recurring < float(np.max(lk)) - 0.5 * (margin - recurring):
                margin = recurring

    value = level + rise + margin
    return Forecast(max(value, 0.0), method, horizon_s, quantile, level, rise, margin)


def _without_count_noise(margin: float, rises: np.ndarray, rate_rps: float, window_s: float,
                         quantile: float) -> float:
    """The margin without the part a Poisson stream's counting noise explains.

    A rate read over a window of W seconds at a steady `rate_rps` λ scatters by sqrt(λ / W) (the count of
    arrivals is Poisson), and the level it is compared with by about sqrt(λ / (W + LEVEL_S)): at the
    demo's 1 rps over 60 s a residual's q0.9 is ~0.22 rps of pure noise, 20% of the demand. Capacity
    at the SLO is already sized for Poisson arrivals at the mean rate (the same reason a burst counts
    only beyond POISSON_Z deviations), so that part buys nothing. Under normality the residuals' sd
    is sqrt(signal^2 + noise^2): the margin gives back z_q x (sd - signal sd) and keeps the rest (the
    tail's shape beyond a normal's, the rate's own changes).

    >>> rng = np.random.default_rng(0)
    >>> noise = rng.poisson(60.0, 4000) / 60.0 - 1.0  # 1 rps read over 60 s: noise only
    >>> m = float(np.quantile(noise, 0.9))
    >>> round(m, 2), round(_without_count_noise(m, noise, 1.0, 60.0, 0.9), 2)
    (0.17, 0.0)
    >>> steps = rng.choice([0.0, 2.0], 4000, p=[0.85, 0.15]) + noise  # the rate itself jumps by 2 rps
    >>> m = float(np.quantile(steps, 0.9))
    >>> round(m, 2), round(_without_count_noise(m, steps, 1.0, 60.0, 0.9), 2)
    (1.92, 1.9)
    """
    if margin <= 0.0 or len(rises) < 2 or rate_rps <= 0.0:
        return margin
    noise_var = rate_rps / window_s + rate_rps / (window_s + LEVEL_S)
    sd = float(np.std(rises))
    signal = math.sqrt(max(0.0, sd * sd - noise_var))
    return max(0.0, margin - NormalDist().inv_cdf(quantile) * (sd - signal))


def _recurring_rise(rises: np.ndarray, windows: np.ndarray) -> float:
    """The largest rise seen in two separate events: per disjoint horizon window the largest rise
    starting in it, then the largest value reached by two windows that are not neighbours. One step
    up (1 -> 10 rps) spans at most two neighbouring windows, so it never sets the margin alone;
    rises that come back (bursty traffic) do. No two separate windows yet: no cap (inf).

    >>> _recurring_rise(np.array([9.0, 9.0, 0.5, 0.4, 0.6]), np.array([3, 4, 0, 1, 2]))
    0.6
    >>> _recurring_rise(np.array([9.0, 0.5, 8.0, 0.4]), np.array([0, 1, 2, 3]))
    8.0
    """
    best = np.full(int(windows.max()) + 1, -np.inf)
    np.maximum.at(best, windows, rises)
    idx = np.flatnonzero(np.isfinite(best))
    out = -np.inf
    for a in range(len(idx)):
        for b in range(a + 1, len(idx)):
            if idx[b] - idx[a] >= 2:
                out = max(out, min(float(best[idx[a]]), float(best[idx[b]])))
    if not np.isfinite(out):
        return math.inf  # two horizons of history or less cannot tell a step from a recurrence
    return max(0.0, out)


def recent_level_max(
    history: Sequence[tuple[float, float]],
    current_rps: float | None,
    now_s: float,
    span_s: float,
) -> float | None:
    """The highest level (`LEVEL_S` trailing mean of the rate) over (now - span, now], or None when
    the history does not reach back that far (what the scale-down delay holds the fleet for)."""
    raw = np.fromiter(chain.from_iterable(history), dtype=float, count=2 * len(history))
    t, y = raw[0::2], raw[1::2]
    keep = np.isfinite(t) & np.isfinite(y) & (y >= 0) & (t <= now_s)
    t, y = t[keep], y[keep]
    if not (t[1:] > t[:-1]).all():
        order = np.lexsort((y, t))  # by time, then rate: as the (time, rate) pairs sort
        t, y = t[order], y[order]
    if current_rps is not None and math.isfinite(current_rps) and current_rps >= 0 and (
            not len(t) or t[-1] < now_s - 1.0):
        t, y = np.append(t, now_s), np.append(y, float(current_rps))
    if not len(t) or span_s <= 0:
        return float(current_rps) if current_rps is not None and span_s <= 0 else None
    step = float(t[-1] - t[-2]) if len(t) >= 2 else 0.0
    if t[0] > now_s - span_s + max(step, 1.0) + 1e-9:
        return None
    lv = _levels(t, y, LEVEL_S)
    return float(np.max(lv[t > now_s - span_s]))
