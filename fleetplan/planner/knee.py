"""The SLO's own verdicts on a config's windows, and the load at which its replicas missed (the
knee): what bounds a replica's capacity whatever the corrected profile says. Pure.

planner/correction.py keeps each window's verdict in `Correction.slo_windows` for the SLO's period
and gives the knee to the plan (`Speeds.knee_rps`); planner/capacity.py counts a replica for no
more than it, and a sibling nobody saw miss at the knee's ratio (`_siblings_knees`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import TypeVar

__all__ = ["KneeKind", "floor_note", "held_floor", "knee_load", "knee_note", "latency_windows", "queue_knee",
           "sibling_note",
           "slo_missed", "slo_verdict", "slo_windows"]


def slo_missed(p99_ms: float | None, sampling_ms: tuple[float, float] | None, slo_ms: float) -> bool:
    """A window's p99 misses the SLO beyond its sampling noise: the low end of its sampling interval
    (what a window of as many requests would read at its luckiest) is above the SLO; without an
    interval, the point value.

    >>> slo_missed(740.0, (690.0, 800.0), 500.0), slo_missed(540.0, (450.0, 700.0), 500.0)
    (True, False)
    """
    if p99_ms is None or not math.isfinite(p99_ms) or p99_ms <= slo_ms:
        return False
    return _luckiest(p99_ms, sampling_ms) > slo_ms


def _luckiest(p99_ms: float, sampling_ms: tuple[float, float] | None) -> float:
    """What a window of as many requests would read at its luckiest: the low end of the p99's
    sampling interval; without one, the p99 itself."""
    return sampling_ms[0] if sampling_ms is not None and math.isfinite(sampling_ms[0]) else p99_ms


# the most windows of an SLO period kept per config (2 h of 60 s cycles: a day's period keeps its last
# two hours). Why a bound: the state is stored with every plan, a day of plans is kept
MAX_SLO_WINDOWS = 120
KNEE_MIN = 2  # a knee needs this many windows on each side of it
KNEE_MISSED = 0.5  # at or above a knee at least this share of the windows missed
KNEE_BELOW = 0.25  # and below it at most this share


def slo_verdict(ttft_p99_ms: float | None, ttft_sampling_ms: tuple[float, float] | None,
                itl_p99_ms: float | None, itl_sampling_ms: tuple[float, float] | None,
                slo: tuple[float, float]) -> bool | None:
    """A window's verdict by the SLO: True when a p99 missed its target beyond its sampling noise
    (`slo_missed`), False when every p99 read is within its target, None when it is neither (a p99
    above its target within its noise, or none read).

    >>> slo_verdict(740.0, (690.0, 800.0), 40.0, None, (500.0, 50.0)), slo_verdict(400.0, None, 40.0, None, (500.0, 50.0))
    (True, False)
    >>> slo_verdict(540.0, (450.0, 700.0), 40.0, None, (500.0, 50.0)) is None
    True
    """
    if slo_missed(ttft_p99_ms, ttft_sampling_ms, slo[0]) or slo_missed(itl_p99_ms, itl_sampling_ms, slo[1]):
        return True
    read = [(p, t) for p, t in ((ttft_p99_ms, slo[0]), (itl_p99_ms, slo[1])) if p is not None and math.isfinite(p)]
    if read and all(p <= t for p, t in read):
        return False
    return None


def knee_load(windows: Sequence[tuple[float, float, bool]]) -> float | None:
    """The load per replica (rps) at which this config's replicas were seen to miss the SLO, from
    the SLO period's windows: the lowest load of a missed window at or above which at least
    KNEE_MISSED of the windows missed while below it at most KNEE_BELOW did, KNEE_MIN windows or
    more on each side; None: no such load (no miss, or misses at every load).

    Why: the online correction moves the profile's speed, not its shape; where the engine's knee
    sits lower than the profile's (a benchmark of other lengths, TP4 at 70B), windows far below the
    knee read a speed that carries the capacity above the load at which the replicas missed. The
    SLO's own verdicts say where the knee is, whatever the profile: the plan does not count a replica
    for more than that load while the period remembers it. Misses at low loads as often as at high
    ones (a long prompt's prefill in any window) are no knee: more replicas would not fix them.

    >>> w = [(0, 3.0, False), (0, 4.0, False), (0, 4.5, False), (0, 5.2, True), (0, 5.4, True), (0, 7.3, True)]
    >>> knee_load(w)
    5.2
    >>> knee_load([(0, x, m) for x, m in [(1.0, True), (2.0, False), (3.0, True), (4.0, False), (5.0, True)]]) is None
    True
    """
    pts = sorted((x, m) for _, x, m in windows if x > 0 and math.isfinite(x))
    missed_before = [0]  # misses among the first i windows by load
    for _, m in pts:
        missed_before.append(missed_before[-1] + m)
    n, total = len(pts), missed_before[-1]
    first = 0  # the first window at this load (ties count as at or above it)
    for i, (x, missed) in enumerate(pts):
        if i == 0 or x > pts[i - 1][0]:
            first = i
        if not missed:
            continue
        below, missed_below = first, missed_before[first]
        above, missed_above = n - first, total - missed_before[first]
        if (below >= KNEE_MIN and missed_above >= KNEE_MIN and missed_above >= KNEE_MISSED * above
                and missed_below <= KNEE_BELOW * below):
            return x
    return None


def held_floor(windows: Sequence[tuple[float, float, bool]]) -> float | None:
    """The load per replica (rps) this config's replicas were seen to hold the SLO at, below every
    load at which one of its windows missed: the KNEE_MIN-th highest such held load (one window
    may have been a light one); None: fewer held windows below every miss.

    Why: the knee's mirror. A window whose p99s were clearly within the targets at a load shows
    that a replica carries that load at the SLO, whatever the profile's shape says; where that shape
    is wrong the other way (a roofline prior's queue for prompts beyond its data, a mix the
    benchmark never held), the speeds the windows read count a replica for less than it was seen
    to carry. Below every miss only: a miss at a lower load (a heavier mix since, a long prompt's
    prefill) takes the floor down to the loads held below it, so one miss is enough to undo it.

    >>> w = [(0, 3.0, False), (0, 4.0, False), (0, 4.5, False), (0, 5.2, True), (0, 6.0, False)]
    >>> held_floor(w)
    4.0
    >>> held_floor([(0, 1.0, True), (0, 3.0, False), (0, 4.0, False)]) is None
    True
    """
    lowest_miss = min((x for _, x, missed in windows if missed), default=math.inf)
    held = sorted((x for _, x, missed in windows if not missed and 0 < x < lowest_miss), reverse=True)
    return held[KNEE_MIN - 1] if len(held) >= KNEE_MIN else None


class KneeKind(Enum):
    """What a knee was read from."""

    MISSES = "misses"  # the replicas' windows missed the SLO at that load (`knee_load`)
    QUEUE = "queue"  # their TTFT queue reaches the target there (`queue_knee`)


def knee_note(knee_rps: float, kind: KneeKind = KneeKind.MISSES) -> str:
    """What the explanation says of a capacity held to its knee."""
    if kind is KneeKind.QUEUE:
        return f"its replicas' TTFT queue reaches the target at {knee_rps:.2f} rps per replica: counted for no more"
    return f"its replicas missed the SLO at {knee_rps:.2f} rps per replica and above: counted for no more"


def sibling_note(ratio: float, kind: KneeKind) -> str:
    """What the explanation says of a config counted at the ratio its sibling's knee showed.

    >>> sibling_note(0.8, KneeKind.QUEUE)
    "counted x0.80: a sibling's replicas showed a TTFT queue reaching the target below what its speeds said"
    """
    shown = ("showed a TTFT queue reaching the target" if kind is KneeKind.QUEUE else "missed the SLO")
    return f"counted x{ratio:.2f}: a sibling's replicas {shown} below what its speeds said"


def floor_note(floor_rps: float) -> str:
    """What the explanation says of a capacity raised to the load its replicas held."""
    return f"its replicas held the SLO at {floor_rps:.2f} rps per replica below every miss: counted for no less"


W = TypeVar("W", tuple[float, float, bool], tuple[float, float, float, float])


def _in_period(prev: tuple[W, ...], now_s: float, period_s: float | None) -> tuple[W, ...]:
    """The windows (t_s first) of the SLO's period ending now (None: every one)."""
    return tuple(w for w in prev if period_s is None or now_s - w[0] < period_s)


def slo_windows(prev: tuple[tuple[float, float, bool], ...], verdict: bool | None, load: float,
                now_s: float, period_s: float | None) -> tuple[tuple[float, float, bool], ...]:
    kept = _in_period(prev, now_s, period_s)
    if verdict is not None and load > 0:
        kept = (*kept, (now_s, load, verdict))
    return kept[-MAX_SLO_WINDOWS:]


QUEUE_MIN_WINDOWS = 4  # a queue's curve needs its lightest windows and loaded ones
QUEUE_LIGHT = 3  # the lightest windows whose median TTFT p99 is the latency without a queue
QUEUE_SHOWN = 1.2  # a window shows a queue when its TTFT p99 is this many times that latency
QUEUE_TOP = 3  # the most loaded such windows whose median reading is taken


def queue_knee(windows: Sequence[tuple[float, float, float, float]], target_ms: float) -> float | None:
    """The load per replica (rps) at which the replicas' own TTFT curve reaches the target, read as
    a queue's: from the SLO period's windows (t_s, load per replica, TTFT p99 ms, the low end of its
    sampling interval ms), the latency without a queue (the median p99 of the QUEUE_LIGHT lightest
    windows: prefill of the long prompts) and, per window that held the target with a queue shown
    beyond its noise (the low end of its p99's sampling interval above QUEUE_SHOWN x that latency),
    the load at which a waiting time growing as 1 / (1 - utilisation) reaches the target, read at
    that low end; the median of the QUEUE_TOP most loaded. None: fewer than QUEUE_MIN_WINDOWS
    windows, or no queue shown below the target.

    Why: a profile outside its data (a roofline prior) can read the right speed at the loads seen and
    still put the knee too far out: its queue grows too slowly with load. azure x4's TensorRT-LLM TP4
    replicas read TTFT x0.89 of the prior (capacity 6.5 rps per replica) while their p99 went
    332 -> 715 ms from 2.0 to 4.4 rps against a 1,000 ms target: the queue says ~5.5-5.9, the ground
    truth is 4.4 (p99 in every window), and the replicas missed at 5.2. At utilisation u the
    p99 of an M/M/1 queue's time in system is the service time's x 1 / (1 - u); with the light
    latency b, a window at load x with p99 w has u = 1 - b / w, and the target T is reached at
    u_T = 1 - b / T, so at x * u_T / u. Beyond the noise: at 1-2 rps a window's p99 is its one or
    two slowest requests, and one long prompt among them is no queue (`latency_windows`).

    >>> w = [(0, 2.0, 330.0, 320.0), (0, 2.1, 340.0, 330.0), (0, 2.3, 335.0, 325.0), (0, 3.2, 420.0, 410.0),
    ...      (0, 4.4, 715.0, 700.0), (0, 4.5, 675.0, 665.0)]
    >>> round(queue_knee(w, 1000.0), 2)   # light 335 ms: the target at u 0.665; 4.5, 4.4, 3.2 rps read 6.03, 5.61, 11.6
    6.03
    >>> queue_knee([(0, 2.0, 330.0, 320.0), (0, 2.5, 340.0, 330.0), (0, 3.0, 335.0, 325.0), (0, 3.5, 338.0, 328.0)],
    ...            1000.0) is None  # no queue
    True
    >>> queue_knee([(0, 1.0, 500.0, 450.0), (0, 1.1, 520.0, 470.0), (0, 1.2, 510.0, 460.0), (0, 1.6, 900.0, 520.0)],
    ...            1000.0) is None  # a p99 of 900 ms whose window could read 520: one long prompt, no queue
    True
    """
    pts = sorted((x, ms, lo) for _, x, ms, lo in windows if x > 0 and math.isfinite(ms) and ms > 0 and lo > 0)
    if len(pts) < QUEUE_MIN_WINDOWS or not target_ms > 0:
        return None
    light = sorted(ms for _, ms, _lo in pts[:QUEUE_LIGHT])[QUEUE_LIGHT // 2]
    if light >= target_ms:
        return None
    loaded = sorted(((x, lo) for x, ms, lo in pts if QUEUE_SHOWN * light < lo and ms <= target_ms),
                    reverse=True)[:QUEUE_TOP]
    if not loaded:
        return None
    reach = sorted(x * (1.0 - light / target_ms) / (1.0 - light / lo) for x, lo in loaded)
    return reach[len(reach) // 2]


# a window's TTFT enters the queue's curve only when its p99 was read from this many requests or more
# (more than planner/evidence.py's MIN_P99_SAMPLES, from which a window's p99 is read at all: a speed
# reading weighs a small window by its sampling interval, a queue compares windows' quantiles)
QUEUE_MIN_REQUESTS = 100.0


def latency_windows(prev: tuple[tuple[float, float, float, float], ...], ttft_ms: float | None,
                    sampling_ms: tuple[float, float] | None, load: float,
                    now_s: float, period_s: float | None, requests: float) -> tuple[tuple[float, float, float, float], ...]:
    """The SLO period's (t_s, load per replica, TTFT p99 ms, low ms) windows after this one
    (`queue_knee`): low is the low end of the p99's sampling interval (`sampling_ms`, what a window
    of as many requests would read at its luckiest; without one, the p99 itself). A window of fewer
    than QUEUE_MIN_REQUESTS `requests` is not kept.

    Why: the p99 of n < 100 requests is their slowest one, which reads on average the n / (n + 1)
    quantile of their latencies, not the 99th: a window at half the load reads a lower quantile of
    the same prompts' prefill. So the lightest windows of a light day read a "latency without a
    queue" below the loaded windows' with no queue at all. Measured: a coding day at 1 rps
    (one TensorRT-LLM TP1 replica, windows of 6-40 requests) read a queue reaching the 500 ms
    target at 0.6-1.7 rps per replica against a ground truth of 2.7 (docs/decisions/0030).

    >>> latency_windows((), 900.0, (520.0, 1400.0), 1.5, 60.0, 3600.0, 180.0)
    ((60.0, 1.5, 900.0, 520.0),)
    >>> latency_windows((), 900.0, (520.0, 1400.0), 0.5, 60.0, 3600.0, 30.0)  # its slowest request
    ()
    """
    kept = _in_period(prev, now_s, period_s)
    if (ttft_ms is not None and math.isfinite(ttft_ms) and ttft_ms > 0 and load > 0
            and requests >= QUEUE_MIN_REQUESTS):
        low = _luckiest(ttft_ms, sampling_ms)
        kept = (*kept, (now_s, load, ttft_ms, min(ttft_ms, low) if low > 0 else ttft_ms))
    return kept[-MAX_SLO_WINDOWS:]
