"""Latency and capacity for a MIX of request lengths, and the engine speed that explains an observation.

A profile is fitted on benchmark points, each with one prompt and one output length (public benchmark
tables, `vllm bench serve --dataset random`). Real traffic is a distribution with a long tail, and the
p99 TTFT is set by the long prompts and by the wait behind them, not by the mean prompt:

- the replica's utilisation and the decode step time follow the MEAN work of the mix;
- the queue wait follows the mix's residual prefill work E[P*Q]/E[W] (an M/G/1 residual: one long
  prompt ahead of you delays you by its whole prefill);
- every length class sees the same wait, its own prefill and its own chunk steps; the mix's p99 is
  the 1% tail of the mixture: each class's TTFT is a shifted exponential through that class's
  profile p50 and p99, and the mixture's p99 solves sum_i w_i P(TTFT_i > T) = 1%.

With one class this is exactly `fleetplan.models.profile.predict` / `capacity` (tests hold it).

A heavier tail needs more replicas: a 12k-token mean with a 60k-token p99 prompt has a p99 TTFT of the
60k prompt's prefill plus the wait, which a mean-length prediction misses by 5x.

`speed_from_latency` inverts the model: the time scale s (engine speed relative to the profile) at which
the profile predicts the observed p99 at the observed load. s < 1: the engine is slower than the
profile says (another version, a different mix, extrapolation); every duration is 1/s longer and the
capacity at a fixed SLO falls. Pure; numpy on small arrays.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fleetplan.models.profile import (
    PerfParams,
    PerfProfile,
    Workload,
    queue_quantiles,
    queued_work,
    request_stall_ms,
    work_terms,
)

_LN2 = math.log(2.0)
_LN50 = math.log(50.0)

# Probability bins of the prompt-length distribution: finest in the tail, which sets the p99 TTFT.
ISL_BINS: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 1.0)
OSL_BINS: tuple[float, ...] = (0.0, 0.5, 0.9, 1.0)
# The quantile levels an observer should report so that the bins above are resolved.
QUANTILE_LEVELS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.65, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.965, 0.98,
                                      0.985, 0.99, 0.9925, 0.995, 0.9975, 0.999)


@dataclass(frozen=True)
class LengthMix:
    """Request length classes (isl, osl, weight); weights are positive and sum to 1.

    `cached_share` in [0, 1]: the share of every prompt's tokens a replica finds in its prefix
    cache (the observed hit rate, vLLM's prefix_cache_hits / prefix_cache_queries). The prefill
    work, its chunks and its attention use the uncached tokens; the KV memory and the decode
    context still hold the whole prompt. 0 (the default): every prompt token is computed."""

    classes: tuple[tuple[float, float, float], ...]
    cached_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cached_share <= 1.0:  # NaN fails too
            raise ValueError(f"cached_share must be in [0, 1], got {self.cached_share}")

    def with_cached_share(self, share: float | None) -> LengthMix:
        """This mix with `share` of each prompt cached (None: unknown, none assumed)."""
        return replace(self, cached_share=0.0 if share is None else min(1.0, max(0.0, float(share))))

    def mean(self) -> Workload:
        return Workload(isl=sum(i * w for i, _, w in self.classes), osl=sum(o * w for _, o, w in self.classes))

    def isl_quantile(self, q: float) -> float:
        """The q-quantile of the prompt length (class resolution)."""
        acc = 0.0
        for isl, _, w in sorted(self.classes):
            acc += w
            if acc >= q - 1e-12:
                return isl
        return max(i for i, _, _ in self.classes)

    def describe(self) -> str:
        m = self.mean()
        cached = f", {self.cached_share:.0%} of prompt tokens cached" if self.cached_share > 0 else ""
        return (f"isl mean {m.isl:.0f} p50 {self.isl_quantile(0.5):.0f} p99 {self.isl_quantile(0.99):.0f}, "
                f"osl mean {m.osl:.0f} ({len(self.classes)} classes){cached}")

    @staticmethod
    def single(isl: float, osl: float) -> LengthMix:
        return LengthMix(((float(isl), float(osl), 1.0),))


def _quantile_fn(points: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((float(q), float(v)) for q, v in points if 0.0 <= q <= 1.0 and math.isfinite(v) and v >= 0)
    if pts and pts[0][0] > 0.0:
        pts.insert(0, (0.0, 0.0))  # lengths start at 0: interpolate up to the first quantile, not flat
    qs = [q for q, _ in pts]
    vs = list(np.maximum.accumulate([v for _, v in pts]))  # a quantile function never falls
    return np.array(qs), np.array(vs, dtype=float)


def _classes(points: Sequence[tuple[float, float]], bins: Sequence[float], mean: float | None,
             floor: float) -> list[tuple[float, float]]:
    """(value, weight) per probability bin: the quantile at the bin's middle (linear in q between the
    given levels, flat beyond them); rescaled to the exact mean when it is known and close."""
    qs, vs = _quantile_fn(points)
    out = []
    for lo, hi in itertools.pairwise(bins):
        mid = 0.5 * (lo + hi)
        v = float(np.interp(mid, qs, vs)) if len(qs) else floor
        out.append((max(v, floor), hi - lo))
    if mean is not None and math.isfinite(mean) and mean > 0:
        m = sum(v * w for v, w in out)
        if m > 0 and 0.5 <= mean / m <= 2.0:  # coarse buckets: keep the shape, match the exact mean
            out = [(max(v * mean / m, floor), w) for v, w in out]
    return out


def mix_from_quantiles(isl_quantiles: Sequence[tuple[float, float]], osl_quantiles: Sequence[tuple[float, float]],
                       *, isl_mean: float | None = None, osl_mean: float | None = None,
                       cached_share: float | None = None) -> LengthMix:
    """A mix from quantiles ((q, tokens), ...) of the prompt and output length distributions.

    Prompt and output lengths are taken as independent (histograms give only the marginals). An empty
    side uses its mean as one class (and needs the mean).

    >>> m = mix_from_quantiles([(0.5, 1000), (0.99, 8000)], [], osl_mean=200)
    >>> round(m.isl_quantile(0.99)), round(m.mean().osl)
    (7929, 200)
    """
    if isl_quantiles:
        isl = _classes(isl_quantiles, ISL_BINS, isl_mean, 0.0)
    elif isl_mean is not None:
        isl = [(float(isl_mean), 1.0)]
    else:
        raise ValueError("a length mix needs prompt-length quantiles or a mean")
    if osl_quantiles:
        osl = _classes(osl_quantiles, OSL_BINS, osl_mean, 1.0)
    elif osl_mean is not None:
        osl = [(max(float(osl_mean), 1.0), 1.0)]
    else:
        raise ValueError("a length mix needs output-length quantiles or a mean")
    merged: dict[tuple[float, float], float] = {}
    for i, wi in isl:
        for o, wo in osl:
            merged[(i, o)] = merged.get((i, o), 0.0) + wi * wo
    total = sum(merged.values())
    return LengthMix(tuple((i, o, w / total) for (i, o), w in sorted(merged.items()))).with_cached_share(cached_share)


@dataclass(frozen=True)
class MixPrediction:
    ttft_p99_ms: float
    itl_p99_ms: float  # per-request mean inter-token time, p99 over requests (the SLO's definition)
    rho: float
    saturated: bool


def _arrays(mix: LengthMix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = np.array(mix.classes, dtype=float)
    return c[:, 0], c[:, 1], c[:, 2]


def prefill_work(p: PerfParams, isl: Any, cached_share: float = 0.0) -> Any:
    """Prefill work (ms) of prompts of `isl` tokens whose leading `cached_share` is in the prefix
    cache: the profile's p0 + p1 P + p2 P^2 for the computed tokens only. The quadratic (attention)
    term counts the query x key pairs of the computed tokens, which also attend to the cached
    ones: P^2 - C^2 for C cached tokens. At least one token is computed (vLLM recomputes the last
    one). cached_share 0: exactly models.profile.work_terms' prefill."""
    if cached_share <= 0.0:
        return p.p0_ms + p.p1_ms * isl + p.p2_ms * isl * isl
    c = np.minimum(cached_share * isl, np.maximum(isl - 1.0, 0.0))
    return p.p0_ms + p.p1_ms * (isl - c) + p.p2_ms * (isl * isl - c * c)


