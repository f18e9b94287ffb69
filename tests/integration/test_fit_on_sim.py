"""The user's workflow on the simulator: bench-engine sweep -> `fleetplan models fit` -> predict.

A fit of a simulated engine's concurrency sweep (1, 4, 16, 64) predicts its throughput at an
unseen concurrency (32) within 15%. The simulator's step time comes from the architecture and
datasheet numbers (fleetplan.sim.groundtruth), not from models/, so this tests the fitting honestly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetplan.harness.cli import main as cli_main
from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.benchclient import file_name, sweep
from fleetplan.sim.engine import EngineConfig, SimEngine

ISL, OSL = 467, 128
TRAIN = (1, 4, 16, 64)
UNSEEN = 32
PROMPTS = {1: 12, 4: 24, 16: 96, 32: 192, 64: 384}  # ~6 waves each (1: 12 sequential requests)
K = 5.0  # low enough that client turnaround (wall ms x K) is negligible in simulated time


# The simulated engine's clock runs behind the wall clock when its process is starved of CPU (the CI
# runs this beside a real vLLM on CPU): a sweep then measures the host, not the engine. Such a sweep
# is repeated, at most ATTEMPTS times, on the engine's own count of how far behind it fell.
ATTEMPTS = 3
BEHIND_MAX_WALL_S = 0.5


async def _sweeps(persona: Engine, meta: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    """(the training sweeps, the unseen one, the most wall seconds the engine's clock fell behind)."""
    engine = SimEngine(EngineConfig(persona, "llama-3.1-8b", GpuType.H100, 1, time_scale=K, startup_s=0.0,
                                    min_chunk_interval_ms=10.0, seed=3))
    await engine.start("127.0.0.1", 0)
    try:
        target = f"http://127.0.0.1:{engine.port}"
        docs = [(await sweep(target, isl=ISL, osl=OSL, concurrencies=[c], num_prompts=PROMPTS[c], time_scale=K,
                             meta=meta))[0] for c in TRAIN]
        (unseen,) = await sweep(target, isl=ISL, osl=OSL, concurrencies=[UNSEEN], num_prompts=PROMPTS[UNSEEN],
                                time_scale=K, meta=meta)
    finally:
        await engine.stop()
    return docs, unseen, engine.behind_max_wall_s


@pytest.mark.parametrize("persona", [Engine.VLLM])
async def test_fit_on_simulator_predicts_unseen_concurrency(persona: Engine, tmp_path: Path) -> None:
    benchfiles = pytest.importorskip("fleetplan.shared.benchfiles")
    profile_mod = pytest.importorskip("fleetplan.models.profile")
    meta = {"engine": persona.value, "gpu": "h100", "tp": 1, "precision": "bf16"}
    for attempt in range(1, ATTEMPTS + 1):
        docs, unseen, behind_s = await _sweeps(persona, meta)
        print(f"sweeps {attempt}: the engine's clock fell at most {behind_s:.2f} wall s behind")
        if behind_s <= BEHIND_MAX_WALL_S:
            break
    assert behind_s <= BEHIND_MAX_WALL_S, f"the host starved the engine in {ATTEMPTS} sweeps ({behind_s:.2f} s)"
    out = tmp_path / "bench"
    out.mkdir()
    for c, doc in zip(TRAIN, docs, strict=True):
        assert doc["failed"] == 0, doc["errors"]
        (out / file_name(doc["model_id"], meta, ISL, OSL, c)).write_text(json.dumps(doc))
    profiles_path = tmp_path / "PROFILES.json"
    assert cli_main(["models", "fit", str(out), "--out", str(profiles_path)]) == 0

    profiles = benchfiles.load_profiles(profiles_path)
    prof = profiles.get("llama-3.1-8b", persona, GpuType.H100, 1)
    assert prof is not None, profiles.keys()
    pred = profile_mod.predict(prof, profile_mod.Workload(isl=ISL, osl=OSL), concurrency=UNSEEN)
    measured = unseen["request_throughput"]
    err = pred.request_rps / measured - 1.0
    print(f"fit-on-simulator: conc {UNSEEN} predicted {pred.request_rps:.2f} req/s, measured {measured:.2f} "
          f"req/s, error {err:+.1%}; TTFT mean predicted {pred.ttft.mean_ms:.0f} ms measured "
          f"{unseen['mean_ttft_ms']:.0f} ms; ITL mean predicted {pred.itl.mean_ms:.1f} ms measured "
          f"{unseen['mean_itl_ms']:.1f} ms")
    assert abs(err) <= 0.15
