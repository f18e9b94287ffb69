"""`fleetplan trace build` and `fleetplan trace coding` end to end: the file they write is what
`fleetplan evaluate --trace` reads, at the rate asked, with its side file; bad arguments are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fleetplan.harness.cli import main
from fleetplan.sim.trace_build import peak_to_mean
from fleetplan.sim.traces import read_trace


def test_build_a_day_at_a_requests_per_day(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "day.jsonl"
    assert main(["trace", "build", "--shape", "day", "--requests-per-day", "30000", "--source", "mooncake",
                 "--seed", "4", "--out", str(out)]) == 0
    tr = read_trace(out)
    assert len(tr) == pytest.approx(30_000, rel=0.03)
    assert tr.duration_s == pytest.approx(86400, rel=0.001)
    assert all(r.blocks for r in tr.requests[:100])  # mooncake's prefix blocks travel with the rows
    info = json.loads((tmp_path / "day.jsonl.info.json").read_text())
    assert info["shape"] == "day" and info["day"] == 2 and info["requests_per_day"] == len(tr)
    assert f"{out}: {len(tr)} requests over 1 day(s)" in capsys.readouterr().out


def test_a_day_with_a_coding_services_swing(tmp_path: Path) -> None:
    out = tmp_path / "deep.jsonl"
    assert main(["trace", "build", "--shape", "day", "--requests-per-day", "40000", "--swing", "10", "--seed", "3",
                 "--out", str(out)]) == 0
    t = np.array([r.t_s for r in read_trace(out).requests])
    hourly = np.bincount((t // 3600).astype(int), minlength=24)[:24]
    assert hourly.max() / hourly.min() == pytest.approx(10.0, rel=0.25)  # the conversation day's own is ~2
    assert json.loads((tmp_path / "deep.jsonl.info.json").read_text())["swing"] == pytest.approx(10.0)


def test_same_seed_same_file(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        assert main(["trace", "build", "--shape", "day", "--rate-scale", "0.2", "--seed", "9", "--out", str(out)]) == 0
    assert a.read_bytes() == b.read_bytes()

def test_coding_hour_file(tmp_path: Path) -> None:
    out = tmp_path / "coding.jsonl"
    assert main(["trace", "coding", "--mean-rps", "4", "--peak-to-mean", "3", "--seed", "2", "--out", str(out)]) == 0
    tr = read_trace(out)
    t = np.array([r.t_s for r in tr.requests])
    assert len(tr) == pytest.approx(4 * 3600, rel=0.06)
    assert peak_to_mean(t, 60.0, 3600.0) == pytest.approx(3.0, rel=0.25)


def test_bad_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    assert main(["trace", "build", "--shape", "day", "--rate-scale", "0", "--seed", "1", "--out", str(out)]) == 2
    assert "--rate-scale must be > 0, got 0.0" in capsys.readouterr().err
    assert main(["trace", "build", "--shape", "day", "--day", "9", "--seed", "1", "--out", str(out)]) == 2
    assert "day must be 0 (Sunday) to 6, got 9" in capsys.readouterr().err
    assert main(["trace", "build", "--shape", "day", "--swing", "0.5", "--seed", "1", "--out", str(out)]) == 2
    assert "--swing must be >= 1 (a peak-to-trough ratio of hourly means), got 0.5" in capsys.readouterr().err
    assert main(["trace", "build", "--shape", "week", "--source", str(tmp_path / "none.csv"), "--seed", "1",
                 "--out", str(out)]) == 2
    assert "none.csv: cannot read trace" in capsys.readouterr().err
    assert not out.exists()


def test_the_committed_coding_hour_is_the_generators(tmp_path: Path, shared_data: Path) -> None:
    """data/traces/coding_like_hour.jsonl is `fleetplan trace coding --seed 0` (data/SOURCES.md)."""
    out = tmp_path / "coding.jsonl"
    assert main(["trace", "coding", "--seed", "0", "--out", str(out)]) == 0
    assert out.read_bytes() == (shared_data / "traces" / "coding_like_hour.jsonl").read_bytes()


def test_prometheus_times() -> None:
    from fleetplan.harness.cli.trace_prom import parse_time

    now = 1_800_000_000.0
    assert parse_time("now", now) == now and parse_time("now-7d", now) == now - 7 * 86400
    assert parse_time("now-90m", now) == now - 5400 and parse_time("1700000000.5", now) == 1_700_000_000.5
    assert parse_time("2024-05-12T00:00:00Z", now) == parse_time("2024-05-12 00:00:00", now) == 1_715_472_000
    assert parse_time("2024-05-12T02:00:00+02:00", now) == 1_715_472_000
    with pytest.raises(ValueError, match="time 'yesterday'"):
        parse_time("yesterday", now)
