"""Policy file: the shipped examples load, errors name key path and value, schedules follow cron."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from planner_helpers import policy_dict

from fleetplan.harness.cli import main
from fleetplan.planner.policy import (
    PolicyError,
    effective,
    load_policy_dict,
    load_policy_text,
    schedule_active,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ("config/example-policy.yaml", "config/example-policy-mixed.yaml")


def _ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_load_and_every_field_is_commented(name: str) -> None:
    text = (ROOT / name).read_text()
    policy = load_policy_text(text, name)
    assert len(policy.models) == 2
    # every line that sets a key carries a comment, or sits in a block whose key line does
    assert text.count("#") > 40


def test_seed_example_is_the_seed_scenario() -> None:
    p = load_policy_text((ROOT / EXAMPLES[0]).read_text(), "x")
    assert {h.gpu.value for h in p.hosts} == {"h100"} and all(h.gpu_count == 8 for h in p.hosts)
    assert p.model("Llama-3-8B") is not None and p.model("meta-llama/Meta-Llama-3-70B-Instruct") is not None
    mixed = load_policy_text((ROOT / EXAMPLES[1]).read_text(), "y")
    assert {g.value for g in mixed.gpu_types} == {"h100", "h200", "a100", "l40s"}


def test_errors_name_file_key_path_and_value() -> None:
    d = policy_dict()
    d["models"][1]["slo"]["ttft_p99_ms"] = -5
    d["models"][0]["allowed"]["engines"] = ["vllm", "tgi"]
    d["scaling"]["bogus"] = 1
    with pytest.raises(PolicyError) as exc:
        load_policy_dict(d, "p.yaml")
    msg = str(exc.value)
    assert "p.yaml: models[1].slo.ttft_p99_ms = -5: " in msg
    assert "p.yaml: models[0].allowed.engines[1] = 'tgi': unknown engine" in msg
    assert "p.yaml: scaling.bogus = 1: Extra inputs are not permitted" in msg
    assert len(exc.value.problems) == 3


def test_cross_checks_and_yaml_errors() -> None:
    d = policy_dict(models=("a", "a"))
    with pytest.raises(PolicyError, match="duplicate model names"):
        load_policy_dict(d, "p")
    d = policy_dict(model_extra={"m8": {"min_replicas": 5, "max_replicas": 2}})
    with pytest.raises(PolicyError, match=r"models\[0\]: min_replicas 5 > max_replicas 2"):
        load_policy_dict(d, "p")
    with pytest.raises(PolicyError, match=r"p\.yaml: YAML syntax error at line 2"):
        load_policy_text("a: 1\n  b: [\n", "p.yaml")
    with pytest.raises(PolicyError, match="expected a mapping"):
        load_policy_text("- 1\n", "p.yaml")


def test_schedules_use_cron_at_the_given_instant() -> None:
    d = policy_dict(schedules=[
        {"name": "office", "cron": "0 8 * * mon-fri", "duration_s": 36000,
         "override": {"min_replicas": {"m8": 3}, "budget": {"max_gpus": 4}}},
        {"name": "maint", "cron": "0 2 * * sun", "duration_s": 7200, "override": {"drain_hosts": ["h00"]}},
    ])
    p = load_policy_dict(d, "p")
    monday_9 = _ts(2024, 11, 11, 9, 0)
    e = effective(p, monday_9)
    assert e.active_schedules == ("office",) and e.min_replicas["m8"] == 3 and e.budget.max_gpus == 4
    assert effective(p, _ts(2024, 11, 11, 18, 30)).active_schedules == ()  # 10 h window ended at 18:00
    assert effective(p, _ts(2024, 11, 11, 7, 59)).active_schedules == ()
    sunday_3 = _ts(2024, 11, 10, 3, 0)
    assert effective(p, sunday_3).drain_hosts == frozenset({"h00"})
    assert not schedule_active(p.schedules[1], _ts(2024, 11, 10, 4, 0, 1))
    bad = policy_dict(schedules=[{"name": "x", "cron": "61 * * * *", "duration_s": 1, "override": {}}])
    with pytest.raises(PolicyError, match=r"schedules\[0\].cron = '61 \* \* \* \*'"):
        load_policy_dict(bad, "p")


def test_cli_policy_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(ROOT / EXAMPLES[1])]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / EXAMPLES[0]).read_text().replace("headroom: 0.2 ", "headroom: -1 ", 1))
    assert main(["policy", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: models[0].headroom = -1: Input should be greater than or equal to 0" in err
    assert main(["policy", "check", str(tmp_path / "missing.yaml")]) == 2


def test_launch_templates_render_per_replica() -> None:
    from fleetplan.models.names import Engine, GpuType, Precision
    from fleetplan.planner.launch import render_launch
    from fleetplan.planner.types import ConfigKey

    p = load_policy_text((ROOT / EXAMPLES[0]).read_text(), "x")
    trt = render_launch(p, ConfigKey("llama-3-70b", Engine.TRTLLM, GpuType.H100, 8, Precision.BF16), 8001,
                        tuple(range(8)))
    assert trt.command == "trtllm-serve"
    assert trt.args[0] == "/var/lib/fleetplan/engines/llama-3-70b-h100-tp8-bf16" and "8001" in trt.args
    v = render_launch(p, ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16), 8002, (3,))
    assert v.args[:2] == ("serve", "meta-llama/Meta-Llama-3-8B-Instruct")
    d = policy_dict()
    d["engines"]["vllm"]["launch"]["args"] = ["--model", "{modle}"]
    with pytest.raises(PolicyError, match=r"engines.vllm: unknown placeholder \{modle\}"):
        load_policy_dict(d, "p")


def test_a_policy_in_use_never_changes_and_a_copy_looks_up_its_own_models() -> None:
    """A process pool's feeder thread pickles a policy while the caller goes on looking models up:
    the lookups are derived at validation, so a lookup leaves the object as it was; a model_copy with
    other models finds its own, not the source's."""
    from planner_helpers import policy as make

    p = make(models=("m8", "m70"))
    before = dict(p.__dict__)
    assert p.model("m8") is p.models[0] and p.aliases().canonical("m70") == "m70"
    assert p.__dict__.keys() == before.keys() and all(p.__dict__[k] is v for k, v in before.items())
    only = p.model_copy(update={"models": p.models[1:]})
    assert only.model("m8") is None and only.model("m70") is p.models[1]
    assert p.model("m8") is p.models[0]
