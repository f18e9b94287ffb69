"""The memory correction (planner/kvmem.py): the engines' KV usage and running requests correct a
profile's KV capacity in both directions, through the same path the plan takes (update_corrections ->
applied_speeds -> capacity_table), and the estimate persists in the planner state."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.mix import LengthMix, MixCapacity, capacity_mix, predict_mix
from fleetplan.models.names import Engine
from fleetplan.planner import kvmem
from fleetplan.planner.capacity import MixedWorkload, capacity_table
from fleetplan.planner.core import plan, plan_to_dict
from fleetplan.planner.correction import applied_speeds, update_corrections
from fleetplan.planner.serde import state_from_dict, state_to_dict
from fleetplan.planner.types import (
    ConfigKey,
    ConfigObservation,
    Correction,
    Fleet,
    ModelObservation,
    Observation,
    PlannerState,
)
from tests.unit.planner.planner_helpers import BF16, H100, VLLM, hosts, policy

KEY = ConfigKey("m8", VLLM, H100, 1, BF16)
ISL, OSL = 1024.0, 1024.0
MIX = LengthMix.single(ISL, OSL)
WORKLOAD = {"m8": MixedWorkload(ISL, OSL)}
TRUE_KV = 100_000.0
TRUE = mp.PerfProfile(mp.ConfigKey("m8", VLLM, H100, 1, BF16),
                      mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06, p2_ms=2e-7, q=1.0),
                      kv_tokens=TRUE_KV,
                      data_range=mp.DataRange((128.0, 4096.0), (64.0, 2048.0), (0.1, 20.0), None, 8))
POLICY = policy(models=("m8",), tps={"m8": [1]}, model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}}})


def capacity(profile: mp.PerfProfile) -> MixCapacity:
    return capacity_mix(profile, MIX, ttft_p99_ms=1000.0, itl_p99_ms=80.0)


def true_capacity() -> float:
    return capacity(TRUE).max_rps


def window(n: int, rate_rps: float, true: mp.PerfProfile = TRUE) -> ConfigObservation:
    """What n replicas of the TRUE engine show serving `rate_rps`: their latency, and per replica
    the requests running (the decode batch at that load, as models/mix.py sizes it: x = B / ((osl -
    1) s0 + B wbar)) and the KV usage they make (prompt + half the output each, over the true cache)."""
    x = rate_rps / n
    seen = predict_mix(true, MIX, x)
    kv = true.kv_tokens or 0.0
    p = true.params
    wbar = p.p0_ms + p.p1_ms * ISL + p.p2_ms * ISL * ISL + (p.s1_ms + p.s2_ms * (ISL + OSL / 2.0)) * (OSL - 1.0)
    xm = x / 1000.0
    running = min(xm * (OSL - 1.0) * p.s0_ms / max(1.0 - xm * wbar, 1e-9), kv / (ISL + OSL / 2.0))
    usage = running * (ISL + OSL / 2.0) / kv
    return ConfigObservation(KEY, n, rate_rps, seen.ttft_p99_ms, seen.itl_p99_ms, 300.0,
                             running_per_replica=running, kv_usage=usage, kv_replicas=n)


def run(profile: mp.PerfProfile, cycles: int, demand_rps: float,
        true: mp.PerfProfile = TRUE) -> tuple[list[tuple[float, int]], dict[ConfigKey, Correction]]:
    """Closed loop: the planner sizes the fleet with its corrected capacity, the TRUE engine serves
    the demand on that many replicas, and what it shows is the next window's evidence."""
    corrections: dict[ConfigKey, Correction] = {}
    out = []
    for k in range(cycles):
        speeds = applied_speeds(corrections, {KEY: profile}, {})
        table, _ = capacity_table(POLICY, {KEY: profile}, WORKLOAD, [H100], speeds=speeds)
        cap = table[KEY].max_rps
        n = max(1, math.ceil(demand_rps / cap))
        out.append((cap, n))
        obs = ModelObservation("m8", demand_rps, ISL, OSL, configs=(window(n, demand_rps, true),))
        corrections = update_corrections(corrections, {"m8": obs}, {KEY: profile}, WORKLOAD, {}, 1000.0 + 60.0 * k)
    return out, corrections


