"""The replay reads the daemon's own config (fleetplan/harness/replay_settings.py): its observation
windows and timeouts, in simulated seconds; a replay without one is the daemon with its defaults."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import yaml

from fleetplan.controller.settings import ControllerSettings, SettingsError, load_settings
from fleetplan.harness.cli import main as cli_main
from fleetplan.harness.demo import DEMO_MODEL_70B, day_requests, demo_policy
from fleetplan.harness.demo_summary import (
    CONTROLLER_FILE,
    PROFILES_FILE,
    evaluate_argv,
    run_replay,
    write_trace,
)
from fleetplan.harness.replay_settings import ReplaySettings, replay_settings
from fleetplan.harness.rig_tools import PROFILES  # the lab's profiles (70B TP4, vLLM + TRT-LLM)
from fleetplan.planner.policy import load_policy_text
from fleetplan.shared.benchfiles import load_profiles
from fleetplan.sim.des import FleetSim
from fleetplan.sim.evaluate import make_controller, make_environment, prepare_trace
from fleetplan.sim.traces import read_trace


def test_a_replay_without_a_config_is_the_daemon_with_its_defaults() -> None:
    # SimSettings and ControlSettings repeat the daemon's defaults; this is where they must agree
    assert replay_settings(ControllerSettings()) == ReplaySettings()


def test_wall_seconds_of_a_lab_at_k_times_real_time_are_k_simulated_seconds() -> None:
    live = ControllerSettings(observe_window_s=12.0, history_s=40.0, history_step_s=2.0, peak_window_s=2.0,
                              length_window_s=30.0, ready_timeout_s=60.0, drain_timeout_s=30.0, cycle_s=90.0)
    rs = replay_settings(live, time_scale=20.0, shared_engine_cache=True)
    assert (rs.sim.window_s, rs.sim.history_s, rs.sim.history_step_s, rs.sim.peak_window_s,
            rs.sim.length_window_s) == (240.0, 800.0, 40.0, 40.0, 600.0)
    assert (rs.control.ready_timeout_s, rs.control.drain_timeout_s) == (1200.0, 600.0)
    assert rs.control.cycle_s == 90.0  # already simulated seconds (the policy's unit)
    assert rs.sim.shared_engine_cache
    with pytest.raises(ValueError, match="time_scale"):
        replay_settings(live, time_scale=0.0)


def test_the_daemons_history_fits_one_prometheus_range_query(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="history_s 691200 / history_step_s 30 = 23040 points"):
        ControllerSettings(history_s=8 * 86400.0)
    ControllerSettings(history_s=8 * 86400.0, history_step_s=300.0)  # coarser steps: fits
    bad = tmp_path / "controller.yaml"
    bad.write_text("history_s: 691200\n")
    with pytest.raises(SettingsError, match=r"controller.yaml: history_s 691200 / history_step_s 30 .* raise "
                                         r"history_step_s to 63 or more"):
        load_settings(bad)


def test_the_daemon_refuses_a_bad_controller_config_naming_the_file_and_the_fields(tmp_path: Path) -> None:
    """load_settings raises SettingsError (a ValueError: the demo's and evaluate's handlers catch it);
    the daemon's entry point turns it into its exit with the same line."""
    import subprocess
    import sys

    bad = tmp_path / "controller.yaml"
    bad.write_text("history_s: 691200\n")
    policy = Path(__file__).resolve().parents[3] / "config" / "example-policy.yaml"
    out = subprocess.run([sys.executable, "-m", "fleetplan", "controller", "--policy", str(policy), "--config",
                          str(bad), "--state-db", str(tmp_path / "state.db")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"{bad}: history_s 691200 / history_step_s 30" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "state.db").exists()  # refused before anything was opened


def _demo_files(tmp_path: Path) -> tuple[Path, Path]:
    reqs = day_requests(900.0, base_rps=0.05, peak_rps=0.4, isl=512, osl=128, model=DEMO_MODEL_70B, seed=5)
    write_trace(tmp_path / "requests.jsonl", reqs)
    policy = demo_policy(models=(DEMO_MODEL_70B,), isl=512, osl=128, ttft_p99_ms=1000.0, itl_p99_ms=30.0,
                         cycle_s=60.0, max_actions=4, trtllm_cached=False, hosts=[("host-a", 8)])
    policy["models"][0]["allowed"]["tp"] = [4]
    (tmp_path / "policy.yaml").write_text(json.dumps(policy))
    return tmp_path / "requests.jsonl", tmp_path / "policy.yaml"


def test_the_replay_cycles_and_reads_as_the_config_says(tmp_path: Path) -> None:
    trace_path, policy_path = _demo_files(tmp_path)
    policy = load_policy_text(policy_path.read_text(), str(policy_path))
    trace = prepare_trace(read_trace(trace_path), policy, DEMO_MODEL_70B)
    rs = replay_settings(ControllerSettings(cycle_s=120.0, observe_window_s=12.0), time_scale=10.0)
    sim = FleetSim(trace, make_controller("fleetplan", trace, policy, load_profiles(PROFILES)),
                   make_environment(policy), rs.sim, control=rs.control)
    sim.run()
    assert sim.control is not None and sim.prom.window_s == 120.0
    times = sorted({t for t, _ in sim.control.decisions})
    assert len(times) >= 5 and {round(b - a) for a, b in itertools.pairwise(times)} == {120}


@pytest.mark.usefixtures("ground_truth_once")  # one capacity search per config (tests/conftest.py)
def test_evaluate_takes_the_daemons_config_and_refuses_a_bad_one(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    trace_path, policy_path = _demo_files(tmp_path)
    base = ["evaluate", "--trace", str(trace_path), "--policy", str(policy_path), "--profiles", str(PROFILES),
            "--model", DEMO_MODEL_70B, "--policies", "fleetplan", "--workers", "1", "--json"]
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(yaml.safe_dump({"observe_window_s": 6.0, "history_s": 600.0, "history_step_s": 3.0}))
    assert cli_main([*base, "--controller-config", str(cfg), "--time-scale", "20"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"]["fleetplan"]["gpu_hours"] > 0
    read = doc["trace"]["replay_settings"]  # what the replay read, in simulated seconds
    assert (read["window_s"], read["history_s"], read["history_step_s"]) == (120.0, 12000.0, 60.0)
    assert read["cycle_s"] is None and doc["trace"]["controller_config"] == str(cfg)
    cfg.write_text("observe_window_s: -1\n")
    assert cli_main([*base, "--controller-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "controller.yaml: observe_window_s = -1" in err and err.count("\n") == 1
    assert cli_main([*base, "--time-scale", "20"]) == 2
    assert "give both" in capsys.readouterr().err
    # a Prometheus scraping every 60 s: the default 30 s burst window sees one sample; said, exit 2
    assert cli_main([*base, "--scrape-interval-s", "60"]) == 2
    err = capsys.readouterr().err
    assert "peak_window_s 30 of the controller config is shorter than two scrape intervals" in err
    cfg.write_text(yaml.safe_dump({"peak_window_s": 120.0}))
    assert cli_main([*base, "--controller-config", str(cfg), "--scrape-interval-s", "60"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["replay_settings"]["scrape_s"] == 60.0


@pytest.mark.usefixtures("ground_truth_once")  # one capacity search per config (tests/conftest.py)
def test_the_demos_recorded_command_reproduces_its_replay_with_the_live_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo writes the live daemon's config (D/controller.yaml, as `Rig.write_controller_config`
    dumps it) and records `fleetplan evaluate ... --controller-config D/controller.yaml --time-scale
    20`: that command gives the figures of the demo's own replay."""
    _demo_files(tmp_path)
    shutil.copy(PROFILES, tmp_path / PROFILES_FILE)
    live = ControllerSettings(lab_dir=tmp_path, observe_window_s=12.0, history_s=40.0, history_step_s=2.0,
                              peak_window_s=2.0, length_window_s=30.0, ready_timeout_s=60.0)
    (tmp_path / CONTROLLER_FILE).write_text(yaml.safe_dump(json.loads(live.model_dump_json(exclude_none=True))))
    replay = run_replay(tmp_path, DEMO_MODEL_70B, policies=("fleetplan",), workers=1, time_scale=20.0)
    argv = evaluate_argv(tmp_path, DEMO_MODEL_70B, policies=("fleetplan",), time_scale=20.0)
    assert argv[argv.index("--controller-config") + 1] == str(tmp_path / CONTROLLER_FILE)
    assert cli_main([*argv[1:], "--workers", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["replay_settings"]["window_s"] == 240.0
    assert doc["policies"]["fleetplan"]["gpu_hours"] == pytest.approx(
        replay.doc["policies"]["fleetplan"]["gpu_hours"], abs=1e-9)
    default = run_replay(tmp_path, DEMO_MODEL_70B, policies=("fleetplan",), workers=1)
    assert default.doc["trace"]["replay_settings"]["window_s"] == 60.0  # without the config: the defaults
