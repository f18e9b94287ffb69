"""Trace generators (sim/trace_build.py, sim/trace_prom.py): the week's shape is followed, the source's
bursts, lengths and conversations are kept, the coding hour's burstiness parameter is reached, seeds
reproduce."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fleetplan.sim import trace_build as tb
from fleetplan.sim.trace_prom import LengthWindow, trace_from_series
from fleetplan.sim.traces import TraceError, block_reuse_share, parse_trace_text, read_trace


@pytest.fixture(scope="module")
def week(shared_data: Path) -> tb.WeekRate:
    return tb.read_week_rate(shared_data / "traces" / "azure_llm_conv_2024_week_rate.csv")


@pytest.fixture(scope="module")
def azure(shared_data: Path) -> tb.SourceLog:
    return tb.source_log(read_trace(shared_data / "traces" / "azure_llm_conv_2023.csv"))


@pytest.fixture(scope="module")
def mooncake(shared_data: Path) -> tb.SourceLog:
    return tb.source_log(read_trace(shared_data / "traces" / "mooncake_conversation.jsonl"))


def _per_minute(t: np.ndarray, minutes: int) -> np.ndarray:
    return np.bincount((t // 60).astype(np.int64), minlength=minutes)[:minutes]


def test_week_envelope_is_the_services_week(week: tb.WeekRate) -> None:
    env = tb.envelope(week, tb.Shape.WEEK)
    assert len(env) == tb.WEEK_MINUTES and env.mean() == pytest.approx(1.0)
    hourly = env.reshape(-1, 60).mean(axis=1)
    assert hourly.max() / hourly.min() == pytest.approx(3.54, rel=0.05)  # SOURCES.md: 3.5x
    daily = env.reshape(7, -1).mean(axis=1)
    assert daily[1:6].mean() / daily[[0, 6]].mean() == pytest.approx(1.8, rel=0.05)  # weekdays 1.8x the weekend
    day = tb.envelope(week, tb.Shape.DAY, 2)
    assert len(day) == tb.DAY_MINUTES and day.mean() == pytest.approx(1.0)
    assert np.corrcoef(day, env[2 * 1440:3 * 1440])[0, 1] > 0.999


def test_a_deeper_swing_keeps_the_hours_order_and_the_mean(week: tb.WeekRate) -> None:
    day = tb.envelope(week, tb.Shape.DAY, 2)
    assert tb.hourly_swing(day) == pytest.approx(1.97, rel=0.02)  # the conversation service's Tuesday
    for swing in (1.97, 10.0, 31.0):
        deep = tb.deepened(day, swing)
        assert tb.hourly_swing(deep) == pytest.approx(swing, rel=1e-3) and deep.mean() == pytest.approx(1.0)
        assert (np.argsort(deep, kind="stable") == np.argsort(day, kind="stable")).all()  # every minute keeps its rank
    assert np.ptp(tb.deepened(day, 1.0)) < 0.15 * np.ptp(day)  # 1: (nearly) flat hours
    with pytest.raises(ValueError, match=r"a peak-to-trough ratio, >= 1; got 0\.5"):
        tb.deepened(day, 0.5)
    with pytest.raises(ValueError, match="a flat envelope has no shape to deepen"):
        tb.deepened(np.ones(120), 2.0)


def test_week_rate_errors_name_file_line_field() -> None:
    text = "minute_start,rpm_min,rpm_median,rpm_max\n1,10,20,30\n8,10,x,30\n"
    with pytest.raises(TraceError, match=r"w.csv:3: field 'rpm_median' = 'x'"):
        tb.parse_week_rate(text, "w.csv")
    with pytest.raises(TraceError, match=r"w.csv:3: field 'rpm_median' = 40.0: must lie in"):
        tb.parse_week_rate("minute_start,rpm_min,rpm_median,rpm_max\n1,10,20,30\n8,10,40,30\n", "w.csv")
    with pytest.raises(TraceError, match="lacks"):
        tb.parse_week_rate("minute,rpm\n1,2\n", "w.csv")


def test_day_follows_the_shape_at_its_rate_and_keeps_the_sources_rows(week: tb.WeekRate, azure: tb.SourceLog) -> None:
    env = tb.envelope(week, tb.Shape.DAY)
    built = tb.build_on_shape(azure, env, 3.0, seed=7)
    assert len(built) == pytest.approx(3.0 * 86400, rel=0.02)
    assert np.all(np.diff(built.t_s) >= 0) and built.t_s[0] >= 0 and built.t_s[-1] < 86400
    hourly = _per_minute(built.t_s, 1440).reshape(24, 60).sum(axis=1)
    want = env.reshape(24, 60).sum(axis=1)
    ratio = (hourly / hourly.mean()) / (want / want.mean())
    assert np.abs(ratio - 1).max() < 0.06  # the modulation's 15-min blocks move an hour by a few %
    # each request is a source row: its lengths and its second within the minute are the source's
    src = azure.trace.requests
    j = np.arange(0, len(built), 997)
    assert all(built.t_s[x] % 60 == pytest.approx(azure.offset_s[built.index[x]], abs=1e-5) for x in j)
    reqs = list(built.requests())
    assert all((reqs[x].prompt_tokens, reqs[x].output_tokens) == (src[built.index[x]].prompt_tokens,
                                                                 src[built.index[x]].output_tokens) for x in j)


def test_minute_modulation_is_the_sources_not_poisson(week: tb.WeekRate, azure: tb.SourceLog) -> None:
    """The counts over the shape vary minute to minute as the source's do beyond its counting noise."""
    env = tb.envelope(week, tb.Shape.DAY)
    built = tb.build_on_shape(azure, env, 20.0, seed=3)
    per_min = _per_minute(built.t_s, 1440) / (env * 20.0 * 60)
    cv = float(per_min.std())
    poisson = math.sqrt(1.0 / (20.0 * 60))
    assert azure.modulation_cv == pytest.approx(0.094, abs=0.01)  # 0.109 raw, 0.055 of it counting noise
    assert math.hypot(azure.modulation_cv, poisson) * 0.85 < cv < math.hypot(azure.modulation_cv, poisson) * 1.25