def _work_terms(p: PerfParams, isl: np.ndarray, osl: np.ndarray, cached_share: float) -> tuple[np.ndarray, np.ndarray]:
    """work_terms with the cached share of each prompt skipped (the decode part is unchanged)."""
    if cached_share <= 0.0:
        return work_terms(p, isl, osl)
    prefill = prefill_work(p, isl, cached_share)
    per_seq = p.s1_ms + p.s2_ms * (isl + osl / 2.0)
    return prefill, prefill + per_seq * (osl - 1.0)


def _x_mem(profile: PerfProfile, isl: np.ndarray, osl: np.ndarray, w: np.ndarray, wbar: float) -> float:
    """Throughput (req/ms) at which the decode batch fills the KV cache: tokens a sequence holds,
    weighted by how long it stays in the batch (its output length)."""
    parts = _x_mem_parts(profile, isl, osl, w)
    return parts if isinstance(parts, float) else _x_mem_at(parts, profile.params.s0_ms, wbar)


def _x_mem_parts(profile: PerfProfile, isl: np.ndarray, osl: np.ndarray, w: np.ndarray) -> float | tuple[float, float]:
    """`_x_mem`'s terms that no duration enters: (the batch that fills the KV cache, the mix's decode
    steps per request), or the throughput itself where it does not depend on the speed (inf, 0)."""
    if profile.kv_tokens is None:
        return math.inf
    stay = np.maximum(osl - 1.0, 1.0)
    tokens = float(np.sum(w * stay * (isl + osl)) / np.sum(w * stay))
    b_max = profile.kv_tokens / max(tokens, 1.0)
    if b_max <= 0:
        return 0.0
    return b_max, float(np.sum(w * (osl - 1.0)))


