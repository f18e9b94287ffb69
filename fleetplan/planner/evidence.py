"""What the fleet's own metrics say about the profiles: the request-length mix and per-config latency.

Two kinds of evidence feed the planner's mix-aware capacity and online correction (models/mix.py,
planner/correction.py), both read from Prometheus over the same window as the request rate:

- the LENGTH MIX per model: quantiles (fleetplan.models.mix.QUANTILE_LEVELS) of the engines' prompt and
  generation length histograms, `vllm:request_prompt_tokens` / `vllm:request_generation_tokens`
  (histograms with `build_1_2_5_buckets(max_model_len)` edges, vllm/v1/metrics/loggers.py).
  TensorRT-LLM's MetricsCollector (tensorrt_llm/metrics/collector.py) exports no per-request length
  histogram, only the token counters, so a TRT-LLM-only model keeps the means (isl/osl);
- per SERVING CONFIG (model, engine, GPU, TP, precision): the READY replicas that served the whole
  window, their request rate, TTFT p99 (`vllm:time_to_first_token_seconds`,
  `trtllm_time_to_first_token_seconds`), per-request ITL p99 (`vllm:request_time_per_output_token_seconds`:
  one observation per request, its mean inter-token time; NOT `vllm:inter_token_latency_seconds`, which
  has one observation per token gap; TRT-LLM's `trtllm_time_per_output_token_seconds` is per request)
  and the completions behind those quantiles. Prometheus knows replicas (the file_sd `replica` label
  written by controller/routing.py), the controller knows which config each replica runs: the
  per-replica bucket rates are fetched and summed per config here, then the quantile is taken.

The HTTP fetch lives in controller/observe.py; everything here is pure (`interpret` takes the fetched
samples, the fleet and the clock) so the rules are unit-tested: what counts as too few samples, which
replicas count, what a stale model gets (nothing).

Quantiles (issue 17.3): the engines' buckets are coarse (vLLM's 1-2-5 length buckets, 100-250 ms TTFT),
and Prometheus' histogram_quantile (promql/quantile.go, bucketQuantile: linear interpolation inside the
bucket) puts each bucket's requests evenly over it, so its quantiles and the mean they imply are biased
(a day of requests with mean output 1,019 tokens read as 1,282; prompts of exactly 64 tokens as p99 85;
a TTFT p99 of 220 ms as 248). Every histogram also exports `_sum` and `_count`: the exact mean of the
window. `bucket_quantiles` places the requests inside their buckets so that the implied mean IS that mean:
the within-bucket shape is a log-logistic distribution (one location, one scale in ln x) fitted to the
bucket counts (interval-censored likelihood) under the constraint that the buckets' conditional means
add up to sum/count; each bucket keeps its count exactly, only the placement inside it is modelled. One
occupied bucket: every request equals the mean (the histogram shows no spread; a fixed-length load is
read as its length). Each quantile carries its interval, the bounds of the bucket holding its rank: the
value is certainly inside it whatever the placement. Without `_sum`/`_count` the point values are
Prometheus' (linear), with the same intervals. A p99 in the LOWEST bucket (a per-request TPOT under
vLLM's first 10 ms edge) is reported as an upper bound: no value, the interval (0, edge].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from fleetplan.models.mix import QUANTILE_LEVELS
from fleetplan.planner.types import ConfigKey, ConfigObservation, Replica, ReplicaState

# decision rules
MIN_LENGTH_SAMPLES = 20.0  # requests in the window below which a length distribution is not trusted
MIN_P99_SAMPLES = 10.0  # observations below which a p99 is just the maximum of a handful: unknown
MIN_CONFIG_REQUESTS = 1.0  # a config that completed nothing in the window has no evidence

Buckets = tuple[tuple[float, float], ...]  # (upper bound `le`, cumulative count or rate); +Inf = math.inf
Moments = tuple[float, float]  # (rate of the histogram's _sum, rate of its _count) over the window


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) pairs; None where Prometheus gives NaN."""
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        return None
    cleaned = _cleaned(buckets)
    if cleaned is None:
        return None
    rank = q * sum(c for _, _, c in cleaned)
    before = 0.0
    for lo, hi, c in cleaned:  # the first bucket whose cumulative count reaches the rank
        if before + c >= rank:
            if math.isinf(hi):
                return lo  # the +Inf bucket: the highest finite bound
            return hi if c <= 0 else lo + (hi - lo) * ((rank - before) / c)
        before += c
    return cleaned[-1][0]  # not reached: the +Inf bucket's cumulative count is the total


