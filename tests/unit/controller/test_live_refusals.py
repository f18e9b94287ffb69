"""The live controller refuses a policy that allows disaggregated pools: its routing cannot send a
pooled model's requests through a proxy yet (the replay runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetplan.controller.metrics import ControllerMetrics
from fleetplan.controller.policy_source import PolicySource
from fleetplan.controller.state import StateStore
from fleetplan.planner.policy import PolicyError

POLICY = """
version: 1
gpu_types: {h100: {price_usd_h: 2.0}}
hosts: [{name: h1, gpu: h100, gpu_count: 8}]
engines:
  vllm: {launch: {command: vllm}, startup: {default_s: 30}}
models:
  - {name: a, slo: {ttft_p99_ms: 500, itl_p99_ms: 50}, allowed: {engines: [vllm], tp: [1]}, workload: {isl: 500, osl: 50}}
  - {name: b, slo: {ttft_p99_ms: 500, itl_p99_ms: 50}, allowed: {engines: [vllm], tp: [1]}, workload: {isl: 500, osl: 50},
     disaggregation: {allowed: ALLOWED}}
"""


def _source(tmp_path: Path, allowed: bool) -> PolicySource:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.replace("ALLOWED", str(allowed).lower()))
    return PolicySource(path, None, StateStore(tmp_path / "state.db"), ControllerMetrics(), {})


def test_a_policy_allowing_pools_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as err:
        _source(tmp_path, True).read()
    msg = str(err.value)
    assert str(tmp_path / "policy.yaml") in msg and "models[1].disaggregation.allowed = true" in msg
    assert "proxy" in msg
    assert _source(tmp_path, False).read().models[1].disaggregation.allowed is False