def _x_mem_at(parts: tuple[float, float], s0_ms: Any, wbar: Any) -> Any:
    b_max, steps = parts
    x = b_max / (steps * s0_ms + b_max * wbar)
    return x if isinstance(x, np.ndarray) else float(x)  # an array: one row per speed (`_latency_at_speeds`)


@dataclass(frozen=True)
class _Terms:
    """The load-independent terms of one profile on one mix (arrays over the length classes)."""

    p: PerfParams
    w: np.ndarray
    isl: np.ndarray  # prompt tokens computed (the uncached ones): the prefill chunks
    osl: np.ndarray  # output tokens: a request's per-request ITL averages its osl - 1 gaps
    prefill: np.ndarray
    wbar: float  # mean work per request (ms)
    resid: float  # the residual prefill work a new prompt queues behind, E[P*Q]/E[W] (ms)
    per_chunk: float  # mean prefill time per chunk (ms)
    mean_chunks: float
    # latency each class's TTFT carries outside this replica's GPU work (ms; 0.0, or one per class):
    # a disaggregated prefill's KV transfer and the decode side's first step (models/disagg.py)
    ttft_added: Any = 0.0


def _wsum(a: np.ndarray) -> Any:
    """The sum over the length classes (the last axis): a float, or a column with one row per speed
    when `a` has one (the same pairwise sum per row: `_latency_at_speeds` relies on it)."""
    s = np.sum(a, axis=-1)
    return float(s) if s.ndim == 0 else s[:, None]


def _terms(p: PerfParams, isl: np.ndarray, osl: np.ndarray, w: np.ndarray, cached_share: float = 0.0) -> _Terms:
    """The terms of `p` on the mix; `p`'s durations may be columns (one row per speed, `_latency_at_speeds`):
    the per-request arrays then have a row per speed, `wbar`, `resid` and `per_chunk` are columns."""
    prefill, work = _work_terms(p, isl, osl, cached_share)
    wbar = _wsum(w * work)
    computed = isl if cached_share <= 0.0 else np.maximum(isl * (1.0 - cached_share), 1.0)  # chunks: computed tokens
    chunks = 1.0 + p.chunk_per_token * computed
    mean_chunks = float(np.sum(w * chunks))
    return _Terms(p, w, computed, osl, prefill, wbar, _wsum(w * prefill * queued_work(p, prefill, work)) / wbar,
                  _wsum(w * prefill) / mean_chunks, mean_chunks)


