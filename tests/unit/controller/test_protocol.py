"""MQTT payload validation: malformed payloads, unknown templates, out-of-range GPUs, old versions."""

from __future__ import annotations

import json

import pytest

from fleetplan.controller.protocol import (
    Ack,
    DesiredState,
    HostLimits,
    HostStatus,
    ProtocolError,
    ReplicaPhase,
    ack_topic,
    check_desired,
    check_version,
    desired_topic,
    host_from_topic,
    parse_ack,
    parse_desired,
    parse_status,
    payload_version,
    status_topic,
    to_payload,
)
from fleetplan.models.names import Engine, GpuType, Precision

LIMITS = HostLimits(
    host="h1",
    gpu=GpuType.H100,
    gpu_count=8,
    port_range=(18000, 18099),
    launch_templates={"sim-vllm": Engine.VLLM, "sim-trtllm": Engine.TRTLLM},
    build_templates=frozenset({"trtllm-build"}),
)


def replica(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "replica_id": "r1", "template": "sim-vllm", "model": "meta-llama/Llama-3.1-8B-Instruct",
        "engine": "vllm", "gpu": "h100", "tp": 2, "precision": "bf16", "gpu_indices": [0, 1],
        "port": 18000,
    }
    base.update(over)
    return base


def desired(*replicas: dict[str, object], version: int = 1, builds: tuple = ()) -> bytes:
    return json.dumps({"version": version, "replicas": list(replicas), "builds": list(builds)}).encode()


