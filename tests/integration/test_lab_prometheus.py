"""Prometheus in the lab scrapes simulated vLLM and TRT-LLM engines; PromQL gives what the engine reports.

Two simulated engines (`fleetplan sim-engine`, persona vllm and trtllm) run on a lab host's ports,
registered in Prometheus through file_sd (controller/routing.write_file_sd) and routed by the lab's
nginx. Load goes through nginx; then, at the timestamp of the last scrape:

- `increase()`/`rate()` of the request and prompt-token counters equal what was sent, exactly
  (the first scrape saw zero, so Prometheus does not extrapolate);
- `histogram_quantile()` over `rate()` of the TTFT buckets equals the quantile computed from the
  engine's own /metrics histogram, and the TTFT the client measured lies in the same bucket.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetplan.controller.routing import ScrapeTarget, write_file_sd
from fleetplan.harness.lab import Lab
from fleetplan.harness.procs import ManagedProcess

pytest.importorskip("fleetplan.sim.engine", reason="the simulated engine (sim/engine.py) has not landed")

MODEL = "llama-3.1-8b"


@dataclass(frozen=True)
class Persona:
    engine: str
    ttft: str  # histogram name
    success: str  # counter name, with _total
    prompt_tokens: str
    metrics_path: str
    model: str  # routed model name (one per engine so nginx picks the engine)


PERSONAS = {
    "vllm": Persona(
        "vllm",
        "vllm:time_to_first_token_seconds",
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "/metrics",
        "llama-3.1-8b",
    ),
    "trtllm": Persona(
        "trtllm",
        "trtllm_time_to_first_token_seconds",
        "trtllm_request_success_total",
        "trtllm_prompt_tokens_total",
        "/prometheus/metrics",
        "llama-3.1-8b-trt",
    ),
}


@dataclass
class RunningEngine:
    persona: Persona
    port: int
    replica: str
    proc: ManagedProcess
    registered_at: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def engine_lab() -> Iterator[tuple[Lab, dict[str, RunningEngine]]]:
    with Lab(hosts=1, services=("prometheus", "nginx")) as lab:
        host = lab.hosts[0]
        engines: dict[str, RunningEngine] = {}
        try:
            for i, (name, persona) in enumerate(PERSONAS.items()):
                port = host.port_range[0] + i
                replica = f"{host.name}-{name}-0"
                argv = [
                    sys.executable, "-m", "fleetplan", "sim-engine",
                    "--persona", name, "--model", MODEL, "--gpu", host.gpu.value, "--tp", "1",
                    "--port", str(port), "--time-scale", "1", "--startup-s", "0",
                    "--replica-id", replica, "--seed", str(i),
                ]  # fmt: skip
                proc = ManagedProcess(f"sim-engine {name}", argv, host.workdir / f"{replica}.log")
                proc.start()
                engines[name] = RunningEngine(persona, port, replica, proc, 0.0)
            for eng in engines.values():
                eng.proc.wait_ready(
                    lambda e=eng: httpx.get(f"{e.url}/health", timeout=1).status_code == 200,  # type: ignore[misc]
                    30.0,
                    f"healthy at {eng.url}/health",
                )
            targets = [
                ScrapeTarget(
                    address=f"127.0.0.1:{e.port}",
                    model=e.persona.model,
                    engine=e.persona.engine,
                    host=host.name,
                    replica=e.replica,
                )
                for e in engines.values()
            ]
            write_file_sd(lab.prometheus_file_sd_dir / "engines.json", targets)
            now = time.time()
            for e in engines.values():
                e.registered_at = now
            lab.router().apply({e.persona.model: [f"127.0.0.1:{e.port}"] for e in engines.values()})
            # Every engine scraped at least once (with zero requests) before any load.
            assert lab.prometheus is not None
            deadline = time.monotonic() + 30
            while True:
                up = lab.prometheus.query('up{job="fleetplan"} == 1')
                if len(up) == len(engines):
                    break
                assert time.monotonic() < deadline, f"targets not up: {lab.prometheus.active_targets()}"
                time.sleep(0.2)
            yield lab, engines
        finally:
            for e in engines.values():
                e.proc.stop()


def test_file_sd_targets_carry_replica_labels_and_metrics_path(
    engine_lab: tuple[Lab, dict[str, RunningEngine]],
) -> None:
    lab, engines = engine_lab
    assert lab.prometheus is not None
    by_replica = {t["labels"]["replica"]: t for t in lab.prometheus.active_targets()}
    assert set(by_replica) == {e.replica for e in engines.values()}
    for e in engines.values():
        t = by_replica[e.replica]
        assert t["health"] == "up", t
        assert t["labels"]["model"] == e.persona.model
        assert t["labels"]["engine"] == e.persona.engine
        assert t["labels"]["host"] == lab.hosts[0].name
        assert t["scrapeUrl"] == f"{e.url}{e.persona.metrics_path}"


def _prom_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets, +Inf last."""
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if bound <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _engine_histogram(text: str, name: str) -> list[tuple[float, float]]:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sorted(
                (float(s.labels["le"]), s.value) for s in family.samples if s.name == f"{name}_bucket"
            )
    raise AssertionError(f"{name} not in the engine's metrics")


