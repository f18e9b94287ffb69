"""`fleetplan evaluate` of a Mooncake cut (a trace with hash_ids and no model column) models the
engines' prefix caches for every policy, through the command a user runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetplan.harness.cli import main as cli_main
from fleetplan.sim.traces import block_reuse_share, read_trace

ROOT = Path(__file__).resolve().parents[3]
MOONCAKE = ROOT / "data" / "traces" / "mooncake_conversation.jsonl"
LONG_CONTEXT = ROOT / "config" / "example-policy-long-context.yaml"
CUT = 240  # requests: the first ~80 s of the hour


def _inputs(tmp: Path) -> tuple[Path, Path, Path]:
    """The trace's first CUT lines; the long-context policy on one host at TP 1 (two configs, so the
    ground-truth searches stay short); the roofline priors as profiles (no benchmark file)."""
    trace = tmp / "mooncake-cut.jsonl"
    with MOONCAKE.open(encoding="utf-8") as f:
        trace.write_text("".join(next(f) for _ in range(CUT)), encoding="utf-8")
    doc = yaml.safe_load(LONG_CONTEXT.read_text(encoding="utf-8"))
    doc["hosts"] = doc["hosts"][:1]
    doc["models"][0]["allowed"]["tp"] = [1]
    policy = tmp / "policy.yaml"
    policy.write_text(yaml.safe_dump(doc), encoding="utf-8")
    profiles = tmp / "profiles.json"
    profiles.write_text(json.dumps({"format": "fleetplan-profiles", "version": 1, "profiles": []}), encoding="utf-8")
    return trace, policy, profiles


def _evaluate(capsys: pytest.CaptureFixture[str], trace: Path, policy: Path, profiles: Path,
              *extra: str) -> dict[str, Any]:
    rc = cli_main(["evaluate", "--trace", str(trace), "--policy", str(policy), "--profiles", str(profiles),
                   "--json", "--workers", "2", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc: dict[str, Any] = json.loads(out.out)
    return doc


def test_every_policy_reports_its_prefix_cache_hit_rate_and_no_prefix_cache_turns_it_off(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, policy, profiles = _inputs(tmp_path)
    bound = block_reuse_share(read_trace(trace).requests)
    assert bound is not None and 0.03 < bound < 0.2  # the cut repeats blocks (6.3%; the whole hour: 36.6%)

    on = _evaluate(capsys, trace, policy, profiles)
    off = _evaluate(capsys, trace, policy, profiles, "--no-prefix-cache")

    assert on["trace"]["block_reuse_share"] == pytest.approx(bound, abs=1e-4)
    replayed = [name for name in on["policies"] if name != "oracle"]  # the oracle is a bound, not a replay
    assert {"fleetplan", "static-peak", "hpa", "best-fixed"} <= set(replayed)
    for name in replayed:
        hit = on["policies"][name]["prefix_cache_hit_rate"]
        # the fleet hits: the trace's shared blocks reach the engines; never more than one replica with an
        # unlimited cache would (token and block shares differ by the prompts' partial last blocks)
        assert hit is not None and 0.0 < hit <= bound + 0.02, (name, hit, bound)
        assert off["policies"][name]["prefix_cache_hit_rate"] is None, name
    # the same fleet (static-peak holds one) computes less of each prompt with the cache: first tokens come sooner
    assert on["policies"]["static-peak"]["ttft_p50_ms"] < off["policies"]["static-peak"]["ttft_p50_ms"]
    print({name: (on["policies"][name]["gpu_hours"], off["policies"][name]["gpu_hours"],
                  on["policies"][name]["prefix_cache_hit_rate"]) for name in replayed})
