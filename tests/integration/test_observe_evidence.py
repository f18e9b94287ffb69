"""controller/observe.py + planner/evidence.py against a REAL Prometheus scraping simulated engines:
the length quantiles per model and the per-config evidence (READY replicas, rate, TTFT p99, per-request
ITL p99, completions) the planner's correction compares with the profiles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from fleetplan.controller.observe import Observer, ObserverConfig, PromClient, to_observation
from fleetplan.controller.routing import ScrapeTarget, write_file_sd
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.types import ConfigKey, Replica, ReplicaState
from fleetplan.sim.engine import EngineConfig, SimEngine
from fleetplan.sim.replay import run_load

pytestmark = pytest.mark.integration

K = 20.0
M = "llama-3.1-8b"
VLLM = ConfigKey(M, Engine.VLLM, GpuType.H100, 1, Precision.BF16)
TRT = ConfigKey(M, Engine.TRTLLM, GpuType.H100, 1, Precision.BF16)


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, tuple[SimEngine, ConfigKey]]]:
    """Two vLLM-persona replicas and one TRT-LLM-persona replica of one model (in-process servers)."""
    out: dict[str, tuple[SimEngine, ConfigKey]] = {}
    try:
        for rid, config in (("v1", VLLM), ("v2", VLLM), ("t1", TRT)):
            e = SimEngine(EngineConfig(persona=config.engine, model=M, gpu=GpuType.H100, tp=1, time_scale=K,
                                       startup_s=0.0, replica_id=rid, min_chunk_interval_ms=100.0))
            await e.start("127.0.0.1", 0)
            out[rid] = (e, config)
        yield out
    finally:
        for e, _ in out.values():
            await e.stop()


async def test_length_mix_and_per_config_evidence_from_prometheus(prometheus, engines) -> None:  # type: ignore[no-untyped-def]
    sd = prometheus.file_sd_dir / "evidence-test.json"
    write_file_sd(sd, [ScrapeTarget(f"127.0.0.1:{e.port}", M, c.engine.value, "host-a", rid)
                       for rid, (e, c) in engines.items()])
    try:
        async with PromClient(prometheus.url) as client:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # file_sd discovery takes a few seconds
                ups = await client.query('up{replica=~"v1|v2|t1"}')
                if len(ups) == 3 and all(u.value == 1 for u in ups):
                    break
                await asyncio.sleep(0.5)
            # 1 simulated rps per replica for 160 simulated s (8 s wall); prompts: 80% 300, 20% 3000 tokens
            loads = [run_load([(i * 1.0, 3000 if i % 5 == 0 else 300, 40) for i in range(160)],
                              f"http://127.0.0.1:{e.port}", speed=K, model=M) for e, _ in engines.values()]
            results = await asyncio.gather(*loads)
            assert not [r for rs in results for r in rs if r.outcome != "ok"]
            await asyncio.sleep(2.0)  # two more scrapes: the last requests are in the window
            obs = Observer(client, ObserverConfig(window_s=8, history_s=20, history_step_s=1, time_scale=K))
            snap = await obs.snapshot([M], with_history=False)
        now = snap.now_s
        reps = [Replica(rid, c, "host-a", (0,), ReplicaState.READY, e.port, now - 1000.0)
                for rid, (e, c) in engines.items()]
        # a replica that just became READY is left out (it did not serve the whole window)
        reps.append(Replica("v3", VLLM, "host-a", (1,), ReplicaState.READY, 9, now - 1.0))
        o = to_observation(snap, [M], reps).models[M]
        assert not o.stale
        # the prompt-length distribution: vLLM replicas only (TRT-LLM exports no length histogram)
        q = dict(o.isl_quantiles)
        assert 200 < q[0.5] <= 500 and 2000 < q[0.99] <= 5000
        assert dict(o.osl_quantiles)[0.5] == pytest.approx(35, abs=15)  # 40 tokens: in the (20, 50] bucket
        by = {c.config: c for c in o.configs}
        v, t = by[VLLM], by[TRT]
        assert v.ready_replicas == 2 and t.ready_replicas == 1
        # a window of 8 s wall holds most of the 8 s load: close to 2 (vLLM) and 1 (TRT-LLM) simulated rps
        assert 0.8 < v.rate_rps < 2.6 and 0.4 < t.rate_rps < 1.3
        assert v.requests > 100 and t.requests > 50
        for c in (v, t):
            assert c.ttft_p99_ms is not None and c.ttft_p99_ms > 0
            # an 8B replica on an H100 decodes in < 10 ms per token: inside vLLM's first TPOT bucket, unknown
            assert c.itl_p99_ms is None or 10 < c.itl_p99_ms < 200
        # the model-level numbers are unchanged by the evidence
        assert o.rate_rps is not None and o.isl is not None
        # without the fleet: lengths only, no per-config evidence
        bare = to_observation(snap, [M]).models[M]
        assert bare.configs == () and bare.isl_quantiles == o.isl_quantiles
    finally:
        sd.unlink(missing_ok=True)
