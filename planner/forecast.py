"""Demand forecast over the lead-time horizon: a quantile of the request rate. Pure (numpy only).

Methods, chosen by how much history there is:
- "seasonal": >= 2 days of history: linear trend + daily harmonics (24 h, 12 h, 8 h) fitted by least
  squares; forecast = max over the horizon of the fit + the q-quantile of the residuals.
- "trend": >= 8 samples over >= 10 minutes: linear trend + residual quantile, max over the horizon.
- "current": otherwise, the current rate.
The forecast is never below the current rate (the planner serves max(current, forecast)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DAY_S = 86400.0


@dataclass(frozen=True)
class Forecast:
    rate_rps: float
    method: str  # seasonal | trend | current | none
    horizon_s: float
    quantile: float


def _design(t: np.ndarray, seasonal: bool) -> np.ndarray:
    cols = [np.ones_like(t), t / DAY_S]
    if seasonal:
        for k in (1, 2, 3):
            w = 2.0 * math.pi * k * t / DAY_S
            cols += [np.sin(w), np.cos(w)]
    return np.stack(cols, axis=1)


def forecast_rate(
    history: Sequence[tuple[float, float]],
    current_rps: float | None,
    now_s: float,
    horizon_s: float,
    quantile: float = 0.9,
) -> Forecast:
    """The q-quantile of the request rate over (now, now + horizon]."""
    pts = [(t, r) for t, r in history if math.isfinite(t) and math.isfinite(r) and r >= 0 and t <= now_s]
    cur = current_rps if current_rps is not None else (pts[-1][1] if pts else None)
    if cur is None:
        return Forecast(0.0, "none", horizon_s, quantile)
    if len(pts) < 8 or pts[-1][0] - pts[0][0] < 600.0:
        return Forecast(float(cur), "current", horizon_s, quantile)
    t = np.array([p[0] for p in pts], dtype=float) - now_s
    y = np.array([p[1] for p in pts], dtype=float)
    span = float(t[-1] - t[0])
    seasonal = span >= 2 * DAY_S and len(pts) >= 48
    x = _design(t, seasonal)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    q = float(np.quantile(resid, quantile))
    steps = max(2, min(60, int(horizon_s / 60.0) + 2))
    tf = np.linspace(0.0, max(horizon_s, 0.0), steps)
    fit = _design(tf, seasonal) @ coef
    if not seasonal:
        # a trend fitted on a short window must not extrapolate wildly: cap at 2x the current rate
        fit = np.minimum(fit, 2.0 * max(float(cur), float(np.max(y))))
    value = float(np.max(fit)) + max(q, 0.0)
    return Forecast(max(float(cur), value, 0.0), "seasonal" if seasonal else "trend", horizon_s, quantile)
