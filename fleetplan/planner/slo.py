"""What a model's SLO means, and the error budget it has left. Pure.

The SLO is written in the ratio form of an SLO document (the Google SRE workbook's, OpenSLO's): a
request is good when it is served with TTFT <= the TTFT target and per-request ITL <= the ITL target;
the objective is the share of good requests over a rolling period (policy `slo.objective`, default
0.99, `slo.period_s`, default 3600 s). `ObjectiveKind.EVERY_WINDOW` is the opt-in stricter reading:
the objective in every observation window (a p99 in every window).

The error budget is what the objective allows to miss: (1 - objective) x the period's requests.
Each cycle adds the window's reading to the model's budget ledger in the planner state: its request
rate x the time since the last reading (at most `MAX_GAP_CYCLES` cycles: a gap in the readings is
not filled in) and the share of them that missed, as the engines' TTFT and per-request TPOT
histograms bound it (planner/evidence.py `slo_missed_share`: at least / at most, since a target
inside a bucket cannot tell a miss). The ledger keeps `SLICES` slices of the period and drops what
is older. `error_budget` reads it: the period's good share and the budget left, each as the two
bounds, and the worst slice's good share (what `EVERY_WINDOW` is judged on).

Spending it is the policy's choice: with `slo.window_floor` below the objective, each window is
sized for a good share between the two (`planned_share`): the objective minus the share of the
budget left (its lower bound) times the room down to the floor. A full budget plans at the floor,
a spent one at the objective, nothing counted yet at the objective, so the period's share stays at
the objective as the ledger fills and the floor bounds any one window's risk. Without a floor (the
default: the floor is the objective) nothing is spent: every window is sized for the targets with
the policy's headroom (a budget looks back, the headroom insures forward; a trial that spent the
budget with no floor let bursts inside the lead time spend 7x of it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["MAX_GAP_CYCLES", "SLICES", "BudgetSlice", "ErrorBudget", "ObjectiveKind", "error_budget",
           "planned_share", "record"]

# the ledger's resolution: an hour in 150 s slices, a day in hours (~100 bytes a slice in the stored
# state, which is kept with every plan)
SLICES = 24
MAX_GAP_CYCLES = 2.0  # a reading stands for at most this many cycles since the previous one


class ObjectiveKind(StrEnum):
    PERIOD = "period"  # the share of good requests over the rolling period (the default)
    EVERY_WINDOW = "every_window"  # the objective in every observation window (a p99 in each)


@dataclass(frozen=True)
class BudgetSlice:
    """One slice of a model's ledger: the requests counted in [t_s, t_s + period / SLICES) and the
    misses among them, at least and at most; `updated_s`: the last reading added."""

    model: str
    t_s: float
    updated_s: float
    requests: float
    missed_lo: float
    missed_hi: float


@dataclass(frozen=True)
class ErrorBudget:
    """A model's SLO over its period as the ledger reads it; each (lo, hi) pair bounds the truth."""

    kind: ObjectiveKind
    objective: float
    period_s: float
    window_floor: float
    requests: float  # counted over the period (simulated or real requests, as the rate is read)
    covered_s: float  # how much of the period the ledger covers (less after a start)
    good_share: tuple[float, float]  # (at least, at most)
    budget_left: tuple[float, float]  # share of the budget left: (at least, at most); < 0: overspent
    worst_slice_good_share: float  # the lowest "at least" good share of a slice with requests


def _slice_start(t_s: float, width_s: float) -> float:
    return math.floor(t_s / width_s) * width_s