def test_valid_desired_round_trips_and_normalises_spellings() -> None:
    d = parse_desired(desired(replica(engine="vLLM", gpu="H100 80GB HBM3", precision="bfloat16")))
    r = d.replicas[0]
    assert (r.engine, r.gpu, r.precision, r.gpu_indices) == (Engine.VLLM, GpuType.H100, Precision.BF16, (0, 1))
    assert parse_desired(to_payload(d)) == d
    assert check_desired(d, LIMITS) == []


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"replicas": []}', "version"),
        (desired(replica(replica_id="../etc/passwd")), "replica_id"),
        (desired(replica(replica_id="r1; rm -rf /")), "replica_id"),
        (desired(replica(template="Sim VLLM")), "template"),
        (desired(replica(model="--trust-remote-code")), "model"),
        (desired(replica(model="a/../../b")), "'..'"),
        (desired(replica(model="m $(id)")), "model"),
        (desired(replica(port=70000)), "port"),
        (desired(replica(tp=2, gpu_indices=[0])), "tp=2 needs 2 gpu_indices"),
        (desired(replica(gpu_indices=[1, 1])), "repeat a GPU"),
        (desired(replica(gpu_indices=[-1, 0])), "gpu_indices"),
        (desired(replica(engine="tgi")), "unknown engine 'tgi'"),
        (desired(replica(gpu="tpu-v5")), "unknown GPU"),
        (desired(replica(extra_arg="--evil")), "extra_arg"),
        (desired(replica(), replica(replica_id="r2", gpu_indices=[1, 2], port=18001)), "GPU 1 used by both"),
        (desired(replica(), replica(replica_id="r2", gpu_indices=[2, 3])), "port 18000 used by both"),
        (desired(replica(), replica(gpu_indices=[2, 3], port=18001)), "'r1' appears twice"),
        (json.dumps({"version": 1, "replicas": [], "argv": ["sh"]}).encode(), "argv"),
    ],
)
def test_malformed_desired_is_rejected_with_a_clear_one_line_reason(payload: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_desired(payload)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert message.startswith(("desired state:",))


def test_unknown_template_is_rejected_by_the_host_check() -> None:
    errors = check_desired(parse_desired(desired(replica(template="nope"))), LIMITS)
    assert errors == ["replica r1: unknown template 'nope' (this host has: sim-trtllm, sim-vllm)"]


def test_template_engine_mismatch_is_rejected() -> None:
    errors = check_desired(parse_desired(desired(replica(template="sim-trtllm"))), LIMITS)
    assert len(errors) == 1 and "starts trtllm, not engine 'vllm'" in errors[0]


def test_gpu_index_out_of_range_is_rejected() -> None:
    errors = check_desired(parse_desired(desired(replica(gpu_indices=[7, 8]))), LIMITS)
    assert errors == ["replica r1: GPU index 8 out of range (host h1 has 8 GPUs: 0-7)"]


def test_port_outside_the_agent_range_and_wrong_gpu_type_are_rejected() -> None:
    errors = check_desired(parse_desired(desired(replica(port=8080, gpu="a100"))), LIMITS)
    assert "replica r1: port 8080 outside this host's range 18000-18099" in errors
    assert "replica r1: gpu 'a100' but host h1 has h100" in errors


def test_builds_are_checked_against_build_templates() -> None:
    build = {"build_id": "b1", "template": "unknown-build", "model": "m", "gpu": "h100", "tp": 1,
             "precision": "fp8", "gpu_indices": [9]}
    errors = check_desired(parse_desired(desired(builds=(build,))), LIMITS)
    assert any("unknown build template 'unknown-build'" in e for e in errors)
    assert any("GPU index 9 out of range" in e for e in errors)


def test_template_needing_a_built_engine_requires_cache_or_build() -> None:
    limits = HostLimits(host="h1", gpu=GpuType.H100, gpu_count=8, port_range=(18000, 18099),
                        launch_templates={"trt": Engine.TRTLLM}, build_templates=frozenset({"bld"}),
                        engine_templates_need_cache=frozenset({"trt"}))
    r = replica(template="trt", engine="trtllm", precision="fp8")
    assert "none cached" in check_desired(parse_desired(desired(r)), limits)[0]
    build = {"build_id": "b1", "template": "bld", "model": r["model"], "gpu": "h100", "tp": 2,
             "precision": "fp8", "gpu_indices": [2, 3]}
    assert check_desired(parse_desired(desired(r, builds=(build,))), limits) == []


def test_version_going_backwards_is_refused() -> None:
    assert check_version(None, 0) is None
    assert check_version(5, 5) is None
    assert check_version(5, 6) is None
    reason = check_version(5, 4)
    assert reason is not None and "older than the applied version 5" in reason


def test_payload_version_recovers_the_version_of_a_bad_payload() -> None:
    assert payload_version(desired(replica(port=1), version=7)) == 7
    assert payload_version(b"garbage") is None
    assert payload_version(b'{"version": true}') is None


def test_last_will_parses_as_offline_status() -> None:
    status = parse_status(b'{"host": "h1", "online": false}')
    assert status == HostStatus(host="h1", online=False)
    assert status.replicas == ()


def test_ack_and_status_round_trip() -> None:
    ack = Ack(version=3, accepted=False, errors=("x",), host="h1")
    assert parse_ack(to_payload(ack)) == ack
    status = parse_status(json.dumps({
        "host": "h1", "online": True, "gpu": "h100", "gpu_count": 8, "nvlink_groups": [[0, 1, 2, 3]],
        "replicas": [{"replica_id": "r1", "model": "m", "engine": "vllm", "tp": 1, "precision": "bf16",
                      "gpu_indices": [0], "port": 18000, "state": "ready", "since_s": 1.0, "pid": 42}],
    }))
    assert status.replicas[0].state is ReplicaPhase.READY
    with pytest.raises(ProtocolError, match=r"replicas\.0\.model: Field required;"):
        parse_status(json.dumps({"host": "h1", "online": True, "replicas": [{"replica_id": "r1"}]}))


def test_topics() -> None:
    assert desired_topic("h1") == "fleetplan/hosts/h1/desired"
    assert status_topic("h1") == "fleetplan/hosts/h1/status"
    assert ack_topic("h1") == "fleetplan/hosts/h1/ack"
    assert host_from_topic("fleetplan/hosts/h1/status") == "h1"
    assert host_from_topic("other/hosts/h1/status") is None
    with pytest.raises(ProtocolError):
        desired_topic("h1/#")


def test_desired_state_is_immutable() -> None:
    d = DesiredState(version=1)
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError on frozen models
        d.version = 2  # type: ignore[misc]


def test_a_trailing_newline_is_not_a_valid_name() -> None:
    """`$` in re.match accepts a trailing newline; every wire name is matched whole."""
    from fleetplan.controller.protocol import is_valid_id, is_valid_model
    from fleetplan.controller.routing import validate_model_name

    assert is_valid_model("m8") and not is_valid_model("m8\n")
    assert is_valid_id("r1") and not is_valid_id("r1\n")
    with pytest.raises(ValueError):
        validate_model_name("m8\n")
