"""The online correction (planner/correction.py): the fleet's latency corrects a wrong profile within
a few cycles, persists in the planner state, and noise does not make the fleet oscillate."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.mix import LengthMix, capacity_mix, predict_mix, scaled
from fleetplan.planner.capacity import MixedWorkload, capacity_table
from fleetplan.planner.correction import MIN_REQUESTS, applied_speeds, update_corrections
from fleetplan.planner.serde import state_from_dict, state_to_dict
from fleetplan.planner.types import ConfigKey, ConfigObservation, Correction, ModelObservation, PlannerState
from tests.unit.planner.planner_helpers import BF16, H100, VLLM, policy

KEY = ConfigKey("m8", VLLM, H100, 1, BF16)
TRUE = mp.PerfProfile(mp.ConfigKey("m8", VLLM, H100, 1, BF16),
                      mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06, p2_ms=2e-7, q=1.0),
                      kv_tokens=400_000.0,
                      data_range=mp.DataRange((128.0, 4096.0), (64.0, 1024.0), (0.5, 20.0), None, 8))
MIX = LengthMix.single(500.0, 200.0)
POLICY = policy(models=("m8",), tps={"m8": [1]}, model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}}})
SLO = {"ttft_p99_ms": 1000.0, "itl_p99_ms": 80.0}


def true_capacity() -> float:
    return capacity_mix(TRUE, MIX, **SLO).max_rps


def run(profile: mp.PerfProfile, cycles: int, demand_rps: float, *, noise_sd: float = 0.0,
        seed: int = 0) -> list[tuple[float, int]]:
    """Closed loop: each cycle the planner sizes the fleet with its corrected capacity, the 'fleet'
    (the true profile) serves the demand on that many replicas, and its latency is the next evidence.
    Returns (capacity per replica used, replicas) per cycle."""
    rng = random.Random(seed)
    corrections: dict[ConfigKey, Correction] = {}
    out = []
    for k in range(cycles):
        speeds = applied_speeds(corrections, {KEY: profile}, {})
        table, _ = capacity_table(POLICY, {KEY: profile}, {"m8": MixedWorkload(500.0, 200.0)}, [H100], speeds=speeds)
        cap = table[KEY].max_rps
        n = max(1, math.ceil(demand_rps / cap))
        out.append((cap, n))
        seen = predict_mix(TRUE, MIX, demand_rps / n)
        f = math.exp(rng.gauss(0.0, noise_sd)) if noise_sd else 1.0
        obs = ModelObservation("m8", demand_rps, 500.0, 200.0, configs=(
            ConfigObservation(KEY, n, demand_rps, seen.ttft_p99_ms * f, seen.itl_p99_ms * f, 300.0),))
        corrections = update_corrections(corrections, {"m8": obs}, {KEY: profile},
                                         {"m8": MixedWorkload(500.0, 200.0)}, {}, 1000.0 + 60.0 * k)
    return out


def test_a_profile_40_percent_optimistic_is_corrected_within_5_cycles() -> None:
    optimistic = scaled(TRUE, 1.4)
    assert capacity_mix(optimistic, MIX, **SLO).max_rps > 1.4 * true_capacity()
    demand = 5.5 * true_capacity()
    hist = run(optimistic, 12, demand)
    want = math.ceil(demand / true_capacity())
    assert hist[0][1] < want  # the optimistic profile alone under-provisions
    for cap, n in hist[5:]:  # what the true profile would plan
        assert n == want
        assert cap == pytest.approx(true_capacity(), rel=0.1)


def test_a_profile_40_percent_pessimistic_comes_down_without_overshooting() -> None:
    pessimistic = scaled(TRUE, 0.6)
    demand = 5.5 * true_capacity()
    hist = run(pessimistic, 45, demand)  # upward is slow on purpose (~40 cycles): evidence first
    want = math.ceil(demand / true_capacity())
    assert hist[0][1] > want
    assert all(cap <= true_capacity() * 1.02 for cap, _ in hist)  # never trusts more than the evidence
    assert all(n >= want for _, n in hist)
    assert hist[-1][1] == want


def test_noise_does_not_make_the_fleet_oscillate() -> None:
    demand = 5.5 * true_capacity()
    want = math.ceil(demand / true_capacity())
    hist = run(TRUE, 120, demand, noise_sd=0.25, seed=3)
    counts = [n for _, n in hist]
    changes = sum(1 for a, b in itertools.pairwise(counts) if a != b)
    assert changes <= 12
    assert max(counts) - min(counts) <= 2
    assert min(counts) >= want - 1


def test_too_few_requests_are_not_evidence() -> None:
    obs = ModelObservation("m8", 5.0, 500.0, 200.0, configs=(
        ConfigObservation(KEY, 1, 5.0, 99_000.0, 900.0, MIN_REQUESTS - 1),))
    out = update_corrections({}, {"m8": obs}, {KEY: TRUE}, {"m8": MixedWorkload(500.0, 200.0)}, {}, 0.0)
    assert out == {}


def test_corrections_survive_the_state_round_trip() -> None:
    c = Correction(KEY, -0.3, 0.01, -0.1, 0.02, 4, 1000.0, 1240.0, 0.72, 0.9)
    state = PlannerState((), 7, (c,))
    back = state_from_dict(state_to_dict(state))
    assert back == state


def test_an_extrapolating_profile_is_conservative_until_observed() -> None:
    speeds = applied_speeds({}, {KEY: TRUE}, {KEY: ("roofline prior only (no benchmark data)",)})
    assert speeds[KEY].ttft < 0.7 and speeds[KEY].itl < 0.7
    assert "conservative" in speeds[KEY].note
    assert applied_speeds({}, {KEY: TRUE}, {}) == {}


def test_a_correction_without_evidence_relaxes_toward_the_profile() -> None:
    # a config the plan stopped running after a slow spell keeps its correction for a while, then is
    # trusted again (tried again) instead of never: the estimate relaxes over RELAX_S without evidence
    slow = Correction(KEY, -0.4, 0.005, -0.4, 0.005, 12, 0.0, 0.0, 0.67, 0.67, -0.4, -0.4)
    nothing = {"m8": ModelObservation("m8", 5.0, 500.0, 200.0)}
    soon = update_corrections({KEY: slow}, nothing, {KEY: TRUE}, {"m8": MixedWorkload(500.0, 200.0)}, {}, 600.0)
    assert soon[KEY].applied_ttft_log == pytest.approx(-0.4)
    later = update_corrections({KEY: slow}, nothing, {KEY: TRUE}, {"m8": MixedWorkload(500.0, 200.0)}, {},
                               86_400.0)
    assert later[KEY].applied_ttft_log == 0.0 and later[KEY].applied_itl_log == 0.0
    assert later[KEY].ttft_log == -0.4  # the evidence itself is kept (report: what was seen, when)
