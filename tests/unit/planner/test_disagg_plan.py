"""The plan chooses, sizes and explains disaggregated prefill and decode pools where the policy
allows them (planner/disagg_plan.py, planner/disagg_counts.py, the count solve in planner/counts.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.config_key import Role
from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.core import plan, plan_to_dict, plan_with_capacities
from fleetplan.planner.counts import Candidate, CountProblem, ModelDemand, solve_counts
from fleetplan.planner.policy import PolicyError
from fleetplan.planner.types import Fleet, ModelObservation, Observation, PlannerState, PlanResult
from tests.unit.planner.planner_helpers import hosts, key, policy, policy_dict

MODEL = "llama-3-8b"
NOW = 1_000_000.0
# a coding assistant: long prompts, short answers, a tight ITL target
RAG = {"slo": {"ttft_p99_ms": 600, "itl_p99_ms": 20}, "workload": {"isl": 4096, "osl": 32}, "headroom": 0.0}
CHAT = {"slo": {"ttft_p99_ms": 600, "itl_p99_ms": 50}, "workload": {"isl": 256, "osl": 256}, "headroom": 0.0}
ALLOW = {"disaggregation": {"allowed": True}}


def _fitted(tp: int) -> mp.PerfProfile:
    """The roofline physics as a profile fitted inside the lengths served here (no prior's caution)."""
    prof = mp.roofline_profile(key(MODEL, tp=tp))
    assert prof is not None
    return replace(prof, source="fit", data_range=mp.DataRange((128.0, 8192.0), (16.0, 512.0), None, None, 20))


def _plan(extra: dict[str, Any], rate: float = 20.0, *, tps: list[int] | None = None,
          counterfactuals: bool = True, n_hosts: int = 2) -> PlanResult:
    tps = tps or [1]
    pol = policy(models=(MODEL,), model_extra={MODEL: {**extra, "allowed": {"engines": ["vllm"], "tp": tps}}})
    obs = Observation({MODEL: ModelObservation(MODEL, rate, extra["workload"]["isl"], extra["workload"]["osl"])})
    return plan(obs, Fleet(hosts(n_hosts)), pol, mp.ProfileSet(tuple(_fitted(t) for t in tps)),
                PlannerState.initial(), NOW, counterfactuals=counterfactuals)


def _roles(r: PlanResult) -> dict[Role, int]:
    out: dict[Role, int] = {}
    for c in r.plan.counts:
        out[c.config.role] = out.get(c.config.role, 0) + c.replicas
    return out


def test_long_prompts_under_a_tight_itl_get_pools_with_fewer_gpus() -> None:
    # 35 rps of 4,096-token prompts and 32-token answers, ITL p99 20 ms, H100 TP1: an aggregated
    # replica carries 2.83 rps (the prefill work in its decode steps binds the ITL), a prefill
    # replica 3.93 (TTFT), a decode replica 45.4 (ITL)
    agg = _plan(RAG, rate=35.0)
    dis = _plan({**RAG, **ALLOW}, rate=35.0)
    assert set(_roles(agg)) == {Role.AGGREGATED}
    roles = _roles(dis)
    assert roles.get(Role.AGGREGATED, 0) == 0
    # prefill-heavy: many prefill replicas per decode replica
    assert roles[Role.PREFILL] == 9 and roles[Role.DECODE] == 1
    assert dis.plan.gpus == 10 < agg.plan.gpus == 13
    assert dis.plan.usd_h < agg.plan.usd_h
    me = dis.explanation.models[0]
    assert me.pools is not None and me.pools.ratio() == "9:1"
    assert me.capacity_rps >= me.required_rps  # the pools carry the demand (the weaker pool's capacity)
    assert me.pools.capacity_rps == pytest.approx(me.capacity_rps)
    assert me.pools.aggregated_usd_h == pytest.approx(agg.plan.usd_h)
    assert me.pools.pair_usd_h == pytest.approx(dis.plan.usd_h)
    # what would flip it: less demand, shorter prompts, a slower link
    assert me.pools.flip_rate_rps is not None and me.pools.flip_rate_rps < 35.0
    # (prompts x1.28: the prefill pool's TTFT out of reach; shorter prompts keep the pools at 35 rps)
    assert me.pools.flip_isl_scale == pytest.approx(1.28, abs=0.02)
    assert me.pools.flip_link_gb_s is not None and me.pools.flip_link_gb_s < me.pools.link_gb_s
    # placed like any replica: every pool replica on GPUs of the hosts
    assert sum(1 for r in dis.plan.replicas if r.config.role is not Role.AGGREGATED) == 10


def test_a_demand_between_shares_the_rate_between_aggregated_replicas_and_pools() -> None:
    # 20 rps: 8 aggregated replicas (8 GPUs) or 6 + 1 pool replicas (7); 3 aggregated + 3 prefill
    # + 1 decode are as cheap, and a tie in money goes to the aggregated replicas
    r = _plan({**RAG, **ALLOW}, rate=20.0)
    assert _roles(r) == {Role.AGGREGATED: 3, Role.PREFILL: 3, Role.DECODE: 1}
    me = r.explanation.models[0]
    assert me.capacity_rps == pytest.approx(3 * 2.8334 + 3 * 3.9288, rel=1e-3) and me.capacity_rps >= 20.0


def test_the_explanation_names_the_ratio_the_saving_and_the_flip() -> None:
    me = _plan({**RAG, **ALLOW}, rate=35.0).explanation.models[0]
    text = "\n".join(me.notes)
    assert "9 prefill + 1 decode replicas (9:1)" in text
    assert "aggregated: 13 replicas, 13 GPUs, $39.00/h" in text
    assert "aggregated would win at" in text and "with prompts x" in text and "GB/s link" in text
    assert "assume the hosts' KV link (nvlink, 450 GB/s per GPU)" in text
    doc = plan_to_dict(_plan({**RAG, **ALLOW}, rate=35.0))
    pools = doc["explanation"]["models"][0]["pools"]
    assert (pools["prefill_replicas"], pools["decode_replicas"], pools["ratio"]) == (9, 1, "9:1")
    assert {c["role"] for c in pools["prefill"]} == {"prefill"} and {c["role"] for c in pools["decode"]} == {"decode"}
    assert {c["role"] for c in doc["plan"]["counts"]} == {"prefill", "decode"}


def test_short_prompts_stay_aggregated() -> None:
    r = _plan({**CHAT, **ALLOW}, rate=30.0)
    assert set(_roles(r)) == {Role.AGGREGATED}
    me = r.explanation.models[0]
    assert me.pools is None
    assert "disaggregated pools allowed; the plan serves aggregated" in me.notes
    assert any(n.startswith("alone at this demand, aggregated:") for n in me.notes)


def test_a_light_load_stays_aggregated() -> None:
    # a pair needs at least one replica per pool: one aggregated replica is cheaper
    assert set(_roles(_plan({**RAG, **ALLOW}, rate=1.0))) == {Role.AGGREGATED}


def test_not_allowed_never_plans_pools() -> None:
    for extra, rate in ((RAG, 20.0), (RAG, 60.0), (CHAT, 30.0)):
        r = _plan(extra, rate=rate)
        assert set(_roles(r)) == {Role.AGGREGATED}
        assert r.explanation.models[0].pools is None
        assert not any("disaggregated" in n for n in r.explanation.models[0].notes)
    assert plan_to_dict(_plan(RAG))["explanation"]["models"][0]["pools"] is None


def test_allowed_is_a_boolean_and_errors_name_the_field() -> None:
    d = policy_dict(models=(MODEL,), model_extra={MODEL: {"disaggregation": {"allowed": "sometimes"}}})
    with pytest.raises(PolicyError, match=r"models\[0\]\.disaggregation\.allowed = 'sometimes'"):
        policy(models=(MODEL,), model_extra={MODEL: {"disaggregation": {"allowed": "sometimes"}}})
    d["models"][0]["disaggregation"] = {"mode": "on"}
    from fleetplan.planner.policy import load_policy_dict
    with pytest.raises(PolicyError, match=r"models\[0\]\.disaggregation\.mode"):
        load_policy_dict(d, "p.yaml")
    assert not policy(models=(MODEL,)).models[0].disaggregation.allowed


def test_counts_are_deterministic_and_the_replay_path_plans_the_same_pools() -> None:
    first = _plan({**RAG, **ALLOW}, rate=40.0)
    again = _plan({**RAG, **ALLOW}, rate=40.0)
    quiet = _plan({**RAG, **ALLOW}, rate=40.0, counterfactuals=False)
    assert first.plan.counts == again.plan.counts == quiet.plan.counts
    assert [r.config for r in first.plan.replicas] == [r.config for r in again.plan.replicas]
    assert Role.PREFILL in _roles(first) and Role.DECODE in _roles(first)
    # without the comparison (the replay's path) the pools are still in the explanation, no what-ifs
    me = quiet.explanation.models[0]
    assert me.pools is not None and me.pools.flip_rate_rps is None
    assert not any(n.startswith("alone at this demand") for n in me.notes)


# ---- the count solve alone --------------------------------------------------------------------

def _cand(role: Role, cap: float, tp: int = 1) -> Candidate:
    return Candidate(replace(key(MODEL, tp=tp), role=role), cap, 3.0 * tp, 60.0)


def _solve(cands: tuple[Candidate, ...], rate: float, backend: str = "SCIP") -> dict[tuple[Role, int], int]:
    p = CountProblem(cands, (ModelDemand(MODEL, rate, 1, 0, None),), {key(MODEL).gpu: {1: 16, 2: 8}},
                     backend=backend, work_limit=5.0)
    return {(c.role, c.tp): n for c, n in solve_counts(p).counts.items()}


@pytest.mark.parametrize("backend", ["SCIP", "cp-sat"])
def test_the_solve_covers_the_rate_with_both_pools(backend: str) -> None:
    cands = (_cand(Role.AGGREGATED, 2.83), _cand(Role.PREFILL, 3.93), _cand(Role.DECODE, 45.4))
    # 35 rps: 13 aggregated ($39) against 9 prefill + 1 decode ($30)
    assert _solve(cands, 35.0, backend) == {(Role.PREFILL, 1): 9, (Role.DECODE, 1): 1}
    # 2 rps: 1 aggregated against 1 + 1
    assert _solve(cands, 2.0, backend) == {(Role.AGGREGATED, 1): 1}
    # a prefill pool without a decode pool serves nothing
    assert _solve(cands[:2], 35.0, backend) == {(Role.AGGREGATED, 1): 13}


def test_a_tie_in_money_goes_to_aggregated() -> None:
    # 4 aggregated replicas of 2.5 rps against 3 prefill of 4 + 1 decode of 50 at 10 rps: $12 each
    cands = (_cand(Role.AGGREGATED, 2.5), _cand(Role.PREFILL, 4.0), _cand(Role.DECODE, 50.0))
    assert _solve(cands, 10.0) == {(Role.AGGREGATED, 1): 4}


def test_the_pools_each_take_their_cheapest_tp_and_may_share_the_rate_with_aggregated() -> None:
    cands = (_cand(Role.AGGREGATED, 2.0), _cand(Role.PREFILL, 3.0), _cand(Role.PREFILL, 5.0, tp=2),
             _cand(Role.DECODE, 40.0), _cand(Role.DECODE, 100.0, tp=2))
    got = _solve(cands, 30.0)
    assert got == {(Role.PREFILL, 1): 10, (Role.DECODE, 1): 1}
    # the table's capacities (no pools in it): a plan_with_capacities caller without pools sees none
    r = plan_with_capacities(Observation({MODEL: ModelObservation(MODEL, 30.0, 4096.0, 32.0)}), Fleet(hosts(2)),
                             policy(models=(MODEL,), tps={MODEL: [1]}, model_extra={MODEL: {**RAG, **ALLOW}}),
                             {key(MODEL): CapacityInfo(2.0, "itl")}, PlannerState.initial(), NOW)
    assert set(_roles(r)) == {Role.AGGREGATED}


def test_pool_replicas_and_their_state_keep_their_role_through_the_stored_documents() -> None:
    from fleetplan.planner.serde import fleet_from_dict, fleet_to_dict, state_from_dict, state_to_dict
    r = _plan({**RAG, **ALLOW}, rate=35.0)
    fleet = Fleet(hosts(2), r.plan.replicas)
    back, _ = fleet_from_dict(fleet_to_dict(fleet))
    assert [x.config for x in back.replicas] == [x.config for x in r.plan.replicas]
    pre = next(x.config for x in r.plan.replicas if x.config.role is Role.PREFILL)
    state = replace(PlannerState.initial(), surplus_since_s=((pre.profile_key(), NOW), (pre, NOW)))
    assert state_from_dict(state_to_dict(state)).surplus_since_s == state.surplus_since_s


def test_pools_that_reach_the_slo_take_the_demand_from_aggregated_configs_that_cannot() -> None:
    # the aggregated replica meets the targets for 90% of the requests even idle (sized from that
    # floor: 1 rps); the pools reach theirs: the plan buys pools, the aggregated config serves no demand
    pol = policy(models=(MODEL,), tps={MODEL: [1]}, model_extra={MODEL: {**RAG, **ALLOW}})
    obs = Observation({MODEL: ModelObservation(MODEL, 10.0, 4096.0, 32.0)})
    agg = key(MODEL)
    table = {agg: CapacityInfo(1.0, "itl", floor_share=0.9)}
    pools = {replace(agg, role=Role.PREFILL): CapacityInfo(4.0, "ttft"),
             replace(agg, role=Role.DECODE): CapacityInfo(40.0, "itl")}
    alone = plan_with_capacities(obs, Fleet(hosts(2)), pol, table, PlannerState.initial(), NOW)
    assert _roles(alone) == {Role.AGGREGATED: 10}
    r = plan_with_capacities(obs, Fleet(hosts(2)), pol, table, PlannerState.initial(), NOW, pools=pools)
    assert _roles(r) == {Role.PREFILL: 3, Role.DECODE: 1}
    me = r.explanation.models[0]
    assert me.unmet_rps == 0.0 and me.capacity_rps == pytest.approx(12.0)
    assert not any("no allowed config meets the SLO" in n for n in me.notes)
    # a prefill pool without a decode pool is no family: the aggregated replicas keep the demand
    half = plan_with_capacities(obs, Fleet(hosts(2)), pol, table, PlannerState.initial(), NOW,
                                pools={k: v for k, v in pools.items() if k.role is Role.PREFILL})
    assert Role.AGGREGATED in _roles(half)



def test_a_long_prompt_tail_sizes_the_decode_pool_for_room_in_its_kv_cache() -> None:
    """Long-context chat (a tenth of the prompts beyond 30k tokens): the decode pool's candidate
    capacity is the rate at which 99% of a replica's arrivals find room for their KV
    (models/kv_room.py), not the rate at which the batch's mean occupancy fills the cache: 3.4 rps
    take three decode replicas, not one."""
    from fleetplan.models.disagg import pool_profiles, replicas_for
    from fleetplan.models.kv_room import kv_room_rps
    from fleetplan.models.mix import capacity_mix
    from fleetplan.planner.core import workloads_from
    from fleetplan.planner.disagg_plan import pool_capacities

    extra = {"slo": {"ttft_p99_ms": 15_000, "itl_p99_ms": 120}, "workload": {"isl": 12_000, "osl": 300},
             "headroom": 0.0, **ALLOW, "allowed": {"engines": ["vllm"], "tp": [1]}}
    pol = policy(models=(MODEL,), model_extra={MODEL: extra})
    prof = replace(_fitted(1), data_range=mp.DataRange((128.0, 131_072.0), (16.0, 2048.0), None, None, 20))
    obs = Observation({MODEL: ModelObservation(
        MODEL, 3.4, 12_000.0, 300.0,
        isl_quantiles=((0.5, 2_500.0), (0.8, 12_000.0), (0.9, 30_000.0), (0.99, 90_000.0), (0.999, 120_000.0)),
        osl_quantiles=((0.5, 250.0), (0.9, 600.0), (0.99, 1_200.0)))})
    workloads = workloads_from(obs, pol)
    caps = pool_capacities(pol, {key(MODEL): prof}, workloads)
    dec = caps[replace(key(MODEL), role=Role.DECODE)]
    decode = pool_profiles(prof).decode
    mix = workloads[MODEL].length_mix()
    mean_limit = capacity_mix(decode, mix, ttft_p99_ms=float("inf"), itl_p99_ms=120.0)
    assert dec.binding == mean_limit.binding == "memory"
    assert dec.max_rps == pytest.approx(kv_room_rps(decode, mix, wait_share=0.01), rel=1e-9)
    assert replicas_for(3.4, mean_limit.max_rps) == 1 and replicas_for(3.4, dec.max_rps) == 3


def test_a_decode_pool_learns_its_own_itl_speed_from_its_replicas() -> None:
    """The correction keeps a decode config of its own, on the decode pool's profile (no prefill
    work), learnt from the decode replicas' windows: a decode replica twice as slow as that profile
    moves the decode pool's capacity, and no aggregated sibling's estimate stands for it."""
    from fleetplan.models.disagg import pool_profiles
    from fleetplan.models.mix import LengthMix, predict_mix
    from fleetplan.planner.correction import shared_prior
    from fleetplan.planner.types import ConfigObservation, Correction, ReplicaState

    pol = policy(models=(MODEL,), model_extra={MODEL: {**RAG, **ALLOW, "allowed": {"engines": ["vllm"], "tp": [1]}}})
    profiles = mp.ProfileSet((_fitted(1),))
    first = _plan({**RAG, **ALLOW}, rate=35.0)
    dec = next(c.config for c in first.plan.counts if c.config.role is Role.DECODE)
    fleet = Fleet(hosts(2), tuple(replace(r, state=ReplicaState.READY, since_s=NOW - 3600.0)
                                  for r in first.plan.replicas))
    seen = predict_mix(pool_profiles(_fitted(1)).decode, LengthMix.single(4096.0, 32.0), 35.0)
    assert seen.itl_p99_ms is not None

    def after(itl_factor: float) -> PlanResult:
        obs = Observation({MODEL: ModelObservation(MODEL, 35.0, 4096.0, 32.0, configs=(
            ConfigObservation(dec, 1, 35.0, None, seen.itl_p99_ms * itl_factor, 2000.0),))})
        return plan(obs, fleet, pol, profiles, PlannerState.initial(), NOW + 60.0, counterfactuals=False)

    as_profiled, slow = after(1.0), after(2.0)
    corr = {c.config: c for c in slow.next_state.corrections}
    assert corr[dec].observations == 1 and corr[dec].itl_log < -0.2
    assert {c.config: c for c in as_profiled.next_state.corrections}[dec].itl_log == pytest.approx(0.0, abs=0.05)
    assert _roles(as_profiled)[Role.DECODE] == 1 < _roles(slow)[Role.DECODE]
    assert any("(decode)" in c.correction for c in slow.explanation.models[0].configs
               if c.config.role is Role.DECODE)
    # an aggregated sibling's slow ITL (the prefill interference) is no prior for a decode config
    agg = dec.profile_key()
    prior = shared_prior(dec, {agg: Correction(agg, 0.0, 0.01, -1.0, 0.01, observations=9)}, 0.0625)
    assert prior.itl_log == 0.0 and prior.observations == 0


def test_a_decode_pool_is_counted_for_no_more_than_the_load_at_which_its_replicas_missed_the_itl() -> None:
    """The knee (planner/knee.py knee_load) bounds a decode pool as it bounds an aggregated
    replica, from the decode replicas' own ITL verdicts; their TTFT (the prefill pool's and the
    transfer's wait) is no verdict on them."""
    from fleetplan.models.disagg import pool_profiles
    from fleetplan.planner.capacity import MixedWorkload
    from fleetplan.planner.correction import applied_speeds, update_corrections
    from fleetplan.planner.disagg_plan import pool_capacities
    from fleetplan.planner.types import ConfigObservation, Correction

    pol = policy(models=(MODEL,), model_extra={MODEL: {**RAG, **ALLOW, "allowed": {"engines": ["vllm"], "tp": [1]}}})
    agg = key(MODEL, tp=1)
    dec = replace(agg, role=Role.DECODE)
    work = {MODEL: MixedWorkload(4096.0, 32.0)}
    fitted = pool_capacities(pol, {agg: _fitted(1)}, work)[dec].max_rps
    knee = 0.6 * fitted
    windows = tuple((NOW + 60.0 * i, x * fitted, missed)
                    for i, (x, missed) in enumerate([(0.3, False), (0.4, False), (0.6, True), (0.7, True)]))
    corr = {dec: Correction(dec, observations=4, updated_s=NOW + 240.0, slo_windows=windows)}
    speeds = applied_speeds(corr, {dec: pool_profiles(_fitted(1)).decode}, {})
    pools = pool_capacities(pol, {agg: _fitted(1)}, work, speeds, observed={agg})
    assert pools[dec].max_rps == pytest.approx(knee)
    assert "missed the SLO at" in pools[dec].correction
    assert pools[replace(agg, role=Role.PREFILL)].max_rps == pool_capacities(pol, {agg: _fitted(1)}, work)[
        replace(agg, role=Role.PREFILL)].max_rps
    # a decode window whose TTFT is ten times the target and whose ITL holds: held, not missed
    obs = ModelObservation(MODEL, 10.0, 4096.0, 32.0, configs=(
        ConfigObservation(dec, 1, 10.0, 6000.0, 10.0, 500.0, ttft_p99_sampling_ms=(5500.0, 6500.0)),))
    out = update_corrections({}, {MODEL: obs}, {dec: pool_profiles(_fitted(1)).decode}, work, {}, NOW,
                             {MODEL: (600.0, 20.0)}, {MODEL: 3600.0})
    assert out[dec].slo_windows == ((NOW, 10.0, False),)
