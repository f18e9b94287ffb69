"""Each query of an observation, the instant ones and the evidence's, is described once
(planner/queries.py): the daemon's Observer renders the description to PromQL, the replay's
Prometheus (sim/promsim.py) evaluates the same description on its scrapes."""

from __future__ import annotations

import math
import re

import pytest

from fleetplan.controller.observe import _SERIES, _TTFT_BUCKET, Observer, ObserverConfig, PromClient
from fleetplan.planner.arrivals import EngineSeries
from fleetplan.planner.observation import Query
from fleetplan.planner.queries import (
    EVIDENCE_QUERIES,
    QUERIES,
    Agg,
    By,
    EvidenceQuery,
    Latest,
    Quantile,
    Rate,
)
from fleetplan.sim.promsim import Counters, PromSim


def test_the_observer_renders_every_described_query_from_its_description() -> None:
    o = Observer(PromClient("http://p:9090"), ObserverConfig(window_s=60, model_labels=("model",)))
    rendered = o.queries()
    assert set(QUERIES) <= set(rendered)
    for q, d in QUERIES.items():
        assert rendered[q] == o.render(d)
        if isinstance(d, Rate | Latest):
            agg = d.agg.value if isinstance(d, Latest) else "sum"
            assert rendered[q].startswith(f"{agg} by ({'replica' if d.by is By.REPLICA else 'model'}) (")
            assert _SERIES[d.series] in rendered[q] and ("rate(" in rendered[q]) is isinstance(d, Rate)
        if isinstance(d, Quantile):
            assert rendered[q].startswith(f"histogram_quantile({d.q:g}, sum by (model, le) (rate(")
    # the engines' names of the series the descriptions read
    assert "prefix_cache_hits_total" in rendered[Query.PREFIX_HITS]
    assert rendered[Query.KV].startswith("avg by (model)")


def _counters(done: float, prompt: float, gen: float) -> Counters:
    c = Counters()
    c.completed, c.prompt_tokens, c.gen_tokens = done, prompt, gen
    c.prefix_queries, c.prefix_hits = prompt, prompt / 4
    c.ttft[0] = done  # every first token within the lowest bucket
    c.itl[1] = 3 * done
    return c


def test_the_replay_evaluates_the_same_descriptions_on_its_scrapes() -> None:
    p = PromSim(window_s=60.0, scrape_s=15.0, delay_s=0.0, history_s=600.0, history_step_s=30.0,
                peak_window_s=30.0, epoch0_s=1e9)
    p.set_targets([("r1", "m"), ("r2", "m")])
    for k in range(6):  # r1: 2 req/s, r2: 1 req/s; r1 queues one more request every scrape
        t = 15.0 * k
        p.scrape(t, {"r1": (_counters(2 * t, 200 * t, 50 * t), 4.0, float(k), 0.5),
                     "r2": (_counters(t, 100 * t, 25 * t), 2.0, 0.0, 0.25)})
    res = p.readings(75.0).results

    def one(q: Query, **labels: str) -> float:
        [v] = [s.value for s in res[q] if all(s.labels.get(k) == x for k, x in labels.items())]
        return v

    # Rate: the counter's increase per second over the window, summed by model
    assert one(Query.PROMPT, model="m") == pytest.approx(300.0)
    assert one(Query.GEN, model="m") == pytest.approx(75.0)
    assert one(Query.PREFIX_QUERIES, model="m") == pytest.approx(300.0)
    assert one(Query.PREFIX_HITS, model="m") == pytest.approx(75.0)
    # Latest: the targets' latest samples, summed (or averaged) by model, or per target
    assert one(Query.RUNNING, model="m") == 6.0 and one(Query.WAITING, model="m") == 5.0
    assert QUERIES[Query.KV] == Latest(EngineSeries.KV_USAGE, agg=Agg.AVG)
    assert one(Query.KV, model="m") == pytest.approx(0.375)
    assert one(Query.REPLICA_RUNNING, replica="r1") == 4.0 and one(Query.REPLICA_DONE, replica="r2") == 75.0
    # Arrivals: completions + the queue's growth (1 request per 15 s on r1)
    assert one(Query.REPLICA_RATE, replica="r1") == pytest.approx(2.0 + 1 / 15)
    assert one(Query.RATE, model="m") == pytest.approx(3.0 + 1 / 15)
    # Quantile: of the summed bucket rates
    assert one(Query.TTFT_P99, model="m") > 0 and one(Query.ITL_P50, model="m") > one(Query.TTFT_P50, model="m")


