"""The online correction (planner/correction.py): the fleet's latency corrects a wrong profile within
a few cycles, persists in the planner state, and noise does not make the fleet oscillate."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.mix import LengthMix, capacity_mix, predict_mix, scaled
from fleetplan.planner.capacity import MixedWorkload, capacity_table
from fleetplan.planner.correction import (
    MAX_STEP_DOWN,
    MAX_STEP_UP,
    MIN_REQUESTS,
    SHARED_VAR,
    applied_speeds,
    regression_cap,
    update_corrections,
)
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


@pytest.mark.parametrize("factor", [0.6, 0.5])
def test_a_pessimistic_profile_comes_down_within_10_windows_without_overshooting(factor: float) -> None:
    # issue 18.2: learn in both directions. A profile 2x pessimistic (and 40%) on purpose: consistent
    # windows at a known load bring the count to the true profile's about as fast as an optimistic one
    # is corrected, never planning more capacity than the evidence supports
    pessimistic = scaled(TRUE, factor)
    demand = 5.5 * true_capacity()
    hist = run(pessimistic, 30, demand)
    want = math.ceil(demand / true_capacity())
    assert hist[0][1] > want
    assert all(cap <= true_capacity() * 1.02 for cap, _ in hist)  # never trusts more than the evidence
    assert all(n >= want for _, n in hist)
    first = next(i for i, (_, n) in enumerate(hist) if n == want)
    assert first <= 10 and all(n == want for _, n in hist[first:])
    assert hist[-1][0] == pytest.approx(true_capacity(), rel=0.07)  # k * sd has shrunk: near the estimate


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
    c = Correction(KEY, -0.3, 0.01, -0.1, 0.02, 4, 1000.0, 1240.0, 0.72, 0.9, -0.3, -0.1,
                   ((1.5, -0.31, 300.0), (2.0, -0.29, 280.0)), ((1.5, -0.1, 300.0),))
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


def observe_once(previous: dict[ConfigKey, Correction], obs: ConfigObservation, now_s: float = 1000.0,
                 extra: tuple[str, ...] = ()) -> dict[ConfigKey, Correction]:
    m = ModelObservation("m8", obs.rate_rps, 500.0, 200.0, configs=(obs,))
    return update_corrections(previous, {"m8": m}, {KEY: TRUE}, {"m8": MixedWorkload(500.0, 200.0)},
                              {KEY: extra} if extra else {}, now_s)


def test_an_optimistic_profile_is_lowered_at_once() -> None:
    seen = predict_mix(TRUE, MIX, 2.0)
    slow = observe_once({}, ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms * 3, seen.itl_p99_ms * 3, 300.0))
    c = slow[KEY]
    assert c.applied_ttft_log <= -0.3 and c.applied_itl_log <= -0.3  # the first window: the whole step
    assert c.applied_ttft_log == c.ttft_log


def test_an_itl_under_the_lowest_bucket_is_an_upper_bound_not_no_evidence() -> None:
    # a real vLLM (CPU build): per-request TPOT p99 under the first 10 ms edge, while the mix counts as
    # extrapolating; before, the ITL estimate was never updated and mean - 1 sd kept a permanent x0.50
    extra = ("prompts up to 85 tokens (p99), the data up to 64",)
    seen = predict_mix(TRUE, MIX, 2.0)
    bound = ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms, None, 300.0,
                              itl_p99_range_ms=(0.0, seen.itl_p99_ms * 1.02))
    prior = applied_speeds({}, {KEY: TRUE}, {KEY: extra})[KEY].itl
    assert prior < 0.55
    corr: dict[ConfigKey, Correction] = {}
    for k in range(8):
        corr = observe_once(corr, bound, 1000.0 + 60 * k, extra)
    c = corr[KEY]
    assert c.itl_var < 0.2 ** 2  # confirmed: no longer sized at the conservative side
    assert math.exp(c.applied_itl_log) > 0.9  # raised to what the bound proves
    assert c.itl_log <= 1e-9  # and never beyond it: the bound proves the profile, not a faster engine
    # a bound ABOVE the prediction says nothing of a faster engine and nothing of a slower one
    loose = ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms, None, 300.0, itl_p99_range_ms=(0.0, 100.0))
    fitted = observe_once({}, loose)[KEY]
    assert fitted.itl_log == pytest.approx(0.0, abs=1e-9) and fitted.applied_itl_log == 0.0


def test_a_bound_lifts_a_slow_estimate_no_faster_than_a_reading_may() -> None:
    # an estimate at x0.40 and a window whose ITL p99 sits under the lowest bucket's edge at the
    # profile's own prediction ("at least x1"): one window moves it by MAX_STEP_UP at most, as a
    # point value may; before, the bound lifted it x2 in one cycle and the fleet shrank into a burst
    slow = math.log(0.4)
    c = Correction(KEY, slow, 0.3, slow, 0.3, 8, 0.0, 1000.0, None, None, slow, slow)
    seen = predict_mix(TRUE, MIX, 2.0)
    bound = ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms / 0.4, None, 300.0,
                              itl_p99_range_ms=(0.0, seen.itl_p99_ms))
    nxt = observe_once({KEY: c}, bound, 1060.0)[KEY]
    assert slow < nxt.itl_log <= slow + MAX_STEP_UP + 0.01  # (+ a minute of relaxing toward the profile)
    assert nxt.itl_var < 0.3  # what it applied, it learnt
    corr = {KEY: nxt}
    for k in range(2, 10):  # windows that keep saying so carry it to the bound
        corr = observe_once(corr, bound, 1000.0 + 60 * k)
    assert corr[KEY].itl_log > -0.1


def test_a_coarse_bucket_holding_the_prediction_is_no_evidence_of_a_slower_engine() -> None:
    # the demo: TTFT p99 read near the top of a 100-250 ms bucket while the truth is ~220 ms; a bucket
    # that holds what the profile predicts does not lower the speed, and a wide one weighs little
    seen = predict_mix(TRUE, MIX, 2.0)
    lo, hi = seen.ttft_p99_ms * 0.6, seen.ttft_p99_ms * 1.5
    near_top = ConfigObservation(KEY, 1, 2.0, hi * 0.99, seen.itl_p99_ms, 300.0, ttft_p99_range_ms=(lo, hi))
    c = observe_once({}, near_top)[KEY]
    assert c.ttft_log >= 0.0
    # the same reading without its bucket (a point value alone) would have lowered it
    plain = ConfigObservation(KEY, 1, 2.0, hi * 0.99, seen.itl_p99_ms, 300.0)
    assert observe_once({}, plain)[KEY].ttft_log < -0.05
    # a bucket entirely above the prediction still lowers it, with the bucket's width as noise
    above = ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms * 1.3, seen.itl_p99_ms, 300.0,
                              ttft_p99_range_ms=(seen.ttft_p99_ms * 1.1, seen.ttft_p99_ms * 2.5))
    narrow = ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms * 1.3, seen.itl_p99_ms, 300.0,
                               ttft_p99_range_ms=(seen.ttft_p99_ms * 1.28, seen.ttft_p99_ms * 1.32))
    wide_step, narrow_step = observe_once({}, above)[KEY].ttft_log, observe_once({}, narrow)[KEY].ttft_log
    assert wide_step < 0 and narrow_step < wide_step


def test_the_regression_holds_a_faster_engine_to_the_loads_it_was_seen_at() -> None:
    # windows whose speed falls with load (the engine nears its knee sooner than the profile says):
    # a faster engine is applied only as far as the line says at the highest load seen
    pts = ((1.0, 0.9, 300.0), (1.5, 0.6, 300.0), (2.0, 0.35, 300.0), (2.5, 0.15, 300.0))
    c = Correction(KEY, 0.7, 0.002, 0.7, 0.002, 8, 0.0, 1000.0, None, None, 0.0, 0.0, pts, pts)
    seen = predict_mix(TRUE, MIX, 2.5)
    obs = ConfigObservation(KEY, 1, 2.5, seen.ttft_p99_ms / 1.15, seen.itl_p99_ms / 1.15, 300.0)
    nxt = observe_once({KEY: c}, obs, 1060.0)[KEY]
    cap = regression_cap(nxt.ttft_points)
    assert cap is not None and cap < 0.4  # the line at the highest load seen, + 1 se
    assert nxt.applied_ttft_log <= cap + 1e-9 and nxt.applied_ttft_log < nxt.ttft_log
    # the same estimate from windows that agree at every load: applied near the estimate
    flat = tuple((x, 0.7, 300.0) for x, _, _ in pts)
    same = observe_once({KEY: replace(c, ttft_points=flat, itl_points=flat)},
                        replace(obs, ttft_p99_ms=seen.ttft_p99_ms / 2.0, itl_p99_ms=seen.itl_p99_ms / 2.0), 1060.0)
    assert same[KEY].applied_ttft_log > same[KEY].ttft_log - 0.05


def test_the_regression_holds_a_slower_engine_that_relaxes_at_low_load() -> None:
    # the knee was seen (a window at 2.5 rps per replica read x0.33) and the next windows, at half
    # that load once the fleet grew, read faster: the estimate relaxes, what is applied stays at the
    # line at the highest load seen, so the fleet does not step back to the load that missed
    pts = ((2.5, -1.1, 300.0), (1.25, -0.5, 300.0), (1.3, -0.45, 300.0), (1.2, -0.5, 300.0))
    c = Correction(KEY, -0.6, 0.01, -0.6, 0.01, 8, 0.0, 1000.0, None, None, -1.1, -1.1, pts, pts)
    seen = predict_mix(TRUE, MIX, 1.25)
    obs = ConfigObservation(KEY, 1, 1.25, seen.ttft_p99_ms / 0.6, seen.itl_p99_ms / 0.6, 300.0)
    nxt = observe_once({KEY: c}, obs, 1060.0)[KEY]
    cap = regression_cap(nxt.ttft_points)
    assert cap is not None and cap < -0.6  # the line at 2.5 rps, + 1 se
    assert nxt.ttft_log > -0.6 and nxt.applied_ttft_log <= cap + 1e-9
    # without the window at the knee the same windows are applied as estimated
    low = tuple(p for p in pts if p[0] < 2.0)
    free = observe_once({KEY: replace(c, ttft_points=low, itl_points=low)}, obs, 1060.0)[KEY]
    assert free.applied_ttft_log > nxt.applied_ttft_log + 0.2


def test_a_lone_surprise_toward_faster_is_noise_and_a_slower_one_is_followed_at_once() -> None:
    # long context: one window's p99 says x1.6 (no 70k-token prefill landed in it), the window
    # before said x0.9; the estimate (x1.0, settled) moves a little. Two such windows in a row are an
    # engine that changed: the filter follows (the capped step). Toward slower: at once, always
    from fleetplan.planner.correction import MAX_STEP_DOWN, MAX_STEP_UP, _kalman, _Reading

    fast = _Reading(math.log(1.6), None, None, 0.0625)
    lone, _ = _kalman(0.0, 0.01, fast, z_prev=math.log(0.9))
    persistent, _ = _kalman(0.0, 0.01, fast, z_prev=math.log(1.5))
    first, _ = _kalman(0.0, 0.01, fast, z_prev=None)  # the first window: nothing to compare with
    assert 0.0 < lone < 0.05
    assert persistent == pytest.approx(MAX_STEP_UP) and first == persistent
    slow = _Reading(math.log(0.45), None, None, 0.0625)
    assert _kalman(0.0, 0.01, slow, z_prev=math.log(1.1))[0] == pytest.approx(-MAX_STEP_DOWN)


def test_a_lone_slower_window_at_a_load_the_config_held_is_averaged_not_followed() -> None:
    # mooncake, 2x pessimistic profiles: a window read ITL 34 ms at 0.78 rps per replica, the next
    # 156 ms at 0.51 (a long prompt's prefill stalled the others' decode). An engine that is slower
    # would have been slower at the higher load too: the window is averaged, and the fleet does not
    # double for it. The same reading above every load that held is followed at once (SLO first)
    held = tuple((2.0, 0.0, 300.0) for _ in range(4))
    settled = Correction(KEY, 0.0, 0.01, 0.0, 0.01, 4, None, 900.0, 1.0, 1.0, 0.0, 0.0, held, held)

    def after(load: float) -> Correction:
        seen = predict_mix(TRUE, MIX, load)
        obs = ConfigObservation(KEY, 1, load, seen.ttft_p99_ms, seen.itl_p99_ms / 0.45, 300.0)
        return observe_once({KEY: settled}, obs)[KEY]

    lower, same, higher = after(1.0), after(2.0), after(3.0)
    assert -0.1 < same.itl_log < 0.0  # the load a window held: a lone window is averaged too
    assert -0.1 < lower.itl_log < 0.0 and lower.applied_itl_log == 0.0
    assert higher.itl_log == pytest.approx(-MAX_STEP_DOWN) and higher.applied_itl_log == higher.itl_log


def test_a_faster_engine_is_trusted_up_to_twice_the_load_it_was_seen_at() -> None:
    # the demo's day: ITL x1.27 seen at 0.5-1.3 rps per replica said 2.55 rps where the truth is 1.66;
    # the correction's capacity is bounded by TRUST_GROWTH x the highest load per replica seen
    from fleetplan.planner.correction import TRUST_GROWTH

    work = {"m8": MixedWorkload(500.0, 200.0)}
    profile_rps = capacity_mix(TRUE, MIX, **SLO).max_rps
    low = profile_rps / 4
    fast = Correction(KEY, 0.5, 0.001, 0.5, 0.001, 12, 0.0, 0.0, 1.65, 1.65, 0.5, 0.5,
                      ((low, 0.5, 300.0),) * 4, ((low, 0.5, 300.0),) * 4)
    speeds = applied_speeds({KEY: fast}, {KEY: TRUE}, {})
    table, _ = capacity_table(POLICY, {KEY: TRUE}, work, [H100], speeds=speeds)
    assert table[KEY].max_rps == pytest.approx(profile_rps, rel=1e-3)  # 2 x a quarter of it: the profile holds
    seen_high = replace(fast, itl_points=((0.8 * profile_rps, 0.5, 300.0),) * 4)
    table, _ = capacity_table(POLICY, {KEY: TRUE}, work, [H100],
                              speeds=applied_speeds({KEY: seen_high}, {KEY: TRUE}, {}))
    unbounded, _ = capacity_table(POLICY, {KEY: TRUE}, work, [H100],
                                  speeds={KEY: replace(speeds[KEY], trusted_rps=None)})
    assert table[KEY].max_rps == pytest.approx(TRUST_GROWTH * 0.8 * profile_rps)
    assert table[KEY].max_rps < unbounded[KEY].max_rps
    assert "trusted up to" in speeds[KEY].note


def test_a_profile_outside_its_data_is_trusted_only_up_to_twice_the_load_seen() -> None:
    # benchmark-fitted mooncake: a vLLM TP2 canary seen at 0.33 rps per replica read as x0.85 of a
    # roofline prior 2.1x the truth, counted at 1.84 rps; the fleet moved onto it and off it again.
    # Slower than the profile or not, a prior's capacity above the loads seen is not evidence
    from fleetplan.planner.correction import TRUST_GROWTH

    work = {"m8": MixedWorkload(500.0, 200.0)}
    profile_rps = capacity_mix(TRUE, MIX, **SLO).max_rps
    low = profile_rps / 8
    slower = Correction(KEY, -0.1, 0.001, -0.1, 0.001, 12, 0.0, 0.0, 0.9, 0.9, -0.1, -0.1,
                        ((low, -0.1, 300.0),) * 4, ((low, -0.1, 300.0),) * 4)
    outside = {KEY: ("roofline prior only (no benchmark data)",)}

    def capacity(extrapolating: dict[ConfigKey, tuple[str, ...]]) -> tuple[float, str]:
        speeds = applied_speeds({KEY: slower}, {KEY: TRUE}, extrapolating)
        table, _ = capacity_table(POLICY, {KEY: TRUE}, work, [H100], speeds=speeds)
        return table[KEY].max_rps, speeds[KEY].note

    inside_rps, inside_note = capacity({})
    outside_rps, outside_note = capacity(outside)
    assert inside_rps > 0.8 * profile_rps  # a fit inside its data: its shape holds above the loads seen
    assert outside_rps == pytest.approx(TRUST_GROWTH * low)  # a prior: what was seen, twice, no more
    assert "outside its data: trusted up to" in outside_note and "trusted up to" not in inside_note
    # and the bound grows with the load the replicas show they hold
    seen_high = replace(slower, itl_points=((0.45 * profile_rps, -0.1, 300.0),) * 4)
    speeds = applied_speeds({KEY: seen_high}, {KEY: TRUE}, outside)
    table, _ = capacity_table(POLICY, {KEY: TRUE}, work, [H100], speeds=speeds)
    assert table[KEY].max_rps == pytest.approx(inside_rps)


def test_a_config_not_observed_starts_from_what_its_siblings_showed() -> None:
    # issue 18.3: a slower engine seen on one config moves the model's others before they run
    other = ConfigKey("m8", VLLM, H100, 2, BF16)
    slow = Correction(KEY, -0.5, 0.002, -0.5, 0.002, 12)
    speeds = applied_speeds({KEY: slow}, {KEY: TRUE, other: TRUE}, {})
    assert speeds[other].itl == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert "shared from the model's observed configs" in speeds[other].note
    assert applied_speeds({}, {other: TRUE}, {}) == {}  # nothing observed: the profile as fitted


def test_a_prior_not_observed_doubts_its_siblings_evidence_not_its_own_prior_again() -> None:
    # an unobserved config whose profile is a roofline prior: its siblings measured the profiles'
    # shared error, so it stands at their estimate less the doubt of how far one config may differ
    # (SHARED_VAR), not less the prior's whole doubt again (x0.48: out of every plan)
    other = ConfigKey("m8", VLLM, H100, 2, BF16)
    seen = Correction(KEY, -0.7, 0.001, -0.7, 0.001, 30)
    outside = {KEY: ("roofline prior only (no benchmark data)",), other: ("roofline prior only (no benchmark data)",)}
    speeds = applied_speeds({KEY: seen}, {KEY: TRUE, other: TRUE}, outside)
    doubt = math.sqrt(0.001 + SHARED_VAR)
    assert speeds[other].itl == pytest.approx(math.exp(-0.7 - doubt), rel=1e-6)
    assert speeds[other].ttft == pytest.approx(math.exp(-0.7 - doubt), rel=1e-6)
    assert speeds[other].itl > math.exp(-0.7) * 0.7  # the prior's doubt again would leave x0.48


def test_a_latency_that_does_not_follow_the_load_does_not_ratchet_the_fleet_up() -> None:
    # issue 18: every replica must buy SLO. A latency with a load-independent part (it stays at 60 ms
    # whatever the load) read at the lower loads of a demand trough says "an ever slower engine" to a
    # filter that inverts the profile at each load: the fleet would grow as the load per replica falls,
    # and the larger fleet lowers the load further. The fleet's own regression (the explained speed
    # RISES with load) keeps what is applied at the line's value at the highest load seen
    corr: dict[ConfigKey, Correction] = {}
    applied = []
    for k, rps in enumerate((8.0, 8.0, 6.0, 4.5, 3.4, 2.5, 2.0, 1.6)):
        seen = predict_mix(TRUE, MIX, rps)
        corr = observe_once(corr, ConfigObservation(KEY, 1, rps, seen.ttft_p99_ms, 60.0, 300.0),
                            1000.0 + 60.0 * k)
        applied.append(corr[KEY].applied_itl_log)
    c = corr[KEY]
    z = [p[1] for p in c.itl_points]
    assert z[0] > z[-1] + 0.5  # the windows: the explained speed fell with the load
    assert c.itl_log < -0.6  # and the estimate followed the low loads down (x0.5)
    assert applied[-1] > c.itl_log + 0.3  # what the plan applies did not: the line at 8 rps, - 1 se
    assert len(set(applied[5:])) == 1  # and, once the rise is clear of the noise, it held: no ratchet


def test_a_window_weighs_what_its_p99_can_tell() -> None:
    # the same slow p99 (x1.5 the prediction) from a window whose p99 another window of the same
    # traffic would read anywhere between 0.5x and 3x (one long prefill among 40 requests) moves the
    # estimate less than from a window that would read it within +-5%; the variance says why
    seen = predict_mix(TRUE, MIX, 2.0)
    p99 = seen.ttft_p99_ms * 1.5

    def step(sampling: tuple[float, float] | None) -> float:
        obs = ConfigObservation(KEY, 1, 2.0, p99, seen.itl_p99_ms, 300.0, ttft_p99_sampling_ms=sampling)
        prior = {KEY: Correction(KEY, 0.0, 0.04, 0.0, 0.04, observations=5, updated_s=940.0)}
        return observe_once(prior, obs)[KEY].ttft_log

    heavy, tight, unknown = step((0.5 * p99, 3.0 * p99)), step((0.95 * p99, 1.05 * p99)), step(None)
    assert heavy < 0.0 and tight < 0.0
    assert abs(heavy) < 0.6 * abs(tight)
    assert abs(tight) >= abs(unknown)  # 300 completions' assumed noise, wider than this window's


def test_windows_that_scatter_more_than_assumed_are_weighed_as_the_noise_they_show() -> None:
    # long context: the last windows read x0.55, x1.8, x0.6, x1.7 at the same load (whether a
    # 70k-token prefill landed in each); a fifth window at x0.55 moves the estimate much less than
    # after windows that agreed, so the plan does not swap configs on every such window
    from fleetplan.planner.correction import scatter

    seen = predict_mix(TRUE, MIX, 2.5)  # above the loads seen: a slower reading is followed at once
    noisy = tuple((2.0, math.log(s), 300.0) for s in (0.55, 1.8, 0.6, 1.7))
    calm = tuple((2.0, math.log(s), 300.0) for s in (1.0, 1.02, 0.98, 1.0))
    assert scatter(noisy) > 3.0 and scatter(calm) == 1.0
    slow = ConfigObservation(KEY, 1, 2.5, seen.ttft_p99_ms * 2.0, seen.itl_p99_ms, 300.0)

    def after(points: tuple[tuple[float, float, float], ...]) -> float:
        prior = Correction(KEY, 0.0, 0.03, 0.0, 0.03, observations=4, updated_s=940.0, ttft_points=points)
        return observe_once({KEY: prior}, slow)[KEY].ttft_log

    assert after(noisy) < 0.0
    assert abs(after(noisy)) < 0.6 * abs(after(calm))


def test_a_slower_engine_inside_the_band_is_applied_where_the_slo_is_missed() -> None:
    """Windows that read TTFT x0.85 of the profile sit inside the deadband: noise around a profile
    that holds, unless the replicas miss the SLO at that load; then the band does not hide it, and
    the slower speed stays applied while the windows keep reading it, miss or not."""
    seen = predict_mix(TRUE, MIX, 2.0)
    slo = (seen.ttft_p99_ms * 1.1, seen.itl_p99_ms * 2.0)  # the profile: 10% inside the TTFT SLO

    def run(slos: dict[str, tuple[float, float]] | None, factor: float, n: int,
            start: dict[ConfigKey, Correction] | None = None) -> dict[ConfigKey, Correction]:
        out = dict(start or {})
        for i in range(n):
            obs = ConfigObservation(KEY, 1, 2.0, seen.ttft_p99_ms * factor, seen.itl_p99_ms, 300.0)
            m = ModelObservation("m8", 2.0, 500.0, 200.0, configs=(obs,))
            out = update_corrections(out, {"m8": m}, {KEY: TRUE}, {"m8": MixedWorkload(500.0, 200.0)}, {},
                                     1000.0 + 60.0 * i, slos)
        return out

    slow = 1.3  # the p99 30% above the profile's: above the SLO
    assert run(None, slow, 8)[KEY].applied_ttft_log == 0.0  # the band alone: the profile stands
    shown = run({"m8": slo}, slow, 8)[KEY]
    assert -0.25 < shown.ttft_log < -0.05 and shown.applied_ttft_log < -0.05
    assert shown.applied_itl_log == 0.0  # the ITL met its SLO: nothing to show there
    # the fleet grows, the SLO is met, the windows still read slower: it stays applied
    kept = run({"m8": slo}, 1.08, 3, start={KEY: shown})[KEY]
    assert kept.applied_ttft_log < -0.04
    # a window inside the SLO that reads the profile's speed: the profile stands again
    assert run({"m8": slo}, 1.0, 20, start={KEY: kept})[KEY].applied_ttft_log == 0.0
