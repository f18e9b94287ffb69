"""The fleet's own KV usage corrects a profile's memory bound. Pure.

A profile's `kv_tokens` (the KV cache's capacity in tokens) bounds how many sequences one replica
holds, and with them its rate (models/mix.py, the memory term). A profile fitted from benchmark
runs with short outputs extrapolates it poorly to long ones: profiles fitted at 256 output tokens
put llama-3.1-70b TP4 on H100 at 11k tokens, a memory bound of 0.29 rps per replica at 1,024
output tokens where the engine serves ~2 rps. The online speed correction (planner/correction.py)
cannot see it: it explains latency by an engine speed, and a memory bound is not a speed.

The engines say how full their KV cache is: vLLM's `vllm:kv_cache_usage_perc` (formerly
`vllm:gpu_cache_usage_perc`), TensorRT-LLM's `trtllm_kv_cache_utilization`, with the requests
running (`vllm:num_requests_running`). With R requests running per replica at KV usage u, each
sequence holding T tokens on average, the cache holds about R T / u tokens. T comes from the
length mix: a running sequence holds its prompt and, on average over its stay, half its output;
sequences stay in the batch for as long as they decode, so the running population is the mix
weighted by output length (`held_tokens`). On an engine that reserves a request's whole length at
admission (TensorRT-LLM's GUARANTEED_NO_EVICT as the simulated engine models it, blocks held for
prompt + max_tokens) the same reading says ~(isl + osl/2) / (isl + osl) of the cache: the
conservative side.

Per config, ln(fleet's kv_tokens / profile's) is tracked as the speed is (a value and its variance):

- a window counts when its config served requests (planner/evidence.py: a ConfigObservation), its
  replicas report both gauges, at least MIN_RUNNING sequences run over them and the usage is at
  least MIN_KV_USAGE. Why not a higher usage floor: the ratio R / u is read from one scrape of
  both gauges (held blocks over the cache, exact at that instant), its noise is which sequences
  happen to run (`reading_var`), not the usage's size; and the fleet a too-small memory bound
  sizes runs its replicas nearly empty (the 24 h day below: u ~ 0.01-0.03 per replica), so a floor
  at 5% would never let the evidence in;
- each window: a Kalman step, capped at MAX_STEP per cycle either way (one odd window never
  swings the fleet), DRIFT_VAR per cycle; without evidence the estimate relaxes toward the
  profile over a day (correction._relaxed);
- applied: a smaller cache at once (the plan grows now); a larger one only as far as the
  evidence's lower side (mean - UP_TRUST_SD sd, as the speed); HYSTERESIS around what is applied;
- a config not observed yet takes what its model's observed configs show against their profiles,
  with the variance widened by SHARED_VAR, at its lower side (`shared_kv`), and starts its own
  filter from there;
- the speed correction reads latency against the profile at the cache applied
  (planner/correction.py update_corrections): a load beyond the profile's memory bound that the
  replicas served is not a faster engine.

The readings are gauges in 0..1 (vLLM documents `kv_cache_usage_perc` so: 1 means 100 percent);
a reading above 1 is no evidence.

Worked example (tests/unit/planner/test_kvmem.py): a profile whose kv_tokens is 8x too small
(ln 8 = 2.08): windows at 40 running sequences read the truth within ~3%; the steps are capped at
ln 2, so the applied capacity reaches the truth within 20% by the third window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from fleetplan.models.mix import LengthMix
from fleetplan.models.profile import PerfProfile
from fleetplan.planner.types import ConfigKey, Correction, ModelObservation

__all__ = ["KvApplied", "KvReading", "applied_kv", "held_tokens", "kv_reading", "shared_kv", "update_all",
           "update_kv", "with_applied_kv", "with_kv_of"]

MIN_KV_USAGE = 0.005  # below: an idle replica's rounding, blocks held by nothing running
MIN_RUNNING = 2.0  # sequences over the config's replicas: fewer say little of T
PRIOR_SD = 0.5  # ln: how far a fitted profile's kv_tokens may be off (the variance it relaxes back to)
OBS_VAR = 0.05 ** 2  # ln^2: the window's mix against the running population's, the gauges' scrape
DRIFT_VAR = 0.02 ** 2
MAX_STEP = math.log(2.0)  # ln per cycle, either way
UP_TRUST_SD = 0.5  # a larger cache than the profile's is trusted up to mean - 0.5 sd
HYSTERESIS = 0.05  # ln: what is applied moves once the candidate leaves this band around it
BOUNDS = (math.log(1.0 / 64.0), math.log(64.0))  # ln: the most a reading says against the profile
RELAX_S = 24 * 3600.0  # without evidence the estimate relaxes toward the profile (e-folding time)


def held_tokens(mix: LengthMix) -> tuple[float, float]:
    """(mean, coefficient of variation) of the tokens a running sequence holds: its prompt plus the
    share of its output generated so far (uniform over its stay), over the running population
    (the mix weighted by how long each class decodes).

    >>> held_tokens(LengthMix.single(1024, 1024))[0]
    1536.0
    >>> round(held_tokens(LengthMix(((100.0, 10.0, 0.5), (100.0, 1000.0, 0.5))))[0])  # long outputs run longer
    596
    """
    num = m2 = den = 0.0
    for isl, osl, w in mix.classes:
        stay = max(osl - 1.0, 1.0) * w
        num += stay * (isl + osl / 2.0)
        m2 += stay * (isl * isl + isl * osl + osl * osl / 3.0)
        den += stay
    if den <= 0 or num <= 0:
        return 0.0, 0.0
    mean = num / den
    return mean, math.sqrt(max(m2 / den - mean * mean, 0.0)) / mean


@dataclass(frozen=True)
class KvReading:
    """One window's KV evidence on one config."""

    kv_tokens: float  # R T / u: the cache's capacity the window shows
    z: float  # ln(kv_tokens / the profile's), within BOUNDS
    var: float  # its measurement variance (`reading_var`)
    running: float  # sequences behind it (over the config's replicas)


