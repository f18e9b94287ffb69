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

__all__ = ["MISS_MINUTES_TOP", "STEPS", "MissMinutes", "PeriodJudgement", "judge", "miss_minutes"]

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


MISS_MINUTES_TOP = 3  # the worst minutes a replay's misses are shown in


@dataclass(frozen=True)
class MissMinutes:
    """Where a replay's misses fell: their number and the minutes (from the trace's start) that held
    the most, most first. Why: 1% of an hour's requests is the whole error budget; when a few
    minutes hold most of the misses, the replay missed a burst the standing fleet could not serve
    (no fleet started after a burst's onset serves the requests already queued behind a 500 ms TTFT
    target); misses spread over the hour are a fleet sized too small all along."""

    misses: int
    worst: tuple[tuple[float, int], ...]  # (the minute's start s, misses in it)

    @property
    def worst_share(self) -> float:
        """The share of the misses in `worst` (0 without a miss)."""
        return sum(n for _, n in self.worst) / self.misses if self.misses else 0.0

    def to_json(self) -> dict[str, object]:
        return {"misses": self.misses, "worst_share": round(self.worst_share, 4),
                "worst_minutes": [{"start_s": t, "misses": n} for t, n in self.worst]}

    def describe(self) -> str:
        """One line: '2277 misses, 98% of them in 3 minutes (0:48 1615, 0:49 662, ...)'."""
        if not self.misses:
            return "no miss"
        where = ", ".join(f"{int(t // 3600)}:{int(t % 3600 // 60):02d} {n}" for t, n in self.worst)
        return (f"{self.misses} misses, {100 * self.worst_share:.0f}% of them in the {len(self.worst)} worst "
                f"minute{'s' if len(self.worst) > 1 else ''} ({where})")


def miss_minutes(arrival_s: np.ndarray, met: np.ndarray, top: int = MISS_MINUTES_TOP) -> MissMinutes:
    """The misses per minute of arrival (minutes aligned to the trace's start), the `top` worst.

    >>> t = np.arange(0.0, 600.0, 0.5)                   # 2 rps for 10 minutes
    >>> met = np.ones(t.size, dtype=bool); met[240:300] = False; met[1000] = False  # 60 in 0:02, 1 in 0:08
    >>> mm = miss_minutes(t, met, top=1)
    >>> mm.misses, mm.worst, round(mm.worst_share, 3)
    (61, ((120.0, 60),), 0.984)
    >>> mm.describe()
    '61 misses, 98% of them in the 1 worst minute (0:02 60)'
    """
    missed = np.asarray(arrival_s)[~np.asarray(met, dtype=bool)]
    if missed.size == 0:
        return MissMinutes(0, ())
    minutes, counts = np.unique(np.floor(missed / 60.0).astype(np.int64), return_counts=True)
    order = np.lexsort((minutes, -counts))[:max(0, top)]  # most misses first, the earlier minute on a tie
    return MissMinutes(int(missed.size), tuple((float(minutes[k] * 60), int(counts[k])) for k in order))