def test_the_true_profile_is_memory_bound_here() -> None:
    assert capacity(TRUE).binding == "memory"


def test_a_kv_capacity_8x_too_small_rises_to_the_true_capacity_within_a_few_windows() -> None:
    small = replace(TRUE, kv_tokens=TRUE_KV / 8.0)
    assert capacity(small).max_rps < 0.4 * true_capacity()  # the profile alone: 3x the fleet
    hist, corrections = run(small, 8, 6.0)
    assert hist[0][0] < 0.4 * true_capacity()
    for cap, _ in hist[3:]:
        assert cap == pytest.approx(true_capacity(), rel=0.2)
        assert cap <= true_capacity() * 1.02  # a larger cache is trusted up to the evidence's lower side
    c = corrections[KEY]
    assert c.kv_windows == 8
    assert c.observed_kv_tokens == pytest.approx(TRUE_KV, rel=1e-6)
    speeds = applied_speeds(corrections, {KEY: small}, {})
    assert speeds[KEY].note == "KV capacity from the fleet: 95.2k tokens vs profile 12.5k (8 windows)"
    table, _ = capacity_table(POLICY, {KEY: small}, WORKLOAD, [H100], speeds=speeds)
    assert table[KEY].profile_rps == pytest.approx(capacity(small).max_rps)
    assert table[KEY].correction == speeds[KEY].note
    assert table[KEY].kv_tokens == speeds[KEY].kv_tokens


def test_a_kv_capacity_2x_too_large_falls_at_once() -> None:
    true = replace(TRUE, kv_tokens=40_000.0)
    large = replace(TRUE, kv_tokens=80_000.0)
    want = capacity(true).max_rps
    assert capacity(large).max_rps > 1.25 * want
    hist, _ = run(large, 6, 6.0, true)
    assert hist[0][0] > 1.25 * want
    # the first window reads the truth and a smaller cache is applied at once; the replicas it
    # overloaded also read as a slower engine for one window, which the next window undoes
    assert hist[1][0] < want
    for cap, _ in hist[2:]:
        assert cap == pytest.approx(want, rel=0.05)


def test_a_nearly_empty_cache_or_too_few_sequences_are_no_evidence() -> None:
    obs = window(2, 3.0)
    for bad in (replace(obs, kv_usage=kvmem.MIN_KV_USAGE / 2), replace(obs, running_per_replica=0.5),
                replace(obs, kv_usage=None), replace(obs, kv_replicas=0)):
        m = ModelObservation("m8", 3.0, ISL, OSL, configs=(bad,))
        c = update_corrections({}, {"m8": m}, {KEY: TRUE}, WORKLOAD, {}, 1000.0)
        assert KEY not in c or c[KEY].kv_windows == 0
    stale = ModelObservation("m8", 3.0, ISL, OSL, configs=(obs,), stale=True)
    c = update_corrections({}, {"m8": stale}, {KEY: TRUE}, WORKLOAD, {}, 1000.0)
    assert KEY not in c or c[KEY].kv_windows == 0


def test_the_kv_estimate_survives_the_speed_update_and_the_state_round_trip() -> None:
    small = replace(TRUE, kv_tokens=TRUE_KV / 8.0)
    _, corrections = run(small, 3, 6.0)
    c = corrections[KEY]
    assert c.kv_windows == 3 and c.observations == 3  # both filters ran on the same windows
    state = PlannerState(corrections=(c,))
    back = state_from_dict(state_to_dict(state))
    assert back.corrections == (c,)
    # a window with latency only keeps the KV estimate
    obs = ModelObservation("m8", 6.0, ISL, OSL, configs=(replace(window(3, 6.0), kv_usage=None),))
    after = update_corrections(corrections, {"m8": obs}, {KEY: small}, WORKLOAD, {}, 2000.0)[KEY]
    assert after.kv_log == c.kv_log and after.kv_windows == 3 and after.observations == 4