def record(ledger: Sequence[BudgetSlice], model: str, now_s: float, rate_rps: float | None,
           missed_share: tuple[float, float] | None, period_s: float, cycle_s: float) -> tuple[BudgetSlice, ...]:
    """The model's ledger after this cycle's reading (other models' slices are left out: the caller
    keeps them). No rate or no missed share: nothing is added (unknown is not good), the old slices
    still age out.

    >>> led = record((), "m", 1000.0, 2.0, (0.01, 0.03), 3600.0, 60.0)  # first reading: one cycle's worth
    >>> [(s.t_s, s.requests, round(s.missed_lo, 2), round(s.missed_hi, 2)) for s in led]
    [(900.0, 120.0, 1.2, 3.6)]
    >>> led = record(led, "m", 1010.0, 2.0, (0.0, 0.0), 3600.0, 60.0)  # 10 s later: 20 more, same slice
    >>> [(s.t_s, s.requests) for s in led]
    [(900.0, 140.0)]
    >>> [s.t_s for s in record(led, "m", 5000.0, 1.0, (0.0, 0.0), 3600.0, 60.0)]  # an hour on: aged out
    [4950.0]
    """
    width = period_s / SLICES
    mine = [s for s in ledger if s.model == model and s.t_s + width > now_s - period_s]
    if rate_rps is None or missed_share is None or not (math.isfinite(rate_rps) and rate_rps >= 0):
        return tuple(mine)
    last = max((s.updated_s for s in mine), default=None)
    dt = cycle_s if last is None else min(max(0.0, now_s - last), MAX_GAP_CYCLES * cycle_s)
    n = rate_rps * dt
    lo, hi = (min(1.0, max(0.0, x)) for x in missed_share)
    start = _slice_start(now_s, width)
    out = [s for s in mine if s.t_s != start]
    prev = next((s for s in mine if s.t_s == start), None)
    base = prev if prev is not None else BudgetSlice(model, start, now_s, 0.0, 0.0, 0.0)
    out.append(BudgetSlice(model, start, now_s, base.requests + n, base.missed_lo + lo * n, base.missed_hi + hi * n))
    return tuple(sorted(out, key=lambda s: s.t_s))


def error_budget(ledger: Sequence[BudgetSlice], model: str, now_s: float, kind: ObjectiveKind, objective: float,
                 period_s: float, window_floor: float) -> ErrorBudget | None:
    """The model's period as its ledger reads it; None: no request counted yet.

    >>> led = record((), "m", 1000.0, 10.0, (0.002, 0.004), 3600.0, 60.0)  # 600 requests, 1.2-2.4 missed
    >>> b = error_budget(led, "m", 1000.0, ObjectiveKind.PERIOD, 0.99, 3600.0, 0.99)
    >>> round(b.good_share[0], 4), [round(x, 2) for x in b.budget_left]  # 6 misses allowed
    (0.996, [0.6, 0.8])
    """
    width = period_s / SLICES
    mine = [s for s in ledger if s.model == model and s.t_s + width > now_s - period_s]
    total = sum(s.requests for s in mine)
    if not mine or total <= 0:
        return None
    lo = sum(s.missed_lo for s in mine) / total
    hi = sum(s.missed_hi for s in mine) / total
    allowed = 1.0 - objective
    worst = min(1.0 - s.missed_hi / s.requests for s in mine if s.requests > 0)
    covered = min(period_s, now_s - min(s.t_s for s in mine))
    return ErrorBudget(kind, objective, period_s, window_floor, total, covered, (1.0 - hi, 1.0 - lo),
                       (1.0 - hi / allowed, 1.0 - lo / allowed), worst)


def planned_share(objective: float, floor: float, budget: ErrorBudget | None, sized_share: float) -> float | None:
    """The share of good requests this window is sized for, where the policy lets the planner spend
    the error budget (`floor` below the objective); None: size for the p99 targets as always.
    `sized_share`: what the p99 targets give (0.99): a share at or above it is planned as the targets.

    >>> b = lambda left: ErrorBudget(ObjectiveKind.PERIOD, 0.99, 3600.0, 0.97, 1e4, 3600.0, (0.995, 0.996),
    ...                              (left, left + 0.1), 0.99)
    >>> [round(planned_share(0.99, 0.97, b(x), 0.99), 4) for x in (1.0, 0.5)]   # all left: the floor
    [0.97, 0.98]
    >>> planned_share(0.99, 0.97, b(-0.2), 0.99), planned_share(0.99, 0.97, None, 0.99)  # spent; unknown
    (None, None)
    >>> planned_share(0.99, 0.99, b(1.0), 0.99)  # no floor below the objective: nothing is spent
    """
    if floor >= objective or budget is None or budget.kind is not ObjectiveKind.PERIOD:
        return None
    left = min(1.0, max(0.0, budget.budget_left[0]))
    share = objective - left * (objective - floor)
    return share if share < sized_share else None
