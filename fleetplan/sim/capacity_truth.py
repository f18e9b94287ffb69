"""Simulated runs of one engine and its ground-truth capacity: `simulate` (an open-loop run through
`fleetplan.sim.batching.BatchCore`), `poisson_arrivals`, and `max_rate_at_slo` (the highest rate
whose p99 TTFT and per-request ITL meet an SLO: the ground-truth capacity search of `fleetplan.sim.core`
for fixed-size requests).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from fleetplan.sim.batching import BatchCore
from fleetplan.sim.core import capacity_at_slo
from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError


@dataclass(frozen=True)
class RunStats:
    """Outcome of an open-loop simulated run (all times in simulated seconds)."""

    completed: int
    duration_s: float
    ttft_s: tuple[float, ...]  # per request
    tpot_s: tuple[float, ...]  # per request mean inter-token time
    output_tokens: int

    @property
    def itl_p99_s(self) -> float:
        """p99 of the per-request ITL (each request's mean inter-token time): the SLO's definition,
        as the meter and the capacity search read it (NaN: no request emitted two tokens)."""
        return _quantile(list(self.tpot_s), 0.99)

    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else math.nan

    def mean_itl_s(self) -> float:
        return sum(self.tpot_s) / len(self.tpot_s) if self.tpot_s else math.nan


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def simulate(
    params: EngineParams,
    arrivals: list[tuple[float, int, int]],
    *,
    seed: int = 0,
    warmup: int = 0,
    max_sim_s: float | None = None,
) -> RunStats:
    """Replay `arrivals` [(t_s, prompt_tokens, output_tokens)] on a BatchCore; TTFT includes the
    persona's frontend overhead. The first `warmup` requests are excluded from the statistics."""
    core = BatchCore(params, seed=seed)
    arrivals = sorted(arrivals)
    overhead = params.factors.ttft_overhead_s
    n = len(arrivals)
    arr_t = [a[0] + overhead for a in arrivals]
    first: dict[str, float] = {}
    counted: set[str] = set()
    ttfts: list[float] = []
    tpots: list[float] = []
    out_tokens = 0
    now = 0.0
    i = 0
    done = 0
    while done < n:
        while i < n and arr_t[i] <= now:
            rid = str(i)
            try:
                core.submit(rid, arrivals[i][1], arrivals[i][2], arr_t[i])
            except RequestTooLongError:
                done += 1
            else:
                if i >= warmup:
                    counted.add(rid)
            i += 1
        if core.idle():
            if i >= n:
                break
            now = arr_t[i]
            continue
        res = core.step(now)
        if res.duration_s <= 0.0:  # nothing schedulable (should not happen); jump to next arrival
            now = arr_t[i] if i < n else now + 1e-3
            continue
        now += res.duration_s
        for rid in res.first_tokens:
            first[rid] = now
            if rid in counted:
                ttfts.append(now - arr_t[int(rid)] + overhead)
        for _rid, k in res.tokens:
            out_tokens += k
        for rid in res.finished:
            done += 1
            if rid in counted:
                emitted = arrivals[int(rid)][2]
                if emitted > 1:
                    tpots.append((now - first[rid]) / (emitted - 1))
            first.pop(rid, None)
        if max_sim_s is not None and now > max_sim_s:
            break
    return RunStats(
        completed=len(tpots) if tpots else len(ttfts),
        duration_s=now,
        ttft_s=tuple(ttfts),
        tpot_s=tuple(tpots),
        output_tokens=out_tokens,
    )


def poisson_arrivals(rate_rps: float, n: int, isl: int, osl: int, seed: int = 0) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        out.append((t, isl, osl))
    return out


@functools.lru_cache(maxsize=4096)
def max_rate_at_slo(params: EngineParams, isl: float, osl: float, ttft_p99_ms: float, itl_p99_ms: float) -> float:
    """Ground-truth capacity of fixed-size requests: the highest Poisson rate (req/s) at which p99 TTFT
    and p99 per-request ITL meet the SLO, by the one capacity search (`fleetplan.sim.core.capacity_at_slo`,
    the SLO's definitions). 0.0 when even a trickle fails. Cached; deterministic for given arguments."""
    return capacity_at_slo(params, [(max(1, round(isl)), max(1, round(osl)))], float(ttft_p99_ms), float(itl_p99_ms))