def share_above(buckets: Iterable[tuple[float, float]], limit: float) -> tuple[float, float] | None:
    """The share of a histogram's observations above `limit`, as its buckets bound it: (low, high),
    the bucket holding `limit` counted out of low and into high (equal where `limit` is a bucket
    edge, as SLO targets often are). None: no observations.

    >>> share_above(((0.25, 90.0), (0.5, 98.0), (1.0, 100.0), (math.inf, 100.0)), 0.5)
    (0.02, 0.02)
    >>> share_above(((0.25, 90.0), (0.5, 98.0), (1.0, 100.0), (math.inf, 100.0)), 0.3)
    (0.02, 0.1)
    """
    cleaned = _cleaned(buckets)
    if cleaned is None:
        return None
    total = sum(c for _, _, c in cleaned)
    surely = maybe = 0.0
    for lo, hi, c in cleaned:
        if lo >= limit:
            surely += c
        elif hi > limit:
            maybe += c
    return surely / total, min(1.0, (surely + maybe) / total)


def slo_missed_share(ttft: Buckets, tpot: Buckets, ttft_slo_s: float,
                     itl_slo_s: float) -> tuple[float, float] | None:
    """The share of a window's requests that missed the SLO (TTFT or per-request TPOT above its
    target), bounded from the engines' two histograms: at least the larger share of either, at most
    both added. None: neither histogram has observations.

    >>> slo_missed_share(((0.5, 99.0), (math.inf, 100.0)), ((0.05, 98.0), (math.inf, 100.0)), 0.5, 0.05)
    (0.02, 0.03)
    """
    parts = [x for x in (share_above(ttft, ttft_slo_s), share_above(tpot, itl_slo_s)) if x is not None]
    if not parts:
        return None
    return max(lo for lo, _ in parts), min(1.0, sum(hi for _, hi in parts))


@dataclass(frozen=True)
class QuantileEstimate:
    """A quantile read from a histogram: the estimate, and the bounds of the bucket holding its rank
    (the value is certainly inside them, whatever the placement inside the bucket)."""

    q: float
    value: float
    lo: float  # 0 for the lowest bucket
    hi: float  # math.inf for the +Inf bucket

    @property
    def in_lowest_bucket(self) -> bool:
        return self.lo <= 0.0


def _cleaned(buckets: Iterable[tuple[float, float]]) -> list[tuple[float, float, float]] | None:
    """(lower bound, upper bound, count) per bucket, as Prometheus reads them (NaN bounds and non-finite
    counts dropped, series of one `le` merged, monotonicity evened out, the lowest bucket from 0);
    None where histogram_quantile gives NaN (no +Inf bucket, fewer than 2 buckets, no observations)."""
    merged: dict[float, float] = {}
    for le, c in buckets:
        if math.isnan(le) or not math.isfinite(c):
            continue
        merged[le] = merged.get(le, 0.0) + c
    pts = sorted(merged.items())
    if len(pts) < 2 or pts[-1][0] != math.inf:
        return None
    out: list[tuple[float, float, float]] = []
    prev_le, prev_c = 0.0, 0.0
    for le, c in pts:
        c = max(c, prev_c)
        out.append((min(prev_le, le), le, c - prev_c))
        prev_le, prev_c = le, c
    return out if prev_c > 0 else None


# the within-bucket shape: log-logistic, G(x) = sigmoid((ln x - a) / s), fitted per histogram
_GL_X, _GL_W = np.polynomial.legendre.leggauss(8)
_GL_X, _GL_W = 0.5 * (_GL_X + 1.0), 0.5 * _GL_W  # Gauss-Legendre on [0, 1]: a bucket's conditional mean
_SCALES = np.exp(np.linspace(math.log(0.003), math.log(1.5), 16))  # s: from a point mass to a wide tail
_ZMAX = 30.0  # |z| beyond which a bucket is all at its edge nearest the bulk (sigmoid saturates)
_FIT_STEPS = 36  # bisection steps on the location (ln x) per scale
_FIT_DEPTH = 2  # of them placed per pass (3 midpoints per scale: numpy calls cost more than these rows)
MEAN_TOLERANCE = 0.02  # a sum/count further than this outside what the buckets allow is not their mean


