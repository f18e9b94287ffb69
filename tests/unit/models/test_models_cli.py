"""`fleetplan models fit | predict | capacity` end to end, in process, on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetplan.harness.cli import main
from fleetplan.shared.benchfiles import ProfilesFileError, load_profiles

ONLINE = "trtllm_v0.14_online_serving_triton_bf16.csv"


def _inferencex(shared_data: Path, isl: str) -> list[str]:
    return sorted(str(p) for p in (shared_data / "benchmarks" / "vllm-inferencex").glob(f"glm5_*_isl{isl}_*.json"))


@pytest.fixture(scope="module")
def profiles_file(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    out = tmp_path_factory.mktemp("fit") / "PROFILES.json"
    files = [str(shared_data / "benchmarks" / ONLINE), *_inferencex(shared_data, "1024"),
             *_inferencex(shared_data, "8192")]
    assert main(["models", "fit", *files, "--gpu", "h200", "--out", str(out)]) == 0
    return out


def test_fit_writes_profiles_and_prints_loo_errors(profiles_file: Path, shared_data: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    profiles = load_profiles(profiles_file)
    labels = {k.label() for k in profiles.keys()}
    assert "LLaMA 3.1 8B/trtllm/h100x1/bf16" in labels and "GLM-5-FP8/vllm/h200x8/fp8" in labels
    glm = next(p for p in profiles.profiles if p.key.model == "GLM-5-FP8")
    assert glm.fit_error is not None and glm.fit_error.points == 12
    assert glm.data_range is not None and glm.data_range.isl == (1024, 8192)
    # printed again for a small run: the table has points and three MAPE columns
    files = _inferencex(shared_data, "1024")
    assert main(["models", "fit", *files, "--gpu", "h200", "--out", str(profiles_file.parent / "p2.json")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("GLM-5-FP8/vllm/h200x8/fp8"))
    cols = line.split()
    assert cols[1] == "6" and all(c.endswith("%") for c in cols[3:6])


def test_bad_files_are_listed_and_skipped(tmp_path: Path, shared_data: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "truncated.json").write_text('{"model_id": "m", "mean_ttft_ms": 3')
    (tmp_path / "nan.json").write_text('{"model_id": "m", "completed": 10, "total_input_tokens": NaN, "mean_ttft_ms": 3}')
    (tmp_path / "empty").mkdir()
    good = _inferencex(shared_data, "2048")
    rc = main(["models", "fit", str(tmp_path / "truncated.json"), str(tmp_path / "nan.json"),
               str(tmp_path / "empty"), *good, "--gpu", "h200", "--no-loo", "--out", str(tmp_path / "P.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped: " + str(tmp_path / "truncated.json") + ": invalid JSON at line 1" in out
    assert "nan.json: field 'total_input_tokens' must be finite, got nan" in out
    assert str(tmp_path / "empty") + ": directory holds no benchmark files" in out
    assert load_profiles(tmp_path / "P.json").keys()


def test_nothing_fitted_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "d").mkdir()
    assert main(["models", "fit", str(tmp_path / "d"), "--out", str(tmp_path / "P.json")]) == 1
    captured = capsys.readouterr()
    assert "nothing could be fitted" in captured.err and not (tmp_path / "P.json").exists()


def test_unknown_gpu_flag_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "fit", str(tmp_path), "--gpu", "voodoo5", "--out", str(tmp_path / "P.json")]) == 2
    assert "unknown GPU 'voodoo5'" in capsys.readouterr().err


def test_predict_json(profiles_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["models", "predict", "--profiles", str(profiles_file), "--model", "llama-3.1-8b",
               "--engine", "tensorrt-llm", "--gpu", "H100 80GB HBM3", "--tp", "1", "--isl", "467",
               "--osl", "256", "--rate", "8", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["ttft_ms"]) == {"mean", "p50", "p99"} and set(doc["itl_ms"]) == {"mean", "p50", "p99"}
    assert doc["request_rps"] == 8 and doc["output_tok_s"] == pytest.approx(8 * 256)
    assert 15 < doc["ttft_ms"]["mean"] < 60 and 5 < doc["itl_ms"]["mean"] < 20  # measured: 26 ms, 9 ms
    assert doc["ttft_ms"]["p50"] <= doc["ttft_ms"]["p99"]


def test_predict_concurrency_and_saturation(profiles_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["models", "predict", "--profiles", str(profiles_file), "--model", "GLM-5-FP8", "--engine", "vllm",
            "--gpu", "h200", "--tp", "8", "--isl", "4096", "--osl", "128", "--json"]
    assert main([*base, "--concurrency", "16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["request_rps"] > 0 and doc["concurrency"] == 16
    assert main([*base, "--rate", "1000"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["saturated"] is True and doc["ttft_ms"]["p99"] is None
    assert any("saturation" in w for w in doc["warnings"])


def test_capacity_json(profiles_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["models", "capacity", "--profiles", str(profiles_file), "--model", "LLaMA 3.1 8B", "--engine",
            "trtllm", "--gpu", "h100", "--tp", "1", "--isl", "467", "--osl", "256", "--json"]
    assert main([*base, "--ttft-p99-ms", "2000", "--itl-p99-ms", "25"]) == 0
    loose = json.loads(capsys.readouterr().out)
    assert loose["binding"] in ("ttft", "itl", "memory") and loose["max_rps"] > 5
    assert main([*base, "--ttft-p99-ms", "2000", "--itl-p99-ms", "15"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["binding"] == "itl" and tight["max_rps"] < loose["max_rps"]


def test_query_errors(profiles_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["models", "capacity", "--model", "nope", "--engine", "vllm", "--gpu", "h100", "--tp", "1",
            "--isl", "100", "--osl", "100", "--ttft-p99-ms", "100", "--itl-p99-ms", "10", "--json"]
    assert main([*args, "--profiles", str(profiles_file)]) == 2
    assert "no profile for nope/vllm/h100x1" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main([*args, "--profiles", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: invalid JSON" in capsys.readouterr().err
    with pytest.raises(ProfilesFileError, match="cannot read"):
        load_profiles(tmp_path / "missing.json")


def test_prior_fallback_is_said(profiles_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "capacity", "--profiles", str(profiles_file), "--model", "llama-3.1-70b", "--engine",
                 "vllm", "--gpu", "b200", "--tp", "2", "--precision", "fp8", "--isl", "1000", "--osl", "200",
                 "--ttft-p99-ms", "1000", "--itl-p99-ms", "50", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["max_rps"] > 0 and any("roofline" in w for w in doc["warnings"])


def test_aliases_file_and_unwritable_out(tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    aliases = tmp_path / "aliases.yaml"
    aliases.write_text("glm-5:\n  - zai-org/GLM-5-FP8\n")
    files = _inferencex(shared_data, "1024")
    out = tmp_path / "P.json"
    assert main(["models", "fit", *files, "--gpu", "h200", "--aliases", str(aliases), "--no-loo",
                 "--out", str(out)]) == 0
    assert [k.model for k in load_profiles(out).keys()] == ["glm-5"]
    aliases.write_text("glm-5: [a, {b: c}]\n")
    assert main(["models", "fit", *files, "--aliases", str(aliases), "--out", str(out)]) == 2
    assert "aliases.yaml: field 'glm-5': expected a list of names" in capsys.readouterr().err
    assert main(["models", "fit", *files, "--gpu", "h200", "--no-loo", "--out",
                 str(tmp_path / "no" / "such" / "dir" / "P.json")]) == 2
    assert "cannot write profiles" in capsys.readouterr().err
