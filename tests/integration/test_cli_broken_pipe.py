"""`fleetplan ... | head`: a reader that closes the pipe early ends the command quietly.

Python's advice (docs.python.org/3/library/signal.html, "Note on SIGPIPE"): catch BrokenPipeError
once at the entry point, point stdout at /dev/null so the final flush cannot fail again, and exit
non-zero. fleetplan exits 141 (128 + SIGPIPE, what a shell reports for `yes | head`).

Each command runs as a real process whose stdout is a pipe the test has already closed, so the first
write (or the flush at exit) fails with EPIPE, deterministically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b"


def _report() -> dict[str, object]:
    """A report API document with one model explained (the fields render_explain prints)."""
    config = {"replicas": 2, "engine": "vllm", "gpu": "h100", "tp": 1, "precision": "bf16",
              "capacity_per_replica_rps": 3.0, "binding": "ttft", "load_per_replica_rps": 1.0,
              "predicted_ttft_p99_ms": 400.0, "predicted_itl_p99_ms": 20.0, "usd_h": 6.0}
    model = {"model": MODEL, "configs": [config], "observed_rps": 2.0, "forecast_rps": 2.0, "demand_rps": 2.0,
             "headroom": 0.2, "required_rps": 2.4, "capacity_rps": 6.0, "target_capacity_rps": 6.0,
             "unmet_rps": 0.0, "slo_ttft_p99_ms": 1000.0, "slo_itl_p99_ms": 50.0, "usd_h": 12.0,
             "notes": [f"note {i}: " + "x" * 200 for i in range(500)]}  # well over a pipe buffer (64 KiB)
    return {"plan": {"cycle_id": 7, "explanation": {"models": [model]}, "observation": {}, "plan": {"replicas": []}}}


@pytest.fixture
def report_url() -> Iterator[str]:
    body = json.dumps(_report()).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _run_into_closed_pipe(*args: str) -> tuple[int, str]:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the command writes anything
    try:
        proc = subprocess.run([sys.executable, "-m", "fleetplan", *args], stdout=write_fd,
                              stderr=subprocess.PIPE, cwd=REPO, timeout=60, check=False)
    finally:
        os.close(write_fd)
    return proc.returncode, proc.stderr.decode(errors="replace")


@pytest.mark.parametrize("json_flag", [(), ("--json",)], ids=["text", "json"])
def test_explain_into_a_closed_pipe_exits_quietly(report_url: str, json_flag: tuple[str, ...]) -> None:
    code, stderr = _run_into_closed_pipe("explain", MODEL, "--url", report_url, *json_flag)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert code == 141, (code, stderr)


def test_explain_into_an_open_pipe_prints_everything(report_url: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "fleetplan", "explain", MODEL, "--url", report_url],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{MODEL}: 2 replicas (cycle 7)")
    assert "note 499: " + "x" * 200 + "\n" in proc.stdout  # the last of 500 notes: nothing cut
    assert proc.stdout.endswith("\n")