def _ttft_p99(t: _Terms, x: float) -> float:
    return float(_ttft_p99_many(t, np.array([x]))[0])


def _ttft_quantiles(t: _Terms, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p50, p99) of each length class's TTFT at each throughput in xs (req/ms, rho < 1): rows are
    loads, columns classes."""
    return _ttft_quantiles_at(t, (xs * t.wbar)[:, None])


def _ttft_quantiles_at(t: _Terms, rho: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_ttft_quantiles` at the utilisations `rho` (a column: one row per load, or per speed)."""
    p = t.p
    itl = p.s0_ms / (1.0 - rho)
    tau = p.q * t.resid / (1.0 - rho)
    q50, q99 = queue_quantiles(p, rho, tau)
    fixed = p.ttft_fixed_ms + t.ttft_added + (0.5 + p.chunk_per_token * t.isl)[None, :] * itl
    own = np.atleast_2d(p.prefill_latency_factor * t.prefill)
    return fixed + p.ttft_p50_factor * own + q50, fixed + p.ttft_p99_factor * own + q99


def _ttft_p99_many(t: _Terms, xs: np.ndarray) -> np.ndarray:
    """TTFT p99 of the mix at each throughput in xs (req/ms, rho < 1): shape (len(xs),)."""
    p50, p99 = _ttft_quantiles(t, xs)
    return _mixture_p99(p50, p99, t.w)


def _exceed(p50: Any, p99: Any, target: float) -> Any:
    """P(latency > target) for a shifted exponential through (p50, p99) (as `_mixture_p99`)."""
    b = np.maximum((p99 - p50) / _LN50, 1e-9)
    a = p50 - b * _LN2
    return np.exp(-np.maximum(target - a, 0.0) / b)


def _ttft_share_many(t: _Terms, xs: np.ndarray, target_ms: float) -> np.ndarray:
    """The share of the mix's requests with TTFT <= target at each throughput in xs."""
    p50, p99 = _ttft_quantiles(t, xs)
    return np.asarray(1.0 - np.sum(t.w * _exceed(p50, p99, target_ms), axis=1), dtype=float)


def _itl_share(t: _Terms, x: Any, target_ms: float) -> Any:
    """The share of requests whose per-request ITL is <= target: per class a shifted exponential
    through its p50 and p99 (`_itl_quantiles`)."""
    xs = np.atleast_1d(np.asarray(x, dtype=float))
    p50, p99 = _itl_quantiles(t, xs)
    out = 1.0 - np.sum(t.w * _exceed(p50, p99, target_ms), axis=1)
    return out if np.ndim(x) else float(out[0])


