"""`fleetplan trace from-prometheus` against a REAL Prometheus holding four hours of a vLLM replica's
metrics, backfilled with `promtool tsdb create-blocks-from openmetrics` from counters whose rates,
length buckets and prefix hits are known: the trace has the hours' arrivals, lengths inside the
buckets with the histogram's mean, and the counters' hit share; the uncertainty is printed and
written beside it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fleetplan.sim.traces import block_reuse_share, read_trace
from tests.integration.test_observe_prometheus import free_port, start_prometheus, stop_prometheus

pytestmark = pytest.mark.integration

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
SCRAPE_S = 15
HOURLY_RPS = (2.0, 6.0, 4.0, 8.0)
# requests per prompt bucket (vLLM's 1-2-5 edges): 20% in (200, 500], 50% in (500, 1000], 30% in (1000, 2000]
PROMPT_EDGES = (100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
PROMPT_SHARE = (0.0, 0.0, 0.2, 0.5, 0.3, 0.0)
PROMPT_MEAN = 900.0
GEN_EDGES = (50.0, 100.0, 200.0, 500.0)
GEN_SHARE = (0.0, 0.0, 1.0, 0.0)
GEN_MEAN = 150.0
HIT_SHARE = 0.3
LABELS = 'model_name="Llama-3-8B",replica="r1",job="engines"'


def openmetrics(start_s: int, end_s: int) -> str:
    """The replica's series every SCRAPE_S from start to end, families one after the other."""
    times = list(range(start_s, end_s + 1, SCRAPE_S))
    done = []
    n = 0.0
    for t in times:
        done.append(n)
        n += HOURLY_RPS[min(len(HOURLY_RPS) - 1, (t - start_s) // 3600)] * SCRAPE_S
    out: list[str] = []

    def counter(name: str, per_request: float) -> None:
        out.append(f"# TYPE {name} counter")
        out.extend(f"{name}_total{{{LABELS}}} {c * per_request} {t}" for t, c in zip(times, done, strict=True))

    def histogram(name: str, edges: tuple[float, ...], share: tuple[float, ...], mean: float) -> None:
        out.append(f"# TYPE {name} histogram")
        for t, c in zip(times, done, strict=True):
            cum = 0.0
            for le, s in zip(edges, share, strict=True):
                cum += s
                out.append(f'{name}_bucket{{{LABELS},le="{le:g}"}} {c * cum} {t}')
            out.append(f'{name}_bucket{{{LABELS},le="+Inf"}} {c} {t}')
            out.append(f"{name}_sum{{{LABELS}}} {c * mean} {t}")
            out.append(f"{name}_count{{{LABELS}}} {c} {t}")

    counter("vllm:request_success", 1.0)
    counter("vllm:prompt_tokens", PROMPT_MEAN)
    counter("vllm:generation_tokens", GEN_MEAN)
    counter("vllm:prefix_cache_queries", PROMPT_MEAN)
    counter("vllm:prefix_cache_hits", PROMPT_MEAN * HIT_SHARE)
    for gauge, value in (("vllm:num_requests_running", 5), ("vllm:num_requests_waiting", 0)):
        out.append(f"# TYPE {gauge} gauge")
        out.extend(f"{gauge}{{{LABELS}}} {value} {t}" for t in times)
    histogram("vllm:request_prompt_tokens", PROMPT_EDGES, PROMPT_SHARE, PROMPT_MEAN)
    histogram("vllm:request_generation_tokens", GEN_EDGES, GEN_SHARE, GEN_MEAN)
    out.append("# EOF")
    return "\n".join(out) + "\n"


@pytest.fixture
def backfilled(tmp_path: Path) -> Iterator[tuple[str, int, int]]:
    if not Path(PROMTOOL).exists():
        pytest.skip("promtool not installed")
    now = int(time.time())
    end = (now - 3 * 3600) // 3600 * 3600  # whole hours, older than the head block
    start = end - len(HOURLY_RPS) * 3600
    om = tmp_path / "replica.om"
    om.write_text(openmetrics(start, end))
    tsdb = tmp_path / "tsdb"
    subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om), str(tsdb)], check=True,
                   capture_output=True, timeout=120)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global: {scrape_interval: 15s}\nscrape_configs: []\n")
    port = free_port()
    proc = start_prometheus(cfg, tsdb, port)
    try:
        yield f"http://127.0.0.1:{port}", start, end
    finally:
        stop_prometheus(proc)


def test_from_prometheus_rebuilds_the_hours(backfilled: tuple[str, int, int], tmp_path: Path) -> None:
    url, start, end = backfilled
    out = tmp_path / "week.jsonl"
    run = subprocess.run([sys.executable, "-m", "fleetplan", "trace", "from-prometheus", "--prometheus", url,
                          "--start", str(start), "--end", str(end), "--model", "llama-3-8b", "--out", str(out),
                          "--step", "60", "--length-window-s", "5400", "--seed", "3"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    print(run.stdout)
    tr = read_trace(out)
    t = np.array([r.t_s for r in tr.requests])
    hourly = np.bincount((t // 3600).astype(int), minlength=4)[:4]  # 2.67 length windows: the last partial
    for got, rps in zip(hourly, HOURLY_RPS, strict=True):
        assert got == pytest.approx(rps * 3600, rel=0.05)
    p = np.array([r.prompt_tokens for r in tr.requests])
    o = np.array([r.output_tokens for r in tr.requests])
    assert np.all((p > 200) & (p <= 2000)) and np.all((o > 100) & (o <= 200))
    assert ((p <= 500).mean(), (p > 1000).mean()) == pytest.approx((0.2, 0.3), abs=0.02)
    assert p.mean() == pytest.approx(PROMPT_MEAN, rel=0.03) and o.mean() == pytest.approx(GEN_MEAN, rel=0.03)
    assert block_reuse_share(tr.requests) == pytest.approx(HIT_SHARE, abs=0.03)
    info = json.loads(out.with_name(out.name + ".info.json").read_text())
    assert info["prompt"]["mean_source"] == "histogram _sum/_count"
    p99 = next(q for q in info["prompt"]["quantiles"] if q["q"] == 0.99)
    assert p99["bucket"] == [1000.0, 2000.0] and 1000 < p99["tokens"] <= 2000
    assert info["prefix_hit_share_mean"] == pytest.approx(HIT_SHARE, abs=0.01)
    assert "certainly in its bucket (1000, 2000]" in run.stdout  # the uncertainty is printed
    assert math.isclose(info["step_s"], 60.0) and info["steps_without_rate"] == 0


def test_from_prometheus_names_a_model_it_does_not_hold(backfilled: tuple[str, int, int], tmp_path: Path) -> None:
    url, start, end = backfilled
    run = subprocess.run([sys.executable, "-m", "fleetplan", "trace", "from-prometheus", "--prometheus", url,
                          "--start", str(start), "--end", str(end), "--model", "qwen-7b", "--out",
                          str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "no request rate for model 'qwen-7b'" in run.stderr
    assert not (tmp_path / "x.jsonl").exists()