def _g(l_bound: np.ndarray, a: np.ndarray, s: np.ndarray) -> np.ndarray:
    """G at a bound: sigmoid(clip((ln bound - a) / s, -_ZMAX, _ZMAX)), computed in one new array."""
    # each operation into the one array (a hot loop on small arrays: allocations cost as much as the
    # rows); np.minimum(np.maximum(.)) is np.clip without its wrapper's cost
    z = np.subtract(l_bound, a)
    np.divide(z, s, out=z)
    np.maximum(z, -_ZMAX, out=z)
    np.minimum(z, _ZMAX, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    np.add(1.0, z, out=z)
    return np.asarray(np.divide(1.0, z, out=z))


def _placed(a: np.ndarray, s: np.ndarray, llo: np.ndarray, lhi: np.ndarray, lo: np.ndarray, hi: np.ndarray,
            r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x at within-bucket rank r (broadcast), and G at the buckets' bounds: with g = G,
    x = clip(exp(a + s ln(p / (1 - p))), lo, hi), p = clip(gl + r (gu - gl), 1e-300, 1 - 1e-16)."""
    gl, gu = _g(llo, a, s), _g(lhi, a, s)
    return _inside(a, s, gl, gu, lo, hi, r), gl, gu


def _inside(a: np.ndarray, s: np.ndarray, gl: np.ndarray, gu: np.ndarray, lo: np.ndarray, hi: np.ndarray,
            r: np.ndarray) -> np.ndarray:
    """`_placed`'s x from G at the buckets' lower and upper bounds."""
    p = np.multiply(r, (gu - gl)[..., None])
    np.add(gl[..., None], p, out=p)
    np.maximum(p, 1e-300, out=p)
    np.minimum(p, 1.0 - 1e-16, out=p)
    q = np.subtract(1.0, p)
    np.divide(p, q, out=p)
    np.log(p, out=p)
    np.multiply(s[..., None], p, out=p)
    np.add(a[..., None], p, out=p)
    np.exp(p, out=p)
    np.maximum(p, lo[..., None], out=p)
    return np.asarray(np.minimum(p, hi[..., None], out=p))


def _midpoints(a_lo: Sequence[float], a_hi: Sequence[float], depth: int) -> list[list[float]]:
    """Per interval, the midpoints the next `depth` halvings may visit: a tree in heap order (node
    k's interval halves into 2k + 1, the upper half, and 2k + 2)."""
    if depth == 2:  # node 0 halves (lo, hi) at m; node 1 halves (m, hi), node 2 (lo, m)
        return [[m, 0.5 * (m + hi), 0.5 * (lo + m)] for lo, hi in zip(a_lo, a_hi, strict=True)
                for m in (0.5 * (lo + hi),)]
    out = []
    for lo0, hi0 in zip(a_lo, a_hi, strict=True):
        row: list[float] = []
        level = [(lo0, hi0)]
        for _ in range(depth):
            below: list[tuple[float, float]] = []
            for lo, hi in level:
                m = 0.5 * (lo + hi)
                row.append(m)
                below += [(m, hi), (lo, m)]
            level = below
        out.append(row)
    return out


def _fit_shape(occupied: Sequence[tuple[float, float, float]], mean: float) -> tuple[float, float]:
    """(a, s) of the within-bucket shape: per scale s the location a at which the buckets' conditional
    means add up to `mean` (bisection: they rise with a), then the s of the highest interval-censored
    likelihood (ties: the narrowest, so one occupied bucket is a point at the mean). Finite buckets.

    A scale whose likelihood cannot reach the best one's, wherever its bisection ends, stops being
    bisected (`_contenders`); the scales left go on to the same locations, so the fit is the one of
    every scale bisected to the end, to the last bit (tests/unit/planner/test_bucket_evidence.py)."""
    lo = np.array([b[0] for b in occupied])
    hi = np.array([b[1] for b in occupied])
    n = np.array([b[2] for b in occupied])
    nb = len(occupied)
    total = float(n.sum())
    with np.errstate(divide="ignore"):
        lb = np.log(np.concatenate([lo, hi]))  # ln of the lower bounds, then of the upper ones: G once for both
    bounds = np.concatenate([lo[lo > 0], hi])
    ns = len(_SCALES)
    a_lo = [math.log(float(bounds.min())) - 2.0] * ns
    a_hi = [math.log(float(bounds.max())) + 2.0] * ns
    live = list(range(ns))  # the scales still bisected
    left = _FIT_STEPS
    while left > 0:
        # the midpoints the next halvings may visit, per scale, placed in one pass (more of them once
        # few scales are left: the numpy calls cost, not the rows); each scale's walk down its tree
        # takes exactly the path the halvings one by one take
        depth = min(_FIT_DEPTH if len(live) > _FEW_SCALES else _FIT_DEPTH_FEW, left)
        mids = _midpoints([a_lo[j] for j in live], [a_hi[j] for j in live], depth)
        a = np.array(mids)[:, :, None]
        s = (_SCALES if len(live) == ns else _SCALES[live])[:, None, None]
        g = _g(lb, a, s)
        x = _inside(a, s, g[..., :nb], g[..., nb:], lo, hi, _GL_X)
        below_all = ((np.multiply(x, _GL_W, out=x).sum(-1) * n).sum(-1) / total < mean).tolist()
        for j, below, row in zip(live, below_all, mids, strict=True):
            node = 0
            for _ in range(depth):
                if below[node]:
                    a_lo[j], node = row[node], 2 * node + 1
                else:
                    a_hi[j], node = row[node], 2 * node + 2
        left -= depth
        if left > 0 and len(live) > 1:
            with np.errstate(divide="ignore"):
                live = _contenders(live, a_lo, a_hi, lb, n)
    a_fit = 0.5 * (np.array(a_lo) + np.array(a_hi))
    g = _g(lb, a_fit[:, None], _SCALES[:, None])
    ll = (n * np.log(np.maximum(g[:, nb:] - g[:, :nb], 1e-300))).sum(-1)
    if len(live) < ns:  # a scale left behind is below the best (and its tie band): out of the choice
        keep = np.zeros(ns, dtype=bool)
        keep[live] = True
        ll = np.where(keep, ll, -np.inf)
    best = int(np.argmax(ll >= ll.max() - 1e-9 * max(1.0, abs(float(ll.max())))))
    return float(a_fit[best]), float(_SCALES[best])


_FEW_SCALES = 3  # scales left at or below which a pass places _FIT_DEPTH_FEW halvings
_FIT_DEPTH_FEW = 4
_H_SLACK = 1e-12  # what a bucket's computed G(upper) - G(lower) may differ by from its bounds' (float rounding)


def _contenders(live: list[int], a_lo: Sequence[float], a_hi: Sequence[float], lb: np.ndarray,
                n: np.ndarray) -> list[int]:
    """The scales of `live` whose likelihood may still be the best, or within the tie band of the
    best, at the end of their bisection. A scale's location ends inside its interval [a_lo, a_hi] and
    G falls as the location rises, so each bucket's probability G(upper) - G(lower) there lies
    between G(upper; a_hi) - G(lower; a_lo) and G(upper; a_lo) - G(lower; a_hi): bounds of the
    likelihood (widened by _H_SLACK per bucket and a relative margin far above float rounding). A
    scale whose upper bound is below another's lower bound by more than the tie band cannot be chosen."""
    nb = len(n)
    s = _SCALES[live][:, None]
    g_lo = _g(lb, np.array([a_lo[j] for j in live])[:, None], s)  # the highest G of each bound
    g_hi = _g(lb, np.array([a_hi[j] for j in live])[:, None], s)  # the lowest
    up = (n * np.log(np.maximum(g_lo[:, nb:] - g_hi[:, :nb] + _H_SLACK, 1e-300))).sum(-1)
    low = (n * np.log(np.maximum(g_hi[:, nb:] - g_lo[:, :nb] - _H_SLACK, 1e-300))).sum(-1)
    margin = 1e-6 * (1.0 + float(np.max(np.maximum(np.abs(up), np.abs(low)))))
    bar = float(low.max()) - margin
    return [j for j, u in zip(live, (up + margin).tolist(), strict=True) if u >= bar]


def bucket_quantiles(levels: Sequence[float], buckets: Iterable[tuple[float, float]],
                     mean: float | None = None) -> tuple[QuantileEstimate, ...]:
    """The quantiles at `levels` of a cumulative histogram, each with the bounds of its bucket.

    With the window's exact `mean` (the histogram's _sum / _count) the requests are placed inside their
    buckets so that the implied mean is that mean (module docstring); without it, or when the +Inf
    bucket holds requests (its values are unbounded) or the mean is not the buckets' (outside what they
    allow by more than MEAN_TOLERANCE), the values are Prometheus' linear interpolation. () where
    Prometheus gives NaN. Values never fall with the level.

    >>> b = ((50.0, 0.0), (100.0, 500.0), (200.0, 500.0), (math.inf, 500.0))  # 500 prompts in (50, 100]
    >>> [round(e.value, 1) for e in bucket_quantiles((0.5, 0.99), b)]  # Prometheus: spread over the bucket
    [75.0, 99.5]
    >>> [(e.value, e.lo, e.hi) for e in bucket_quantiles((0.5, 0.99), b, mean=64.0)]  # all of them 64
    [(64.0, 50.0, 100.0), (64.0, 50.0, 100.0)]
    """
    cleaned = _cleaned(buckets)
    if cleaned is None:
        return ()
    total = sum(c for _, _, c in cleaned)
    occupied = [b for b in cleaned if b[2] > 0]
    usable = mean is not None and math.isfinite(mean) and mean >= 0 and not math.isinf(occupied[-1][1])
    if usable and mean is not None:
        m_lo = sum(lo * c for lo, _, c in occupied) / total
        m_hi = sum(hi * c for _, hi, c in occupied) / total
        usable = m_lo * (1 - MEAN_TOLERANCE) <= mean <= m_hi * (1 + MEAN_TOLERANCE)
    shape: tuple[float, float] | None = None
    if usable and mean is not None and len(occupied) > 1:
        shape = _fit_shape(occupied, mean)
    found: list[tuple[float, float, float, float]] = []  # per level: q, its bucket's bounds, the rank inside it
    for q in levels:
        if not 0.0 <= q <= 1.0 or math.isnan(q):
            continue
        rank, before = q * total, 0.0
        lo, hi, c = occupied[-1]
        for b in cleaned:
            if b[2] > 0 and before + b[2] >= rank - 1e-12 * total:
                lo, hi, c = b
                break
            before += b[2]
        else:
            before = total - c
        found.append((q, lo, hi, min(max((rank - before) / c, 0.0), 1.0)))
    placed: list[float] = []
    if shape is not None and found:  # every level placed in one pass (a row per level)
        lo_l, hi_l = np.array([f[1] for f in found]), np.array([f[2] for f in found])
        with np.errstate(divide="ignore"):
            x, _, _ = _placed(np.array([shape[0]]), np.array([shape[1]]), np.log(lo_l), np.log(hi_l), lo_l, hi_l,
                              np.array([f[3] for f in found])[:, None])
        placed = x.reshape(-1).tolist()
    out: list[QuantileEstimate] = []
    last = 0.0
    for i, (q, lo, hi, r) in enumerate(found):
        if math.isinf(hi):
            v = lo  # Prometheus: the highest finite bound
        elif usable and mean is not None and shape is None:
            v = min(max(mean, lo), hi)  # one occupied bucket: every request is the mean
        elif shape is not None:
            v = placed[i]
        else:
            v = lo + (hi - lo) * r
        last = max(last, v)
        out.append(QuantileEstimate(q, last, lo, hi))
    return tuple(out)


def mean_of(moments: Moments | None) -> float | None:
    """sum / count of a histogram's window rates; None when unknown (not fetched, nothing counted)."""
    if moments is None:
        return None
    total, count = moments
    if not (math.isfinite(total) and math.isfinite(count)) or count <= 0 or total < 0:
        return None
    return total / count


def parse_le(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        v = float(text)  # "+Inf" parses to inf
    except ValueError:
        return None
    return None if math.isnan(v) else v


@dataclass(frozen=True)
class ReplicaSeries:
    """One scrape target's series over the window (wall-clock rates, as Prometheus returns them)."""

    done_rps: float | None = None  # completions per wall second
    ttft: Buckets = ()  # cumulative bucket rates (seconds)
    tpot: Buckets = ()  # per-request time per output token (seconds)
    ttft_moments: Moments | None = None  # rates of the TTFT histogram's _sum and _count; None: not fetched
    tpot_moments: Moments | None = None


def _empty_models() -> Mapping[str, Buckets]:
    return MappingProxyType({})


def _empty_replicas() -> Mapping[str, ReplicaSeries]:
    return MappingProxyType({})


def _empty_moments() -> Mapping[str, Moments]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Evidence:
    """The raw per-model length histograms and per-replica series of one snapshot."""

    window_s: float  # wall seconds of the rate() window
    time_scale: float = 1.0  # simulated seconds per wall second (lab); histograms hold simulated seconds
    prompt_len: Mapping[str, Buckets] = field(default_factory=_empty_models)  # canonical model -> buckets
    gen_len: Mapping[str, Buckets] = field(default_factory=_empty_models)
    replicas: Mapping[str, ReplicaSeries] = field(default_factory=_empty_replicas)
    # canonical model -> the length histograms' (_sum, _count) rates; None: not fetched (linear quantiles)
    prompt_len_moments: Mapping[str, Moments] | None = None
    gen_len_moments: Mapping[str, Moments] | None = None
    # the length histograms' own rate() window (wall s): a p99 of a minute's few dozen requests is
    # their maximum, and capacity swung with it cycle to cycle; None: `window_s`
    length_window_s: float | None = None


@dataclass(frozen=True)
class ModelEvidence:
    isl_quantiles: tuple[tuple[float, float], ...] = ()
    osl_quantiles: tuple[tuple[float, float], ...] = ()
    configs: tuple[ConfigObservation, ...] = ()
    notes: tuple[str, ...] = ()  # why some evidence was left out
    # the same quantiles with the bounds of the bucket holding each (`QuantileEstimate`): the
    # extrapolation guard reads the most favourable side (planner/capacity.py `extrapolation`)
    isl_estimates: tuple[QuantileEstimate, ...] = ()
    osl_estimates: tuple[QuantileEstimate, ...] = ()
    # the model's TTFT and per-request TPOT histograms summed over every replica with a series
    # (cumulative bucket rates): the share of its requests that missed the SLO (`slo_missed_share`)
    ttft: Buckets = ()
    tpot: Buckets = ()

    def isl_p99_low(self) -> float | None:
        """The lowest prompt-length p99 the histogram allows (its bucket's lower bound); None: unknown."""
        return next((e.lo for e in self.isl_estimates if e.q == 0.99), None)


def length_estimates(buckets: Buckets, window_s: float, moments: Moments | None = None,
                     levels: Sequence[float] = QUANTILE_LEVELS) -> tuple[QuantileEstimate, ...]:
    """The length quantiles at `levels` with their bucket bounds, consistent with the window's exact
    mean when `moments` are known; () with fewer than MIN_LENGTH_SAMPLES requests in the window."""
    if not buckets:
        return ()
    total = max((r for le, r in buckets if le == math.inf), default=0.0)
    if not math.isfinite(total) or total * window_s < MIN_LENGTH_SAMPLES:
        return ()
    return tuple(e for e in bucket_quantiles(levels, buckets, mean_of(moments)) if math.isfinite(e.value))


def length_quantiles(buckets: Buckets, window_s: float, levels: Sequence[float] = QUANTILE_LEVELS,
                     moments: Moments | None = None) -> tuple[tuple[float, float], ...]:
    """((q, tokens), ...) at `levels` (`length_estimates` without the bounds)."""
    return tuple((e.q, e.value) for e in length_estimates(buckets, window_s, moments, levels))


SAMPLING_Z = 2.0  # the p99's sampling interval: the quantiles 2 standard deviations of its rank away


def _p99_ms(buckets: Buckets, window_s: float, moments: Moments | None = None
            ) -> tuple[float | None, tuple[float, float] | None, tuple[float, float] | None]:
    """(p99 in ms, the (lo, hi) ms bounds of its bucket, its sampling interval in ms). A p99 in the
    lowest bucket is an upper bound only: (None, (0, edge), None); too few observations: all None.

    The sampling interval: the p99 of n requests is their (0.99 n)-th smallest; that rank wanders by
    sqrt(n 0.99 0.01) between windows of the same traffic, so the values at the ranks
    SAMPLING_Z such deviations below and above it bound what another window would read (order
    statistics, no shape assumed). A heavy tail (a 70k-token prefill stalling the decode of 1 request in
    40) reads a wide interval, a tight one a narrow interval: planner/correction.py weighs the window
    by it.
    """
    total = max((r for le, r in buckets if le == math.inf), default=0.0)
    n = total * window_s
    if not math.isfinite(total) or n < MIN_P99_SAMPLES:
        return None, None, None
    dq = SAMPLING_Z * math.sqrt(0.99 * 0.01 / n)
    est = bucket_quantiles((max(0.0, 0.99 - dq), 0.99, min(1.0, 0.99 + dq)), buckets, mean_of(moments))
    if len(est) != 3 or not math.isfinite(est[1].value):
        return None, None, None
    low, e, high = est
    bounds = (e.lo * 1000.0, e.hi * 1000.0)
    if e.in_lowest_bucket:
        return None, bounds, None  # "below the first edge": a bound, not a value (an interpolated 9.9 ms is an artefact)
    return e.value * 1000.0, bounds, (low.value * 1000.0, high.value * 1000.0)


def _sum_moments(parts: Iterable[Moments | None]) -> Moments | None:
    """The config's (sum, count): every replica's, or None when any replica's is missing."""
    total = count = 0.0
    for m in parts:
        if m is None:
            return None
        total, count = total + m[0], count + m[1]
    return total, count


def _sum_buckets(parts: Iterable[Buckets]) -> Buckets:
    acc: dict[float, float] = {}
    for b in parts:
        for le, r in b:
            if math.isfinite(r):
                acc[le] = acc.get(le, 0.0) + r
    return tuple(sorted(acc.items()))


def serving_whole_window(r: Replica, now_s: float, window_sim_s: float) -> bool:
    """READY, and READY since before the window opened (unknown since: trusted)."""
    if r.state is not ReplicaState.READY:
        return False
    return r.since_s is None or r.since_s <= now_s - window_sim_s + 1e-9


def interpret(model: str, evidence: Evidence | None, replicas: Sequence[Replica], now_s: float, *,
              stale: bool) -> ModelEvidence:
    """The length mix and per-config observations of `model` (canonical name). Pure.

    Rules: a stale model gets nothing (never plan on partial numbers); a length distribution needs
    MIN_LENGTH_SAMPLES requests in the window; a config's evidence comes only from its READY replicas
    that were READY for the whole window and whose series Prometheus returned (a replica that joined
    mid-window would dilute the load per replica); a config with fewer than MIN_CONFIG_REQUESTS
    completions has none; a p99 over fewer than MIN_P99_SAMPLES observations is unknown (None); a p99
    inside the lowest bucket (e.g. a per-request ITL under vLLM's first 10 ms edge) has no value but its
    range (0, edge]: an upper bound (planner/correction.py reads it as "at least this fast"). Every
    quantile is consistent with the window's exact mean where the histograms' _sum/_count were fetched,
    and carries its bucket's bounds (`ConfigObservation.ttft_p99_range_ms`, `itl_p99_range_ms`).
    Rates are divided by the time scale (simulated rps); completions are counts over the window.
    """
    if stale or evidence is None or evidence.window_s <= 0:
        return ModelEvidence()
    w = evidence.window_s
    lw = evidence.length_window_s or w
    k = evidence.time_scale if evidence.time_scale > 0 else 1.0
    notes: list[str] = []
    isl_e = length_estimates(evidence.prompt_len.get(model, ()), lw,
                             (evidence.prompt_len_moments or {}).get(model))
    osl_e = length_estimates(evidence.gen_len.get(model, ()), lw, (evidence.gen_len_moments or {}).get(model))

    by_config: dict[ConfigKey, list[ReplicaSeries]] = {}
    every: list[ReplicaSeries] = []  # every replica with a series: what the model's requests met
    for r in sorted(replicas, key=lambda r: r.replica_id):
        if r.config.model != model:
            continue
        s = evidence.replicas.get(r.replica_id)
        if s is not None:
            every.append(s)
        if not serving_whole_window(r, now_s, w * k):
            continue
        if s is None or s.done_rps is None or not math.isfinite(s.done_rps):
            notes.append(f"{r.replica_id}: no series in Prometheus (not scraped yet?): left out of "
                         f"{r.config.label()}")
            continue
        by_config.setdefault(r.config, []).append(s)

    configs: list[ConfigObservation] = []
    for c, series in sorted(by_config.items()):
        done = sum(max(0.0, s.done_rps or 0.0) for s in series)
        requests = done * w
        if requests < MIN_CONFIG_REQUESTS:
            continue
        ttft, ttft_range, ttft_spread = _p99_ms(_sum_buckets(s.ttft for s in series), w,
                                                _sum_moments(s.ttft_moments for s in series))
        itl, itl_range, itl_spread = _p99_ms(_sum_buckets(s.tpot for s in series), w,
                                             _sum_moments(s.tpot_moments for s in series))
        configs.append(ConfigObservation(c, len(series), done / k, ttft, itl, requests,
                                         ttft_p99_range_ms=ttft_range, itl_p99_range_ms=itl_range,
                                         ttft_p99_sampling_ms=ttft_spread, itl_p99_sampling_ms=itl_spread))
    return ModelEvidence(tuple((e.q, e.value) for e in isl_e), tuple((e.q, e.value) for e in osl_e),
                         tuple(configs), tuple(notes), isl_e, osl_e,
                         _sum_buckets(s.ttft for s in every), _sum_buckets(s.tpot for s in every))


class _Sample(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def value(self) -> float: ...


@dataclass(frozen=True)
class MomentSamples:
    """The query results of the histograms' _sum and _count rates (None: that query was not run)."""

    prompt_sum: Iterable[_Sample] | None = None
    prompt_count: Iterable[_Sample] | None = None
    gen_sum: Iterable[_Sample] | None = None
    gen_count: Iterable[_Sample] | None = None
    ttft_sum: Iterable[_Sample] | None = None  # per replica
    ttft_count: Iterable[_Sample] | None = None
    tpot_sum: Iterable[_Sample] | None = None
    tpot_count: Iterable[_Sample] | None = None


def collect(prompt_len: Iterable[_Sample], gen_len: Iterable[_Sample], done: Iterable[_Sample],
            ttft: Iterable[_Sample], tpot: Iterable[_Sample], *, model_of: Callable[[Mapping[str, str]], str | None],
            window_s: float, time_scale: float = 1.0, replica_label: str = "replica",
            moments: MomentSamples | None = None, length_window_s: float | None = None) -> Evidence:
    """Evidence from the query results (observe.Sample-like: .labels, .value). Length buckets are
    grouped by canonical model (several label groups of one model summed), the rest by replica.
    `moments`: the _sum/_count rates; a model or replica missing either has none (linear quantiles)."""

    def pairs(total: Iterable[_Sample] | None, count: Iterable[_Sample] | None,
              key: Callable[[Mapping[str, str]], str | None]) -> dict[str, Moments] | None:
        if total is None or count is None:
            return None
        acc: dict[str, list[float]] = {}
        for i, part in enumerate((total, count)):
            for smp in part:
                k = key(smp.labels)
                if not k or not math.isfinite(smp.value):
                    continue
                acc.setdefault(k, [math.nan, math.nan])
                v = acc[k][i]
                acc[k][i] = smp.value if math.isnan(v) else v + smp.value
        return {k: (t, c) for k, (t, c) in acc.items() if not (math.isnan(t) or math.isnan(c))}

    def by_model(samples: Iterable[_Sample]) -> dict[str, Buckets]:
        acc: dict[str, dict[float, float]] = {}
        for s in samples:
            m, le = model_of(s.labels), parse_le(s.labels.get("le"))
            if m is None or le is None or not math.isfinite(s.value):
                continue
            d = acc.setdefault(m, {})
            d[le] = d.get(le, 0.0) + s.value
        return {m: tuple(sorted(d.items())) for m, d in acc.items()}

    def by_replica(samples: Iterable[_Sample]) -> dict[str, Buckets]:
        acc: dict[str, dict[float, float]] = {}
        for s in samples:
            rid, le = s.labels.get(replica_label, ""), parse_le(s.labels.get("le"))
            if not rid or le is None or not math.isfinite(s.value):
                continue
            d = acc.setdefault(rid, {})
            d[le] = d.get(le, 0.0) + s.value
        return {r: tuple(sorted(d.items())) for r, d in acc.items()}

    done_by: dict[str, float] = {}
    for s in done:
        rid = s.labels.get(replica_label, "")
        if rid and math.isfinite(s.value):
            done_by[rid] = done_by.get(rid, 0.0) + s.value
    t, p = by_replica(ttft), by_replica(tpot)
    ms = moments or MomentSamples()

    def rid_of(labels: Mapping[str, str]) -> str | None:
        return labels.get(replica_label) or None

    tm, pm = pairs(ms.ttft_sum, ms.ttft_count, rid_of), pairs(ms.tpot_sum, ms.tpot_count, rid_of)
    reps = {rid: ReplicaSeries(done_by.get(rid), t.get(rid, ()), p.get(rid, ()),
                               None if tm is None else tm.get(rid), None if pm is None else pm.get(rid))
            for rid in sorted(set(done_by) | set(t) | set(p))}
    plm, glm = pairs(ms.prompt_sum, ms.prompt_count, model_of), pairs(ms.gen_sum, ms.gen_count, model_of)
    return Evidence(window_s, time_scale, MappingProxyType(by_model(prompt_len)),
                    MappingProxyType(by_model(gen_len)), MappingProxyType(reps),
                    None if plm is None else MappingProxyType(plm), None if glm is None else MappingProxyType(glm),
                    length_window_s)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no Infinity: null = unbounded


def _range(r: tuple[float, float] | None) -> list[float | None] | None:
    return None if r is None else [r[0], _finite(r[1])]


def evidence_to_json(e: ModelEvidence) -> dict[str, Any]:
    """For the stored observation (what `fleetplan report --json` shows next to the plan)."""
    return {
        "isl_quantiles": [[q, v] for q, v in e.isl_quantiles],
        "osl_quantiles": [[q, v] for q, v in e.osl_quantiles],
        "isl_bounds": [[x.q, x.lo, _finite(x.hi)] for x in e.isl_estimates],
        "osl_bounds": [[x.q, x.lo, _finite(x.hi)] for x in e.osl_estimates],
        "configs": [{"config": c.config.label(), "ready_replicas": c.ready_replicas, "rate_rps": c.rate_rps,
                     "ttft_p99_ms": c.ttft_p99_ms, "itl_p99_ms": c.itl_p99_ms, "requests": c.requests,
                     "ttft_p99_range_ms": _range(c.ttft_p99_range_ms), "itl_p99_range_ms": _range(c.itl_p99_range_ms),
                     "ttft_p99_sampling_ms": _range(c.ttft_p99_sampling_ms),
                     "itl_p99_sampling_ms": _range(c.itl_p99_sampling_ms)}
                    for c in e.configs],
        "notes": list(e.notes),
    }


__all__ = [
    "Evidence",
    "ModelEvidence",
    "MomentSamples",
    "QuantileEstimate",
    "ReplicaSeries",
    "bucket_quantiles",
    "collect",
    "evidence_to_json",
    "histogram_quantile",
    "interpret",
    "length_estimates",
    "length_quantiles",
    "mean_of",
    "parse_le",
    "serving_whole_window",
]
