"""`fleetplan plan`: policy + profiles + demand (+ current fleet) -> tables or one JSON document."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fleetplan.controller.protocol import ID_PATTERN
from fleetplan.harness.cli import main
from fleetplan.models.profile import ProfileSet

ROOT = Path(__file__).resolve().parents[3]
DEMAND = """
time_s: 1731574800
models:
  Llama-3-8B: {rate_rps: 30, isl: 820, osl: 200}
  llama-3-70b: {rate_rps: 6}
"""


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(ProfileSet().to_json_dict()))  # no data: roofline priors
    demand = tmp_path / "demand.yaml"
    demand.write_text(DEMAND)
    fleet = tmp_path / "current.json"
    fleet.write_text(json.dumps({
        "hosts": [{"name": f"gpu-0{i}", "gpu": "H100 SXM5", "gpu_count": 8,
                   "nvlink_groups": [[0, 1, 2, 3, 4, 5, 6, 7]]} for i in range(1, 4)],
        "replicas": [{"replica_id": "old-8b", "model": "llama-3-8b", "engine": "vllm", "gpu": "h100", "tp": 1,
                      "precision": "bf16", "host": "gpu-03", "gpu_indices": [7], "state": "ready",
                      "port": 8001, "since_s": 1731570000}],
        "builds": [{"model": "llama-3-70b", "engine": "trtllm", "gpu": "h100", "tp": 8, "ready": False}],
        "planner_state": {"cycle": 3, "surplus_since_s": []},
    }))
    return {"policy": str(ROOT / "config/example-policy.yaml"), "profiles": str(profiles),
            "demand": str(demand), "fleet": str(fleet)}


def _args(f: dict[str, str], *extra: str) -> list[str]:
    return ["plan", "--policy", f["policy"], "--profiles", f["profiles"], "--demand", f["demand"], *extra]


def test_plan_json_document(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_args(files), "--fleet", files["fleet"], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"plan", "target", "actions", "explanation", "next_state"}
    assert doc["next_state"]["cycle"] == 4
    models = {m["model"]: m for m in doc["explanation"]["models"]}
    assert models["llama-3-8b"]["observed_rps"] == 30 and models["llama-3-8b"]["unmet_rps"] == 0
    assert models["llama-3-8b"]["capacity_rps"] >= models["llama-3-8b"]["required_rps"]
    for m in models.values():
        for c in m["configs"]:
            assert c["predicted_ttft_p99_ms"] is not None and c["predicted_ttft_p99_ms"] <= m["slo_ttft_p99_ms"]
            assert c["predicted_itl_p99_ms"] <= m["slo_itl_p99_ms"]
    hosts = {"gpu-01", "gpu-02", "gpu-03"}
    assert all(r["host"] in hosts for r in doc["plan"]["replicas"])
    assert doc["explanation"]["solver"][0]["status"] in ("OPTIMAL", "FEASIBLE")
    assert any(b.startswith("llama-3-8b: replica capacity limited by") for b in doc["explanation"]["binding_constraints"])
    # ids are valid agent-protocol ids (MQTT desired state)
    ids = [r["replica_id"] for r in doc["plan"]["replicas"]] + [a["replica"]["replica_id"] for a in doc["actions"]]
    assert ids and all(re.match(ID_PATTERN, i) for i in ids)
    # the 70B engine build is already in progress: no second BUILD for it
    assert not [a for a in doc["actions"] if a["kind"] == "build" and a["replica"]["model"] == "llama-3-70b"
                and a["replica"]["tp"] == 8]


def test_plan_tables(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(files)) == 0
    out = capsys.readouterr().out
    for title in ("DEMAND AND CAPACITY", "CONFIGS (plan for now)", "PLAN (now)", "ACTIONS", "SOLVER"):
        assert title in out
    assert "llama-3-70b" in out


def test_plan_errors_exit_2(files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad-demand.yaml"
    bad.write_text("models:\n  llama-3-8b: {rate_rps: -1, colour: red}\n")
    assert main(["plan", "--policy", files["policy"], "--profiles", files["profiles"], "--demand", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: models.llama-3-8b.rate_rps = -1:" in err
    assert f"{bad}: models.llama-3-8b.colour = 'red': Extra inputs are not permitted" in err
    assert main(["plan", "--policy", files["policy"], "--profiles", str(tmp_path / "nope.json"),
                 "--demand", files["demand"]]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_fleet_document_round_trip(files: dict[str, str]) -> None:
    from fleetplan.planner.serde import fleet_from_dict, fleet_to_dict, state_from_dict, state_to_dict

    fleet, state = fleet_from_dict(json.loads(Path(files["fleet"]).read_text()), "current.json")
    assert fleet.hosts[0].gpu.value == "h100" and fleet.replicas[0].state.value == "ready"
    again, state2 = fleet_from_dict(fleet_to_dict(fleet, state), "x")
    assert (again, state2) == (fleet, state)
    assert state_from_dict(state_to_dict(state)) == state
