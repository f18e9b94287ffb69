"""A model's cheapest aggregated fleet against its cheapest disaggregated pair across its
configurations (planner/disagg_fleet.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.disagg import ETH_25G, NVLINK4, KvLink, LinkKind
from fleetplan.models.mix import LengthMix
from fleetplan.models.names import Engine, GpuType
from fleetplan.planner.disagg_choice import PhaseSpeeds, Serving, choose_serving
from fleetplan.planner.disagg_fleet import choose_for_model
from tests.unit.planner.planner_helpers import key, policy

MODEL = "llama-3-8b"
RAG = LengthMix.single(4096.0, 32.0)
SLO = {"slo": {"ttft_p99_ms": 600, "itl_p99_ms": 20}}


def _profiles(*keys: mp.ConfigKey) -> dict[mp.ConfigKey, mp.PerfProfile]:
    out = {}
    for k in keys:
        prof = mp.roofline_profile(k)
        assert prof is not None
        out[k] = prof
    return out


def test_one_config_agrees_with_the_per_config_choice() -> None:
    pol = policy(models=(MODEL,), model_extra={MODEL: SLO})
    k1 = key(MODEL)
    s = choose_for_model(pol, MODEL, _profiles(k1), RAG, 20.0)
    c = choose_serving(_profiles(k1)[k1], RAG, 20.0, ttft_p99_ms=600, itl_p99_ms=20, link=NVLINK4, price_usd_h=3.0)
    assert s.chosen is c.chosen is Serving.DISAGGREGATED
    assert s.aggregated is not None and s.aggregated.pool == c.aggregated
    assert s.prefill is not None and s.decode is not None and c.disaggregated is not None
    assert (s.prefill.pool, s.decode.pool) == (c.disaggregated.prefill, c.disaggregated.decode)
    assert s.gpus() == 7 and s.extrapolated
    assert s.flip_rate_rps is not None and c.flips is not None and s.flip_rate_rps == pytest.approx(c.flips.rate_rps)


def test_each_pool_on_its_cheapest_config() -> None:
    # a TP2 profile whose decode is cheap per GPU and prefill dear: the decode pool may take it while
    # the prefill pool stays on TP1; the aggregated fleet is one config
    pol = policy(models=(MODEL,), model_extra={MODEL: SLO})
    k1, k2 = key(MODEL), key(MODEL, tp=2)
    profs = _profiles(k1, k2)
    p2 = profs[k2].params
    profs[k2] = replace(profs[k2], params=replace(p2, p1_ms=5 * p2.p1_ms, p0_ms=5 * p2.p0_ms))
    s = choose_for_model(pol, MODEL, profs, RAG, 60.0)
    assert s.prefill is not None and s.prefill.config == k1
    assert s.decode is not None
    alone = choose_for_model(pol, MODEL, {k1: profs[k1]}, RAG, 60.0)
    assert alone.prefill is not None and alone.decode is not None
    assert s.prefill.pool.usd_h + s.decode.pool.usd_h <= alone.prefill.pool.usd_h + alone.decode.pool.usd_h


def test_pairs_share_engine_and_gpu() -> None:
    # the prefill pool on one engine, the decode pool on another is no pair
    pol = policy(models=(MODEL,), model_extra={MODEL: SLO}, prices={"h100": 3.0, "a100": 1.0})
    kv, kt = key(MODEL), key(MODEL, engine=Engine.TRTLLM, gpu=GpuType.A100)
    s = choose_for_model(pol, MODEL, _profiles(kv, kt), RAG, 20.0)
    assert s.prefill is not None and s.decode is not None
    assert (s.prefill.config.engine, s.prefill.config.gpu) == (s.decode.config.engine, s.decode.config.gpu)


def test_short_prompts_slow_links_and_speeds() -> None:
    pol = policy(models=(MODEL,), model_extra={MODEL: SLO})
    profs = _profiles(key(MODEL), key(MODEL, tp=2))
    assert choose_for_model(pol, MODEL, profs, RAG, 20.0).chosen is Serving.DISAGGREGATED
    # over 25 GbE the prefill pool moves to TP2 (two links carry its KV, its prefill is shorter) and
    # still wins; over a 1 GB/s link it does not
    eth = choose_for_model(pol, MODEL, profs, RAG, 20.0, link_for=lambda g: ETH_25G)
    assert eth.chosen is Serving.DISAGGREGATED and eth.prefill is not None and eth.prefill.config.tp == 2
    crawl = KvLink(LinkKind.NETWORK, 1.0, 0.5)
    assert choose_for_model(pol, MODEL, profs, RAG, 20.0, link_for=lambda g: crawl).chosen is Serving.AGGREGATED
    loose = policy(models=(MODEL,), model_extra={MODEL: {"slo": {"ttft_p99_ms": 600, "itl_p99_ms": 50}}})
    assert choose_for_model(loose, MODEL, profs, RAG, 20.0).chosen is Serving.AGGREGATED
    slow = {k: PhaseSpeeds(itl=1 / 3) for k in profs}
    assert choose_for_model(loose, MODEL, profs, RAG, 20.0, speeds=slow).chosen is Serving.DISAGGREGATED


def test_configs_without_a_price_or_of_another_model_are_not_candidates() -> None:
    pol = policy(models=(MODEL,), model_extra={MODEL: SLO})
    priced, unpriced = key(MODEL), key(MODEL, gpu=GpuType.A100)
    other = {key("other-model"): replace(_profiles(priced)[priced], key=key("other-model"))}
    s = choose_for_model(pol, MODEL, {**_profiles(unpriced), **other}, RAG, 20.0)
    assert s.aggregated is None and s.chosen is Serving.AGGREGATED and not s.slo_reachable and s.gpus() == 0
    s = choose_for_model(pol, MODEL, _profiles(priced, unpriced), RAG, 20.0)
    assert s.aggregated is not None and s.aggregated.config == priced
    with pytest.raises(ValueError, match="'nope' is not in the policy"):
        choose_for_model(pol, "nope", {}, RAG, 1.0)