def _itl_quantiles(t: _Terms, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p50, p99) of each length class's per-request ITL at each throughput in xs: rows are loads,
    columns classes. One decode batch for all classes (the mean step, k99 x it); prefill stalls from
    everyone's chunks, which a request's own osl - 1 gaps average (models.profile.itl_p99_request)."""
    return _itl_quantiles_at(t, (xs * t.wbar)[:, None], xs[:, None])


def _itl_quantiles_at(t: _Terms, rho: np.ndarray, x: Any) -> tuple[np.ndarray, np.ndarray]:
    """`_itl_quantiles` at the utilisations `rho` (a column) and throughput `x` (a column, or one
    throughput for every row: `_latency_at_speeds`)."""
    p = t.p
    itl = p.s0_ms / (1.0 - rho)
    base = p.itl_p99_factor * itl * (1.0 + p.itl_p99_load * rho)
    p99 = np.broadcast_to(base, (rho.shape[0], len(t.w)))
    if p.itl_stall_weight > 0.0:
        stall = p.itl_stall_weight * p.prefill_latency_factor * t.per_chunk
        p99 = base + request_stall_ms(stall, x * t.mean_chunks * itl, t.osl[None, :])
    return np.broadcast_to(p.itl_p50_factor * itl, p99.shape), p99


def _itl_p99(t: _Terms, x: Any) -> Any:
    """Per-request ITL p99 of the mix at throughput x (a float, or an array of them)."""
    xs = np.atleast_1d(np.asarray(x, dtype=float))
    p50, p99 = _itl_quantiles(t, xs)
    out = _mixture_p99(np.asarray(p50), np.asarray(p99), t.w)
    return out if np.ndim(x) else float(out[0])


def _mixture_p99(p50: np.ndarray, p99: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per row, T with sum_i w_i P(TTFT_i > T) = 1%, TTFT_i a shifted exponential through its
    (p50_i, p99_i); rows are loads, columns length classes."""
    if p50.shape[1] == 1:
        return np.asarray(p99[:, 0], dtype=float)
    b = np.maximum((p99 - p50) / _LN50, 1e-9)
    a = p50 - b * _LN2
    lo, hi = np.min(a, axis=1), np.max(p99, axis=1)
    # exceed = sum(w * exp(-max(mid - a, 0) / b)) per row, each operation into one buffer (a hot loop on
    # small arrays: allocations and np.sum's wrapper cost more than the rows; the same operations)
    mid, buf = np.empty_like(lo), np.empty(np.broadcast_shapes(a.shape, b.shape, np.shape(w)))
    col = mid[:, None]
    for _ in range(36):
        np.multiply(0.5, np.add(lo, hi, out=mid), out=mid)
        np.subtract(col, a, out=buf)
        np.maximum(buf, 0.0, out=buf)
        np.negative(buf, out=buf)
        np.divide(buf, b, out=buf)
        np.exp(buf, out=buf)
        np.multiply(w, buf, out=buf)
        above = np.add.reduce(buf, axis=1) > 0.01
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
    return np.asarray(hi, dtype=float)


def _scaled_params(p: PerfParams, k: Any) -> PerfParams:
    """`p` with every duration x `k` (a float, or a column of them: one row per speed)."""
    return replace(p, s0_ms=p.s0_ms * k, s1_ms=p.s1_ms * k, s2_ms=p.s2_ms * k, p0_ms=p.p0_ms * k,
                   p1_ms=p.p1_ms * k, p2_ms=p.p2_ms * k, ttft_fixed_ms=p.ttft_fixed_ms * k)


def scaled(profile: PerfProfile, speed: float) -> PerfProfile:
    """The profile of an engine `speed` times as fast: every duration divided by `speed`."""
    if speed == 1.0:
        return profile
    return replace(profile, params=_scaled_params(profile.params, 1.0 / speed))


def predict_mix(profile: PerfProfile, mix: LengthMix, rate_rps: float) -> MixPrediction:
    """TTFT p99 and per-request ITL p99 of the mix at an open-loop rate (inf beyond saturation)."""
    isl, osl, w = _arrays(mix)
    t = _terms(profile.params, isl, osl, w, mix.cached_share)
    x = max(rate_rps, 0.0) / 1000.0
    if x >= min(1.0 / t.wbar, _x_mem(profile, isl, osl, w, t.wbar)):
        return MixPrediction(math.inf, math.inf, x * t.wbar, True)
    return MixPrediction(_ttft_p99(t, x), float(_itl_p99(t, x)), x * t.wbar, False)


def _largest_x(ok: Callable[[np.ndarray], np.ndarray], x_hi: float) -> float:
    """The largest x in [0, x_hi] with ok(x), for ok true below a threshold: three rounds of a
    64-point grid, each inside the previous bracket (relative resolution ~4e-6 of x_hi)."""
    if not bool(ok(np.array([0.0]))[0]):
        return 0.0
    lo, hi = 0.0, x_hi
    for _ in range(3):
        xs = np.linspace(lo, hi, 65)
        good = ok(xs)
        k = int(np.argmin(good)) if not good.all() else len(xs)  # first failing point
        if k == len(xs):
            return hi
        lo, hi = float(xs[k - 1]), float(xs[k])
    return lo


