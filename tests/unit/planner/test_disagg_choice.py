"""Aggregated or disaggregated serving (planner/disagg_choice.py): the cheaper fleet at the SLO and
what would flip it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetplan.models import profile as mp
from fleetplan.models.disagg import ETH_25G, NVLINK4, KvLink, LinkKind
from fleetplan.models.mix import LengthMix
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.disagg_choice import PhaseSpeeds, Serving, choose_serving

KEY = mp.ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
PROFILE = mp.roofline_profile(KEY)
assert PROFILE is not None
RAG = LengthMix.single(4096.0, 32.0)  # long prompts, short outputs
CHAT = LengthMix.single(256.0, 256.0)
TIGHT = {"ttft_p99_ms": 600.0, "itl_p99_ms": 20.0, "price_usd_h": 3.0}
LOOSE = {"ttft_p99_ms": 600.0, "itl_p99_ms": 50.0, "price_usd_h": 3.0}


def test_long_prompts_short_outputs_tight_itl_choose_disaggregated() -> None:
    c = choose_serving(PROFILE, RAG, 20.0, **TIGHT, link=NVLINK4)
    assert c.chosen is Serving.DISAGGREGATED and c.slo_reachable
    d = c.disaggregated
    assert d is not None and d.extrapolated
    assert d.gpus < c.aggregated.gpus and d.usd_h < c.aggregated.usd_h and c.saving_usd_h() > 0
    # the aggregated replica is held back by the ITL target (the prompts' prefill in every step),
    # the prefill replica by TTFT alone, the decode replica serves many times the prefill one's rate
    assert c.aggregated.binding == "itl"
    assert d.prefill.binding == "ttft" and d.prefill.capacity_rps > c.aggregated.capacity_rps
    assert d.decode.capacity_rps > 5 * d.prefill.capacity_rps
    assert d.prefill.replicas > d.decode.replicas == 1


def test_short_prompts_keep_aggregated() -> None:
    for rate in (5.0, 20.0, 80.0):
        c = choose_serving(PROFILE, CHAT, rate, **LOOSE, link=NVLINK4, flips=False)
        assert c.chosen is Serving.AGGREGATED and c.slo_reachable
        assert c.disaggregated is not None and c.disaggregated.usd_h >= c.aggregated.usd_h
    c = choose_serving(PROFILE, CHAT, 20.0, **TIGHT, link=NVLINK4, flips=False)  # a tie: one pool, no transfer
    assert c.chosen is Serving.AGGREGATED and c.disaggregated is not None
    assert c.disaggregated.usd_h == c.aggregated.usd_h


def test_a_loose_itl_target_gains_nothing_from_the_split() -> None:
    # long prompts, but the TTFT target binds the aggregated replica as it binds the prefill one:
    # disaggregation does not raise throughput, the decode pool is an extra replica
    c = choose_serving(PROFILE, RAG, 20.0, **LOOSE, link=NVLINK4, flips=False)
    assert c.chosen is Serving.AGGREGATED and c.aggregated.binding == "ttft"
    assert c.disaggregated is not None
    assert c.disaggregated.prefill.capacity_rps == pytest.approx(c.aggregated.capacity_rps, rel=0.05)


def test_slow_link_between_the_pools_flips_it_back() -> None:
    fast = choose_serving(PROFILE, RAG, 20.0, **TIGHT, link=NVLINK4)
    slow = choose_serving(PROFILE, RAG, 20.0, **TIGHT, link=ETH_25G, flips=False)
    assert fast.chosen is Serving.DISAGGREGATED and slow.chosen is Serving.AGGREGATED
    assert slow.aggregated == fast.aggregated  # the link changes only the prefill pool
    assert slow.disaggregated is not None and fast.disaggregated is not None
    assert slow.disaggregated.prefill.replicas > fast.disaggregated.prefill.replicas
    assert slow.disaggregated.transfer_p99_ms > 50 * fast.disaggregated.transfer_p99_ms
    assert slow.flips is None


def test_light_load_stays_aggregated() -> None:
    # one aggregated replica against at least one per pool
    c = choose_serving(PROFILE, RAG, 1.0, **TIGHT, link=NVLINK4, flips=False)
    assert c.chosen is Serving.AGGREGATED and c.aggregated.replicas == 1
    assert c.disaggregated is not None and c.disaggregated.ratio() == "1:1"


def test_what_would_flip_it_does_flip_it() -> None:
    c = choose_serving(PROFILE, RAG, 20.0, **TIGHT, link=NVLINK4)
    f = c.flips
    assert f is not None and f.rate_rps is not None and f.isl_scale is not None and f.link_gb_s is not None
    other = Serving.AGGREGATED
    assert choose_serving(PROFILE, RAG, f.rate_rps, **TIGHT, link=NVLINK4, flips=False).chosen is other
    shorter = LengthMix.single(4096.0 * f.isl_scale, 32.0)
    assert f.isl_scale < 1.0
    assert choose_serving(PROFILE, shorter, 20.0, **TIGHT, link=NVLINK4, flips=False).chosen is other
    assert f.link_gb_s < NVLINK4.gb_s
    slow = replace(NVLINK4, gb_s=f.link_gb_s)
    assert choose_serving(PROFILE, RAG, 20.0, **TIGHT, link=slow, flips=False).chosen is other
    # and from the aggregated side: a demand or prompts at which disaggregated would win
    a = choose_serving(PROFILE, RAG, 1.0, **TIGHT, link=NVLINK4)
    assert a.chosen is Serving.AGGREGATED and a.flips is not None and a.flips.rate_rps is not None
    assert a.flips.rate_rps > 1.0
    assert choose_serving(PROFILE, RAG, a.flips.rate_rps, **TIGHT, link=NVLINK4,
                          flips=False).chosen is Serving.DISAGGREGATED


def test_prefill_stalls_in_short_outputs_choose_disaggregated() -> None:
    # a profile whose prefill chunks stall the decode steps (fitted on per-gap ITL data): a request of
    # a few tokens that meets one long prefill misses the ITL target, so the aggregated replica is
    # sized far below its TTFT limit; the decode pool has no prefill to stall it
    stalls = replace(PROFILE, params=replace(PROFILE.params, itl_stall_weight=1.0))
    mix = LengthMix(((6000.0, 4.0, 0.5), (1000.0, 8.0, 0.5)))
    slo = {"ttft_p99_ms": 1000.0, "itl_p99_ms": 40.0, "price_usd_h": 3.0}
    plain = choose_serving(PROFILE, mix, 10.0, **slo, link=NVLINK4, flips=False)
    stalled = choose_serving(stalls, mix, 10.0, **slo, link=NVLINK4, flips=False)
    assert plain.chosen is Serving.AGGREGATED
    assert stalled.aggregated.binding == "itl"
    assert stalled.aggregated.capacity_rps < 0.5 * plain.aggregated.capacity_rps
    assert stalled.chosen is Serving.DISAGGREGATED and stalled.slo_reachable
    assert stalled.disaggregated == plain.disaggregated  # no stalls in either pool


def test_unknown_kv_bytes_keep_aggregated() -> None:
    other = replace(PROFILE, key=replace(KEY, model="my-model"))
    c = choose_serving(other, RAG, 20.0, **TIGHT, link=NVLINK4)
    assert c.chosen is Serving.AGGREGATED and c.disaggregated is None and c.flips is None
    assert c.saving_usd_h() == 0.0


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="rate_rps"):
        choose_serving(PROFILE, RAG, -1.0, **TIGHT, link=NVLINK4)
    with pytest.raises(ValueError, match="price_usd_h"):
        choose_serving(PROFILE, RAG, 1.0, ttft_p99_ms=600.0, itl_p99_ms=20.0, price_usd_h=-3.0,
                       link=KvLink(LinkKind.NETWORK, 10.0, 0.5))


def test_an_itl_slower_than_the_profile_on_aggregated_replicas_chooses_disaggregated() -> None:
    # the online correction saw the aggregated replicas' ITL 3x what the profile says (the prefill
    # interference it misses): the aggregated fleet is sized on it, the decode pool is not
    base = choose_serving(PROFILE, RAG, 20.0, **LOOSE, link=NVLINK4, flips=False)
    slow = choose_serving(PROFILE, RAG, 20.0, **LOOSE, link=NVLINK4, flips=False, speeds=PhaseSpeeds(itl=1 / 3))
    assert base.chosen is Serving.AGGREGATED and slow.chosen is Serving.DISAGGREGATED
    assert slow.aggregated.binding == "itl" and slow.aggregated.replicas > base.aggregated.replicas
    assert slow.disaggregated == base.disaggregated
    # a slower prefill (TTFT speed) slows the aggregated replica and the prefill pool alike
    ttft = choose_serving(PROFILE, RAG, 20.0, **LOOSE, link=NVLINK4, flips=False, speeds=PhaseSpeeds(ttft=0.8))
    assert ttft.disaggregated is not None and base.disaggregated is not None
    assert ttft.disaggregated.prefill.capacity_rps < base.disaggregated.prefill.capacity_rps
    assert ttft.aggregated.capacity_rps < base.aggregated.capacity_rps
    assert ttft.disaggregated.decode == base.disaggregated.decode
    dec = choose_serving(PROFILE, RAG, 20.0, **LOOSE, link=NVLINK4, flips=False, speeds=PhaseSpeeds(decode_itl=0.5))
    assert dec.disaggregated is not None and dec.disaggregated.decode.capacity_rps < base.disaggregated.decode.capacity_rps
