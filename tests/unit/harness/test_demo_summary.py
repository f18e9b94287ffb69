"""The demo's summary.json (fleetplan/harness/demo_summary.py) on a tiny day: the live figures by the
SLO's own definition, a real (short) replay of the same day, policy and profiles for fleetplan and the
baselines, and the recorded `fleetplan evaluate` command reproducing it."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fleetplan.harness.cli import main as cli_main
from fleetplan.harness.demo import DEMO_MODEL_70B, day_requests, demo_policy
from fleetplan.harness.demo_summary import (
    BY_ENGINE_KEY,
    POLICY_FILE,
    PROFILES_FILE,
    REPLAY_POLICIES,
    SUMMARY_FILE,
    TRACE_FILE,
    LiveGpuMeter,
    build_summary,
    graduation_figures,
    live_figures,
    render_summary,
    request_meets_slo,
    run_replay,
    write_summary,
    write_trace,
)
from fleetplan.harness.rig_tools import PROFILES  # the lab's profiles (70B TP4, vLLM + TRT-LLM)
from fleetplan.sim.traces import read_trace

TTFT_MS, ITL_MS = 1000.0, 30.0


def _result(outcome: str = "ok", ttft_ms: float | None = 200.0, itl_ms: float | None = 20.0) -> Any:
    return SimpleNamespace(outcome=outcome, ttft_s=None if ttft_ms is None else ttft_ms / 1000.0,
                           itl_mean_s=None if itl_ms is None else itl_ms / 1000.0)


def test_a_request_meets_the_slo_by_its_own_definition() -> None:
    assert request_meets_slo(_result(), TTFT_MS, ITL_MS)
    assert request_meets_slo(_result(ttft_ms=1000.0, itl_ms=30.0), TTFT_MS, ITL_MS)  # <= targets
    assert not request_meets_slo(_result(ttft_ms=1000.5), TTFT_MS, ITL_MS)
    assert not request_meets_slo(_result(itl_ms=30.1), TTFT_MS, ITL_MS)  # per-request ITL over the target
    assert request_meets_slo(_result(itl_ms=None), TTFT_MS, ITL_MS)  # a one-token output: ITL 0
    assert not request_meets_slo(_result(ttft_ms=None), TTFT_MS, ITL_MS)
    assert not request_meets_slo(_result("http_503"), TTFT_MS, ITL_MS)  # failed: a miss
    assert not request_meets_slo(_result("incomplete"), TTFT_MS, ITL_MS)


def test_live_gpu_meter_clips_to_the_day_and_splits_engines() -> None:
    m = LiveGpuMeter(t_from_s=100.0, t_to_s=3700.0)
    m.sample(0.0, {"vllm": 4}, 0)
    m.sample(1900.0, {"vllm": 4, "trtllm": 4}, 4)  # 4 vLLM GPUs counted from 100 to 1900 s
    m.sample(5000.0, {}, 0)  # both counted from 1900 to 3700 s (clipped), the build's 4 GPUs too
    by = m.gpu_hours_by_engine()
    assert by["vllm"] == pytest.approx(4 * 3600 / 3600)
    assert by["trtllm"] == pytest.approx((4 + 4) * 1800 / 3600)
    assert m.gpu_hours() == pytest.approx(8.0)
    live = live_figures([_result(), _result(itl_ms=45.0), _result("timeout", None, None), _result(itl_ms=None)],
                        ttft_slo_ms=TTFT_MS, itl_slo_ms=ITL_MS, meter=m, price_usd_h=3.0)
    assert (live["requests"], live["served"], live["failed"], live["slo_met"]) == (4, 3, 1, 2)
    assert live["slo_attainment"] == 0.5
    assert live["gpu_hours"] == pytest.approx(8.0) and live["cost_usd"] == pytest.approx(24.0)
    assert live["build_gpu_hours"] == pytest.approx(2.0)
    assert live["slo_p99_met"] is False  # the p99 per-request ITL (45 ms) is over 30 ms
    # the graduation's steps as the records showed them: build and TRT-LLM replica first seen at 1900 s,
    # no vLLM replica at 5000 s
    assert live["graduation"] == {"build_started_s": 1900.0, "trtllm_serving_s": 1900.0, "vllm_gone_s": 5000.0}


def test_live_gpu_meter_records_each_graduation_step_once() -> None:
    m = LiveGpuMeter(t_from_s=0.0, t_to_s=4000.0)
    m.sample(0.0, {"vllm": 4}, 0)
    m.sample(100.0, {"vllm": 8}, 4)  # the build starts
    m.sample(200.0, {"vllm": 8}, 4)
    m.sample(700.0, {"vllm": 8, "trtllm": 4}, 0)  # the engine serves beside vLLM
    m.sample(900.0, {"trtllm": 8}, 0)  # the swap is done
    m.sample(1000.0, {"vllm": 4, "trtllm": 8}, 4)  # vLLM back and a second build: the first steps stay
    m.sample(1100.0, {"trtllm": 8}, 0)
    assert (m.build_started_s, m.trtllm_serving_s, m.vllm_gone_s) == (100.0, 700.0, 900.0)
    never = LiveGpuMeter(t_from_s=0.0, t_to_s=100.0)
    never.sample(0.0, {"vllm": 4}, 0)
    never.sample(50.0, {}, 0)  # no vLLM replica, but no TRT-LLM one either: not a graduation
    assert (never.build_started_s, never.trtllm_serving_s, never.vllm_gone_s) == (None, None, None)


def test_graduation_figures_and_line() -> None:
    live = {"gpu_hours": 8.0, BY_ENGINE_KEY: {"vllm": 2.0, "trtllm": 6.0},
            "graduation": {"build_started_s": 600.0, "trtllm_serving_s": 1300.0, "vllm_gone_s": 2100.0}}
    pols = {"fleetplan": {"gpu_hours": 8.4}, "fleetplan-vllm-only": {"gpu_hours": 9.5}}
    g = graduation_figures(live, pols)
    assert g["live_trtllm_share"] == 0.75
    assert g["live_saved_gpu_hours"] == pytest.approx(1.5) and g["replay_saved_gpu_hours"] == pytest.approx(1.1)
    line = render_summary({"graduation": g, "replay": {}})
    assert "engine build started t = 600 s, first replica serving t = 1300 s, no vLLM replica left t = 2100 s" in line
    assert "carried 75%" in line and "(9.50 GPU-h replayed): +1.50 live, +1.10 replayed GPU-h" in line
    # no build live: says so, and claims no saving from the live run's distance to the replay
    none = graduation_figures({"gpu_hours": 5.0, BY_ENGINE_KEY: {"vllm": 5.0}, "graduation": {
        "build_started_s": None, "trtllm_serving_s": None, "vllm_gone_s": None}},
        {"fleetplan": {"gpu_hours": 5.2}, "fleetplan-vllm-only": {"gpu_hours": 5.2}})
    assert none["live_trtllm_share"] == 0.0 and none["live_saved_gpu_hours"] == pytest.approx(0.2)
    line = render_summary({"graduation": none, "replay": {}})
    assert "graduation to TensorRT-LLM (live): not on this day" in line and "saved" not in line


@pytest.mark.usefixtures("ground_truth_once")  # the recorded command reuses the capacities (tests/conftest.py)
def test_summary_of_a_tiny_day_with_a_real_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = DEMO_MODEL_70B
    reqs = day_requests(1200.0, base_rps=0.05, peak_rps=0.6, isl=512, osl=128, model=model, seed=3)
    write_trace(tmp_path / TRACE_FILE, reqs)
    trace = read_trace(tmp_path / TRACE_FILE)  # what `fleetplan evaluate --trace` reads
    assert len(trace.requests) == len(reqs)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [(p, o) for _t, p, o, _m in reqs]
    assert trace.duration_s == pytest.approx(reqs[-1][0] - reqs[0][0], abs=1e-3)
    policy = demo_policy(models=(model,), isl=512, osl=128, ttft_p99_ms=TTFT_MS, itl_p99_ms=ITL_MS,
                         cycle_s=60.0, max_actions=4, trtllm_cached=False, hosts=[("host-a", 8), ("host-b", 8)])
    policy["models"][0]["allowed"]["tp"] = [4]
    (tmp_path / POLICY_FILE).write_text(json.dumps(policy))  # JSON is YAML
    shutil.copy(PROFILES, tmp_path / PROFILES_FILE)

    replay = run_replay(tmp_path, model, workers=1)
    meter = LiveGpuMeter(t_from_s=reqs[0][0], t_to_s=reqs[-1][0])
    meter.sample(0.0, {"vllm": 4}, 0)
    meter.sample(2000.0, {}, 0)
    live = live_figures([_result()] * len(reqs), ttft_slo_ms=TTFT_MS, itl_slo_ms=ITL_MS, meter=meter)
    summary = build_summary(work=tmp_path, model=model, day={"requests": len(reqs)},
                            slo={"ttft_p99_ms": TTFT_MS, "itl_p99_ms": ITL_MS}, live=live, replay=replay,
                            replay_wall_s=1.0)
    path = write_summary(tmp_path, summary)
    doc = json.loads(path.read_text())
    assert path.name == SUMMARY_FILE
    assert set(doc) == {"version", "model", "day", "slo", "live", "replay", "live_vs_replay", "graduation"}
    assert "per-request ITL" in doc["slo"]["definition"]
    assert doc["live"]["gpu_hours"] == pytest.approx(meter.gpu_hours(), abs=1e-4)
    rep = doc["replay"]
    assert list(rep["policies"]) == list(REPLAY_POLICIES)
    for name, p in rep["policies"].items():
        assert p["gpu_hours"] > 0, name
        assert BY_ENGINE_KEY in p and p[BY_ENGINE_KEY + "_source"], name
        if p[BY_ENGINE_KEY] is not None:
            assert sum(p[BY_ENGINE_KEY].values()) == pytest.approx(p["gpu_hours"], abs=1e-3), name
        if name != "oracle":
            assert 0.0 <= p["slo_attainment"] <= 1.0
    for name in ("static-peak", "static-mean", "hpa"):  # one config each: derivable without the field
        assert rep["policies"][name][BY_ENGINE_KEY] is not None
    assert rep["trace"]["requests"] == len(reqs)
    cmp_ = doc["live_vs_replay"]
    assert cmp_["live_over_replay"] == pytest.approx(live["gpu_hours"] / rep["policies"]["fleetplan"]["gpu_hours"],
                                                    rel=1e-3)
    grad = doc["graduation"]  # the vLLM-only replay is the yardstick of what TRT-LLM saved
    assert grad["replay_vllm_only_gpu_hours"] == rep["policies"]["fleetplan-vllm-only"]["gpu_hours"]
    assert grad["live_saved_gpu_hours"] == pytest.approx(grad["replay_vllm_only_gpu_hours"] - live["gpu_hours"],
                                                        abs=1e-3)
    table = render_summary(doc)
    assert "live (the daemon)" in table and "replay oracle (bound)" in table and rep["command"] in table
    assert "replay best-fixed (hindsight)" in table and " x " in rep["policies"]["best-fixed"]["fleet"]

    # the recorded command reproduces the replay's figures
    argv = shlex.split(rep["command"])
    assert argv[:2] == ["fleetplan", "evaluate"] and argv == rep["argv"]
    capsys.readouterr()
    assert cli_main([*argv[1:], "--workers", "1"]) == 0
    again = json.loads(capsys.readouterr().out)
    for name, p in rep["policies"].items():
        assert again["policies"][name]["gpu_hours"] == p["gpu_hours"], name
        assert again["policies"][name].get("slo_attainment") == p.get("slo_attainment"), name