def reading_var(cv: float, running: float) -> float:
    """A window's variance in ln: OBS_VAR, plus the spread of the held tokens over the sequences
    that happened to run (cv^2 / R: the mean of R draws).

    >>> round(reading_var(0.25, 40.0), 4)
    0.0041
    """
    return OBS_VAR + cv * cv / max(running, 1.0)


def kv_reading(config: ConfigKey, profile: PerfProfile, o: ModelObservation | None,
               mix: LengthMix | None) -> KvReading | None:
    """This window's reading of `config`'s KV capacity, or None (no profile memory, a stale model,
    no served window, gauges missing, too few sequences running, a nearly empty cache)."""
    if o is None or o.stale or mix is None or profile.kv_tokens is None or not profile.kv_tokens > 0:
        return None
    ev = next((c for c in o.configs if c.config == config), None)
    if ev is None or ev.running_per_replica is None or ev.kv_usage is None or ev.kv_replicas < 1:
        return None
    r, u = ev.running_per_replica, ev.kv_usage
    if not (math.isfinite(r) and math.isfinite(u)) or u < MIN_KV_USAGE or u > 1.0 + 1e-9:
        return None
    running = r * ev.kv_replicas
    if running < MIN_RUNNING:
        return None
    t, cv = held_tokens(mix)
    if not t > 0:
        return None
    tokens = r * t / u
    z = min(max(math.log(tokens / profile.kv_tokens), BOUNDS[0]), BOUNDS[1])
    return KvReading(tokens, z, reading_var(cv, running), running)


def _relaxed(mean: float, var: float, age_s: float) -> tuple[float, float]:
    k = math.exp(-max(age_s, 0.0) / RELAX_S)
    return mean * k, PRIOR_SD ** 2 + (var - PRIOR_SD ** 2) * k * k


def _applied(mean: float, var: float) -> float:
    """A smaller cache at once; a larger one up to the evidence's lower side."""
    if mean <= 0.0:
        return mean
    return max(0.0, mean - UP_TRUST_SD * math.sqrt(max(var, 0.0)))


def _hysteresis(applied: float | None, candidate: float) -> float:
    if applied is None or abs(candidate - applied) > HYSTERESIS:
        return candidate
    return applied


def update_kv(prev: Correction, rd: KvReading | None, now_s: float,
              prior: tuple[float, float] | None = None) -> Correction:
    """The correction with this window's KV reading folded in (None: no reading; what is applied
    relaxes toward the profile). `prior`: (mean, variance) before its first window (None: the
    profile's, 0 with PRIOR_SD; `shared_kv` where a sibling was observed).

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType("h100"), 4, Precision.BF16)
    >>> c = update_kv(Correction(k), KvReading(8000.0, math.log(8.0), 0.004, 40.0), 0.0)
    >>> round(c.kv_log, 3), c.kv_windows  # ln 8 = 2.08, one step capped at ln 2
    (0.693, 1)
    """
    if rd is None:
        if prev.kv_windows == 0 or prev.kv_updated_s is None:
            return prev
        m, v = _relaxed(prev.kv_log, prev.kv_var, now_s - prev.kv_updated_s)
        return replace(prev, applied_kv_log=_hysteresis(prev.applied_kv_log, _applied(m, v)))
    if prev.kv_windows == 0 or prev.kv_updated_s is None:
        mean, var = prior if prior is not None else (0.0, PRIOR_SD ** 2)
    else:
        mean, var = _relaxed(prev.kv_log, prev.kv_var, now_s - prev.kv_updated_s)
    var += DRIFT_VAR
    nu = rd.z - mean
    k = var / (var + rd.var)
    step = max(-MAX_STEP, min(MAX_STEP, k * nu))
    k_used = step / nu if abs(nu) > 1e-12 else k
    mean, var = mean + step, max((1.0 - k_used) * var, 1e-6)
    applied = _hysteresis(prev.applied_kv_log if prev.kv_windows else None, _applied(mean, var))
    return replace(prev, kv_log=mean, kv_var=var, kv_windows=prev.kv_windows + 1, kv_updated_s=now_s,
                   observed_kv_tokens=rd.kv_tokens, applied_kv_log=applied)


