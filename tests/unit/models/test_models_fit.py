"""Fitting: recovers a known model from its own predictions; saturation classification."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetplan.models.bench import BenchmarkPoint, LoadKind
from fleetplan.models.fit import FitFailure, fit_profile, holdout_errors, saturation_flags
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.models.profile import ConfigKey, PerfProfile, Workload, predict, roofline_profile

KEY = ConfigKey("some-new-model", Engine.VLLM, GpuType.H100, 2, Precision.FP8)


def _truth() -> PerfProfile:
    prior = roofline_profile(ConfigKey("llama-3.1-70b", Engine.VLLM, GpuType.H100, 2, Precision.FP8))
    assert prior is not None
    params = replace(prior.params, s0_ms=prior.params.s0_ms * 1.3, p1_ms=prior.params.p1_ms * 0.8,
                     ttft_fixed_ms=15.0, q=2.0)
    return replace(prior, key=KEY, params=params, kv_tokens=400_000.0, source="fit")


def _points(truth: PerfProfile) -> list[BenchmarkPoint]:
    points = []
    for isl in (500, 2000, 6000):
        for conc in (2, 8, 32, 64):
            pred = predict(truth, Workload(isl, 200), concurrency=conc)
            points.append(BenchmarkPoint(
                source=f"synthetic isl{isl} c{conc}", model=KEY.model, engine=KEY.engine, gpu=KEY.gpu, tp=KEY.tp,
                precision=KEY.precision, isl=isl, osl=200, load=LoadKind.CONCURRENCY, concurrency=conc,
                request_rps=pred.request_rps, output_tok_s=pred.output_tok_s,
                ttft_p50_ms=pred.ttft.p50_ms, ttft_p99_ms=pred.ttft.p99_ms,
                itl_mean_ms=pred.itl.mean_ms, itl_p99_ms=pred.itl.p99_ms, series=f"isl{isl}"))
    return points


def test_fit_recovers_a_known_model() -> None:
    truth = _truth()
    points = _points(truth)
    report = fit_profile(KEY, points)
    e = report.profile.fit_error
    assert e is not None and e.points == len(points)
    assert e.ttft_mape is not None and e.ttft_mape < 5.0
    assert e.itl_mape is not None and e.itl_mape < 5.0
    assert e.throughput_mape is not None and e.throughput_mape < 5.0
    # and it predicts an unseen operating point
    w = Workload(4000, 200)
    want, got = predict(truth, w, concurrency=16), predict(report.profile, w, concurrency=16)
    assert got.ttft.p50_ms == pytest.approx(want.ttft.p50_ms, rel=0.1)
    assert got.itl.mean_ms == pytest.approx(want.itl.mean_ms, rel=0.1)
    assert got.output_tok_s == pytest.approx(want.output_tok_s, rel=0.1)
    assert report.profile.data_range is not None and report.profile.data_range.concurrency == (2, 64)


def test_holding_out_a_series_predicts_it() -> None:
    points = _points(_truth())
    train = [p for p in points if p.isl != 2000]
    test = [p for p in points if p.isl == 2000]
    errs = holdout_errors(KEY, train, test)
    assert max(errs["ttft"]) < 15 and max(errs["itl"]) < 15 and max(errs["throughput"]) < 15


def _rate(rate: float, achieved: float, ttft: float | None, load: LoadKind = LoadKind.RATE) -> BenchmarkPoint:
    return BenchmarkPoint(source="t", model="m", engine=Engine.VLLM, gpu=GpuType.H100, tp=1,
                          precision=Precision.BF16, isl=500, osl=200, load=load,
                          rate_rps=rate if load is LoadKind.RATE else None, request_rps=achieved,
                          output_tok_s=achieved * 200, ttft_mean_ms=ttft, series="s")


def test_saturation_flags() -> None:
    pts = [_rate(2, 2, 20), _rate(8, 6.5, 30), _rate(16, 10, 900), _rate(4, 12.5, 5000, LoadKind.MAX)]
    # 8 rps achieved 6.5 while draining but TTFT shows no backlog: not saturated;
    # 16 rps is beyond the measured saturation rate (12.5): saturated; the INF row always is
    assert saturation_flags(pts) == [False, False, True, True]
    # without a measured saturation rate the top rate alone is no saturation
    assert saturation_flags([_rate(2, 2, 20), _rate(8, 8, 25)]) == [False, False]


def test_fit_failure_is_named() -> None:
    with pytest.raises(FitFailure, match="no points"):
        fit_profile(KEY, [])
    bare = replace(_rate(2, 2, None), output_tok_s=None)
    with pytest.raises(FitFailure, match="no usable statistic"):
        fit_profile(bare.key, [bare])


def test_throughput_only_profiles_say_their_latencies_are_prior_shaped() -> None:
    pts = [replace(_rate(1, 10 + i, None, LoadKind.MAX), isl=128 * (i + 1), series=f"s{i}") for i in range(4)]
    profile = fit_profile(pts[0].key, pts, loo=False).profile
    assert profile.data_range is not None and profile.data_range.latency_points == 0
    pred = predict(profile, Workload(256, 200), rate_rps=1.0)
    assert any("no TTFT/ITL measurements" in w for w in pred.warnings)
    with_latency = fit_profile(KEY, _points(_truth()), loo=False).profile
    assert with_latency.data_range is not None and with_latency.data_range.latency_points == 12


def _gap_points(truth: PerfProfile, *, per_gap: bool) -> list[BenchmarkPoint]:
    points = []
    sat = 1000.0 / (truth.params.p0_ms + truth.params.p1_ms * 2048 + 255 * (truth.params.s1_ms + truth.params.s2_ms * 2176))
    for f in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.6):
        pred = predict(truth, Workload(2048, 256), rate_rps=f * sat)
        p99 = {"itl_p99_ms": pred.itl.p99_ms} if per_gap else {"tpot_p99_ms": pred.itl.p99_ms}
        points.append(BenchmarkPoint(
            source=f"synthetic r{f}", model=KEY.model, engine=KEY.engine, gpu=KEY.gpu, tp=KEY.tp,
            precision=KEY.precision, isl=2048, osl=256, load=LoadKind.RATE, rate_rps=f * sat,
            request_rps=pred.request_rps, ttft_mean_ms=pred.ttft.mean_ms, ttft_p99_ms=pred.ttft.p99_ms,
            itl_mean_ms=pred.itl.mean_ms, series="s", **p99))
    return points


def test_the_prefill_stall_is_fitted_from_per_gap_p99_only() -> None:
    truth = _truth()
    truth = replace(truth, params=replace(truth.params, itl_stall_weight=1.0, itl_p99_factor=1.1))
    fitted = fit_profile(KEY, _gap_points(truth, per_gap=True), loo=False).profile
    assert fitted.params.itl_stall_weight > 0.5
    w = Workload(2048, 256)
    for f in (0.01, 0.3):
        rate = f * 1000.0 / (truth.params.p0_ms + truth.params.p1_ms * 2048
                             + 255 * (truth.params.s1_ms + truth.params.s2_ms * 2176))
        assert predict(fitted, w, rate_rps=rate).itl.p99_ms == pytest.approx(
            predict(truth, w, rate_rps=rate).itl.p99_ms, rel=0.15)
    # per-request TPOT p99 averages the stalls away: no stall term from such data
    tpot_only = fit_profile(KEY, _gap_points(truth, per_gap=False), loo=False).profile
    assert tpot_only.params.itl_stall_weight == 0.0


def test_closed_loop_waves_are_fitted_only_when_the_data_demand_them() -> None:
    truth = _truth()
    waves = replace(truth, params=replace(truth.params, closed_loop_sync=0.8))
    fitted = fit_profile(KEY, _points(waves), loo=False).profile
    assert fitted.params.closed_loop_sync > 0.5
    w = Workload(4000, 200)
    want, got = predict(waves, w, concurrency=16), predict(fitted, w, concurrency=16)
    assert got.ttft.p50_ms == pytest.approx(want.ttft.p50_ms, rel=0.15)
    assert got.itl.mean_ms == pytest.approx(want.itl.mean_ms, rel=0.15)
    # the same sweep without waves keeps them off
    assert fit_profile(KEY, _points(truth), loo=False).profile.params.closed_loop_sync == 0.0