async def _send_load(base: str, n: int, concurrency: int, seed: int) -> tuple[list[float], int]:
    """n streaming completions; returns (client TTFTs in s, total prompt tokens)."""
    rng = random.Random(seed)
    prompts = [rng.randrange(1000, 8000) for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient, prompt_tokens: int) -> None:
        async with sem:
            body = {"prompt_tokens": prompt_tokens, "max_tokens": 8, "stream": True, "prompt": "x"}
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and first is None:
                        first = time.perf_counter() - t0
            assert first is not None
            ttfts.append(first)

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    return ttfts, sum(prompts)


@pytest.mark.parametrize("persona", sorted(PERSONAS))
async def test_promql_rate_and_histogram_quantile_match_the_engine(
    engine_lab: tuple[Lab, dict[str, RunningEngine]], persona: str
) -> None:
    lab, engines = engine_lab
    prom = lab.prometheus
    assert prom is not None
    eng = engines[persona]
    p = eng.persona
    n = 24
    # Through the lab's nginx front, routed by path prefix to this engine's model.
    ttfts, prompt_tokens = await _send_load(
        f"{lab.nginx_url}/m/{p.model}", n, concurrency=6, seed=len(persona)
    )

    async with httpx.AsyncClient(timeout=5) as client:
        own_text = (await client.get(f"{eng.url}{p.metrics_path}")).text
    own = _engine_histogram(own_text, p.ttft)
    assert own[-1][1] == n, "the engine counted every request"

    # Wait for a scrape that has seen all n finished (a scrape can see every first token while
    # the last requests still decode), then query at exactly that scrape's timestamp.
    sel = f'{{replica="{eng.replica}"}}'
    deadline = time.monotonic() + 15
    while True:
        res = await asyncio.to_thread(prom.query, f"sum({p.success}{sel})")
        ttft_res = await asyncio.to_thread(prom.query, f"{p.ttft}_count{sel}")
        if res and ttft_res and float(res[0]["value"][1]) == n and float(ttft_res[0]["value"][1]) == n:
            break
        assert time.monotonic() < deadline, f"Prometheus never saw {n} finished requests: {res}"
        await asyncio.sleep(0.2)
    t_last = float((await asyncio.to_thread(prom.query, f"max(timestamp({p.success}{sel}))"))[0]["value"][1])
    window = f"{int(t_last - eng.registered_at) + 10}s"

    def at(expr: str) -> float:
        import httpx as h

        body = h.get(f"{prom.url}/api/v1/query", params={"query": expr, "time": f"{t_last:.3f}"}).json()
        assert body["status"] == "success", body
        assert len(body["data"]["result"]) == 1, (expr, body["data"]["result"])
        return float(body["data"]["result"][0]["value"][1])

    requests = await asyncio.to_thread(at, f"sum(increase({p.success}{sel}[{window}]))")
    assert requests == pytest.approx(n, rel=1e-9)
    seconds = int(window[:-1])
    tokens_rate = await asyncio.to_thread(at, f"sum(rate({p.prompt_tokens}{sel}[{window}]))")
    assert tokens_rate * seconds == pytest.approx(prompt_tokens, rel=1e-9)

    client_sorted = sorted(ttfts)
    for q in (0.5, 0.9):
        expr = f"histogram_quantile({q}, sum by (le) (rate({p.ttft}_bucket{sel}[{window}])))"
        prom_q = await asyncio.to_thread(at, expr)
        assert prom_q == pytest.approx(_prom_quantile(q, own), rel=1e-6)
        # The client's own measurement (wall x time-scale 1) lies in the bucket Prometheus
        # interpolated in, give or take the HTTP/event-loop overhead of a loaded 2-core box.
        edges = [b for b, _ in own]
        upper = next(b for b in edges if b >= prom_q)
        lower = max([b for b in edges if b < prom_q], default=0.0)
        client_q = client_sorted[min(len(client_sorted) - 1, int(q * len(client_sorted)))]
        slack = 0.1  # s; CI boxes are shared and busy
        assert lower - slack <= client_q <= upper + slack, (q, client_q, prom_q, (lower, upper))


def test_engine_processes_stop_cleanly(tmp_path: Path) -> None:
    """A ManagedProcess engine leaves no process behind (the same helper the fixture uses)."""
    from fleetplan.harness.procs import free_port, group_pids

    port = free_port()
    argv = [
        sys.executable, "-m", "fleetplan", "sim-engine", "--persona", "vllm", "--model", MODEL,
        "--gpu", "h100", "--port", str(port), "--startup-s", "0",
    ]  # fmt: skip
    proc = ManagedProcess("sim-engine", argv, tmp_path / "engine.log")
    proc.start()
    proc.wait_ready(
        lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200, 30, "healthy"
    )
    pgid = proc.pid
    assert pgid is not None and group_pids(pgid)
    proc.stop()
    assert group_pids(pgid) == []
