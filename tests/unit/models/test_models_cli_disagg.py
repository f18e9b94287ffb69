"""`fleetplan models capacity ... --disagg` end to end, in process, on a real profiles file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fleetplan.harness.cli import main
from fleetplan.models import profile as mp
from fleetplan.models.disagg import ETH_25G
from fleetplan.models.mix import LengthMix
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.disagg_choice import choose_serving

KEY = mp.ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
ARGS = ["models", "capacity", "--model", "llama-3-8b", "--engine", "vllm", "--gpu", "h100", "--tp", "1",
        "--precision", "bf16", "--isl", "4096", "--osl", "32", "--ttft-p99-ms", "600", "--itl-p99-ms", "20",
        "--disagg"]


@pytest.fixture()
def profiles(tmp_path: Path) -> Path:
    prior = mp.roofline_profile(KEY)
    assert prior is not None
    other = replace(prior, key=replace(KEY, model="my-model"), source="fit")
    path = tmp_path / "PROFILES.json"
    path.write_text(json.dumps(mp.ProfileSet((other,)).to_json_dict()))
    return path


def test_prints_both_pools_and_the_cheaper_fleet(profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--profiles", str(profiles), "--rate", "20", "--price-usd-h", "3"]) == 0
    out = capsys.readouterr().out
    assert "prefill replica     max 3.929 req/s (binding: ttft)" in out
    assert "decode replica      max 45.421 req/s (binding: itl)" in out
    assert ("at 20 req/s:\n  disaggregated: 6 prefill + 1 decode replicas (6:1), 7 GPUs, $21.00/h; "
            "aggregated: 8 replicas, 8 GPUs, $24.00/h\n") in out
    assert "  aggregated would win at 16.8 req/s; with prompts x0.38; over a 6.71 GB/s link\n" in out
    assert out.count("extrapolated from the aggregated profile") == 1
    assert main([*ARGS, "--profiles", str(profiles)]) == 0  # without a rate: the capacities only
    out = capsys.readouterr().out
    assert "pools extrapolated from the aggregated profile" in out and "req/s:" not in out


def test_json_over_a_slow_link(profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--profiles", str(profiles), "--link", "eth25", "--rate", "20", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["link"] == {"kind": "network", "gb_s": 3.125} and doc["extrapolated"] is True
    assert doc["kv_transfer_p99_ms"] > 200.0  # 4,096 tokens of Llama-3-8B KV (0.5 GB) over 25 GbE
    assert doc["choice"]["chosen"] == "aggregated"
    prior = mp.roofline_profile(KEY)
    assert prior is not None
    same = choose_serving(prior, LengthMix.single(4096, 32), 20.0, ttft_p99_ms=600, itl_p99_ms=20, link=ETH_25G,
                          price_usd_h=3.0)
    assert same.disaggregated is not None and same.flips is not None
    assert doc["choice"]["prefill"]["replicas"] == same.disaggregated.prefill.replicas
    assert doc["choice"]["flips"]["link_gb_s"] == pytest.approx(same.flips.link_gb_s)


def test_unknown_architecture_and_bad_rate(profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [*ARGS, "--profiles", str(profiles)]
    args[args.index("llama-3-8b")] = "my-model"
    assert main(args) == 2
    assert "my-model/vllm/h100x1/bf16: KV bytes per token unknown" in capsys.readouterr().err
    assert main([*ARGS, "--profiles", str(profiles), "--rate", "-1"]) == 2
    assert "--rate must be a rate >= 0, got -1.0" in capsys.readouterr().err