def test_the_weeks_own_band_is_reached_at_its_rate(week: tb.WeekRate, azure: tb.SourceLog) -> None:
    """Out of sample: the modulation comes from the 2023 hour; at the 2024 week's rate the spread of the
    minutes inside each 7.2-minute column is the week's digitised band (median (max-min)/median 0.23)."""
    env = tb.envelope(week, tb.Shape.WEEK)[2 * 1440 + 600:2 * 1440 + 900]  # Tuesday 10:00-15:00
    cols = (week.minute_start >= 2 * 1440 + 610) & (week.minute_start < 2 * 1440 + 890)
    real = float(np.median((week.rpm_max[cols] - week.rpm_min[cols]) / week.rpm_median[cols]))
    rpm = float(week.rpm_median[cols].mean())
    built = tb.build_on_shape(azure, env, rpm / 60.0, seed=11)
    per_min = _per_minute(built.t_s, len(env)).astype(float)
    width = 7
    groups = per_min[: len(env) // width * width].reshape(-1, width)
    ours = float(np.median((groups.max(axis=1) - groups.min(axis=1)) / np.median(groups, axis=1)))
    assert 0.15 < real < 0.35
    assert ours == pytest.approx(real, rel=0.35)


def test_conversations_and_prefix_reuse_survive(week: tb.WeekRate, mooncake: tb.SourceLog) -> None:
    env = tb.envelope(week, tb.Shape.DAY)[:360]  # six hours
    built = tb.build_on_shape(mooncake, env, 6.0, seed=5)  # ~2 lanes: conversations thinned whole
    reqs = built.to_trace("day", model="llama-3-8b").requests
    src_share = block_reuse_share(mooncake.trace.requests)
    assert src_share is not None and src_share > 0.3
    assert block_reuse_share(reqs) == pytest.approx(src_share, abs=0.04)
    # coarse timestamps (batches every ~3 s) are spread over their grain
    assert mooncake.grain_s == pytest.approx(3.0, abs=0.01)
    assert len(np.unique(built.t_s)) > 0.99 * len(built)
    # the JSONL written is what the reader reads back
    head = tb.BuiltTrace(built.source, built.t_s[:3000], built.index[:3000], built.namespace[:3000])
    text = "".join(tb.jsonl_chunks(head, chunk=700))
    assert text == "".join(tb.jsonl_requests(head.requests()))
    assert len(set(head.namespace.tolist())) > 1  # some rows moved to other lanes' or passes' block ids
    back = parse_trace_text(text, "built.jsonl")
    t0 = head.t_s[0]
    for a, b in zip(back.requests, head.requests(), strict=True):
        assert (a.prompt_tokens, a.output_tokens, a.blocks) == (b.prompt_tokens, b.output_tokens, b.blocks)
        assert a.t_s == pytest.approx(b.t_s - t0, abs=2e-6)


def test_seeds_reproduce(week: tb.WeekRate, azure: tb.SourceLog) -> None:
    env = tb.envelope(week, tb.Shape.DAY)[:120]
    a, b, c = (tb.build_on_shape(azure, env, 4.0, seed=s) for s in (1, 1, 2))
    assert np.array_equal(a.t_s, b.t_s) and np.array_equal(a.index, b.index)
    assert not (len(a) == len(c) and np.array_equal(a.t_s, c.t_s))
    assert tb.coding_hour(tb.CodingHour(duration_s=600), 4) == tb.coding_hour(tb.CodingHour(duration_s=600), 4)
    assert tb.coding_hour(tb.CodingHour(duration_s=600), 4) != tb.coding_hour(tb.CodingHour(duration_s=600), 5)


@pytest.mark.parametrize("target", [2.0, 4.1, 6.0])
def test_coding_hour_reaches_its_burstiness(target: float) -> None:
    p = tb.CodingHour(peak_to_mean_60s=target)
    intensity = tb.coding_intensity(p, np.random.default_rng(0))
    binned = intensity.reshape(60, 60).mean(axis=1)
    assert binned.max() / intensity.mean() == pytest.approx(target, rel=1e-9)
    assert intensity.mean() == pytest.approx(p.mean_rps, rel=1e-9)
    peaks = [tb.peak_to_mean(np.array([r.t_s for r in tb.coding_hour(p, s).requests]), 60.0, 3600.0)
             for s in range(8)]
    assert np.mean(peaks) == pytest.approx(target, rel=0.1)
    assert all(abs(x / target - 1) < 0.25 for x in peaks)


def test_coding_hour_lengths_are_a_coding_services() -> None:
    p = tb.CodingHour()
    tr = tb.coding_hour(p, 0)
    prompt = np.array([r.prompt_tokens for r in tr.requests])
    out = np.array([r.output_tokens for r in tr.requests])
    assert len(tr) == pytest.approx(p.mean_rps * 3600, rel=0.05)
    assert 1800 < prompt.mean() < 2500 and 6500 < np.percentile(prompt, 99)
    assert prompt.max() <= p.context_tokens - p.max_output_tokens  # prompt + max_tokens fit the context
    assert 20 < out.mean() < 36 and np.median(out) < out.mean() and out.max() <= p.max_output_tokens
    with pytest.raises(ValueError, match="peak_to_mean_60s"):
        tb.coding_hour(tb.CodingHour(peak_to_mean_60s=0.5), 0)


def test_prometheus_series_to_trace_keeps_the_bucket_bounds_and_hit_share() -> None:
    step = 60.0
    rates = [(600.0 + step * i, 5.0 if i < 30 else 10.0) for i in range(60)]
    # prompts: 30% in (100, 200], 70% in (500, 1000]; mean 600 -> placed inside those buckets
    prompt = ((100.0, 0.0), (200.0, 3.0), (500.0, 3.0), (1000.0, 10.0), (math.inf, 10.0))
    output = ((10.0, 0.0), (20.0, 10.0), (math.inf, 10.0))
    windows = [LengthWindow(600.0 + 1800.0, prompt, output, 600.0, 15.0),
               LengthWindow(600.0 + 3600.0, None, None, 2000.0, 100.0)]  # a window with counters only
    built = trace_from_series(rates, step, 600.0, windows, [(t, 0.4) for t, _ in rates], seed=1)
    tr = built.trace
    assert len(tr) == pytest.approx(5 * 1800 + 10 * 1800, rel=0.03)
    first = [r for r in tr.requests if r.t_s < 1800]
    p = np.array([r.prompt_tokens for r in first])
    assert np.all(((p > 100) & (p <= 200)) | ((p > 500) & (p <= 1000)))
    assert p.mean() == pytest.approx(600, rel=0.03) and ((p <= 200).mean()) == pytest.approx(0.3, abs=0.03)
    assert {r.prompt_tokens for r in tr.requests if r.t_s >= 1800 + 1} == {2000}
    assert block_reuse_share(tr.requests) == pytest.approx(0.4, abs=0.03)
    rep = built.report
    assert rep["prompt"]["windows_without_histogram"] == 1
    assert any("certainly in its bucket" in line for line in built.lines())
    assert trace_from_series(rates, step, 600.0, windows, None, seed=1).trace == \
        trace_from_series(rates, step, 600.0, windows, None, seed=1).trace
