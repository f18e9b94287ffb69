"""Policy values no deployment has are refused with the file, the key path and the value: infinite or
NaN numbers, non-positive or absurd SLOs, names with shell characters, out-of-range counts; a YAML
bomb is refused before it is expanded."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from planner_helpers import policy_dict

from fleetplan.planner import policy_yaml
from fleetplan.planner.policy import (
    HOST_NAME_PATTERN,
    MODEL_NAME_PATTERN,
    PolicyError,
    load_policy_dict,
    load_policy_text,
    load_policy_yaml,
)

ROOT = Path(__file__).resolve().parents[3]


def _set(d: dict[str, Any], path: str, value: Any) -> None:
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    node: Any = d
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value


def _refused(path: str, value: Any) -> str:
    d = policy_dict()
    _set(d, path, value)
    with pytest.raises(PolicyError) as exc:
        load_policy_dict(d, "p.yaml")
    assert len(exc.value.problems) == 1, exc.value.problems
    return str(exc.value)


@pytest.mark.parametrize(("path", "value", "shown"), [
    ("models.0.slo.ttft_p99_ms", math.inf, "models[0].slo.ttft_p99_ms = inf: Input should be a finite number"),
    ("models.0.slo.ttft_p99_ms", math.nan, "models[0].slo.ttft_p99_ms = nan: Input should be a finite number"),
    ("models.0.slo.itl_p99_ms", -math.inf, "models[0].slo.itl_p99_ms = -inf: Input should be a finite number"),
    ("models.0.slo.ttft_p99_ms", 0, "models[0].slo.ttft_p99_ms = 0: Input should be greater than 0"),
    ("models.1.slo.itl_p99_ms", -80, "models[1].slo.itl_p99_ms = -80: Input should be greater than 0"),
    ("models.0.slo.ttft_p99_ms", 1e300, "models[0].slo.ttft_p99_ms = 1e+300: Input should be less than or equal"),
    ("models.0.workload.isl", math.inf, "models[0].workload.isl = inf: Input should be a finite number"),
    ("models.0.headroom", math.nan, "models[0].headroom = nan: Input should be a finite number"),
    ("models.0.max_replicas", 10**30, "models[0].max_replicas = 1000000000000000000000000000000: "),
    ("gpu_types.h100.price_usd_h", math.inf, "gpu_types.h100.price_usd_h = inf: Input should be a finite"),
    ("scaling.cycle_s", 1e300, "scaling.cycle_s = 1e+300: Input should be less than or equal to 86400"),
    ("scaling.scale_down_delay_s", math.inf, "scaling.scale_down_delay_s = inf: Input should be a finite"),
    ("engines.vllm.startup.default_s", math.nan, "engines.vllm.startup.default_s = nan: Input should be a finite"),
    ("budget.max_usd_h", math.inf, "budget.max_usd_h = inf: Input should be a finite number"),
])
def test_absurd_numbers_are_refused_naming_file_field_and_value(path: str, value: Any, shown: str) -> None:
    assert f"p.yaml: {shown}" in _refused(path, value)


@pytest.mark.parametrize("name", ["m8; rm -rf /", "$(reboot)", "m8`id`", "a b", "-rf", "../../etc/passwd",
                                  "meta-llama//x", "meta-llama/", "m8\n", "m8|tee", "", "x" * 201, "m>8", "'m8'"])
def test_model_names_with_shell_characters_or_traversal_are_refused(name: str) -> None:
    msg = _refused("models.0.name", name)
    assert msg.startswith(f"p.yaml: models[0].name = {name[:77]!r}"[:60]) and "a model name is" in msg, msg


@pytest.mark.parametrize("name", ["meta-llama/Llama-3-70B", "Llama-3.1-8B-Instruct", "qwen2.5:7b",
                                  "org/model+lora", "m8"])
def test_real_model_names_are_accepted(name: str) -> None:
    d = policy_dict()
    d["models"][0]["name"] = name
    d["engines"]["trtllm"]["cached_builds"] = [{"model": name, "gpu": "h100", "tp": 1}]
    assert load_policy_dict(d, "p.yaml").models[0].name == name


def test_aliases_hosts_overrides_and_launch_text_are_checked_too() -> None:
    assert "models[0].aliases[1] = '$(id)': an alias is" in _refused("models.0.aliases", ["Llama 3.1 8B", "$(id)"])
    assert "hosts[0].name = 'h/1': a host name is" in _refused("hosts", [{"name": "h/1", "gpu": "h100",
                                                                         "gpu_count": 8}])
    assert "engines.vllm.startup.overrides[0].model = '../x': a model name is" in _refused(
        "engines.vllm.startup.overrides", [{"model": "../x", "seconds": 5}])
    assert "engines.vllm.launch.args[0] = 'a\\x00b': control characters" in _refused(
        "engines.vllm.launch.args", ["a\x00b"])
    assert "engines.vllm.launch.env: environment variable name 'A B'" in _refused(
        "engines.vllm.launch.env", {"A B": "1"})
    sched = {"name": "s", "cron": "0 8 * * *", "duration_s": 60,
             "override": {"min_replicas": {"m8": -1}, "drain_hosts": []}}
    assert "schedules[0].override.min_replicas.m8 = -1: Input should be greater than or equal to 0" in _refused(
        "schedules", [sched])
    sched["override"] = {"drain_hosts": ["#"]}
    assert "schedules[0].override.drain_hosts[0] = '#': a host name is" in _refused("schedules", [sched])


def test_yaml_infinities_are_refused_from_the_text() -> None:
    text = (ROOT / "config/example-policy.yaml").read_text()
    bad = re.sub(r"ttft_p99_ms: \d+", "ttft_p99_ms: .inf", text, count=1)
    assert bad != text
    with pytest.raises(PolicyError, match=r"^p\.yaml: models\[0\]\.slo\.ttft_p99_ms = inf: Input should be a finite"):
        load_policy_text(bad, "p.yaml")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "config").glob("example-policy*.yaml")))
def test_shipped_policies_still_load(name: str) -> None:
    assert load_policy_text((ROOT / "config" / name).read_text(), name).models


def test_name_patterns_are_the_wire_protocols() -> None:
    """A policy name the agents' protocol would refuse could never be served."""
    from fleetplan.controller import protocol

    assert MODEL_NAME_PATTERN == protocol.MODEL_PATTERN and HOST_NAME_PATTERN == protocol.HOST_PATTERN


