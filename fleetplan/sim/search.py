"""The one bracket-and-bisect of the simulator's searches: the smallest count that reaches a goal
(best-fixed's replica count, the ground-truth capacity's rate on a geometric grid, the cheapest
setting of a yardstick's ladder)."""

from __future__ import annotations

from collections.abc import Callable


def smallest_count(reaches: Callable[[int], bool], n_max: int, start: int | None = None) -> int | None:
    """The smallest count n in [1, n_max] with `reaches(n)`, for a `reaches` that more replicas never
    turn false (more capacity never serves worse). None: not even n_max reaches it.

    Without `start`: bisection, the largest count first (about log2(n_max) + 1 calls). With a
    `start` near the answer (e.g. the mean rate over a replica's capacity): from there, steps that
    double until the answer is bracketed, then bisection; a few calls, and few far below the
    answer, where a replay is slowest (an overloaded fleet queues every request).

    >>> calls = []
    >>> smallest_count(lambda n: calls.append(n) or n >= 5, 16), calls
    (5, [16, 8, 4, 6, 5])
    >>> calls = []
    >>> smallest_count(lambda n: calls.append(n) or n >= 5, 16, start=6), calls
    (5, [6, 5, 3, 4])
    >>> calls = []
    >>> smallest_count(lambda n: calls.append(n) or n >= 9, 16, start=4), calls
    (9, [4, 5, 7, 11, 9, 8])
    >>> smallest_count(lambda n: n >= 17, 16, start=4) is None
    True
    """
    if n_max < 1:
        return None
    if start is None:
        if not reaches(n_max):
            return None
        lo, hi = 0, n_max  # reaches(hi); lo = 0 never serves
    else:
        n = min(max(start, 1), n_max)
        step = 1
        if reaches(n):
            hi, lo = n, n - step
            while lo >= 1 and reaches(lo):  # walk down in doubling steps until one fails
                hi, step = lo, step * 2
                lo = hi - step
            lo = max(lo, 0)
        else:
            lo = n
            while True:  # walk up in doubling steps until one reaches it
                if lo >= n_max:
                    return None
                hi = min(lo + step, n_max)
                if reaches(hi):
                    break
                lo, step = hi, step * 2
    while hi - lo > 1:  # reaches(hi), not reaches(lo)
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return hi