def test_without_evidence_the_applied_kv_relaxes_toward_the_profile() -> None:
    small = replace(TRUE, kv_tokens=TRUE_KV / 8.0)
    _, corrections = run(small, 5, 6.0)
    applied = corrections[KEY].applied_kv_log
    later = update_corrections(corrections, {}, {KEY: small}, WORKLOAD, {}, 1000.0 + 2 * 86400.0)[KEY]
    assert 0.0 < later.applied_kv_log < 0.3 * applied


def test_held_tokens_weigh_the_running_population_by_its_stay() -> None:
    mean, cv = kvmem.held_tokens(LengthMix(((1000.0, 10.0, 0.9), (1000.0, 2000.0, 0.1))))
    # 90% of requests decode 9 steps, 10% 1,999: the running ones are nearly all long
    assert 1900.0 < mean < 2000.0
    assert 0.0 < cv < 0.5


def test_a_config_not_observed_yet_takes_its_siblings_kv_at_the_lower_side() -> None:
    small = replace(TRUE, kv_tokens=TRUE_KV / 8.0)
    _, corrections = run(small, 5, 6.0)
    trt = replace(KEY, engine=Engine.TRTLLM)
    trt_small = replace(small, key=replace(small.key, engine=Engine.TRTLLM))
    speeds = applied_speeds(corrections, {KEY: small, trt: trt_small}, {})
    own, shared = speeds[KEY].kv_tokens, speeds[trt].kv_tokens
    assert own is not None and shared is not None
    assert 0.7 * own < shared < own  # the same profile error, with what an engine does differently as doubt
    assert speeds[trt].note.startswith("KV capacity shared from the model's observed configs")
    # its own first window starts from there: no capped climb from the profile
    obs = ModelObservation("m8", 6.0, ISL, OSL, configs=(replace(window(4, 6.0), config=trt),))
    after = update_corrections(corrections, {"m8": obs}, {KEY: small, trt: trt_small}, WORKLOAD, {}, 9000.0)
    assert after[trt].kv_windows == 1
    assert trt_small.kv_tokens is not None
    assert trt_small.kv_tokens * math.exp(after[trt].kv_log) == pytest.approx(TRUE_KV, rel=0.05)


def test_plan_sizes_with_the_fleets_kv_capacity_and_says_so() -> None:
    """End to end through plan(): the windows its own fleet shows correct the memory bound, the
    explanation says so, and the next state (stored with every plan) carries the estimate."""
    small = replace(TRUE, kv_tokens=TRUE_KV / 8.0)
    state = PlannerState.initial()
    counts = []
    n = 0
    for k in range(6):
        configs = (window(n, 6.0),) if n else ()
        obs = Observation({"m8": ModelObservation("m8", 6.0, ISL, OSL, configs=configs)})
        r = plan(obs, Fleet(hosts(2)), POLICY, mp.ProfileSet((small,)), state, 1_700_000_000.0 + 60.0 * k)
        state = r.next_state
        [ce] = [c for m in r.explanation.models for c in m.configs if c.config == KEY]
        n = ce.replicas
        counts.append(n)
    want = math.ceil(6.0 / true_capacity())  # what the true profile plans (the policy: no headroom)
    assert counts[0] >= 2 * want and counts[3:] == [want] * 3
    assert ce.correction.startswith("KV capacity from the fleet:") and "vs profile 12.5k" in ce.correction
    assert ce.capacity_per_replica_rps == pytest.approx(true_capacity(), rel=0.2)
    d = plan_to_dict(r)
    [c] = d["next_state"]["corrections"]
    assert c["kv_windows"] == 5 and c["observed_kv_tokens"] == pytest.approx(TRUE_KV, rel=1e-6)