@pytest.mark.parametrize(("text", "needle"), [
    # billion laughs: 9 levels of 9 aliases
    ("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
     + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)), "more than 64 aliases"),
    # doubling: 50 aliases that expand to 2**25 values
    ("a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 26)),
     "expands to more than 100000 values"),
    ("x: " + "[" * 5000 + "]" * 5000, "nested deeper than 32 levels"),
])
def test_yaml_bombs_are_refused_before_they_are_expanded(text: str, needle: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_: object) -> None:
        raise AssertionError("the document was built")

    monkeypatch.setattr(yaml.SafeLoader, "construct_document", never)
    with pytest.raises(PolicyError) as exc:
        load_policy_text(text, "bomb.yaml")
    assert str(exc.value).startswith("bomb.yaml: line ") and needle in str(exc.value), str(exc.value)


HOSTILE = [
    ("x: " + "[" * 5000 + "]" * 5000, "line 1: YAML refused: nested deeper than 32 levels"),
    ("".join("  " * i + f"k{i}:\n" for i in range(40)), "line 32: YAML refused: nested deeper than 32 levels"),
    ("a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 26)),
     "line 10: YAML refused: expands to more than 1000 values (alias bomb?)"),
    ("x: [" + ",".join(["1"] * 1_001) + "]\n", "line 1: YAML refused: more than 1000 values"),  # limit lowered
    ("a: &a [x, *a]\n", "recursive alias"),
    ("a: \x00", "unacceptable character"),
    ("a: 1\n  b: [\n", "YAML syntax error at line 2"),
    ("a: 1\n---\nb: 2\n", "YAML syntax error at line 2"),
]


@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python"])
@pytest.mark.parametrize(("text", "needle"), HOSTILE)
def test_both_composers_apply_the_same_bounds(text: str, needle: str, libyaml: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if libyaml and not yaml.__with_libyaml__:
        pytest.skip("PyYAML built without libyaml")
    monkeypatch.setattr(yaml, "__with_libyaml__", libyaml)
    monkeypatch.setattr(policy_yaml, "MAX_YAML_NODES", 1_000)  # the pure-Python composer is slow
    with pytest.raises(PolicyError) as exc:
        load_policy_text(text, "h.yaml")
    assert str(exc.value).startswith("h.yaml: ") and needle in str(exc.value), str(exc.value)


@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python"])
def test_both_composers_load_the_examples_alike(libyaml: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yaml, "__with_libyaml__", libyaml and yaml.__with_libyaml__)
    for path in sorted((ROOT / "config").glob("example-policy*.yaml")):
        text = path.read_text()
        assert load_policy_yaml(text, path.name) == yaml.safe_load(text)


def test_the_planner_may_derive_slos_beyond_the_file_bounds() -> None:
    """The counterfactual relaxes every SLO by 10%: a policy at the upper bound must still plan."""
    from fleetplan.models.profile import ProfileSet
    from fleetplan.planner.capacity import MixedWorkload, capacity_table
    from fleetplan.planner.counterfactual import slo_relaxed_capacities
    from fleetplan.planner.policy import MAX_SLO_ITL_MS, MAX_SLO_TTFT_MS

    text = (ROOT / "config/example-policy.yaml").read_text()
    text = re.sub(r"ttft(_p99)?_ms: \d+", f"ttft_ms: {MAX_SLO_TTFT_MS:.0f}", text)
    text = re.sub(r"itl(_p99)?_ms: \d+", f"itl_ms: {MAX_SLO_ITL_MS:.0f}", text)
    p = load_policy_text(text, "p.yaml")
    assert all(m.slo.ttft_p99_ms == MAX_SLO_TTFT_MS for m in p.models)
    w = {m.name: MixedWorkload(820.0, 200.0) for m in p.models}
    gpus = {h.gpu for h in p.hosts}
    base, _ = capacity_table(p, ProfileSet(), w, gpus)
    relaxed = slo_relaxed_capacities(p, ProfileSet(), w, gpus)
    assert base and set(relaxed) == set(base)
