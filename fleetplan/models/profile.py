"""Performance profiles of one serving configuration and what they predict.

A profile answers, for one (model, engine, GPU type, TP size, precision): given an ISL/OSL mix and a
request rate (open loop) or a number of concurrent clients (closed loop), what TTFT and ITL do
requests see, what output throughput results, and what is the largest request rate that meets a
TTFT-p99 and an ITL-p99 target.

The model has physical structure (all times in milliseconds, X = throughput in requests per ms):

    P    = p0 + p1*isl + p2*isl^2              prefill work of one request (linear + attention term)
    d    = s1 + s2*(isl + osl/2)               decode work per sequence per step (compute + KV read)
    W    = P + d*(osl - 1)                     GPU work one request adds beyond the fixed step cost
    rho  = X*W                                 utilisation; X_sat = 1/W
    ITL  = s0 / (1 - rho)                      s0: fixed step cost (weights read from HBM once a step)
    B    = X*(osl - 1)*ITL                     sequences in the decode batch (Little's law)
    Wq   = q*P*rho/(1 - rho)                   queueing for prefill as load nears saturation
    TTFT = L0 + f*P + (1/2 + c*isl)*ITL + Wq   front end + own prefill + the running step and one
                                               step per prefill chunk (c = 1/chunk) + queue

The step time rises with the batch size (s1) and the context tokens in the batch (s2); the fixed
step cost s0 has the roofline prior weight bytes / HBM bandwidth. The KV cache holds kv_tokens, so
the batch is capped at kv_tokens / (isl + osl): an open-loop rate needing more is beyond one replica
(capacity binding "memory"); in a closed loop the clients the batch cannot hold queue for a slot.
Percentiles: TTFT p50/p99 scale the own-prefill term with fitted factors and the queueing wait like
an exponential (ln 2, ln 100); ITL p50/p99 are fitted multiples of the mean. Every quantity rises
with load, and every solve (closed loop, KV limit, capacity) is in closed form.

Every function here is pure; the equation helpers work on floats and on numpy arrays alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from fleetplan.models.config_key import ConfigKey as ConfigKey  # the one configuration identity
from fleetplan.models.config_key import Role as Role
from fleetplan.models.hardware import GPU_SPECS, llm_spec
from fleetplan.models.names import (
    Engine,
    GpuType,
    Precision,
    model_key,
    parse_engine,
    parse_gpu,
    parse_precision,
)

PROFILES_FORMAT_VERSION = 1
_LN2 = math.log(2.0)
_LN100 = math.log(100.0)


class ProfileError(ValueError):
    """A PROFILES.json document that cannot be read; the message names the field and value."""


@dataclass(frozen=True)
class Workload:
    isl: float  # mean prompt tokens
    osl: float  # mean output tokens


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class Prediction:
    ttft: LatencyStats
    itl: LatencyStats
    output_tok_s: float
    request_rps: float
    concurrency: float  # requests in the system (Little's law) or the given client count
    warnings: tuple[str, ...]
    batch: float = 0.0  # mean sequences in the decode batch
    saturated: bool = False  # the load is beyond what one replica sustains: latencies are inf


class Binding(StrEnum):
    TTFT = "ttft"
    ITL = "itl"
    MEMORY = "memory"


@dataclass(frozen=True)
class Capacity:
    max_rps: float
    binding: Binding
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class PerfParams:
    """Fitted parameters of the physical model (milliseconds; see the module docstring)."""

    s0_ms: float  # fixed cost of one decode step
    s1_ms: float  # per sequence in the batch, per step
    s2_ms: float  # per context token in the batch, per step
    p0_ms: float  # fixed prefill cost per request
    p1_ms: float  # per prompt token
    p2_ms: float  # per prompt token squared (attention)
    q: float  # queueing coefficient
    ttft_p50_factor: float = 0.95  # p50 prefill / mean prefill
    ttft_p99_factor: float = 1.6  # p99 prefill / mean prefill
    itl_p50_factor: float = 0.95
    itl_p99_factor: float = 1.8
    chunk_per_token: float = 1.0 / 8192.0  # 1 / prefill chunk size: steps a prompt token waits for
    ttft_fixed_ms: float = 2.0  # latency outside the GPU: HTTP, tokenisation, scheduling
    prefill_latency_factor: float = 1.0  # a prompt's prefill latency / the GPU work it adds
    queue_decode_share: float = 1.0  # how much decode work, next to prefill, new prompts queue behind
    itl_stall_weight: float = 0.0  # share of a prefill chunk's time a stalled token gap carries (p99 gap)
    closed_loop_sync: float = 0.0  # 0..1: how much closed-loop clients move in waves (prefills together)
    queue_tail: float = 0.0  # 0..1: share of the queue wait with an M/M/1 tail (0: exponential, old profiles)
    itl_p99_load: float = 0.0  # per-request (TPOT) p99: k99*ITL*(1 + this*rho), spread rising with load

    def as_tuple(self) -> tuple[float, ...]:
        return (self.s0_ms, self.s1_ms, self.s2_ms, self.p0_ms, self.p1_ms, self.p2_ms, self.q,
                self.ttft_p50_factor, self.ttft_p99_factor, self.itl_p50_factor, self.itl_p99_factor,
                self.chunk_per_token, self.ttft_fixed_ms, self.prefill_latency_factor,
                self.queue_decode_share, self.itl_stall_weight, self.closed_loop_sync,
                self.queue_tail, self.itl_p99_load)

    @staticmethod
    def from_tuple(values: tuple[float, ...] | list[float]) -> PerfParams:
        return PerfParams(*[float(v) for v in values])


PARAM_NAMES: tuple[str, ...] = (
    "s0_ms", "s1_ms", "s2_ms", "p0_ms", "p1_ms", "p2_ms", "q",
    "ttft_p50_factor", "ttft_p99_factor", "itl_p50_factor", "itl_p99_factor", "chunk_per_token",
    "ttft_fixed_ms", "prefill_latency_factor", "queue_decode_share", "itl_stall_weight",
    "closed_loop_sync", "queue_tail", "itl_p99_load",
)
_OPTIONAL_PARAMS = {"chunk_per_token": 1.0 / 8192.0, "ttft_fixed_ms": 2.0, "prefill_latency_factor": 1.0,
                    "queue_decode_share": 1.0, "itl_stall_weight": 0.0, "closed_loop_sync": 0.0,
                    "queue_tail": 0.0, "itl_p99_load": 0.0}


@dataclass(frozen=True)
class FitError:
    """Leave-one-out mean absolute percentage error per metric (None: no data for the metric)."""

    points: int
    ttft_mape: float | None
    itl_mape: float | None
    throughput_mape: float | None


@dataclass(frozen=True)
class DataRange:
    isl: tuple[float, float]
    osl: tuple[float, float]
    rate_rps: tuple[float, float] | None  # open-loop points
    concurrency: tuple[float, float] | None  # closed-loop points
    latency_points: int | None = None  # points below saturation with TTFT or ITL (None: not recorded)
    # the benchmark's requests had varied lengths (a real dataset, not fixed ISL/OSL): its latencies
    # already include the spread of that mix, so capacity is computed at the mean, not per class
    length_spread: bool = False


@dataclass(frozen=True)
class PerfProfile:
    key: ConfigKey
    params: PerfParams
    kv_tokens: float | None = None  # KV-cache capacity in tokens (None: unknown, no memory limit)
    source: str = "fit"  # "fit" (from benchmark points) or "roofline" (prior only)
    fit_error: FitError | None = None
    data_range: DataRange | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


# --------------------------------------------------------------------------------------------
# The model equations. Written with + - * / and ** only, so that fit.py evaluates the same
# expressions on numpy arrays (one point per element); every solve below is in closed form.


def work_terms(p: PerfParams, isl: Any, osl: Any) -> tuple[Any, Any]:
    """(P, W): prefill work of one request and all GPU work it adds beyond the fixed step cost (ms)."""
    prefill = p.p0_ms + p.p1_ms * isl + p.p2_ms * isl * isl
    per_seq = p.s1_ms + p.s2_ms * (isl + osl / 2.0)
    return prefill, prefill + per_seq * (osl - 1.0)


def queued_work(p: PerfParams, prefill: Any, work: Any) -> Any:
    """GPU work per request a new prompt queues behind: its prefill and a share r of the decode."""
    return prefill + p.queue_decode_share * (work - prefill)


def latency_terms(p: PerfParams, isl: Any, osl: Any, x: Any) -> tuple[Any, Any, Any, Any, Any]:
    """(ITL, TTFT mean, TTFT p50, TTFT p99, decode batch) at throughput x (requests/ms), rho < 1."""
    prefill, work = work_terms(p, isl, osl)
    rho = x * work
    itl = p.s0_ms / (1.0 - rho)
    tau = p.q * prefill * queued_work(p, prefill, work) / work / (1.0 - rho)  # wait of those who wait
    wq = rho * tau  # mean wait
    steps = (0.5 + p.chunk_per_token * isl) * itl  # wait for the running step, then one per chunk
    fixed = p.ttft_fixed_ms + steps
    own = p.prefill_latency_factor * prefill
    q50, q99 = queue_quantiles(p, rho, tau)
    return (itl, fixed + own + wq, fixed + p.ttft_p50_factor * own + q50,
            fixed + p.ttft_p99_factor * own + q99, x * (osl - 1.0) * itl)


def queue_quantiles(p: PerfParams, rho: Any, tau: Any) -> tuple[Any, Any]:
    """p50 and p99 of the queue wait whose mean is rho*tau.

    Exponential (old profiles, queue_tail 0): ln(2) and ln(100) times the mean. M/M/1 (queue_tail
    1): a share rho of the requests waits, exponentially with mean tau, so P(wait > t) =
    rho*exp(-t/tau) and the q-quantile is tau*ln(rho/(1-q)) once rho > 1-q, else 0: at light load
    the p99 is a rare long wait, the median none. Both rise with rho; queue_tail blends them."""
    a = p.queue_tail
    wq = rho * tau
    mm1_50 = tau * np.log(np.maximum(2.0 * rho, 1.0))
    mm1_99 = tau * np.log(np.maximum(100.0 * rho, 1.0))
    return (1.0 - a) * _LN2 * wq + a * mm1_50, (1.0 - a) * _LN100 * wq + a * mm1_99


# P(at least k prefill chunks in one step) reaches 1% for a Poisson count with these means (k = 1..4)
_STALL_THRESHOLDS = (0.01005, 0.1486, 0.4360, 0.8232)
_STALL_SHARPNESS = 12.0


def itl_p99_gap(p: PerfParams, isl: Any, osl: Any, x: Any, itl: Any) -> Any:
    """p99 of all token gaps (vllm bench serve's p99_itl, vLLM's inter_token_latency histogram).

    k99*ITL plus prefill stalls: a step that also computes a prompt chunk takes the chunk's prefill
    time longer, so once more than 1% of the steps carry one the p99 gap includes it (and two
    chunks once 1% of the steps carry two, ...). Chunks per step are Poisson with mean
    phi = x * chunks_per_prompt * ITL; each threshold crossing is a smooth step in phi. The stall
    weight is fitted only on per-gap ITL p99 data (0 for per-request TPOT p99, whose mean over a
    request's tokens averages the stalls away). Per-request data instead fit itl_p99_load: the
    spread of the per-request mean rises with utilisation rho, k99*ITL*(1 + itl_p99_load*rho)."""
    base, stall, chunks = _itl_terms(p, isl, osl, x, itl)
    if stall is None:
        return base
    return base + stall * _stall_steps(x * chunks * itl)


def _itl_terms(p: PerfParams, isl: Any, osl: Any, x: Any, itl: Any) -> tuple[Any, Any, Any]:
    """(k99*ITL*(1 + itl_p99_load*rho), one prefill chunk's stall time or None without a stall term,
    prefill chunks per prompt): what the per-gap and the per-request ITL p99 share."""
    prefill, work = work_terms(p, isl, osl)
    base = p.itl_p99_factor * itl * (1.0 + p.itl_p99_load * x * work)
    chunks = 1.0 + p.chunk_per_token * isl
    if p.itl_stall_weight <= 0.0:
        return base, None, chunks
    return base, p.itl_stall_weight * p.prefill_latency_factor * prefill / chunks, chunks


def _stall_steps(m: Any) -> Any:
    """The smooth count of Poisson thresholds (mean m) passed: k where P(count >= k) reaches 1%, k = 1..4."""
    count = 0.0
    for t in _STALL_THRESHOLDS:
        z = (m / t) ** _STALL_SHARPNESS
        count = count + z / (1.0 + z)
    return count


def poisson_p99(m: Any) -> Any:
    """The 99th percentile of a Poisson count of mean m, smooth and rising in m: the thresholds of
    `itl_p99_gap` (k = 1..4) up to m = 1, the normal approximation m + 2.326 sqrt(m) once it is
    larger (from m ~ 1.2; at m = 1 the thresholds give 3.97, the normal 3.33: continuous)."""
    count = _stall_steps(m)
    return np.where(m > 1.0, np.maximum(count, m + 2.326 * np.sqrt(np.maximum(m, 0.0))), count)


def itl_p99_request(p: PerfParams, isl: Any, osl: Any, x: Any, itl: Any) -> Any:
    """p99 over requests of each request's mean inter-token time (TPOT: the SLO's ITL, vLLM's
    request_time_per_output_token histogram).

    k99*ITL*(1 + itl_p99_load*rho) plus the prefill stalls of a request's own gaps: over its
    n = osl - 1 gaps the stalls are Poisson with mean m = phi*n, the 1% of requests with the most
    carry poisson_p99(m) of them, spread over n gaps. One gap: the per-gap p99's stall
    (`itl_p99_gap`); a 1,000-token output averages them away (their mean, also in ITL through rho,
    is counted twice: a small, conservative overlap that keeps the p99 rising with load). Why: the stall weight is fitted on per-gap p99 data, and a per-request p99 that kept
    the whole per-gap stall halved the demo's fitted capacity (ITL p99 29 ms predicted where its
    benchmark measured a TPOT p99 of 21 ms).
    """
    base, stall, chunks = _itl_terms(p, isl, osl, x, itl)
    if stall is None:
        return base
    return base + request_stall_ms(stall, x * chunks * itl, osl)


def request_stall_ms(stall_ms: Any, stalls_per_gap: Any, osl: Any) -> Any:
    """What prefill stalls add to the p99 request's mean inter-token time: over its n = osl - 1 gaps
    the stalls are Poisson with mean stalls_per_gap x n; the 1% of requests with the most carry
    poisson_p99 of them, spread over the n gaps (itl_p99_request; models.mix per length class)."""
    n = np.maximum(osl - 1.0, 1.0)
    return stall_ms * poisson_p99(stalls_per_gap * n) / n


def closed_loop_shift(p: PerfParams, isl: Any, osl: Any, x: Any, itl: Any) -> tuple[Any, Any]:
    """(ITL, TTFT added) in a closed loop whose clients move in waves (fixed lengths: they finish
    together and send their next prompts together). A share `closed_loop_sync` of the prefill work
    then runs before the wave's first tokens instead of between its decode steps: the ITL falls
    towards the decode-only step time s0/(1 - x*(W - P)) and the TTFT carries the difference for all
    osl - 1 steps. The cycle TTFT + (osl - 1)*ITL, hence the throughput, is unchanged; both terms
    still rise with x."""
    prefill, work = work_terms(p, isl, osl)
    itl_decode = p.s0_ms / (1.0 - x * (work - prefill))
    moved = p.closed_loop_sync * (itl - itl_decode)
    return itl - moved, moved * (osl - 1.0)


def closed_loop_x(p: PerfParams, isl: Any, osl: Any, clients: Any) -> Any:
    """Throughput (req/ms) with `clients` requests always in flight.

    x * (TTFT + (osl-1)*ITL) = N with the equations above is a quadratic in x:
    W*(P*(q-f) - L0)*x^2 + (L0 + f*P + (osl - 1/2 + c*isl)*s0 + N*W)*x - N = 0, whose root with
    rho < 1 is returned (L0: ttft_fixed_ms, f: prefill_latency_factor; the discriminant is never
    negative).
    """
    prefill, work = work_terms(p, isl, osl)
    own = p.prefill_latency_factor * prefill
    a = p.q * prefill * queued_work(p, prefill, work) - work * (own + p.ttft_fixed_ms)
    b = p.ttft_fixed_ms + own + (osl - 0.5 + p.chunk_per_token * isl) * p.s0_ms + clients * work
    disc = b * b + 4.0 * a * clients
    return 2.0 * clients / (b + disc ** 0.5)


def closed_loop_capped(p: PerfParams, isl: Any, osl: Any, clients: Any, x_cap: Any) -> tuple[Any, Any]:
    """(throughput, extra queueing before the first token) with `clients` in flight when the KV
    cache allows at most x_cap: the clients the batch cannot hold wait for a slot (clients/x minus
    the in-service latency). (A smooth knee was tried and fitted the InferenceX data worse.)"""
    x_free = closed_loop_x(p, isl, osl, clients)
    x = 0.5 * (x_free + x_cap - abs(x_free - x_cap))  # min() for floats and arrays alike
    itl, ttft, _, _, _ = latency_terms(p, isl, osl, x)
    return x, clients / x - (ttft + (osl - 1.0) * itl)


def memory_x(p: PerfParams, isl: Any, osl: Any, max_batch: Any) -> Any:
    """Throughput (req/ms) at which the decode batch fills `max_batch` sequences."""
    _, work = work_terms(p, isl, osl)
    return max_batch / ((osl - 1.0) * p.s0_ms + max_batch * work)


def _max_batch(profile: PerfProfile, isl: float, osl: float) -> float | None:
    if profile.kv_tokens is None:
        return None
    return profile.kv_tokens / max(isl + osl, 1.0)


def _max_x(profile: PerfProfile, isl: float, osl: float) -> float:
    """The largest sustainable throughput (req/ms): compute saturation or a full KV cache."""
    _, work = work_terms(profile.params, isl, osl)
    x_sat = 1.0 / work
    b_max = _max_batch(profile, isl, osl)
    if b_max is None:
        return float(x_sat)
    if b_max <= 0.0:
        return 0.0
    return float(min(x_sat, memory_x(profile.params, isl, osl, b_max)))


def saturation_rps(profile: PerfProfile, workload: Workload) -> float:
    """The request rate (per second) at which one replica saturates: compute or KV-cache bound."""
    return _max_x(profile, workload.isl, workload.osl) * 1000.0


def _range_warnings(profile: PerfProfile, workload: Workload, rate_rps: float | None,
                    concurrency: float | None) -> list[str]:
    warnings: list[str] = []
    if profile.source == "roofline":
        warnings.append(f"{profile.key.label()}: roofline prior only (no benchmark data)")
    r = profile.data_range
    if r is None:
        return warnings

    def check(name: str, value: float, span: tuple[float, float]) -> None:
        lo, hi = span
        if value < lo * 0.9 or value > hi * 1.1:
            warnings.append(f"{name} {value:g} outside the data range {lo:g}..{hi:g}")

    if r.latency_points == 0:
        warnings.append("no TTFT/ITL measurements below saturation in the data: latencies follow the "
                        "prior's shape, scaled by the throughput fit")
    check("isl", workload.isl, r.isl)
    check("osl", workload.osl, r.osl)
    if rate_rps is not None and r.rate_rps is not None:
        check("rate_rps", rate_rps, r.rate_rps)
    if concurrency is not None and r.concurrency is not None:
        check("concurrency", concurrency, r.concurrency)
    return warnings


def _saturated_prediction(x_rps: float, concurrency: float, warnings: list[str]) -> Prediction:
    inf = math.inf
    stats = LatencyStats(inf, inf, inf)
    return Prediction(stats, stats, 0.0, x_rps, concurrency, tuple(warnings), batch=inf, saturated=True)


def _check_workload(workload: Workload) -> None:
    if not (workload.isl >= 0 and workload.osl >= 1 and math.isfinite(workload.isl + workload.osl)):
        raise ValueError(f"workload isl={workload.isl} osl={workload.osl}: need isl >= 0 and osl >= 1")


def predict(profile: PerfProfile, workload: Workload, *, rate_rps: float | None = None,
            concurrency: float | None = None) -> Prediction:
    """Latency and throughput at an open-loop request rate or a closed-loop client count.

    A rate at or beyond saturation gives infinite latencies (`saturated=True`, with a warning).
    """
    if (rate_rps is None) == (concurrency is None):
        raise ValueError("predict() needs exactly one of rate_rps and concurrency")
    _check_workload(workload)
    p = profile.params
    isl, osl = workload.isl, workload.osl
    warnings = _range_warnings(profile, workload, rate_rps, concurrency)
    x_max = _max_x(profile, isl, osl)
    if x_max <= 0.0:
        warnings.append("the model does not fit in GPU memory")
        return _saturated_prediction(0.0, concurrency if concurrency is not None else math.inf, warnings)
    extra_wait = 0.0
    if rate_rps is not None:
        if not rate_rps >= 0:
            raise ValueError(f"rate_rps={rate_rps} must be >= 0")
        x = rate_rps / 1000.0
        if x >= x_max:
            warnings.append(f"rate {rate_rps:g} rps is at or beyond the saturation rate "
                            f"{x_max * 1000.0:.4g} rps of one replica")
            return _saturated_prediction(rate_rps, math.inf, warnings)
    else:
        assert concurrency is not None
        if not concurrency > 0:
            raise ValueError(f"concurrency={concurrency} must be > 0")
        x_raw, wait_raw = closed_loop_capped(p, isl, osl, concurrency, x_max)
        x, extra_wait = float(x_raw), max(float(wait_raw), 0.0)
        if x >= 0.9 * x_max:
            warnings.append("concurrency near or beyond the KV-cache batch limit: requests queue")
    # the M/M/1 queue tail is an open-loop shape: a closed loop's queue is bounded by its clients
    lp = p if rate_rps is not None or p.queue_tail <= 0.0 else replace(p, queue_tail=0.0)
    itl, ttft_mean, ttft_p50, ttft_p99, batch = latency_terms(lp, isl, osl, x)
    in_system = concurrency if concurrency is not None else x * (ttft_mean + (osl - 1.0) * itl)
    if concurrency is not None and p.closed_loop_sync > 0.0:
        itl, moved = closed_loop_shift(p, isl, osl, x, itl)
        extra_wait += float(moved)
    return Prediction(
        ttft=LatencyStats(ttft_mean + extra_wait, ttft_p50 + extra_wait, ttft_p99 + extra_wait),
        itl=LatencyStats(itl, itl * p.itl_p50_factor, float(itl_p99_gap(p, isl, osl, x, itl))),
        output_tok_s=x * 1000.0 * osl,
        request_rps=x * 1000.0,
        concurrency=in_system,
        warnings=tuple(warnings),
        batch=batch,
    )


def _itl_stall_limit(p: PerfParams, isl: float, osl: float, work: float, x_hi: float, target_ms: float) -> float:
    """The largest x <= x_hi whose per-request ITL p99 (with prefill stalls) meets the target:
    bisection on a function that rises with x, a fixed number of halvings (so the answer never rises
    as the target tightens)."""
    def ok(x: float) -> bool:
        itl = p.s0_ms / (1.0 - x * work)
        return float(itl_p99_request(p, isl, osl, x, itl)) <= target_ms

    if ok(x_hi):
        return x_hi
    return min(_bisect_x(ok, work), x_hi)


def _bisect_x(ok: Callable[[float], bool], work: float) -> float:
    """The largest x in [0, 1/W) with ok(x), for ok true below a threshold: a fixed number of
    halvings on the same grid whatever the target, so the answer never rises as a target tightens."""
    if not ok(0.0):
        return 0.0
    lo, hi = 0.0, 1.0 / work
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def capacity(profile: PerfProfile, workload: Workload, *, ttft_p99_ms: float, itl_p99_ms: float) -> Capacity:
    """`_capacity`, remembered on its exact inputs (a plan asks it twice for the same config and mix: the
    capacity and its warnings; the answer is immutable)."""
    try:
        return _capacity_memo(profile, workload, ttft_p99_ms, itl_p99_ms)
    except TypeError:  # an unhashable field (a profile built with lists): computed as it is
        return _capacity(profile, workload, ttft_p99_ms=ttft_p99_ms, itl_p99_ms=itl_p99_ms)


@functools.lru_cache(maxsize=1024)
def _capacity_memo(profile: PerfProfile, workload: Workload, ttft_p99_ms: float, itl_p99_ms: float) -> Capacity:
    return _capacity(profile, workload, ttft_p99_ms=ttft_p99_ms, itl_p99_ms=itl_p99_ms)


def _capacity(profile: PerfProfile, workload: Workload, *, ttft_p99_ms: float, itl_p99_ms: float) -> Capacity:
    """The largest request rate one replica sustains with TTFT p99 and ITL p99 under the targets.

    Both limits are closed forms in the utilisation rho = x*W:
    ITL p99 <= T   <=>  rho <= 1 - k99*s0/T;
    TTFT p99 <= T  <=>  rho <= (T - L0 - m99*P - h) / (T - L0 - m99*P + ln(100)*q*P),
    with h = (1/2 + c*isl)*s0 the steps a new request waits for. The ITL is the per-request p99 (the
    SLO's: `itl_p99_request`); with prefill stalls or a load-dependent spread, a bisection.
    """
    _check_workload(workload)
    p = profile.params
    isl, osl = workload.isl, workload.osl
    warnings = _range_warnings(profile, workload, None, None)
    prefill, work = work_terms(p, isl, osl)
    x_mem = _max_x(profile, isl, osl)
    if x_mem <= 0.0:
        warnings.append("the model does not fit in GPU memory")
        return Capacity(0.0, Binding.MEMORY, tuple(warnings))
    rho_itl = max(1.0 - p.itl_p99_factor * p.s0_ms / itl_p99_ms, 0.0) if itl_p99_ms > 0 else 0.0
    fixed = p.ttft_fixed_ms + p.ttft_p99_factor * p.prefill_latency_factor * prefill
    steps = (0.5 + p.chunk_per_token * isl) * p.s0_ms
    num = ttft_p99_ms - fixed - steps
    queue = _LN100 * p.q * prefill * queued_work(p, prefill, work) / work
    rho_ttft = max(num / (num + steps + queue), 0.0) if num > 0 else 0.0
    if p.queue_tail > 0.0:  # no closed form: bisection on the TTFT p99, which rises with x
        rho_ttft = work * _bisect_x(lambda x: float(latency_terms(p, isl, osl, x)[3]) <= ttft_p99_ms, work)
    x_itl = rho_itl / work
    if (p.itl_stall_weight > 0.0 or p.itl_p99_load > 0.0) and x_itl > 0.0:
        x_itl = _itl_stall_limit(p, isl, osl, work, x_itl, itl_p99_ms)
    candidates = [(rho_ttft / work, Binding.TTFT), (x_itl, Binding.ITL)]
    if profile.kv_tokens is not None:
        candidates.append((x_mem, Binding.MEMORY))
    x, binding = min(candidates, key=lambda c: c[0])
    if x <= 0.0:
        warnings.append(f"{binding.value} p99 target cannot be met even at zero load")
    return Capacity(float(x) * 1000.0, binding, tuple(warnings))


# --------------------------------------------------------------------------------------------
# Roofline prior


def _engine_factor(engine: Engine) -> float:
    return 0.9 if engine is Engine.TRTLLM else 1.0


def roofline_params(key: ConfigKey) -> PerfParams | None:
    """Prior parameters from published hardware numbers and the model architecture (None: unknown)."""
    spec = llm_spec(key.model)
    gpu = GPU_SPECS.get(key.gpu)
    if spec is None or gpu is None:
        return None
    tp = max(key.tp, 1)
    bw = gpu.hbm_bandwidth_gb_s * 1e9 * 0.75 * tp  # achievable bytes/s across the TP group
    flops = gpu.tflops(key.precision) * 1e12 * 0.7 * tp  # achievable FLOP/s
    f = _engine_factor(key.engine)
    comm_ms = 0.3 if tp > 1 else 0.0
    s0 = (spec.weight_bytes(key.precision) / bw * 1000.0 + 1.0 + comm_ms) * f
    token_ms = 2.0 * spec.params_b * 1e9 / flops * 1000.0
    s2 = spec.kv_bytes_per_token(key.precision) / bw * 1000.0 * f
    attn_ms = 2.0 * spec.layers * spec.hidden / flops * 1000.0
    return PerfParams(
        s0_ms=s0,
        s1_ms=token_ms * f,
        s2_ms=s2,
        p0_ms=s0 + 2.0,
        p1_ms=token_ms * f,
        p2_ms=attn_ms * f,
        q=1.0,
    )


def kv_capacity_tokens(key: ConfigKey) -> float | None:
    """Tokens of KV cache one replica holds (90% of HBM minus weights), None when unknown."""
    spec = llm_spec(key.model)
    gpu = GPU_SPECS.get(key.gpu)
    if spec is None or gpu is None:
        return None
    free = key.tp * gpu.memory_gb * 1e9 * 0.9 - spec.weight_bytes(key.precision)
    return max(free, 0.0) / spec.kv_bytes_per_token(key.precision)


def roofline_profile(key: ConfigKey) -> PerfProfile | None:
    """A prior-only profile when no benchmark data exist (None: architecture or GPU unknown)."""
    params = roofline_params(key)
    if params is None:
        return None
    return PerfProfile(key=key, params=params, kv_tokens=kv_capacity_tokens(key), source="roofline",
                       notes=("roofline prior: weight bytes / HBM bandwidth per step; no benchmark data",))


# --------------------------------------------------------------------------------------------
# ProfileSet and its JSON form


def _key_to_dict(k: ConfigKey) -> dict[str, Any]:
    return {"model": k.model, "engine": k.engine.value, "gpu": k.gpu.value, "tp": k.tp,
            "precision": k.precision.value}


def _opt_pair(v: tuple[float, float] | None) -> list[float] | None:
    return None if v is None else [v[0], v[1]]


def profile_to_dict(p: PerfProfile) -> dict[str, Any]:
    d: dict[str, Any] = {
        "key": _key_to_dict(p.key),
        "source": p.source,
        "params": dict(zip(PARAM_NAMES, p.params.as_tuple(), strict=True)),
        "kv_tokens": p.kv_tokens,
        "notes": list(p.notes),
    }
    if p.fit_error is not None:
        e = p.fit_error
        d["fit_error"] = {"points": e.points, "ttft_mape": e.ttft_mape, "itl_mape": e.itl_mape,
                          "throughput_mape": e.throughput_mape}
    if p.data_range is not None:
        r = p.data_range
        d["data_range"] = {"isl": list(r.isl), "osl": list(r.osl), "rate_rps": _opt_pair(r.rate_rps),
                           "concurrency": _opt_pair(r.concurrency), "latency_points": r.latency_points,
                           "length_spread": r.length_spread}
    return d


def _field(d: Mapping[str, Any], name: str, where: str) -> Any:
    if not isinstance(d, Mapping) or name not in d:
        raise ProfileError(f"{where}: missing field {name!r}")
    return d[name]


def _num(v: Any, where: str, *, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v)):
        raise ProfileError(f"{where}: expected a finite number, got {v!r}")
    return float(v)


def _req_num(v: Any, where: str) -> float:
    out = _num(v, where)
    assert out is not None
    return out


def _pair(v: Any, where: str) -> tuple[float, float] | None:
    if v is None:
        return None
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ProfileError(f"{where}: expected [low, high], got {v!r}")
    return (_req_num(v[0], where), _req_num(v[1], where))


def profile_from_dict(d: Mapping[str, Any], where: str = "profile") -> PerfProfile:
    kd = _field(d, "key", where)
    kw = f"{where}.key"
    try:
        tp_raw = _field(kd, "tp", kw)
        if isinstance(tp_raw, bool) or not isinstance(tp_raw, int) or tp_raw < 1:
            raise ProfileError(f"{kw}.tp: expected a positive integer, got {tp_raw!r}")
        key = ConfigKey(
            model=str(_field(kd, "model", kw)),
            engine=parse_engine(str(_field(kd, "engine", kw))),
            gpu=parse_gpu(str(_field(kd, "gpu", kw))),
            tp=tp_raw,
            precision=parse_precision(str(_field(kd, "precision", kw))),
        )
    except ValueError as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"{kw}: {exc}") from exc
    pd = _field(d, "params", where)
    values: list[float] = []
    for name in PARAM_NAMES:
        if name in _OPTIONAL_PARAMS and isinstance(pd, Mapping) and name not in pd:
            values.append(_OPTIONAL_PARAMS[name])
            continue
        value = _req_num(_field(pd, name, f"{where}.params"), f"{where}.params.{name}")
        if value < 0:
            raise ProfileError(f"{where}.params.{name}: must be >= 0, got {value!r}")
        values.append(value)
    params = PerfParams.from_tuple(values)
    if params.s0_ms <= 0:
        raise ProfileError(f"{where}.params.s0_ms: must be > 0, got {params.s0_ms!r}")
    fit_error = None
    if d.get("fit_error") is not None:
        fe = d["fit_error"]
        w = f"{where}.fit_error"
        fit_error = FitError(
            points=int(_req_num(_field(fe, "points", w), f"{w}.points")),
            ttft_mape=_num(fe.get("ttft_mape"), f"{w}.ttft_mape", optional=True),
            itl_mape=_num(fe.get("itl_mape"), f"{w}.itl_mape", optional=True),
            throughput_mape=_num(fe.get("throughput_mape"), f"{w}.throughput_mape", optional=True),
        )
    data_range = None
    if d.get("data_range") is not None:
        rd = d["data_range"]
        w = f"{where}.data_range"
        isl = _pair(_field(rd, "isl", w), f"{w}.isl")
        osl = _pair(_field(rd, "osl", w), f"{w}.osl")
        assert isl is not None and osl is not None
        lat = _num(rd.get("latency_points"), f"{w}.latency_points", optional=True)
        data_range = DataRange(isl=isl, osl=osl, rate_rps=_pair(rd.get("rate_rps"), f"{w}.rate_rps"),
                               concurrency=_pair(rd.get("concurrency"), f"{w}.concurrency"),
                               latency_points=None if lat is None else int(lat),
                               length_spread=rd.get("length_spread") is True)
    kv = _num(d.get("kv_tokens"), f"{where}.kv_tokens", optional=True)
    notes = d.get("notes") or []
    return PerfProfile(key=key, params=params, kv_tokens=kv, source=str(d.get("source", "fit")),
                       fit_error=fit_error, data_range=data_range, notes=tuple(str(n) for n in notes))


@dataclass(frozen=True)
class ProfileSet:
    """All profiles of a PROFILES.json, looked up by configuration."""

    profiles: tuple[PerfProfile, ...] = ()

    def get(self, model: str, engine: Engine, gpu: GpuType, tp: int,
            precision: Precision | None = None) -> PerfProfile | None:
        mk = model_key(model)
        matches = [p for p in self.profiles
                   if model_key(p.key.model) == mk and p.key.engine == engine and p.key.gpu == gpu
                   and p.key.tp == tp and (precision is None or p.key.precision == precision)]
        if not matches:
            return None
        # fitted profiles before priors; then the most data points
        matches.sort(key=lambda p: (p.source != "fit", -(p.fit_error.points if p.fit_error else 0)))
        return matches[0]

    def keys(self) -> tuple[ConfigKey, ...]:
        return tuple(p.key for p in self.profiles)

    def with_profile(self, profile: PerfProfile) -> ProfileSet:
        """A copy where `profile` replaces any profile with the same key."""
        rest = tuple(p for p in self.profiles if p.key != profile.key)
        return replace(self, profiles=(*rest, profile))

    def to_json_dict(self) -> dict[str, Any]:
        return {"format": "fleetplan-profiles", "version": PROFILES_FORMAT_VERSION,
                "profiles": [profile_to_dict(p) for p in self.profiles]}

    @staticmethod
    def from_json_dict(d: dict[str, Any]) -> ProfileSet:
        if not isinstance(d, Mapping):
            raise ProfileError(f"top level: expected an object, got {type(d).__name__}")
        items = _field(d, "profiles", "top level")
        if not isinstance(items, list):
            raise ProfileError(f"profiles: expected a list, got {type(items).__name__}")
        return ProfileSet(tuple(profile_from_dict(item, f"profiles[{i}]") for i, item in enumerate(items)))