@dataclass(frozen=True)
class MixCapacity:
    max_rps: float
    binding: str  # ttft | itl | memory
    # the share of requests an idle replica serves within both targets when one target's p99 is out
    # of its reach for this mix (its capacity is then sized to within FLOOR_SLACK of that share);
    # None: both p99 targets are reachable
    floor_share: float | None = None


@dataclass(frozen=True)
class Attainment:
    """The predicted share of requests meeting the SLO: TTFT and per-request ITL under their targets
    (the two taken as independent: histograms give only the marginals)."""

    share: float
    ttft_share: float
    itl_share: float


# A config whose idle replica already misses a target for more than 1% of the mix (the p99 out of
# reach: long prompts' own prefill beyond the TTFT target, prefill stalls in every request's
# decode) is sized to within this share of what it can reach: replicas beyond that buy almost no
# SLO. 0.5 points: at a 99% SLO half the misses it allows (0.25 sized the example of
# tests/unit/planner/test_plan_evidence.py at 17 replicas where 13 hold 95.1% of 95.5%: +0.02 points for the last).
FLOOR_SLACK = 0.005
SLO_SHARE = 0.99  # the share of requests a p99 target covers


def _sized(ok: Callable[[np.ndarray], np.ndarray], share: Callable[[np.ndarray], np.ndarray],
           x_hi: float) -> tuple[float, float | None]:
    """(largest x with ok(x), None) when the target's p99 is reachable at all; else (largest x whose
    share stays within FLOOR_SLACK of the idle share, the idle share)."""
    if bool(ok(np.array([0.0]))[0]):
        return _largest_x(ok, x_hi), None
    floor = float(share(np.array([0.0]))[0])
    return _largest_x(lambda xs: share(xs) >= floor - FLOOR_SLACK, x_hi), floor


def _with_added(t: _Terms, ttft_added_ms: Sequence[float] | None) -> _Terms:
    """`t` whose classes' TTFTs each carry the given latency (ms, one per class; None: none)."""
    if ttft_added_ms is None:
        return t
    added = np.asarray(ttft_added_ms, dtype=float)
    if added.shape != t.w.shape:
        raise ValueError(f"ttft_added_ms: one latency per length class ({t.w.shape[0]}), got {added.shape}")
    return replace(t, ttft_added=added[None, :])


def capacity_mix(profile: PerfProfile, mix: LengthMix, *, ttft_p99_ms: float, itl_p99_ms: float,
                 ttft_speed: float = 1.0, itl_speed: float = 1.0,
                 ttft_added_ms: Sequence[float] | None = None) -> MixCapacity:
    """The largest rate one replica sustains with the mix's TTFT p99 and ITL p99 under the targets.

    `ttft_speed` / `itl_speed`: the engine's speed relative to the profile as observed through each
    latency (see `speed_from_latency`); each limit is computed on the profile scaled by its speed,
    the memory limit on the slower of the two. A target whose p99 even an idle replica misses (more
    than 1% of the mix cannot meet it at any load) limits the rate to where the share meeting it is
    within FLOOR_SLACK of the idle share (`floor_share` says so): more replicas would not help.
    `ttft_added_ms`: a latency per length class (in `mix.classes` order) that each class's TTFT
    carries beyond what this replica computes (a disaggregated prefill's KV transfer, models/disagg.py).
    """
    isl, osl, w = _arrays(mix)

    t_t = _with_added(_terms(scaled(profile, ttft_speed).params, isl, osl, w, mix.cached_share), ttft_added_ms)
    x_t, floor_t = _sized(lambda xs: _ttft_p99_many(t_t, xs) <= ttft_p99_ms,
                          lambda xs: _ttft_share_many(t_t, xs, ttft_p99_ms), (1.0 - 1e-9) / t_t.wbar)
    t_i = _terms(scaled(profile, itl_speed).params, isl, osl, w, mix.cached_share)
    x_i, floor_i = _sized(lambda xs: _itl_p99(t_i, xs) <= itl_p99_ms,
                          lambda xs: _itl_share(t_i, xs, itl_p99_ms), (1.0 - 1e-9) / t_i.wbar)
    slow = scaled(profile, min(ttft_speed, itl_speed))
    x_m = _x_mem(slow, isl, osl, w, _terms(slow.params, isl, osl, w, mix.cached_share).wbar)
    x, binding = min((x_t, "ttft"), (x_i, "itl"), (x_m, "memory"), key=lambda c: c[0])
    floor = None
    if floor_t is not None or floor_i is not None:
        it = floor_i if floor_i is not None else float(_itl_share(t_i, 0.0, itl_p99_ms))
        tt = floor_t if floor_t is not None else float(_ttft_share_many(t_t, np.array([0.0]), ttft_p99_ms)[0])
        floor = tt * it
    return MixCapacity(float(x) * 1000.0, binding, floor)