_SEL = ',job="e"}'
# the evidence queries' PromQL as the Observer wrote it by hand before they were described, with the
# per-model length queries reading prompts where requests enter and outputs where they leave
_ENTRY, _EXIT = ',role!="decode"', ',role!="prefill"'
_EVIDENCE_PROMQL = {
    EvidenceQuery.PROMPT_LEN: 'sum by (model, le) (rate({__name__=~"vllm[:_]request_prompt_tokens_bucket"' + _ENTRY
                              + _SEL + '[600s]))',
    EvidenceQuery.GEN_LEN: 'sum by (model, le) (rate({__name__=~"vllm[:_]request_generation_tokens_bucket"' + _EXIT
                           + _SEL + '[600s]))',
    EvidenceQuery.DONE: 'sum by (replica) (rate({__name__=~"vllm[:_]request_success_total|'
                        'trtllm_request_success_total"' + _SEL + '[60s]))',
    EvidenceQuery.TTFT: 'sum by (replica, le) (rate({__name__=~"vllm[:_]time_to_first_token_seconds_bucket|'
                        'trtllm_time_to_first_token_seconds_bucket"' + _SEL + '[60s]))',
    EvidenceQuery.TPOT: 'sum by (replica, le) (rate({__name__=~"vllm[:_]request_time_per_output_token_seconds_bucket|'
                        'trtllm_time_per_output_token_seconds_bucket"' + _SEL + '[60s]))',
    EvidenceQuery.PROMPT_SUM: 'sum by (model) (rate({__name__=~"vllm[:_]request_prompt_tokens_sum"' + _ENTRY
                              + _SEL + '[600s]))',
    EvidenceQuery.PROMPT_COUNT: 'sum by (model) (rate({__name__=~"vllm[:_]request_prompt_tokens_count"' + _ENTRY
                                + _SEL + '[600s]))',
    EvidenceQuery.GEN_SUM: 'sum by (model) (rate({__name__=~"vllm[:_]request_generation_tokens_sum"' + _EXIT
                           + _SEL + '[600s]))',
    EvidenceQuery.GEN_COUNT: 'sum by (model) (rate({__name__=~"vllm[:_]request_generation_tokens_count"' + _EXIT
                             + _SEL + '[600s]))',
    EvidenceQuery.TTFT_SUM: 'sum by (replica) (rate({__name__=~"vllm[:_]time_to_first_token_seconds_sum|'
                            'trtllm_time_to_first_token_seconds_sum"' + _SEL + '[60s]))',
    EvidenceQuery.TTFT_COUNT: 'sum by (replica) (rate({__name__=~"vllm[:_]time_to_first_token_seconds_count|'
                              'trtllm_time_to_first_token_seconds_count"' + _SEL + '[60s]))',
    EvidenceQuery.TPOT_SUM: 'sum by (replica) (rate({__name__=~"vllm[:_]request_time_per_output_token_seconds_sum|'
                            'trtllm_time_per_output_token_seconds_sum"' + _SEL + '[60s]))',
    EvidenceQuery.TPOT_COUNT: 'sum by (replica) (rate({__name__=~'
                              '"vllm[:_]request_time_per_output_token_seconds_count|'
                              'trtllm_time_per_output_token_seconds_count"' + _SEL + '[60s]))',
}


def test_the_observer_renders_the_evidence_queries_from_their_descriptions() -> None:
    o = Observer(PromClient("http://p:9090"), ObserverConfig(window_s=60, length_window_s=600, model_labels=("model",),
                                                             extra_selector='job="e"'))
    rendered = o.evidence_queries()
    assert set(rendered) == set(EVIDENCE_QUERIES) == set(EvidenceQuery)
    assert rendered == _EVIDENCE_PROMQL
    # the length window is never shorter than the rate window
    short = Observer(PromClient("http://p:9090"), ObserverConfig(window_s=90.4, length_window_s=30))
    assert short.evidence_queries()[EvidenceQuery.PROMPT_SUM].endswith("[90s]))")
    # the TTFT quantiles read the evidence's TTFT histogram names: the same engines' series as the
    # grouped spelling they were written in before
    assert _TTFT_BUCKET in o.queries()[Query.TTFT_P99]
    for prefix in ("vllm:", "vllm_", "trtllm_", "trtllm:", "sglang:", ""):
        name = f"{prefix}time_to_first_token_seconds_bucket"
        assert bool(re.fullmatch(_TTFT_BUCKET, name)) is bool(
            re.fullmatch(r"(vllm[:_]|trtllm_)time_to_first_token_seconds_bucket", name)), name


def _engine(done: float) -> Counters:
    """An engine that finished `done` requests: 3 in 4 with 500-token prompts and 40 generated
    tokens, the rest 1,500 and 400; first tokens in 30 ms or 300 ms, 20 ms or 50 ms per token."""
    c = Counters()
    c.completed = done
    short, long = 0.75 * done, 0.25 * done
    c.prompt_tokens, c.gen_tokens = 500 * short + 1500 * long, 40 * short + 400 * long
    c.prompt_len[8], c.prompt_len[10] = short, long  # le 500, le 2000
    c.gen_len[5], c.gen_len[8] = short, long  # le 50, le 500
    c.ttft[4], c.ttft[8] = short, long  # le 0.04, le 0.25
    c.tpot[3], c.tpot[6] = short, long  # le 0.075, le 0.2
    c.sums = [0.03 * short + 0.3 * long, 0.02 * short + 0.05 * long, c.prompt_tokens, c.gen_tokens]
    return c


