"""Room in a decode replica's KV cache: the share of arrivals that must wait for it, and the rate at
which that share stays under a bound.

A decode replica (models/disagg.py) admits a request when its KV cache has room for the request's
prompt and output (TensorRT-LLM reserves prompt + max_tokens at admission; vLLM's blocks grow to it);
otherwise the request waits, with every request queued behind it, until running sequences finish
and free theirs, and that wait is in the client's TTFT (the decode side's first step comes after
it). The mean batch filling the cache (`models.mix` `_x_mem`: the rate at which the MEAN occupancy
reaches `kv_tokens`) is saturation, not a rate at which arrivals find room: with long prompts a few
sequences hold most of the cache, and a burst of them fills it long before the mean does
(Mooncake's hour: five prompts of 76k-111k tokens within 45 s hold 465k tokens, more than one
H100's cache).

The occupancy is read as an M/G/infinity system: sequences of class i arrive at x w_i and hold
v_i = isl_i + osl_i tokens for their osl_i decode steps, so the sequences in the batch are Poisson
with mean L = x E[osl] step (Little's law) and the tokens they hold are compound Poisson, each
sequence's size drawn with weight w_i osl_i:

    mean = L m1,  variance = L m2,  skewness = m3 / (m2^1.5 sqrt(L)),  m_k = sum_i u_i v_i^k

(u_i = w_i osl_i / E[osl]). The step is the one of a batch that holds the whole cache,

    step = s0 + s1 L + s2 kv_tokens

(the profile's decode step with every cached token read): an arrival waits only when the cache is
nearly full, and then every step reads nearly all of it, so the sequences that must leave to make
room stay that long (the mean step, s0 / (1 - x A), is a fraction of it at a mean occupancy well
below the cache, and read there the share is 10-20x too small against the simulator). That
distribution is read as a translated gamma with these three moments (the actuarial approximation of
a compound Poisson sum: a handful of heavy sequences gives a skewed sum, many light ones a normal
one; against Panjer's exact recursion the L at which 1% wait is within 4% on a Mooncake-like mix).
An arrival of class i waits when the occupancy exceeds kv_tokens - v_i (arrivals see the time
average), so

    wait share = sum_i w_i P(S > kv_tokens - v_i)

(a class larger than the cache always waits; the requests queued behind a waiting one are not
counted: the full-cache step is on the safe side of that). Against the simulator's decode engine
(TensorRT-LLM persona, H100, 425k tokens of KV; tests/unit/sim/test_kv_room_sim.py) the rate this
gives for 1% is at or below the rate at which 1% of arrivals wait there, on prompt mixes of one
length, a 10% tail of 100k-token prompts and a log-normal spread.

The share rises with L: the largest L within the bound comes from rounds of a grid on log L, the
rate from L = x E[osl] (s0 + s1 L + s2 kv_tokens) in closed form.

Pure: numpy and scipy.special on small arrays.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaincc

from fleetplan.models.mix import LengthMix
from fleetplan.models.profile import PerfParams, PerfProfile

# the search for the largest batch: log L over [the full cache's batch - _LOG_RANGE, it], _ROUNDS
# grids of _GRID points each inside the last bracket (relative resolution ~1e-4: far below the
# approximation's own error)
_LOG_RANGE, _ROUNDS, _GRID = 16.0, 3, 64


def full_step_ms(p: PerfParams, kv_tokens: float, batch: float) -> float:
    """The decode step (ms) of `batch` sequences holding `kv_tokens` tokens: s0 + s1 batch + s2 kv_tokens."""
    return p.s0_ms + p.s1_ms * batch + p.s2_ms * kv_tokens


def _eosl(mix: LengthMix, kv_tokens: float) -> float:
    """E[osl 1{the sequence fits the cache}]: the decode steps an arrival spends in the batch (one
    that can never fit spends none)."""
    total = sum(w for _, _, w in mix.classes)
    return float(sum(w * max(osl, 1.0) for isl, osl, w in mix.classes if isl + max(osl, 1.0) <= kv_tokens) / total)


def batch_sequences(p: PerfParams, mix: LengthMix, rate_rps: float, kv_tokens: float) -> float:
    """L: the sequences in the decode batch at `rate_rps`, each holding its osl steps of the
    full-cache step (Little's law, the module docstring); inf where the steps cannot keep up."""
    xe = max(rate_rps, 0.0) / 1000.0 * _eosl(mix, kv_tokens)
    if xe * p.s1_ms >= 1.0:
        return math.inf
    return xe * (p.s0_ms + p.s2_ms * kv_tokens) / (1.0 - xe * p.s1_ms)


def _arrays(mix: LengthMix, kv_tokens: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens each class holds, arrival weights, batch weights: arrival x osl over the classes that
    fit the cache, normalised; all zero where none fits)."""
    c = np.array(mix.classes, dtype=float)
    isl, osl, w = c[:, 0], np.maximum(c[:, 1], 1.0), c[:, 2]
    v = isl + osl
    stay = np.where(v <= kv_tokens, w * osl, 0.0)
    total = float(stay.sum())
    return v, w / w.sum(), stay / total if total > 0 else stay


def _wait_shares(v: np.ndarray, w: np.ndarray, u: np.ndarray, kv_tokens: float, batch: np.ndarray) -> np.ndarray:
    """The share of arrivals that find fewer than their own tokens free, for each mean batch in
    `batch` (sequences; the module docstring): one row per batch, summed over the classes."""
    b = np.asarray(batch, dtype=float)[:, None]
    room = kv_tokens - v[None, :]
    m1, m2, m3 = (float(np.sum(u * v ** k)) for k in (1, 2, 3))
    safe = np.maximum(b, 1e-300)
    shape = 4.0 * safe * m2 ** 3 / (m3 * m3)  # 4 / skewness^2
    scale = np.sqrt(safe * m2 / shape)
    loc = safe * m1 - shape * scale
    with np.errstate(divide="ignore", invalid="ignore"):
        above = gammaincc(shape, np.maximum((room - loc) / scale, 0.0))  # P(S > room)
    above = np.where(room < 0.0, 1.0, np.where(b > 0.0, above, 0.0))  # an empty batch: only the too-long wait
    return np.asarray(np.sum(w[None, :] * above, axis=1), dtype=float)


def kv_wait_share(profile: PerfProfile, mix: LengthMix, rate_rps: float, *, speed: float = 1.0) -> float:
    """The share of a decode replica's arrivals at `rate_rps` that wait for room in its KV cache
    (0.0 where the profile knows no cache size; 1.0 at or beyond the step's saturation). `speed`:
    the engine's decode speed relative to the profile (every step 1/speed as long)."""
    if profile.kv_tokens is None:
        return 0.0
    p = profile.params
    steps = PerfParams(p.s0_ms / speed, p.s1_ms / speed, p.s2_ms / speed, 0.0, 0.0, 0.0, p.q)
    batch = batch_sequences(steps, mix, rate_rps, profile.kv_tokens)
    if not math.isfinite(batch):
        return 1.0
    v, w, u = _arrays(mix, profile.kv_tokens)
    return float(_wait_shares(v, w, u, profile.kv_tokens, np.array([batch]))[0])


def kv_room_rps(profile: PerfProfile, mix: LengthMix, *, wait_share: float, speed: float = 1.0) -> float:
    """The largest rate at which at most `wait_share` of a decode replica's arrivals wait for room in
    its KV cache (inf where the profile knows no cache size; 0.0 where more than that share cannot
    fit even in an empty cache).

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> from fleetplan.models.profile import ConfigKey
    >>> k = ConfigKey("m", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
    >>> prof = PerfProfile(k, PerfParams(7.0, 0.017, 3.6e-5, 0.0, 0.0, 0.0, 1.0), kv_tokens=360_000.0)
    >>> short = LengthMix.single(12_000, 340)
    >>> tail = LengthMix(((2_000, 340, 0.9), (100_000, 340, 0.1)))   # the same mean prompt: 11,800
    >>> round(kv_room_rps(prof, short, wait_share=0.01), 2), round(kv_room_rps(prof, tail, wait_share=0.01), 2)
    (2.56, 0.96)

    The mean occupancy fills this cache at ~4.3 rps for both mixes (`models.mix.capacity_mix`'s
    "memory" limit); at 2 rps 8% of the tail mix's arrivals wait, almost none of the other's:

    >>> round(kv_wait_share(prof, short, 2.0), 4), round(kv_wait_share(prof, tail, 2.0), 3)
    (0.0003, 0.081)
    """
    if profile.kv_tokens is None:
        return math.inf
    p = profile.params
    kv = profile.kv_tokens
    v, w, u = _arrays(mix, kv)
    if _wait_shares(v, w, u, kv, np.zeros(1))[0] > wait_share:
        return 0.0
    # the largest batch within the bound, below the one whose mean occupancy fills the cache (beyond
    # it most arrivals wait): rounds of a grid on log L, each inside the previous bracket
    hi = math.log(kv / float(np.sum(u * v)))
    lo = hi - _LOG_RANGE
    for _ in range(_ROUNDS):
        grid = np.linspace(lo, hi, _GRID)
        ok = _wait_shares(v, w, u, kv, np.exp(grid)) <= wait_share
        k = int(np.argmin(ok)) if not ok.all() else _GRID
        if k == _GRID:
            lo = hi
            break
        if k == 0:
            return 0.0
        lo, hi = float(grid[k - 1]), float(grid[k])
    batch = math.exp(lo)
    # L = x E[osl] step(L)  =>  x = L / (E[osl] step(L))   (x in requests per ms)
    return batch / (_eosl(mix, kv) * full_step_ms(p, kv, batch) / speed) * 1000.0
