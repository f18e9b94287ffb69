"""The commands as a user runs them: sim-engine, replay-load and bench-engine as processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetplan.models.names import Engine, GpuType
from fleetplan.models.readers import read_benchmark

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleetplan", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serving(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """A sim-engine process, once it says it listens; SIGTERM at the end (it must exit 0), else killed."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "listening on http://127.0.0.1:" in line, line
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    port = _free_port()
    with _serving(_cli("sim-engine", "--persona", "trtllm", "--model", "llama-3.1-8b", "--gpu", "H100 SXM5",
                       "--tp", "1", "--port", str(port), "--time-scale", "20", "--startup-s", "0",
                       "--min-chunk-interval-ms", "10", "--replica-id", "host-a-0", "--gpu-indices", "0")):
        yield f"http://127.0.0.1:{port}"


def test_replay_load_writes_per_request_results(engine_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{i:02d}.5000000,{300 + 10 * i},{20 + i}" for i in range(40)]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "results.jsonl"
    run = subprocess.run(
        _cli("replay-load", "--trace", str(trace), "--target", engine_url, "--speed", "20", "--duration-s", "29.9",
             "--out", str(out)),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 30  # --duration-s bounds the replay (arrivals at 0..29 s)
    assert all(r["outcome"] == "ok" for r in lines)
    assert [r["output_tokens"] for r in lines] == [20 + i for i in range(30)]
    assert [r["prompt_tokens"] for r in lines] == [300 + 10 * i for i in range(30)]
    assert all(r["ttft_s"] > 0 and r["itl_mean_s"] > 0 for r in lines)
    summary = json.loads(run.stdout[run.stdout.index("{"):])
    assert summary["ok"] == 30 and summary["ttft_p99_ms"] > 0


def test_replay_load_refuses_a_remote_target(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:00,10,10\n")
    run = subprocess.run(_cli("replay-load", "--trace", str(trace), "--target", "http://192.0.2.1:80"),
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "not a loopback address" in run.stderr


def test_bench_engine_files_are_read_by_models(engine_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    run = subprocess.run(
        _cli("bench-engine", "--target", engine_url, "--isl", "200", "--osl", "32", "--concurrency", "1,4",
             "--num-prompts", "12", "--time-scale", "20", "--out", str(out)),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    files = sorted(out.glob("*.json"))
    assert [f.name for f in files] == ["llama318b_trtllm_h100_tp1_bf16_isl200_osl32_conc1.json",
                                       "llama318b_trtllm_h100_tp1_bf16_isl200_osl32_conc4.json"]
    for f, conc in zip(files, (1, 4), strict=True):
        (point,) = read_benchmark(f.read_text(), str(f)).points
        assert (point.engine, point.gpu, point.tp, point.concurrency) == (Engine.TRTLLM, GpuType.H100, 1, conc)
        assert point.isl == 200 and point.osl == 32
        assert point.ttft_mean_ms is not None and 10 < point.ttft_mean_ms < 1000  # simulated ms


def test_sim_engine_rejects_an_unknown_model() -> None:
    run = subprocess.run(_cli("sim-engine", "--persona", "vllm", "--model", "mystery-7b", "--gpu", "h100",
                              "--port", "1"), cwd=REPO, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "unknown model 'mystery-7b'" in run.stderr


def test_engine_dir_without_an_engine_is_refused_with_one_built_it_serves(tmp_path: Path) -> None:
    """The lab's trtllm stand-in serves from {engine_dir} as trtllm-serve does: nothing there, no engine."""
    engine_dir = tmp_path / "llama-3.1-8b-h100-tp1-bf16"
    engine_dir.mkdir()

    def argv(port: int) -> list[str]:
        return _cli("sim-engine", "--persona", "trtllm", "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "1",
                    "--port", str(port), "--time-scale", "20", "--startup-s", "0", "--engine-dir", str(engine_dir))

    empty = subprocess.run(argv(_free_port()), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert empty.returncode == 1
    assert f"--engine-dir {engine_dir}: no engine there" in empty.stderr
    (engine_dir / "rank0.engine").write_text("engine")
    with _serving(argv(_free_port())) as proc:
        assert proc.poll() is None  # an engine there: it serves
