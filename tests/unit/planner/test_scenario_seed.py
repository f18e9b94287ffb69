"""Seed scenario from data/benchmarks/seed_articles.csv (8x H100, Llama-3 8B and 70B).

Capacities come straight from the article's throughput figures (tokens/s at batch 64 on 8 GPUs):
rps per replica = tok/s / replicas per 8 GPUs / mean output tokens. With those figures a steady high
load is served by TensorRT-LLM (~1.4-1.5x vLLM's throughput per GPU); a fleet without a cached
TensorRT-LLM engine starts on vLLM now and builds the engines for the target plan.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from fleetplan.models.names import Engine, parse_engine, parse_gpu, parse_precision
from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.core import plan_with_capacities
from fleetplan.planner.policy import Policy, load_policy_dict
from fleetplan.planner.types import (
    ActionKind,
    ConfigKey,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    PlannerState,
)

ROOT = Path(__file__).resolve().parents[3]
NOW = 1_731_500_000.0
OSL = 200.0


def _policy(cached: bool) -> Policy:
    d = yaml.safe_load((ROOT / "config/example-policy.yaml").read_text())
    d["budget"] = {}
    d["schedules"] = []
    for m in d["models"]:
        m["workload"]["osl"] = OSL
    d["engines"]["trtllm"]["cached_builds"] = (
        [{"model": "llama-3-8b", "gpu": "h100", "tp": 1}, {"model": "llama-3-70b", "gpu": "h100", "tp": 8}]
        if cached else [])
    return load_policy_dict(d, "seed-policy")


def _seed_capacities(shared: Path, policy: Policy) -> dict[ConfigKey, CapacityInfo]:
    aliases = policy.aliases()
    out: dict[ConfigKey, CapacityInfo] = {}
    with (shared / "benchmarks" / "seed_articles.csv").open() as f:
        for row in csv.DictReader(f):
            if row["source"] != "production-3-month-report" or not row["throughput_tok_s"]:
                continue
            model = aliases.canonical(row["model"])
            gpus = int(row["gpus"])
            tp = int(row["tp"]) if row["tp"] else 1  # 8B: 8 single-GPU replicas on the 8 GPUs
            per_replica_tok_s = float(row["throughput_tok_s"]) / (gpus // tp)
            key = ConfigKey(model, parse_engine(row["engine"]), parse_gpu(row["gpu"]), tp,
                            parse_precision(row["precision"]))
            out[key] = CapacityInfo(per_replica_tok_s / OSL, "throughput")
    return out


def _steady(rate: float, name: str) -> ModelObservation:
    history = tuple((NOW - 3600 + 120 * i, rate * (1 + 0.02 * ((-1) ** i))) for i in range(31))
    return ModelObservation(name, rate, 820.0, OSL, None, None, history, False)


def _fleet() -> Fleet:
    return Fleet(tuple(HostInventory(f"gpu-{i:02d}", parse_gpu("H100 SXM5"), 8, (tuple(range(8)),), True)
                       for i in range(6)))


@pytest.fixture()
def load() -> Observation:
    # steady high load (article spellings of the model names)
    return Observation({"Llama-3-8B": _steady(200.0, "Llama-3-8B"), "Llama-3-70B": _steady(80.0, "Llama-3-70B")})


def test_seed_figures_parse(shared_data: Path) -> None:
    caps = _seed_capacities(shared_data, _policy(True))
    assert len(caps) == 4
    by = {(k.model, k.engine): v.max_rps for k, v in caps.items()}
    assert by[("llama-3-8b", Engine.TRTLLM)] == pytest.approx(48200 / 8 / OSL)
    assert by[("llama-3-70b", Engine.VLLM)] == pytest.approx(7800 / OSL)


def test_steady_high_load_picks_trtllm(shared_data: Path, load: Observation) -> None:
    policy = _policy(cached=True)
    r = plan_with_capacities(load, _fleet(), policy, _seed_capacities(shared_data, policy),
                             PlannerState.initial(), NOW)
    engines = {c.config.engine for c in r.plan.counts}
    assert engines == {Engine.TRTLLM}
    assert r.plan == r.target
    assert all(m.unmet_rps == 0 for m in r.explanation.models)
    assert all(m.demand_rps >= m.observed_rps for m in r.explanation.models)  # type: ignore[operator]
    vllm_gpus = 12 + 24  # what vLLM would need: 12 x TP1 for 8B, 3 x TP8 for 70B
    assert r.plan.gpus < vllm_gpus


def test_no_cached_trtllm_engine_starts_on_vllm(shared_data: Path, load: Observation) -> None:
    policy = _policy(cached=False)
    r = plan_with_capacities(load, _fleet(), policy, _seed_capacities(shared_data, policy),
                             PlannerState.initial(), NOW)
    assert {c.config.engine for c in r.plan.counts} == {Engine.VLLM}
    # the target converges to TensorRT-LLM once built (a last small slice may stay on vLLM when that is
    # cheaper than one more TensorRT-LLM replica)
    trt = sum(c.replicas * c.capacity_per_replica_rps for c in r.target.counts if c.config.engine == Engine.TRTLLM)
    total = sum(c.replicas * c.capacity_per_replica_rps for c in r.target.counts)
    assert trt / total > 0.85
    assert r.target.usd_h < r.plan.usd_h
    assert all(m.unmet_rps == 0 for m in r.explanation.models)
    kinds = [a.kind for a in (*r.actions, *r.deferred_actions)]
    assert kinds.count(ActionKind.BUILD) == 2
    assert kinds.index(ActionKind.BUILD) > kinds.index(ActionKind.START)  # serving capacity first
    builds = [a for a in (*r.actions, *r.deferred_actions) if a.kind == ActionKind.BUILD]
    assert {a.replica.config.model for a in builds} == {"llama-3-8b", "llama-3-70b"}
    assert ActionKind.START in kinds
    assert any("engine builds pending" in n for n in r.explanation.notes)
