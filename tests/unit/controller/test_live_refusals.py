"""The live controller refuses a policy that allows disaggregated pools when no pool proxy is
configured (routing.pool_proxy): nothing could send a pooled model's requests to its pools."""

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


def _source(tmp_path: Path, allowed: bool, *, pool_proxy: bool = False) -> PolicySource:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.replace("ALLOWED", str(allowed).lower()))
    return PolicySource(path, None, StateStore(tmp_path / "state.db"), ControllerMetrics(), {}, pool_proxy=pool_proxy)


def test_a_policy_allowing_pools_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as err:
        _source(tmp_path, True).read()
    msg = str(err.value)
    assert str(tmp_path / "policy.yaml") in msg and "models[1].disaggregation.allowed = true" in msg
    assert "no pool proxy is configured" in msg and "routing.pool_proxy" in msg
    assert _source(tmp_path, False).read().models[1].disaggregation.allowed is False


def test_with_a_pool_proxy_configured_a_policy_allowing_pools_loads(tmp_path: Path) -> None:
    assert _source(tmp_path, True, pool_proxy=True).read().models[1].disaggregation.allowed is True
