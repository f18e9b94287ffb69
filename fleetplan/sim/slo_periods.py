"""The SLO as users write it, judged on a replay: the share of good requests over every rolling period.

A model's SLO (planner/policy.py `Slo`) is an objective over a rolling period: 99% of the requests
good over any hour, by default. A replay longer than the period is judged window by window: each
model's requests in every window of `period_s` (stepped by `period_s / STEPS`, the last one ending
at the trace's end) are counted, and the replay serves the SLO when every window of every model has
at least its objective. A replay no longer than the period has one window, the whole trace, so an
hour's replay under the default SLO is judged as before.

Why not the whole trace's share: a day's share counts the night's easy requests against the
afternoon's misses, a looser rule than the one the users wrote (a fleet that misses 5% of the
peak hour serves 99.4% of the day). The yardsticks found with hindsight are held to the same rule
as fleetplan (sim/yardsticks.py), so "cheaper than best-fixed" means at the users' SLO.

>>> import numpy as np
>>> t = np.arange(0.0, 7200.0, 1.0)                 # 1 rps for two hours
>>> met = np.ones(t.size, dtype=bool); met[5000:5100] = False   # 100 misses in the second hour
>>> j = judge(t, np.zeros(t.size, dtype=int), met, ["m"], {"m": 0.99}, {"m": 3600.0}, 7200.0)
>>> round(j.worst_share, 4), j.worst_model, j.met, round(float(met.mean()), 4)
(0.9722, 'm', False, 0.9861)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["STEPS", "PeriodJudgement", "judge"]

STEPS = 12  # windows per period: an hour's period is judged every 5 minutes


@dataclass(frozen=True)
class PeriodJudgement:
    """The worst window of any model: its good share, its model, where it starts, its period and
    objective; `met`: every window of every model at or above its objective; `windows` judged,
    `windows_met` of them at the objective."""

    worst_share: float
    worst_model: str | None
    worst_start_s: float
    period_s: float
    objective: float
    met: bool
    windows: int
    windows_met: int

    def to_json(self) -> dict[str, object]:
        return {"worst_share": round(self.worst_share, 5), "model": self.worst_model,
                "start_s": round(self.worst_start_s, 1), "period_s": self.period_s, "objective": self.objective,
                "met": self.met, "windows": self.windows, "windows_met": self.windows_met}


def _starts(span_s: float, period_s: float) -> np.ndarray:
    if span_s <= period_s:
        return np.zeros(1)
    step = period_s / STEPS
    starts = np.arange(0.0, span_s - period_s, step)
    return np.append(starts, span_s - period_s)  # the last window ends at the trace's end


def judge(arrival_s: np.ndarray, model_index: np.ndarray, met: np.ndarray, model_names: Sequence[str],
          objective: Mapping[str, float], period_s: Mapping[str, float], span_s: float) -> PeriodJudgement:
    """Every model's rolling windows over [0, span_s] (see the module's doc). Arrivals in trace order
    (sorted); windows without requests are not judged; no request at all: met, share 1."""
    worst: tuple[float, str | None, float, float, float] = (1.0, None, 0.0, 0.0, 0.0)
    worst_gap = -np.inf
    windows = windows_met = 0
    for i, name in enumerate(model_names):
        mine = model_index == i
        if not mine.any():
            continue
        t = arrival_s[mine]
        good = np.concatenate(([0], np.cumsum(met[mine].astype(np.int64))))
        per, obj = float(period_s[name]), float(objective[name])
        lo_t = _starts(span_s, per)
        lo = np.searchsorted(t, lo_t, side="left")
        hi = np.searchsorted(t, lo_t + per if span_s > per else np.full(1, np.inf), side="left")
        n = hi - lo
        keep = n > 0
        if not keep.any():
            continue
        share = (good[hi[keep]] - good[lo[keep]]) / n[keep]
        windows += int(keep.sum())
        windows_met += int((share >= obj - 1e-12).sum())
        k = int(np.argmin(share))
        gap = obj - float(share[k])
        if gap > worst_gap:
            worst_gap = gap
            worst = (float(share[k]), name, float(lo_t[keep][k]), per, obj)
    return PeriodJudgement(*worst, windows == windows_met, windows, windows_met)
