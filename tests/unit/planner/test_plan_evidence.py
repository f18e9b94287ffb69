"""plan() with length mixes, observed evidence and no profile: what the planner does with the fleet's
own numbers (planner/correction.py, models/mix.py), end to end through plan()."""

from __future__ import annotations

import json
from dataclasses import replace

from planner_helpers import H100, VLLM, hosts, policy, policy_dict
from pytest import approx

from fleetplan.controller.plan_text import config_lines
from fleetplan.models import profile as mp
from fleetplan.models.mix import LengthMix, predict_mix, scaled
from fleetplan.planner.capacity import MixedWorkload
from fleetplan.planner.core import plan, plan_to_dict, workloads_from
from fleetplan.planner.demand import burst_need_rps
from fleetplan.planner.policy import Policy, load_policy_dict
from fleetplan.planner.serde import state_from_dict
from fleetplan.planner.types import (
    ConfigKey,
    ConfigObservation,
    Fleet,
    LossReason,
    ModelObservation,
    Observation,
    PlannerState,
)

NOW = 1_700_000_000.0
KEY = ConfigKey("m8", VLLM, H100, 1, mp.Precision.BF16)
TRUE = mp.PerfProfile(mp.ConfigKey("m8", VLLM, H100, 1, mp.Precision.BF16),
                      mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06, p2_ms=2e-7, q=1.0),
                      kv_tokens=400_000.0,
                      data_range=mp.DataRange((128.0, 4096.0), (64.0, 1024.0), (0.5, 20.0), None, 8))
ONE = policy(models=("m8",), model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}}})


def _obs(rate: float, replicas: int, ttft: float | None, itl: float | None, **kw: object) -> Observation:
    ev = (ConfigObservation(KEY, replicas, rate, ttft, itl, 500.0),) if replicas else ()
    return Observation({"m8": ModelObservation("m8", rate, 500.0, 200.0, configs=ev, **kw)})  # type: ignore[arg-type]


def test_a_slow_fleet_scales_up_now_and_the_state_carries_the_correction() -> None:
    profiles = mp.ProfileSet((scaled(TRUE, 1.6),))  # the profile is 1.6x too optimistic
    rate = 60.0
    first = plan(_obs(rate, 0, None, None), Fleet(hosts(2)), ONE, profiles, PlannerState.initial(), NOW)
    n0 = sum(c.replicas for c in first.plan.counts)
    seen = predict_mix(TRUE, LengthMix.single(500, 200), rate / n0)
    second = plan(_obs(rate, n0, seen.ttft_p99_ms, seen.itl_p99_ms), Fleet(hosts(2)), ONE, profiles,
                  first.next_state, NOW + 60)
    n1 = sum(c.replicas for c in second.plan.counts)
    assert n1 > n0  # feedback: the same demand, more replicas, this cycle
    cfg = second.explanation.models[0].configs[0]
    assert cfg.capacity_factor < 0.85 and cfg.correction.startswith("engine speed vs profile")
    assert cfg.observed_ttft_p99_ms == seen.ttft_p99_ms
    doc = plan_to_dict(second)
    json.dumps(doc)
    assert doc["explanation"]["models"][0]["configs"][0]["capacity_factor"] < 0.85
    restored = state_from_dict(doc["next_state"])  # what the daemon stores and reloads after a restart
    assert restored.corrections == second.next_state.corrections
    assert restored.corrections[0].observations == 1


def test_a_model_without_any_capacity_data_runs_its_floor() -> None:
    p = load_policy_dict(policy_dict(models=("acme-13b",), model_extra={"acme-13b": {
        "min_replicas": 1, "allowed": {"tp": [1, 2], "engines": ["vllm"]}}}), "test")
    r = plan(Observation({"acme-13b": ModelObservation("acme-13b", 5.0)}), Fleet(hosts(1)), p,
             mp.ProfileSet(()), PlannerState.initial(), NOW)
    assert sum(c.replicas for c in r.plan.counts) == 1
    assert any("no capacity data" in n for n in r.explanation.models[0].notes)


def test_the_policy_workload_may_be_a_distribution_and_observed_quantiles_win() -> None:
    d = policy_dict(models=("m8",))
    d["models"][0]["workload"] = {"isl": 820, "osl": 200, "isl_quantiles": {0.5: 500, 0.95: 2400, 0.99: 4100}}
    p = load_policy_dict(d, "test")
    w = workloads_from(Observation(), p)["m8"]
    assert isinstance(w, MixedWorkload) and w.mix is not None
    assert w.length_mix().isl_quantile(0.99) > 2.5 * w.length_mix().isl_quantile(0.5)
    obs = Observation({"m8": ModelObservation("m8", 1.0, 1000.0, 100.0,
                                              isl_quantiles=((0.5, 800.0), (0.99, 9000.0)))})
    w2 = workloads_from(obs, p)["m8"]
    assert w2.length_mix().isl_quantile(0.99) > 8000