def attainment_mix(profile: PerfProfile, mix: LengthMix, rate_rps: float, *, ttft_ms: float, itl_ms: float,
                   ttft_speed: float = 1.0, itl_speed: float = 1.0) -> Attainment:
    """The share of the mix's requests one replica serves within both targets at `rate_rps` (0 at or
    beyond saturation), at the given speeds (as `capacity_mix`). At rate 0: the config's floor, the
    best any count of it reaches.

    >>> from fleetplan.models.profile import ConfigKey, PerfParams, PerfProfile
    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
    >>> prof = PerfProfile(k, PerfParams(9.0, 0.05, 0.0002, 5.0, 0.06, 2e-7, 1.0))
    >>> mix = LengthMix(((500.0, 200.0, 0.97), (12000.0, 200.0, 0.03)))  # 3% of prompts 12k tokens
    >>> a = attainment_mix(prof, mix, 0.0, ttft_ms=500.0, itl_ms=80.0)  # their own prefill alone ~750 ms
    >>> round(a.ttft_share, 3), round(a.itl_share, 3)
    (0.97, 1.0)
    >>> attainment_mix(prof, mix, 5.0, ttft_ms=500.0, itl_ms=80.0).share < a.share
    True
    """
    isl, osl, w = _arrays(mix)
    t_t = _terms(scaled(profile, ttft_speed).params, isl, osl, w, mix.cached_share)
    t_i = _terms(scaled(profile, itl_speed).params, isl, osl, w, mix.cached_share)
    slow = scaled(profile, min(ttft_speed, itl_speed))
    x = max(rate_rps, 0.0) / 1000.0
    x_max = min(1.0 / t_t.wbar, 1.0 / t_i.wbar,
                _x_mem(slow, isl, osl, w, _terms(slow.params, isl, osl, w, mix.cached_share).wbar))
    if x >= x_max:
        return Attainment(0.0, 0.0, 0.0)
    ts = float(_ttft_share_many(t_t, np.array([x]), ttft_ms)[0])
    its = float(_itl_share(t_i, x, itl_ms))
    return Attainment(ts * its, ts, its)


_SPEED_LO, _SPEED_HI = 0.1, 10.0


def speed_from_latency(profile: PerfProfile, mix: LengthMix, rate_rps: float, observed_p99_ms: float,
                       *, itl: bool) -> float | None:
    """The engine speed s (relative to the profile) at which the profile predicts `observed_p99_ms`
    (TTFT p99, or per-request ITL p99 when `itl`) at `rate_rps` per replica; clamped to [0.1, 10]
    (an infinite observation, a saturated replica, is the lower bound).

    The prediction at speed s is the profile's at rate/s with every duration x 1/s, which falls as s
    rises: bisection on log s. None when the observation cannot be used (not finite, not positive).
    """
    return speeds_from_latency(profile, mix, rate_rps, [observed_p99_ms], itl=itl)[0]


