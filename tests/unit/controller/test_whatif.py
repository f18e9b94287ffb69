"""`fleetplan what-if`: the plan diff of three policy edits, exit codes, and bad files named."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetplan.harness.cli import main
from fleetplan.models.profile import ProfileSet

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "config/example-policy.yaml").read_text())


def _replica(rid: str, model: str, tp: int, host: str, gpus: list[int]) -> dict[str, Any]:
    return {"replica_id": rid, "model": model, "engine": "vllm", "gpu": "h100", "tp": tp, "host": host,
            "gpu_indices": gpus, "state": "ready", "since_s": 1731570000}


def _trusted_priors() -> ProfileSet:
    """The roofline priors of the example policy's configs, written as if benchmarked over the example
    workload (so the extrapolation guard leaves them as they are: these tests are about the diff)."""
    from dataclasses import replace

    from fleetplan.models import profile as mp
    from fleetplan.models.names import Engine, GpuType, Precision

    out = []
    for model, tps in (("llama-3-8b", (1, 2)), ("llama-3-70b", (4, 8))):
        for engine in (Engine.VLLM, Engine.TRTLLM):
            for tp in tps:
                prior = mp.roofline_profile(mp.ConfigKey(model, engine, GpuType.H100, tp, Precision.BF16))
                assert prior is not None
                out.append(replace(prior, source="fit", data_range=mp.DataRange(
                    (100.0, 10000.0), (10.0, 2000.0), (0.1, 100.0), None, 10)))
    return ProfileSet(tuple(out))


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(_trusted_priors().to_json_dict()))
    # what runs now (the example policy's plan for the example demand), the 70B on gpu-04;
    # no `hosts`: the policy's inventory applies
    fleet = tmp_path / "current.json"
    fleet.write_text(json.dumps({"replicas": [
        _replica("r70", "llama-3-70b", 8, "gpu-04", list(range(8))),
        _replica("r8a", "llama-3-8b", 2, "gpu-03", [0, 1]),
        _replica("r8b", "llama-3-8b", 2, "gpu-03", [2, 3])]}))
    return {"profiles": str(profiles), "fleet": str(fleet), "dir": str(tmp_path),
            "old": str(ROOT / "config/example-policy.yaml"), "demand": str(ROOT / "config/example-demand.yaml")}


def _edit(files: dict[str, str], name: str, fn: Any) -> str:
    doc = copy.deepcopy(BASE)
    fn(doc)
    path = Path(files["dir"]) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _whatif(files: dict[str, str], new: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, Any]:
    args = ["what-if", "--policy", new, "--against", files["old"], "--profiles", files["profiles"],
            "--demand", files["demand"], "--fleet", files["fleet"], *extra]
    code = main([*args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert main(args) == code  # the text rendering of the same diff
    text = capsys.readouterr().out
    return code, (doc, text)


def _rows(doc: dict[str, Any], key: str = "changes") -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(c["model"], c["engine"], c["tp"]): c for c in doc[key]}


def test_no_edit_no_change_exit_0(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, (doc, text) = _whatif(files, files["old"], capsys)
    assert code == 0 and doc["changed"] is False
    assert doc["changes"] == [] and doc["usd_h_before"] == doc["usd_h_after"] > 0
    assert "RESULT: no change (exit 0)" in text


def test_tighter_slo_adds_capacity_and_costs_more(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    new = _edit(files, "tight", lambda d: d["models"][0]["slo"].update(itl_p99_ms=30))
    code, (doc, text) = _whatif(files, new, capsys)
    assert code == 1 and doc["changed"]
    rows = _rows(doc)
    assert set(m for m, _, _ in rows) == {"llama-3-8b"}  # only the edited model moves
    assert sum(c["started"] for c in rows.values()) >= 1 and doc["usd_h_after"] > doc["usd_h_before"]
    # the running vLLM TP2 replicas stay; the extra capacity is started, not swapped in
    assert not any(c["stopped"] for c in rows.values())
    assert doc["slo_risk"] == []
    assert [a["kind"] for a in doc["actions"]] and all(a["model"] == "llama-3-8b" for a in doc["actions"])
    assert "$/h now:    $36.00/h -> $39.00/h (+3.00)" in text and "+1 start" in text
    assert "RESULT: CHANGE (exit 1)" in text


def test_host_removed_moves_its_replica(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    new = _edit(files, "nohost", lambda d: d.update(hosts=[h for h in d["hosts"] if h["name"] != "gpu-04"]))
    code, (doc, text) = _whatif(files, new, capsys)
    assert code == 1
    moved = _rows(doc)[("llama-3-70b", "vllm", 8)]
    assert (moved["before"], moved["after"], moved["started"], moved["stopped"]) == (1, 1, 1, 1)
    assert doc["usd_h_before"] == doc["usd_h_after"] and doc["slo_risk"] == []
    kinds = [(a["kind"], a["replica_id"] if a["kind"] != "start" else a["host"]) for a in doc["actions"]]
    assert ("drain", "r70") in kinds and ("stop", "r70") in kinds
    assert any(k == "start" and h != "gpu-04" for k, h in kinds)
    assert "(moved)" in text and "DRAIN r70" in text


def test_vllm_disallowed_builds_trtllm_and_flags_slo_risk(files: dict[str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def no_vllm(d: dict[str, Any]) -> None:
        for m in d["models"]:
            m["allowed"]["engines"] = ["trtllm"]

    code, (doc, text) = _whatif(files, _edit(files, "novllm", no_vllm), capsys)
    assert code == 1
    rows = _rows(doc)
    assert rows[("llama-3-8b", "vllm", 2)]["after"] == 0 and rows[("llama-3-70b", "vllm", 8)]["after"] == 0
    assert rows[("llama-3-8b", "trtllm", 1)]["started"] >= 1  # the cached 8B engine serves now
    target = _rows(doc, "target_changes")
    assert target[("llama-3-70b", "trtllm", 8)]["after"] >= 1  # after its build
    # the 70B has no built TensorRT-LLM engine: nothing serves it until the build is done
    risk = {r["model"]: r for r in doc["slo_risk"]}
    assert set(risk) == {"llama-3-70b"} and risk["llama-3-70b"]["below_demand"]
    assert risk["llama-3-70b"]["capacity_after_rps"] == 0.0 and risk["llama-3-70b"]["capacity_before_rps"] > 12
    builds = {(a["model"], a["tp"]) for a in doc["actions"] if a["kind"] == "build"}
    assert ("llama-3-70b", 8) in builds
    assert "SLO RISK (1)" in text and "llama-3-70b: capacity 0.0 rps below DEMAND" in text
    assert "BUILD build_llama-3-70b_trtllm_h100_tp8_bf16" in text


def test_bad_files_exit_2_naming_file_field_and_value(files: dict[str, str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bad = _edit(files, "bad", lambda d: d["models"][1]["slo"].update(ttft_p99_ms=-5))
    args = ["what-if", "--policy", bad, "--against", files["old"], "--profiles", files["profiles"],
            "--demand", files["demand"]]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert bad in err and "models[1].slo.ttft_p99_ms" in err and "-5" in err
    demand = Path(files["dir"]) / "demand.yaml"
    demand.write_text("models:\n  llama-3-8b: {rate_rps: fast}\n")
    args = ["what-if", "--policy", files["old"], "--against", files["old"], "--profiles", files["profiles"],
            "--demand", str(demand)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(demand) in err and "models.llama-3-8b.rate_rps" in err and "'fast'" in err
    assert main([*args[:-1], str(Path(files["dir"]) / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read demand" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # neither --against nor --controller
        main(["what-if", "--policy", files["old"], "--profiles", files["profiles"], "--demand", files["demand"]])
    assert exc.value.code == 2