def test_a_one_off_burst_is_held_for_the_slo_period_then_forgotten() -> None:
    """A burst shorter than the lead time cannot be chased: the capacity that drains it is held for
    the SLO's period (default 3600 s), whose objective it would spend when it comes back, then
    forgotten."""
    p = policy(models=("m8",), scaling={"scale_down_delay_s": 300, "cycle_s": 60},
               model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}, "headroom": 0.0}})
    profiles = mp.ProfileSet((TRUE,))
    calm = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), p, profiles, PlannerState.initial(), NOW)
    burst = plan(_obs(10.0, 0, None, None, peak_rps=60.0), Fleet(hosts(2)), p, profiles,
                 PlannerState.initial(), NOW)
    assert burst.explanation.models[0].required_rps > 3 * calm.explanation.models[0].required_rps
    later = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), p, profiles, burst.next_state, NOW + 120)
    assert later.explanation.models[0].required_rps == burst.explanation.models[0].required_rps
    held = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), p, profiles, later.next_state, NOW + 3000)
    assert held.explanation.models[0].required_rps == burst.explanation.models[0].required_rps
    gone = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), p, profiles, held.next_state, NOW + 3700)
    assert gone.explanation.models[0].required_rps == calm.explanation.models[0].required_rps


def test_a_burst_rides_on_the_level_and_a_step_down_is_no_burst() -> None:
    """The memory holds a burst's excess over its window's mean: over a higher level it needs more,
    and a steady level that steps down leaves nothing to hold."""
    p = policy(models=("m8",), scaling={"scale_down_delay_s": 300, "cycle_s": 60},
               model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}, "headroom": 0.0}})
    profiles = mp.ProfileSet((TRUE,))
    burst = plan(_obs(10.0, 0, None, None, peak_rps=60.0), Fleet(hosts(2)), p, profiles,
                 PlannerState.initial(), NOW)
    low = plan(_obs(10.0, 0, None, None), Fleet(hosts(2)), p, profiles, burst.next_state, NOW + 600)
    high = plan(_obs(20.0, 0, None, None), Fleet(hosts(2)), p, profiles, burst.next_state, NOW + 600)
    assert high.explanation.models[0].required_rps > low.explanation.models[0].required_rps + 9.0
    steady = plan(_obs(90.0, 0, None, None, peak_rps=90.0), Fleet(hosts(8)), p, profiles,
                  PlannerState.initial(), NOW)
    assert not steady.next_state.bursts  # a peak inside the Poisson noise of its level is no burst
    after = plan(_obs(15.0, 0, None, None), Fleet(hosts(8)), p, profiles, steady.next_state, NOW + 600)
    calm = plan(_obs(15.0, 0, None, None), Fleet(hosts(8)), p, profiles, PlannerState.initial(), NOW + 600)
    assert after.explanation.models[0].required_rps == calm.explanation.models[0].required_rps


def test_a_burst_seen_over_a_high_level_shrinks_when_the_level_falls() -> None:
    """A burst of +25 rps over a 40 rps level (its peak 70 rps, less noise), then the
    level falls to 4 rps: the excess rides at sqrt(4 / 40) of its size (a tenth of the clients), not
    whole (which would hold 34 rps for the SLO's period over a 4 rps level); over a level above the
    one it stood over, it rides whole (never larger than seen)."""
    p = policy(models=("m8",), scaling={"scale_down_delay_s": 300, "cycle_s": 60},
               model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}, "headroom": 0.0}})
    profiles = mp.ProfileSet((TRUE,))
    burst = plan(_obs(40.0, 0, None, None, peak_rps=70.0), Fleet(hosts(8)), p, profiles,
                 PlannerState.initial(), NOW)
    (_, _, excess, level), = burst.next_state.bursts
    assert level == 40.0 and 20.0 < excess < 30.0
    low = plan(_obs(4.0, 0, None, None), Fleet(hosts(8)), p, profiles, burst.next_state, NOW + 600)
    # the capacity that drains a 15 s burst within the 1 s TTFT SLO (planner/demand.py)
    assert low.explanation.models[0].required_rps == approx(burst_need_rps(4.0 + excess * 0.1 ** 0.5, 15.0, 1000.0))
    # (at 52 rps or more it would be the edge of a ramp: level plus half the excess held, dropped)
    high = plan(_obs(50.0, 0, None, None), Fleet(hosts(8)), p, profiles, burst.next_state, NOW + 600)
    assert high.explanation.models[0].required_rps == approx(burst_need_rps(50.0 + excess, 15.0, 1000.0))