def speeds_from_latency(profile: PerfProfile, mix: LengthMix, rate_rps: float, observed_p99_ms: Sequence[float],
                        *, itl: bool) -> list[float | None]:
    """`speed_from_latency` of each observation (a p99 and its bounds) at the same load, in one pass:
    the same speeds to the last bit, the midpoints the bisections share predicted once."""
    out: list[float | None] = [None] * len(observed_p99_ms)
    if not (math.isfinite(rate_rps) and rate_rps >= 0):
        return out  # NaN, negative: not a latency
    lo0, hi0 = math.log(_SPEED_LO), math.log(_SPEED_HI)
    todo: dict[int, tuple[float, float]] = {}  # observation -> its bisection's interval
    for j, obs in enumerate(observed_p99_ms):
        if not obs > 0:
            continue
        if math.isinf(obs):
            out[j] = _SPEED_LO  # saturated: slower than anything the profile explains (steps are capped)
        else:
            todo[j] = (lo0, hi0)
    if not todo:
        return out
    latency_at = _latency_at_speeds(profile, mix, rate_rps, itl=itl)
    at_hi, at_lo = latency_at([hi0, lo0])
    for j in list(todo):
        if at_hi >= observed_p99_ms[j]:
            out[j] = _SPEED_HI
            del todo[j]
        elif at_lo <= observed_p99_ms[j]:
            out[j] = _SPEED_LO
            del todo[j]
    # 40 halvings each; the midpoints the next BISECT_DEPTH of them may visit are predicted in one batch
    # (per interval a tree in heap order: node i's interval halves into 2i+1, the upper half, and 2i+2),
    # then each walk down its tree takes exactly the path its halvings one by one take
    left = 40
    while left > 0 and todo:
        depth = min(BISECT_DEPTH, left)
        trees: dict[tuple[float, float], int] = {}  # interval -> the offset of its tree's midpoints
        mids: list[float] = []
        for interval in todo.values():
            if interval in trees:
                continue
            trees[interval] = len(mids)
            bounds = [interval]
            for i in range(2 ** depth - 1):
                a, b = bounds[i]
                mid = 0.5 * (a + b)
                mids.append(mid)
                bounds += [(mid, b), (a, mid)]
        lat = latency_at(mids)
        for j, (lo, hi) in todo.items():
            base, i = trees[(lo, hi)], 0
            for _ in range(depth):
                if lat[base + i] > observed_p99_ms[j]:
                    lo, i = mids[base + i], 2 * i + 1
                else:
                    hi, i = mids[base + i], 2 * i + 2
            todo[j] = (lo, hi)
        left -= depth
    for j, (lo, hi) in todo.items():
        out[j] = math.exp(0.5 * (lo + hi))
    return out


BISECT_DEPTH = 5  # halvings predicted per batch: 31 speeds (numpy on small arrays: the calls cost, not the rows)


def _latency_at_speeds(profile: PerfProfile, mix: LengthMix, rate_rps: float, *,
                       itl: bool) -> Callable[[Sequence[float]], list[float]]:
    """The function of log speeds z giving `predict_mix(scaled(profile, exp(z)), mix, rate_rps)`'s TTFT
    p99 (per-request ITL p99 when `itl`) for each z, in one pass with a row per speed: every row does
    the same float operations as the one-speed prediction (tests/unit/models/test_mix.py holds it bit
    for bit). What no speed enters (the mix's arrays, the KV-cache terms) is computed once."""
    isl, osl, w = _arrays(mix)
    x = max(rate_rps, 0.0) / 1000.0
    x_mem = _x_mem_parts(profile, isl, osl, w)
    cached = mix.cached_share

    def at(log_speeds: Sequence[float]) -> list[float]:
        k = np.array([1.0 / math.exp(z) for z in log_speeds])[:, None]
        p = _scaled_params(profile.params, k)
        t = _terms(p, isl, osl, w, cached)
        saturated = x >= np.minimum(1.0 / t.wbar, x_mem if isinstance(x_mem, float) else _x_mem_at(x_mem, p.s0_ms, t.wbar))
        rho = np.asarray(x * t.wbar)
        with np.errstate(all="ignore"):  # saturated rows compute nonsense and are replaced by inf
            p50, p99 = _itl_quantiles_at(t, rho, x) if itl else _ttft_quantiles_at(t, rho)
            out = _mixture_p99(np.asarray(p50), np.asarray(p99), t.w)
        return list(np.where(saturated[:, 0], math.inf, out).tolist())

    return at