def test_the_replay_evaluates_the_evidence_descriptions_as_it_did_by_hand() -> None:
    """The numbers are the replay's before its evidence queries were described (exactly)."""
    p = PromSim(window_s=60.0, scrape_s=15.0, delay_s=0.0, history_s=600.0, history_step_s=30.0,
                peak_window_s=30.0, epoch0_s=1e9, length_window_s=120.0)
    p.set_targets([("r1", "a"), ("r2", "a"), ("r3", "b")])
    for k in range(9):  # 4, 2 and 1 req/s; r2 finishes 8 more at 75 s; r3's target is removed at 120 s
        t = 15.0 * k
        if k == 8:
            p.set_targets([("r1", "a"), ("r2", "a")])
        p.scrape(t, {"r1": (_engine(4 * t), 0.0, 0.0, 0.0), "r2": (_engine(2 * t + 8 * (k > 4)), 0.0, 0.0, 0.0),
                     "r3": (_engine(t), 0.0, 0.0, 0.0)})
    e = p.evidence(120.0)
    assert (e.window_s, e.length_window_s) == (60.0, 120.0)
    # lengths per model over the length window (r2's 8 extra requests in it), cumulative buckets
    a = dict(e.prompt_len["a"])
    assert (a[500.0], a[2000.0], a[math.inf]) == (4.550000000000001, 6.066666666666667, 6.066666666666667)
    assert dict(e.gen_len["b"])[50.0] == 0.75 and dict(e.gen_len["b"])[math.inf] == 1.0
    assert e.prompt_len_moments is not None and e.gen_len_moments is not None
    assert dict(e.prompt_len_moments) == {"a": (4550.000000000001, 6.066666666666666), "b": (750.0, 1.0)}
    assert dict(e.gen_len_moments) == {"a": (788.6666666666667, 6.066666666666666), "b": (130.0, 1.0)}
    # completions and latencies per replica over the rate window (r2's jump before it)
    assert [(r, s.done_rps) for r, s in e.replicas.items()] == [("r1", 4.0), ("r2", 2.0), ("r3", 1.0)]
    r2 = e.replicas["r2"]
    assert (dict(r2.ttft)[0.04], dict(r2.ttft)[0.25], dict(r2.tpot)[0.075], dict(r2.tpot)[math.inf]) == (
        1.5, 2.0, 1.5, 2.0)
    assert (r2.ttft_moments, r2.tpot_moments) == ((0.195, 2.0), (0.05499999999999999, 2.0))
    assert e.replicas["r3"].ttft_moments == (0.09750000000000002, 1.0)


def test_the_replay_counts_a_disaggregated_models_requests_once() -> None:
    """A prefill replica and a decode replica of one model each finish every request (one token on
    the prefill side): per-model queries read their Leg, as the Observer's role matchers do."""
    p = PromSim(window_s=60.0, scrape_s=15.0, delay_s=0.0, history_s=600.0, history_step_s=30.0,
                peak_window_s=30.0, epoch0_s=1e9)
    p.set_targets([("pre", "m", "prefill"), ("dec", "m", "decode")])
    for k in range(41):  # 2 req/s of 100-token prompts through both pools; 20 tokens out
        t = 15.0 * k
        pre, dec = _counters(2 * t, 200 * t, 2 * t), _counters(2 * t, 200 * t, 40 * t)
        for c, gen in ((pre, 1), (dec, 20)):
            n = 2 * t
            c.prompt_len[6], c.gen_len[0 if gen == 1 else 4] = n, n  # LENGTH_BUCKETS: 100 and 1 / 20 tokens
            c.sums[2], c.sums[3] = 100 * n, gen * n
        p.scrape(t, {"pre": (pre, 1.0, 0.0, 0.1), "dec": (dec, 3.0, 0.0, 0.5)})
    res = p.readings(600.0).results

    def one(q: Query) -> float:
        [v] = [s.value for s in res[q] if s.labels.get("model") == "m"]
        return v

    assert one(Query.RATE) == pytest.approx(2.0)  # not 4: the decode pool's completions are not arrivals
    assert one(Query.PROMPT) == pytest.approx(200.0) and one(Query.GEN) == pytest.approx(40.0)
    assert one(Query.RUNNING) == 4.0  # gauges read every target
    assert p.readings(600.0).history[0].points[-1][1] == pytest.approx(2.0)
    evidence = p.evidence(600.0)
    assert evidence.gen_len_moments is not None and evidence.prompt_len_moments is not None
    gen_sum, gen_count = evidence.gen_len_moments["m"]
    assert gen_sum / gen_count == pytest.approx(20.0)  # not 10.5: the prefill side's one token is not an output
    prompt_sum, prompt_count = evidence.prompt_len_moments["m"]
    assert prompt_sum / prompt_count == pytest.approx(100.0) and prompt_count == pytest.approx(2.0)