def with_kv_of(c: Correction, src: Correction | None) -> Correction:
    """`c` carrying `src`'s KV fields (the speed's update builds a new Correction)."""
    if src is None:
        return c
    return replace(c, kv_log=src.kv_log, kv_var=src.kv_var, kv_windows=src.kv_windows,
                   kv_updated_s=src.kv_updated_s, observed_kv_tokens=src.observed_kv_tokens,
                   applied_kv_log=src.applied_kv_log)


SHARED_VAR = 0.35 ** 2  # ln^2: how far one config's cache may stand from its siblings' against their profiles


def shared_kv(config: ConfigKey, corrections: Mapping[ConfigKey, Correction]) -> tuple[float, float] | None:
    """The KV estimate of a config without windows of its own: what the observed configs of its
    model show against their profiles (pooled, weighted by 1/variance), the variance widened by
    SHARED_VAR. Why: profiles fitted on one benchmark's lengths err alike (the short-output fit
    put vLLM and TensorRT-LLM alike at ~11k tokens); engines allocate their caches differently
    (TensorRT-LLM a share of the memory left after the weights, vLLM a share of all of it, less
    the weights), which stays doubt. None: no sibling observed."""
    w = mw = 0.0
    for c, k in corrections.items():
        if c.model != config.model or c == config or k.kv_windows == 0:
            continue
        w += 1.0 / max(k.kv_var, 1e-6)
        mw += k.kv_log / max(k.kv_var, 1e-6)
    return None if w == 0.0 else (mw / w, 1.0 / w + SHARED_VAR)


@dataclass(frozen=True)
class KvApplied:
    """The KV capacity the plan evaluates a config's profile with, and why."""

    kv_tokens: float
    note: str


def _tokens(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e5 else f"{x / 1e3:.1f}k"


def applied_kv(config: ConfigKey, corrections: Mapping[ConfigKey, Correction],
               profile: PerfProfile) -> KvApplied | None:
    """The kv_tokens the plan evaluates `profile` with, and the explanation's words (e.g. 'KV
    capacity from the fleet: 0.43M tokens vs profile 11.0k (6 windows)'); None: the profile's own."""
    if profile.kv_tokens is None:
        return None
    corr = corrections.get(config)
    if corr is not None and corr.kv_windows > 0:
        if abs(corr.applied_kv_log) < 1e-9:
            return None
        kv = profile.kv_tokens * math.exp(corr.applied_kv_log)
        return KvApplied(kv, f"KV capacity from the fleet: {_tokens(kv)} tokens vs profile "
                             f"{_tokens(profile.kv_tokens)} ({corr.kv_windows} windows)")
    shared = shared_kv(config, corrections)
    if shared is None:
        return None
    a = _applied(*shared)
    if abs(a) < 1e-9:
        return None
    kv = profile.kv_tokens * math.exp(a)
    return KvApplied(kv, f"KV capacity shared from the model's observed configs: {_tokens(kv)} tokens vs "
                         f"profile {_tokens(profile.kv_tokens)} (not observed yet)")


def with_applied_kv(profile: PerfProfile, config: ConfigKey,
                    corrections: Mapping[ConfigKey, Correction]) -> PerfProfile:
    """`profile` at the KV capacity the corrections apply to `config` (itself when none)."""
    a = applied_kv(config, corrections, profile)
    return profile if a is None else replace(profile, kv_tokens=a.kv_tokens)


def update_all(previous: Mapping[ConfigKey, Correction], observations: Mapping[str, ModelObservation],
               profiles: Mapping[ConfigKey, PerfProfile], mixes: Mapping[str, LengthMix],
               now_s: float) -> dict[ConfigKey, Correction]:
    """Per config with a KV estimate (now or before), its correction after this cycle's windows
    (the other fields as in `previous`)."""
    out: dict[ConfigKey, Correction] = {}
    for config, prof in sorted(profiles.items()):
        base = previous.get(config)
        rd = kv_reading(config, prof, observations.get(config.model), mixes.get(config.model))
        if base is None:
            if rd is None:
                continue
            base = Correction(config)
        if rd is None and base.kv_windows == 0:
            continue
        out[config] = update_kv(base, rd, now_s, shared_kv(config, previous))
    return out
