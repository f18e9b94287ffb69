"""planner/evidence.py: Prometheus' histogram_quantile, the length mix and the per-config evidence rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import pytest

from fleetplan.models.mix import QUANTILE_LEVELS, mix_from_quantiles
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.evidence import (
    MIN_LENGTH_SAMPLES,
    MIN_P99_SAMPLES,
    Evidence,
    MomentSamples,
    ReplicaSeries,
    bucket_quantiles,
    collect,
    evidence_to_json,
    histogram_quantile,
    interpret,
    length_estimates,
    length_quantiles,
)
from fleetplan.planner.types import ConfigKey, Replica, ReplicaState

INF = math.inf
M = "llama-3.1-70b"
VLLM = ConfigKey(M, Engine.VLLM, GpuType.H100, 4, Precision.FP16)
TRT = ConfigKey(M, Engine.TRTLLM, GpuType.H100, 4, Precision.FP16)
NOW = 10_000.0
WINDOW = 8.0  # wall s
K = 20.0  # time scale: the window is 160 simulated s


def cumulative(edges: list[float], counts: list[float]) -> tuple[tuple[float, float], ...]:
    """Cumulative (le, value) from per-bucket values (last = +Inf bucket)."""
    out, acc = [], 0.0
    for le, c in zip([*edges, INF], counts, strict=True):
        acc += c
        out.append((le, acc))
    return tuple(out)


# ---- histogram_quantile: Prometheus' bucketQuantile --------------------------------------------

def test_histogram_quantile_interpolates_like_prometheus() -> None:
    b = cumulative([1.0, 2.0, 4.0], [10, 10, 20, 0])
    assert histogram_quantile(0.5, b) == pytest.approx(2.0)  # rank 20 = end of the (1, 2] bucket
    assert histogram_quantile(0.25, b) == pytest.approx(1.0)  # rank 10 = end of the first bucket
    assert histogram_quantile(0.375, b) == pytest.approx(1.5)  # rank 15: half-way into (1, 2]
    assert histogram_quantile(0.05, b) == pytest.approx(0.2)  # rank 2: the first bucket starts at 0
    assert histogram_quantile(0.75, b) == pytest.approx(3.0)


def test_histogram_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    b = cumulative([1.0, 2.0], [1, 1, 98])
    assert histogram_quantile(0.99, b) == 2.0


def test_histogram_quantile_unknown_cases() -> None:
    assert histogram_quantile(0.5, ()) is None
    assert histogram_quantile(0.5, ((1.0, 3.0), (2.0, 5.0))) is None  # no +Inf bucket
    assert histogram_quantile(0.5, cumulative([1.0], [0, 0])) is None  # no observations
    assert histogram_quantile(1.5, cumulative([1.0], [1, 0])) is None


def test_histogram_quantile_evens_out_non_monotonic_rates() -> None:
    b = ((1.0, 10.0), (2.0, 9.99), (INF, 20.0))  # rate() extrapolation can break monotonicity a hair
    v = histogram_quantile(0.9, b)
    assert v == pytest.approx(2.0)


# ---- the length mix ----------------------------------------------------------------------------

LEN_EDGES = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0]


def test_length_quantiles_at_the_planner_levels_and_monotone() -> None:
    # 90% of prompts in (500, 1000], 10% in (5000, 10000]: a heavy tail
    per = [0.0] * (len(LEN_EDGES) + 1)
    per[LEN_EDGES.index(1000.0)] = 0.9 * 5.0  # rates per wall second, 5 rps in all
    per[LEN_EDGES.index(10000.0)] = 0.1 * 5.0
    b = cumulative(LEN_EDGES, per)
    q = length_quantiles(b, WINDOW)
    assert [lv for lv, _ in q] == list(QUANTILE_LEVELS)
    vals = [v for _, v in q]
    assert vals == sorted(vals)
    d = dict(q)
    assert 500 < d[0.5] <= 1000 and d[0.99] > 5000
    # the planner turns them into a mix whose p99 prompt is the tail's, not the mean's
    mix = mix_from_quantiles(q, [], osl_mean=200)
    assert mix.isl_quantile(0.99) > 5000 and mix.mean().isl < 2500


def test_length_quantiles_need_enough_requests() -> None:
    per = [0.0] * (len(LEN_EDGES) + 1)
    per[LEN_EDGES.index(1000.0)] = (MIN_LENGTH_SAMPLES - 1) / WINDOW
    assert length_quantiles(cumulative(LEN_EDGES, per), WINDOW) == ()
    per[LEN_EDGES.index(1000.0)] = (MIN_LENGTH_SAMPLES + 1) / WINDOW
    assert length_quantiles(cumulative(LEN_EDGES, per), WINDOW) != ()


# ---- per-config evidence -----------------------------------------------------------------------

TTFT_EDGES = [0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
TPOT_EDGES = [0.01, 0.025, 0.05, 0.075, 0.1]


def series(done_rps: float, ttft_slow: bool = False) -> ReplicaSeries:
    """A replica completing done_rps per wall second; TTFT in (0.25, 0.5] s, or (1, 2.5] s if slow."""
    ttft = [0.0] * (len(TTFT_EDGES) + 1)
    ttft[TTFT_EDGES.index(2.5 if ttft_slow else 0.5)] = done_rps
    tpot = [0.0] * (len(TPOT_EDGES) + 1)
    tpot[TPOT_EDGES.index(0.05)] = done_rps
    return ReplicaSeries(done_rps, cumulative(TTFT_EDGES, ttft), cumulative(TPOT_EDGES, tpot))


def replica(rid: str, config: ConfigKey = VLLM, state: ReplicaState = ReplicaState.READY,
            since_s: float | None = NOW - 1000.0) -> Replica:
    return Replica(rid, config, "host-a", (0, 1, 2, 3), state, 8000, since_s)


def evidence(reps: dict[str, ReplicaSeries]) -> Evidence:
    return Evidence(WINDOW, K, replicas=MappingProxyType(reps))


def test_interpret_sums_replicas_per_config_and_divides_rates_by_the_time_scale() -> None:
    e = evidence({"r1": series(4.0), "r2": series(4.0), "t1": series(2.0, ttft_slow=True)})
    out = interpret(M, e, [replica("r1"), replica("r2"), replica("t1", TRT)], NOW, stale=False)
    by = {c.config: c for c in out.configs}
    v, t = by[VLLM], by[TRT]
    assert v.ready_replicas == 2 and v.rate_rps == pytest.approx(8.0 / K) and v.requests == pytest.approx(64.0)
    assert v.ttft_p99_ms is not None and 250 < v.ttft_p99_ms <= 500
    assert v.itl_p99_ms is not None and 25 < v.itl_p99_ms <= 50  # per-request TPOT, ms
    assert t.ready_replicas == 1 and t.ttft_p99_ms is not None and 1000 < t.ttft_p99_ms <= 2500


def test_interpret_counts_only_replicas_ready_for_the_whole_window() -> None:
    e = evidence({"r1": series(4.0), "r2": series(1.0), "r3": series(4.0), "r4": series(4.0)})
    reps = [
        replica("r1"),
        replica("r2", since_s=NOW - 0.5 * WINDOW * K),  # joined mid-window: would dilute the load per replica
        replica("r3", state=ReplicaState.DRAINING),
        replica("r4", state=ReplicaState.STARTING),
    ]
    (c,) = interpret(M, e, reps, NOW, stale=False).configs
    assert c.ready_replicas == 1 and c.rate_rps == pytest.approx(4.0 / K)
    # since unknown: trusted
    (c,) = interpret(M, e, [replica("r1", since_s=None)], NOW, stale=False).configs
    assert c.ready_replicas == 1


def test_interpret_leaves_out_a_replica_prometheus_has_no_series_for() -> None:
    e = evidence({"r1": series(4.0)})
    out = interpret(M, e, [replica("r1"), replica("r2")], NOW, stale=False)
    (c,) = out.configs
    assert c.ready_replicas == 1  # not 2: r2's share is unknown, and counting it would halve the load
    assert any("r2" in n for n in out.notes)


def test_interpret_few_samples_give_unknown_p99_and_idle_configs_no_evidence() -> None:
    few = (MIN_P99_SAMPLES - 1) / WINDOW
    out = interpret(M, evidence({"r1": series(few)}), [replica("r1")], NOW, stale=False)
    (c,) = out.configs
    assert c.ttft_p99_ms is None and c.itl_p99_ms is None and c.requests == pytest.approx(MIN_P99_SAMPLES - 1)
    out = interpret(M, evidence({"r1": series(0.0)}), [replica("r1")], NOW, stale=False)
    assert out.configs == ()


def test_a_p99_inside_the_lowest_bucket_is_an_upper_bound() -> None:
    tpot = [0.0] * (len(TPOT_EDGES) + 1)
    tpot[0] = 4.0  # every request under 10 ms: histogram_quantile would say 9.9 ms by interpolation
    s = ReplicaSeries(4.0, series(4.0).ttft, cumulative(TPOT_EDGES, tpot))
    (c,) = interpret(M, evidence({"r1": s}), [replica("r1")], NOW, stale=False).configs
    # no value (the 9.9 ms would be a bucket artefact), but a bound: every request under 10 ms
    assert c.itl_p99_ms is None and c.itl_p99_range_ms == (0.0, 10.0)
    assert c.ttft_p99_ms is not None and c.ttft_p99_range_ms == (250.0, 500.0)


def test_interpret_stale_model_or_no_evidence_gives_nothing() -> None:
    per = [0.0] * (len(LEN_EDGES) + 1)
    per[LEN_EDGES.index(1000.0)] = 10.0
    e = Evidence(WINDOW, K, prompt_len=MappingProxyType({M: cumulative(LEN_EDGES, per)}),
                 replicas=MappingProxyType({"r1": series(4.0)}))
    assert interpret(M, e, [replica("r1")], NOW, stale=True).configs == ()
    assert interpret(M, e, [replica("r1")], NOW, stale=True).isl_quantiles == ()
    assert interpret(M, None, [replica("r1")], NOW, stale=False).configs == ()
    live = interpret(M, e, [replica("r1")], NOW, stale=False)
    assert live.isl_quantiles and live.osl_quantiles == ()  # no generation histogram: mean only
    # another model's replicas are not this model's evidence
    assert interpret("other", e, [replica("r1")], NOW, stale=False).configs == ()


@dataclass(frozen=True)
class S:
    labels: dict[str, str]
    value: float


def test_collect_groups_lengths_by_canonical_model_and_latency_by_replica() -> None:
    canon = {"Llama-3.1-70B-Instruct": M, M: M}

    def model_of(labels: dict[str, str]) -> str | None:
        for k in ("model", "model_name"):
            if labels.get(k):
                return canon.get(labels[k], labels[k])
        return None

    prompt = [S({"model": M, "le": "1000.0"}, 1.0), S({"model": M, "le": "+Inf"}, 1.0),
              S({"model_name": "Llama-3.1-70B-Instruct", "le": "1000.0"}, 2.0),
              S({"model_name": "Llama-3.1-70B-Instruct", "le": "+Inf"}, 3.0),
              S({"le": "+Inf"}, 9.0)]  # no model label: dropped
    done = [S({"replica": "r1"}, 0.5), S({"replica": "r1"}, 0.25), S({"replica": ""}, 7.0)]
    ttft = [S({"replica": "r1", "le": "0.5"}, 0.75), S({"replica": "r1", "le": "+Inf"}, 0.75),
            S({"replica": "r1", "le": "NaN"}, 1.0)]
    e = collect(prompt, [], done, ttft, [], model_of=model_of, window_s=WINDOW, time_scale=K)  # type: ignore[arg-type]
    assert e.prompt_len[M] == ((1000.0, 3.0), (INF, 4.0))
    assert set(e.replicas) == {"r1"}
    r1 = e.replicas["r1"]
    assert r1.done_rps == 0.75 and r1.ttft == ((0.5, 0.75), (INF, 0.75)) and r1.tpot == ()


# ---- quantiles consistent with the exact mean (_sum / _count; issue 17.3) ------------------------

VLLM_LEN_EDGES = [float(m * 10 ** e) for e in range(0, 5) for m in (1, 2, 5)]  # build_1_2_5_buckets


def histogram_of(values: list[float], edges: list[float]) -> tuple[tuple[float, float], ...]:
    per = [0.0] * (len(edges) + 1)
    for v in values:
        per[next((i for i, e in enumerate(edges) if v <= e), len(edges))] += 1.0
    return cumulative(edges, per)


def test_a_fixed_length_load_reads_as_its_length() -> None:
    # prompts of exactly 64 tokens (a real vLLM, CPU build): all in the (50, 100] bucket, sum/count = 64
    b = histogram_of([64.0] * 400, VLLM_LEN_EDGES)
    assert histogram_quantile(0.99, b) == pytest.approx(99.5)  # Prometheus: spread over the bucket
    est = length_estimates(b, 1.0, (64.0 * 400, 400.0))
    assert {e.value for e in est} == {64.0}  # the histogram shows no spread: every prompt is the mean
    assert all((e.lo, e.hi) == (50.0, 100.0) for e in est)
    # without _sum/_count: Prometheus' reading, with the same interval
    assert dict(length_quantiles(b, 1.0))[0.99] == pytest.approx(99.5)


def test_quantiles_agree_with_the_exact_mean() -> None:
    # the demo's lengths: Gaussian around 1,024 (sd 25%), vLLM's 1-2-5 buckets; Prometheus' quantiles
    # put half the requests evenly over (1000, 2000] and read p99 ~1,980 and a mean far above the truth
    rng = np.random.default_rng(7)
    values = [max(8.0, float(int(x))) for x in rng.normal(1024.0, 256.0, 4000)]
    true_mean, true_p99 = float(np.mean(values)), float(np.quantile(values, 0.99))
    b = histogram_of(values, VLLM_LEN_EDGES)
    levels = [i / 200 for i in range(1, 200)]
    est = bucket_quantiles(levels, b, true_mean)
    implied = float(np.mean([e.value for e in est]))
    linear = float(np.mean([histogram_quantile(q, b) for q in levels]))
    assert abs(implied - true_mean) < 0.03 * true_mean < abs(linear - true_mean)
    p99 = next(e for e in est if e.q == 0.99)
    prom = histogram_quantile(0.99, b)
    assert prom is not None and abs(p99.value - true_p99) < 0.1 * true_p99 < abs(prom - true_p99)
    assert (p99.lo, p99.hi) == (1000.0, 2000.0) and p99.lo <= true_p99 <= p99.hi
    # a latency: TTFT ~N(150 ms, 30 ms) in vLLM's 100-250 ms bucket; clients would measure p99 ~220 ms
    ttft = [max(0.01, float(x)) for x in rng.normal(0.150, 0.030, 3000)]
    edges = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
    hb = histogram_of(ttft, edges)
    (t99,) = bucket_quantiles((0.99,), hb, float(np.mean(ttft)))
    truth, prom_t = float(np.quantile(ttft, 0.99)), histogram_quantile(0.99, hb)
    assert prom_t is not None and abs(t99.value - truth) < abs(prom_t - truth)
    assert (t99.lo, t99.hi) == (0.1, 0.25)


def test_a_mean_that_is_not_the_buckets_is_ignored_and_inf_bucket_is_the_top_bound() -> None:
    b = histogram_of([64.0] * 100, VLLM_LEN_EDGES)
    (e,) = bucket_quantiles((0.99,), b, 5000.0)  # a sum/count of another population: linear reading
    assert e.value == pytest.approx(99.5)
    top = cumulative([1.0, 2.0], [1, 1, 98])
    (e,) = bucket_quantiles((0.99,), top, 7.0)
    assert e.value == 2.0 and e.lo == 2.0 and math.isinf(e.hi)


def test_interpret_uses_the_moments_and_carries_the_bounds() -> None:
    b = histogram_of([64.0] * 400, VLLM_LEN_EDGES)
    rate = tuple((le, c / WINDOW) for le, c in b)  # rates per wall second
    e = Evidence(WINDOW, K, prompt_len=MappingProxyType({M: rate}),
                 prompt_len_moments=MappingProxyType({M: (64.0 * 400 / WINDOW, 400 / WINDOW)}))
    me = interpret(M, e, [], NOW, stale=False)
    assert dict(me.isl_quantiles)[0.99] == 64.0 and me.isl_p99_low() == 50.0
    js = evidence_to_json(me)
    assert js["isl_bounds"][0][1:] == [50.0, 100.0]


def test_collect_reads_the_sum_and_count_series() -> None:
    def model_of(labels: dict[str, str]) -> str | None:
        return labels.get("model")

    prompt = [S({"model": M, "le": "100.0"}, 2.0), S({"model": M, "le": "+Inf"}, 2.0)]
    ms = MomentSamples(prompt_sum=[S({"model": M}, 128.0)], prompt_count=[S({"model": M}, 2.0)],
                       ttft_sum=[S({"replica": "r1"}, 0.3)], ttft_count=[S({"replica": "r1"}, 2.0)],
                       tpot_sum=[S({"replica": "r1"}, 0.02)])  # no tpot _count: unknown
    ttft = [S({"replica": "r1", "le": "0.5"}, 2.0), S({"replica": "r1", "le": "+Inf"}, 2.0)]
    done = [S({"replica": "r1"}, 2.0)]
    e = collect(prompt, [], done, ttft, [], model_of=model_of, window_s=WINDOW, moments=ms)  # type: ignore[arg-type]
    assert e.prompt_len_moments == {M: (128.0, 2.0)} and e.gen_len_moments is None
    r1 = e.replicas["r1"]
    assert r1.ttft_moments == (0.3, 2.0) and r1.tpot_moments is None
    plain = collect(prompt, [], done, ttft, [], model_of=model_of, window_s=WINDOW)  # type: ignore[arg-type]
    assert plain.prompt_len_moments is None and plain.replicas["r1"].ttft_moments is None


def test_a_p99_carries_what_another_window_of_the_same_traffic_would_read() -> None:
    # 40 requests: 39 with a TPOT in (10, 25] ms and one stalled behind a long prefill, in (75, 100]:
    # the p99 reads the stall, but a window without it would read ~25 ms: the sampling interval
    # spans both. 4,000 requests with the same shape: the p99 is pinned within its own bucket.
    def tpot_series(total: float, stalled: float) -> ReplicaSeries:
        tpot = [0.0] * (len(TPOT_EDGES) + 1)
        tpot[TPOT_EDGES.index(0.025)] = (total - stalled) / WINDOW
        tpot[TPOT_EDGES.index(0.1)] = stalled / WINDOW
        return ReplicaSeries(total / WINDOW, series(total / WINDOW).ttft, cumulative(TPOT_EDGES, tpot))

    (few,) = interpret(M, evidence({"r1": tpot_series(40.0, 1.0)}), [replica("r1")], NOW, stale=False).configs
    lo, hi = few.itl_p99_sampling_ms or (0.0, 0.0)
    assert few.itl_p99_ms is not None and 75.0 < few.itl_p99_ms <= 100.0
    assert lo <= 25.0 and hi >= few.itl_p99_ms  # a window without the stall reads the body
    (many,) = interpret(M, evidence({"r1": tpot_series(4000.0, 100.0)}), [replica("r1")], NOW,
                        stale=False).configs
    lo, hi = many.itl_p99_sampling_ms or (0.0, 0.0)
    assert many.itl_p99_ms is not None and 75.0 < lo <= many.itl_p99_ms <= hi <= 100.0