def test_corrections_survive_a_cycle_before_any_host_reported() -> None:
    """After a restart the first cycle may see no hosts (agents not reported yet, no policy hosts):
    the stored corrections must not be forgotten then."""
    profiles = mp.ProfileSet((scaled(TRUE, 1.6),))
    seen = predict_mix(TRUE, LengthMix.single(500, 200), 20.0)
    first = plan(_obs(40.0, 2, seen.ttft_p99_ms, seen.itl_p99_ms), Fleet(hosts(2)), ONE, profiles,
                 PlannerState.initial(), NOW)
    assert first.next_state.corrections
    restarted = plan(_obs(40.0, 0, None, None), Fleet(), ONE, profiles, first.next_state, NOW + 60)
    assert restarted.next_state.corrections == first.next_state.corrections


def _tail_policy(tps: list[int]) -> Policy:
    d = policy_dict(models=("m8",), tps={"m8": tps}, model_extra={"m8": {
        "allowed": {"tp": tps, "engines": ["vllm"]}, "slo": {"ttft_p99_ms": 500, "itl_p99_ms": 80}}})
    # ~5% of the prompts 9-13k tokens: on TP1 their own prefill alone (~600-800 ms) exceeds 500 ms
    d["models"][0]["workload"] = {"isl": 900, "osl": 200,
                                  "isl_quantiles": {0.5: 500, 0.95: 700, 0.97: 12000, 0.999: 13000}}
    return load_policy_dict(d, "test")


def test_a_config_that_cannot_reach_the_slo_gives_way_to_one_that_can() -> None:
    # issue 18.1: no count of TP1 meets the TTFT p99 for this mix (an idle replica serves ~95.5% in
    # time); TP2 prefills 3x faster and does. The plan buys TP2, not TP1 replicas that do not help;
    # allowed only TP1, it sizes TP1 from its floor and says so, with what its last replica buys
    dr = mp.DataRange((128.0, 16000.0), (64.0, 1024.0), (0.5, 20.0), None, 8)
    tp1 = replace(TRUE, data_range=dr)
    tp2 = mp.PerfProfile(mp.ConfigKey("m8", VLLM, H100, 2, mp.Precision.BF16),
                         mp.PerfParams(s0_ms=6.0, s1_ms=0.03, s2_ms=0.0001, p0_ms=3.0, p1_ms=0.02, p2_ms=5e-8,
                                       q=1.0), kv_tokens=900_000.0, data_range=dr)
    obs = Observation({"m8": ModelObservation("m8", 20.0)})
    both = plan(obs, Fleet(hosts(4)), _tail_policy([1, 2]), mp.ProfileSet((tp1, tp2)), PlannerState.initial(), NOW)
    [cfg] = both.explanation.models[0].configs
    assert cfg.config.tp == 2 and cfg.floor_share is None
    assert cfg.predicted_attainment is not None and cfg.predicted_attainment >= 0.99
    [alt] = [a for a in both.explanation.models[0].alternatives if a.config.tp == 1]
    assert alt.reason == LossReason.SLO
    assert "out of its reach for this length mix: an idle replica meets it for 95." in alt.detail
    only = plan(obs, Fleet(hosts(4)), _tail_policy([1]), mp.ProfileSet((tp1,)), PlannerState.initial(), NOW)
    [one] = only.explanation.models[0].configs
    assert one.config.tp == 1 and one.floor_share is not None and 0.94 < one.floor_share < 0.97
    assert one.replicas > 1 and one.capacity_per_replica_rps > 0  # sized, not "no capacity at the SLO"
    assert one.predicted_attainment is not None and one.predicted_attainment >= one.floor_share - 0.0051
    assert one.last_replica_attainment is not None and 0 < one.last_replica_attainment < 0.01
    doc = plan_to_dict(only)
    c = doc["explanation"]["models"][0]["configs"][0]
    text = "\n".join(config_lines(doc["explanation"]["models"][0], c, doc))
    assert "out of reach: an idle replica meets the SLO for 95." in text
    assert "the last replica adds +0." in text


