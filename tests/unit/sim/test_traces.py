"""Trace readers (Azure CSV, Mooncake JSONL, BurstGPT CSV) and day shaping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetplan.sim.traces import (
    Trace,
    TraceError,
    TraceFormat,
    TraceRequest,
    iter_rates,
    parse_trace_text,
    read_trace,
    repeat_days,
    reshape,
    rotated,
    shape_day,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_azure_csv_sorted_from_zero_with_7_digit_fractions() -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:51.2224670,879,55\n"
    )
    tr = parse_trace_text(text, "az.csv", model="llama-3.1-8b")
    assert tr.format is TraceFormat.AZURE
    assert [r.prompt_tokens for r in tr.requests] == [374, 396, 879]
    assert tr.requests[0].t_s == 0.0
    assert tr.requests[1].t_s == pytest.approx(4.314579, abs=1e-5)
    assert tr.requests[2].t_s == pytest.approx(4.541877, abs=1e-5)
    assert all(r.model == "llama-3.1-8b" for r in tr.requests)


def test_mooncake_jsonl_ms_timestamps() -> None:
    text = (
        '{"timestamp": 1500, "input_length": 10, "output_length": 3, "hash_ids": [0]}\n'
        "\n"
        '{"timestamp": 500, "input_length": 20, "output_length": 4, "hash_ids": [1]}\n'
    )
    tr = parse_trace_text(text, "m.jsonl")
    assert tr.format is TraceFormat.MOONCAKE
    assert tr.requests == (TraceRequest(0.0, 20, 4, None, (1,)), TraceRequest(1.0, 10, 3, None, (0,)))


def test_burstgpt_fixture_skips_failed_and_keeps_models() -> None:
    tr = read_trace(FIXTURES / "burstgpt_sample.csv", model="ignored-for-burstgpt")
    assert tr.format is TraceFormat.BURSTGPT
    assert len(tr) == 6 and tr.skipped == 1
    assert "burstgpt_sample.csv:3" in tr.skip_reasons[0]
    assert tr.models() == ("ChatGPT", "GPT-4")
    assert tr.requests[0] == TraceRequest(0.0, 300, 40, "ChatGPT")
    assert [r.t_s for r in tr.requests] == sorted(r.t_s for r in tr.requests)
    one = tr.as_single_model("llama")
    assert one.models() == ("llama",) and len(one) == 6


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12x,5\n",
         "bad.csv:2: field 'ContextTokens' = '12x': not a number"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12,5\nyesterday,1,1\n",
         "bad.csv:3: field 'TIMESTAMP' = 'yesterday'"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12,-5\n",
         "bad.csv:2: field 'GeneratedTokens' = '-5': must be >= 1"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12\n",
         "bad.csv:2: field 'GeneratedTokens' = None: missing"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 3}\n{"timestamp": 2, "input_length": 1.5, "output_length": 3}\n',
         "bad.csv:2: field 'input_length' = 1.5: not a whole token count"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 3}\n{oops\n', "bad.csv:2: not a JSON object"),
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,,5,5,10,x\n",
         "bad.csv:2: field 'Model' = '': missing"),
        ("time,prompt,output\n1,2,3\n", "bad.csv:1: unknown trace header"),
        ("", "bad.csv: empty trace"),
    ],
)
def test_bad_rows_name_file_line_field_value(text: str, needle: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace_text(text, "bad.csv")
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.csv: cannot read trace"):
        read_trace(tmp_path / "nope.csv")


def _uniform(n: int, span_s: float) -> Trace:
    reqs = tuple(TraceRequest(i * span_s / n, 100 + i % 7, 10 + i % 5) for i in range(n))
    return Trace("u", TraceFormat.AZURE, reqs)


def test_shape_day_keeps_lengths_and_imposes_the_envelope() -> None:
    src = _uniform(3600, 3600.0)  # 1 rps for an hour
    day = shape_day(src, 24 * 3600.0, rate_scale=1.0)
    assert day.requests[-1].t_s < 24 * 3600.0
    assert len(day) == pytest.approx(24 * 3600, rel=0.01)  # mean rate kept: f has mean 1
    # lengths come from the trace, in order, tiled
    assert [(r.prompt_tokens, r.output_tokens) for r in day.requests[:3600]] == [
        (r.prompt_tokens, r.output_tokens) for r in src.requests
    ]
    hourly = iter_rates(day.requests, 3600.0, 24 * 3600.0)
    assert hourly[0] < 0.6 and hourly[11] > 1.4 and hourly[12] > 1.4  # trough at midnight, peak at noon
    assert hourly.max() / hourly.min() == pytest.approx(3.0, rel=0.1)


def test_rate_scale_tiles_and_speeds_up_flat() -> None:
    src = _uniform(600, 600.0)
    fast = reshape(src, duration_s=600.0, rate_scale=3.0)
    assert len(fast) == pytest.approx(1800, abs=3)
    rates = iter_rates(fast.requests, 60.0, 600.0)
    assert np.allclose(rates, 3.0, atol=0.1)
    assert [r.t_s for r in fast.requests] == sorted(r.t_s for r in fast.requests)


def test_real_traces_read(shared_data: Path) -> None:
    az = read_trace(shared_data / "traces" / "azure_llm_conv_2023.csv")
    mc = read_trace(shared_data / "traces" / "mooncake_conversation.jsonl")
    assert len(az) == 19366 and az.format is TraceFormat.AZURE
    assert len(mc) == 12031 and mc.format is TraceFormat.MOONCAKE
    assert 3400 < az.duration_s < 3600 and 3400 < mc.duration_s < 3600


def test_repeat_days_lays_copies_back_to_back_and_cuts() -> None:
    day = Trace("d", TraceFormat.MOONCAKE, (TraceRequest(0.0, 5, 2, "m", (1, 2)), TraceRequest(30.5, 7, 3, "m")))
    week = repeat_days(day, 3, 60.0)
    assert [r.t_s for r in week.requests] == [0.0, 30.5, 60.0, 90.5, 120.0, 150.5]
    assert week.requests[2] == TraceRequest(60.0, 5, 2, "m", (1, 2))  # lengths, model and blocks kept
    assert week.source == "d" and week.format is TraceFormat.MOONCAKE
    cut = repeat_days(day, 3, 60.0, end_s=90.5)  # strictly before end_s
    assert [r.t_s for r in cut.requests] == [0.0, 30.5, 60.0]
    # the same floats as adding k x day_s to each request's time
    odd = Trace("o", TraceFormat.AZURE, tuple(TraceRequest(t, 1, 1) for t in (0.1, 0.7, 86399.3)))
    assert [r.t_s for r in repeat_days(odd, 7, 86400.0).requests] == [
        r.t_s + k * 86400.0 for k in range(7) for r in odd.requests]
    with pytest.raises(ValueError, match="before day_s"):
        repeat_days(day, 2, 30.0)
    with pytest.raises(ValueError, match="days must be >= 1"):
        repeat_days(day, 0, 60.0)


def test_as_single_model_relabels_and_keeps_a_labelled_trace() -> None:
    tr = Trace("t", TraceFormat.AZURE, (TraceRequest(0.0, 5, 2, "a", (3,)), TraceRequest(1.0, 7, 3, None)))
    one = tr.as_single_model("a")
    assert one.requests == (TraceRequest(0.0, 5, 2, "a", (3,)), TraceRequest(1.0, 7, 3, "a"))
    assert one.as_single_model("a") is one  # already labelled: not copied


def test_rotated_keeps_the_requests_and_moves_their_phase_against_the_clock() -> None:
    reqs = tuple(TraceRequest(t, 100 + i, 10 + i, None, (i,)) for i, t in enumerate((0.0, 0.7, 2.9, 3.0, 5.2, 8.0)))
    trace = Trace("t.csv", TraceFormat.AZURE, reqs)
    out = rotated(trace, 2.0)  # the tile period: 8.0 + 8.0 / 5 = 9.6 s; 8.0 wraps to 8.0 + 2.0 - 9.6 = 0.4
    assert sorted((r.prompt_tokens, r.output_tokens, r.blocks) for r in out.requests) == \
        sorted((r.prompt_tokens, r.output_tokens, r.blocks) for r in reqs)
    assert [r.prompt_tokens for r in out.requests] == [105, 100, 101, 102, 103, 104]  # the last one first
    ts = [r.t_s for r in out.requests]
    assert ts[0] == 0.0 and ts == sorted(ts)
    # the others keep their spacing, 2.0 s later, less the 0.4 s the first one now starts at
    assert [round(t, 9) for t in ts[1:]] == [1.6, 2.3, 4.5, 4.6, 6.8]
    assert rotated(trace, 0.0) is trace
    assert out.duration_s <= trace.duration_s + 1.6