def test_a_stale_or_idle_reading_plans_on_the_last_mix_a_reading_showed() -> None:
    """A new replica's first window is stale and shows no mix: the plan keeps sizing on the long
    prompts it saw, not on the policy's short `workload` (which needs fewer replicas), says so, and
    the held mix survives a restart (the stored state). After HOLD_S the policy's mix applies."""
    from fleetplan.planner.lengths import HOLD_S

    profiles = mp.ProfileSet((TRUE,))
    long_q = ((0.5, 3000.0), (0.99, 4000.0))

    def obs(*, stale: bool) -> Observation:
        if stale:
            return Observation({"m8": ModelObservation("m8", 20.0, stale=True)})
        return Observation({"m8": ModelObservation("m8", 20.0, 3200.0, 200.0, isl_quantiles=long_q)})

    def replicas(r: object) -> int:
        return sum(c.replicas for c in r.plan.counts)  # type: ignore[attr-defined]

    fresh = plan(obs(stale=False), Fleet(hosts(4)), ONE, profiles, PlannerState.initial(), NOW)
    policy_mix = plan(obs(stale=True), Fleet(hosts(4)), ONE, profiles, PlannerState.initial(), NOW)
    assert replicas(fresh) > replicas(policy_mix)  # the policy's 500-token prompts need fewer
    state = state_from_dict(plan_to_dict(fresh)["next_state"])  # stored and reloaded
    assert state.lengths == fresh.next_state.lengths and state.lengths[0].isl == 3200.0
    held = plan(obs(stale=True), Fleet(hosts(4)), ONE, profiles, state, NOW + 60)
    assert replicas(held) == replicas(fresh)
    assert held.explanation.models[0].length_mix == fresh.explanation.models[0].length_mix
    assert any(n.startswith("length mix: held from the reading 60 s ago") for n in held.explanation.models[0].notes)
    assert not any(n.startswith("length mix: held") for n in fresh.explanation.models[0].notes)
    idle = plan(Observation({"m8": ModelObservation("m8", 0.0)}), Fleet(hosts(4)), ONE, profiles, state, NOW + 60)
    assert idle.explanation.models[0].length_mix == fresh.explanation.models[0].length_mix
    late = plan(obs(stale=True), Fleet(hosts(4)), ONE, profiles, state, NOW + HOLD_S + 60)
    assert late.explanation.models[0].length_mix == policy_mix.explanation.models[0].length_mix
    assert late.next_state.lengths == ()


def test_a_held_mix_holds_only_what_a_stored_state_can_load_again() -> None:
    # a reading with a NaN mean, a 0 output mean and a NaN quantile: the held mix keeps the rest,
    # and the stored state loads (a state that cannot load would stop the daemon after a restart)
    import math

    from fleetplan.planner.lengths import hold_lengths
    from fleetplan.planner.serde import state_to_dict

    odd = Observation({"m8": ModelObservation("m8", 2.0, math.nan, 0.0,
                                              isl_quantiles=((0.5, 900.0), (0.99, math.nan)))})
    _, held = hold_lengths(odd, (), lambda n: n, now_s=NOW)
    assert held[0].isl is None and held[0].osl is None and held[0].isl_quantiles == ((0.5, 900.0),)
    state = PlannerState(lengths=held)
    assert state_from_dict(json.loads(json.dumps(state_to_dict(state)))) == state


def test_the_burst_memory_survives_a_restart_and_an_older_store_reads() -> None:
    """The memory is stored with the plan (model, t, excess, level); a store written before the
    level was kept holds (model, t, capacity needed) and reads with level 0."""
    p = policy(models=("m8",), scaling={"scale_down_delay_s": 300, "cycle_s": 60},
               model_extra={"m8": {"allowed": {"tp": [1], "engines": ["vllm"]}, "headroom": 0.0}})
    burst = plan(_obs(10.0, 0, None, None, peak_rps=60.0), Fleet(hosts(2)), p, mp.ProfileSet((TRUE,)),
                 PlannerState.initial(), NOW)
    doc = json.loads(json.dumps(plan_to_dict(burst)["next_state"]))
    assert state_from_dict(doc).bursts == burst.next_state.bursts
    (model, t, excess, level), = burst.next_state.bursts
    assert model == "m8" and t == NOW and excess > 40.0 and level == 10.0
    old = state_from_dict({**doc, "bursts": [["m8", NOW, 55.0]]})
    assert old.bursts == (("m8", NOW, 55.0, 0.0),)
