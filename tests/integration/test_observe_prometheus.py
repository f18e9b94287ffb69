"""controller/observe.py against a REAL Prometheus scraping exporters in both vLLM spellings and TRT-LLM names.

The exporters serve counters that grow at known rates, so the expected rate / ISL / OSL / quantiles are
exact; a second part stops one exporter (target down) and then Prometheus itself (fail static).
"""

from __future__ import annotations

import asyncio
import http.server
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from fleetplan.controller.observe import Observer, ObserverConfig, PromClient, render_snapshot

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_text(prefix: str, model_name: str, t: float) -> str:
    """vLLM-shaped exposition: 2 req/s, 100 prompt + 20 generated tokens each; TTFT 0.05 s, ITL 0.02 s."""
    n = 2.0 * t
    lines = [
        f'{prefix}request_success_total{{model_name="{model_name}",finished_reason="stop"}} {n}',
        f'{prefix}prompt_tokens_total{{model_name="{model_name}"}} {100 * n}',
        f'{prefix}generation_tokens_total{{model_name="{model_name}"}} {20 * n}',
        f'{prefix}num_requests_waiting{{model_name="{model_name}"}} 3',
        f'{prefix}num_requests_running{{model_name="{model_name}"}} 5',
        f'{prefix}kv_cache_usage_perc{{model_name="{model_name}"}} 0.25',
    ]
    for le, frac in (("0.01", 0.0), ("0.1", 1.0), ("1.0", 1.0), ("+Inf", 1.0)):
        lines.append(f'{prefix}time_to_first_token_seconds_bucket{{model_name="{model_name}",le="{le}"}} {frac * n}')
    for le, frac in (("0.01", 0.0), ("0.025", 1.0), ("0.1", 1.0), ("+Inf", 1.0)):
        lines.append(f'{prefix}inter_token_latency_seconds_bucket{{model_name="{model_name}",le="{le}"}} {frac * 19 * n}')
    return "\n".join(lines) + "\n"


def trtllm_text(model_name: str, t: float) -> str:
    n = 1.0 * t
    lines = [
        f'trtllm_request_success_total{{model_name="{model_name}"}} {n}',
        f'trtllm_prompt_tokens_total{{model_name="{model_name}"}} {400 * n}',
        f'trtllm_generation_tokens_total{{model_name="{model_name}"}} {50 * n}',
        f'trtllm_num_requests_waiting{{model_name="{model_name}"}} 0',
        f'trtllm_num_requests_running{{model_name="{model_name}"}} 2',
        f'trtllm_kv_cache_utilization{{model_name="{model_name}"}} 0.5',
    ]
    for le, frac in (("0.1", 0.0), ("0.5", 1.0), ("+Inf", 1.0)):
        lines.append(f'trtllm_time_to_first_token_seconds_bucket{{model_name="{model_name}",le="{le}"}} {frac * n}')
    for le, frac in (("0.01", 1.0), ("+Inf", 1.0)):
        lines.append(f'trtllm_time_per_output_token_seconds_bucket{{model_name="{model_name}",le="{le}"}} {frac * 49 * n}')
    return "\n".join(lines) + "\n"


def saturated_text(model_name: str, t: float) -> str:
    """A saturated vLLM replica: 1 req/s completes while the queue grows by 0.5 req/s (arrivals 1.5/s)."""
    n = 1.0 * t
    return "\n".join([
        f'vllm:request_success_total{{model_name="{model_name}",finished_reason="length"}} {n}',
        f'vllm:num_requests_waiting{{model_name="{model_name}"}} {0.5 * t}',
        f'vllm:num_requests_running{{model_name="{model_name}"}} 4',
    ]) + "\n"


class Exporter:
    def __init__(self, render: Callable[[float], str]) -> None:
        t0 = time.time()

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = render(time.time() - t0).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prom_lab(tmp_path: Path) -> Iterator[tuple[str, dict[str, Exporter], subprocess.Popen[bytes]]]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("prometheus not installed")
    exps = {
        "r-colon": Exporter(lambda t: vllm_text("vllm:", "Llama-3.1-8B-Instruct", t)),
        "r-under": Exporter(lambda t: vllm_text("vllm_", "llama-3.1-8b", t)),
        "r-trt": Exporter(lambda t: trtllm_text("qwen-7b", t)),
        "r-sat": Exporter(lambda t: saturated_text("saturated-7b", t)),
    }
    models = {"r-colon": "llama-3.1-8b", "r-under": "llama-3.1-8b", "r-trt": "qwen-7b", "r-sat": "saturated-7b"}
    sd = tmp_path / "targets.json"
    import json

    sd.write_text(json.dumps([
        {"targets": [f"127.0.0.1:{e.port}"], "labels": {"replica": rid, "model": models[rid]}}
        for rid, e in exps.items()
    ]))
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: engines\n"
        "    scrape_interval: 1s\n"
        f"    file_sd_configs: [{{files: ['{sd}'], refresh_interval: 1s}}]\n"
    )
    proc = start_prometheus(cfg, tmp_path / "tsdb", port)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, exps, proc
    finally:
        stop_prometheus(proc)
        for e in exps.values():
            e.stop()


def start_prometheus(cfg: Path, tsdb: Path, port: int) -> subprocess.Popen[bytes]:
    """A Prometheus on 127.0.0.1:`port`, returned once it answers /-/ready."""
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tsdb}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return proc


def stop_prometheus(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def wait_for(pred: Callable[[], object], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():  # type: ignore[misc]
            return
        await asyncio.sleep(0.5)
    raise AssertionError("condition not met in time")


async def test_observe_both_spellings_and_trtllm_then_fail_static(prom_lab) -> None:  # type: ignore[no-untyped-def]
    url, exps, proc = prom_lab
    canon = {"llama318binstruct": "llama-3.1-8b"}
    from fleetplan.models.names import model_key

    async with PromClient(url) as client:
        obs = Observer(
            client,
            ObserverConfig(window_s=5, history_s=30, history_step_s=1, time_scale=2.0),
            canonical=lambda n: canon.get(model_key(n), n),
        )

        async def ready() -> bool:
            s = await obs.snapshot(["llama-3.1-8b", "qwen-7b", "saturated-7b"])
            return all(not m.stale and m.rate_rps for m in s.models.values()) and len(s.replicas) == 4 and len(s.models["llama-3.1-8b"].history) >= 6

        await wait_for(ready, 30)
        snap = await obs.snapshot(["llama-3.1-8b", "qwen-7b", "saturated-7b", "absent-model"])
        print(render_snapshot(snap))
        ll, qw = snap.models["llama-3.1-8b"], snap.models["qwen-7b"]
        # two vLLM replicas at 2 req/s wall each, time scale 2 -> 2 simulated req/s
        assert ll.rate_rps == pytest.approx(2.0, rel=0.15)
        assert ll.isl == pytest.approx(100, rel=0.05) and ll.osl == pytest.approx(20, rel=0.05)
        assert ll.ttft_p99_ms is not None and 10 < ll.ttft_p99_ms <= 100
        assert ll.itl_p99_ms is not None and 10 < ll.itl_p99_ms <= 25
        assert ll.queue_depth == 6 and ll.running == 10 and ll.kv_usage == pytest.approx(0.25)
        assert ll.replicas_up == 2 and not ll.stale
        assert qw.rate_rps == pytest.approx(0.5, rel=0.15)
        assert qw.isl == pytest.approx(400, rel=0.05) and qw.osl == pytest.approx(50, rel=0.05)
        assert qw.ttft_p99_ms is not None and 100 < qw.ttft_p99_ms <= 500
        assert qw.kv_usage == pytest.approx(0.5)
        assert snap.replicas["r-trt"].running == 2
        assert len(ll.history) >= 3 and ll.history[-1][0] <= snap.now_s
        # saturated: arrivals = completions (1/s) + queue growth (0.5/s) = 1.5/s wall = 0.75 simulated;
        # the completion rate alone (0.5) would under-size the fleet exactly when it is short
        assert snap.models["saturated-7b"].rate_rps == pytest.approx(0.75, rel=0.12)
        absent = snap.models["absent-model"]
        assert absent.stale and absent.rate_rps is None
        assert any("absent-model" in a for a in snap.alerts)

        # one llama target down -> llama is stale (fail static), qwen still fine
        exps["r-under"].stop()

        async def llama_stale() -> bool:
            s = await obs.snapshot(["llama-3.1-8b"])
            return s.models["llama-3.1-8b"].stale

        await wait_for(llama_stale, 15)
        snap = await obs.snapshot(["llama-3.1-8b", "qwen-7b"])
        # the rate the targets that are up still serve stays, as a lower bound (it can raise capacity,
        # never lower it): at least r-colon's 1 simulated rps, at most what both served
        ll = snap.models["llama-3.1-8b"]
        assert ll.rate_rps is not None and 0.85 <= ll.rate_rps <= 2.3
        assert ll.isl is None and ll.osl is None  # no length means planned on from a partial reading
        assert any("r-under" in a for a in snap.alerts)
        assert not snap.models["qwen-7b"].stale

        # Prometheus down -> everything stale, one alert, no exception
        proc.terminate()
        proc.wait(10)
        snap = await obs.snapshot(["llama-3.1-8b", "qwen-7b"])
        assert not snap.prometheus_ok
        assert all(m.stale and m.rate_rps is None for m in snap.models.values())
        assert snap.alerts and "unreachable" in snap.alerts[0]


async def test_a_new_replica_is_counted_from_its_start_in_its_first_window(prom_lab, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A replica that becomes ready joins qwen-7b (1 req/s beside r-trt's 1 req/s). In its first
    rate window its samples do not cover the window: told when it became ready, the Observer counts
    it from then (its counter began at 0) and the model stays known at the window's true rate,
    1 + (the new replica's age in the window) / 10 s; not told, the model is fail-static (a lower
    bound) for that window, as before."""
    import json

    url, _exps, _proc = prom_lab
    async with PromClient(url) as client:
        obs = Observer(client, ObserverConfig(window_s=10, history_s=30, history_step_s=1))

        async def steady() -> bool:
            m = (await obs.snapshot(["qwen-7b"])).models["qwen-7b"]
            return not m.stale and m.rate_rps == pytest.approx(1.0, rel=0.15)

        await wait_for(steady, 30)
        ready_s = time.time()
        new = Exporter(lambda t: f'trtllm_request_success_total{{model_name="qwen-7b"}} {1.0 * t}\n'
                                 'trtllm_num_requests_running{model_name="qwen-7b"} 0\n'
                                 'trtllm_num_requests_waiting{model_name="qwen-7b"} 0\n')
        try:
            sd = tmp_path / "targets.json"
            targets = json.loads(sd.read_text())
            targets.append({"targets": [f"127.0.0.1:{new.port}"], "labels": {"replica": "r-new", "model": "qwen-7b"}})
            sd.write_text(json.dumps(targets))
            told, untold = [], []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                a = await obs.snapshot(["qwen-7b"], ready_wall_s={"r-new": ready_s})
                b = await obs.snapshot(["qwen-7b"])
                for snap, seen in ((a, told), (b, untold)):
                    r = snap.replicas.get("r-new")
                    if r is not None and r.up and not r.window_full:
                        seen.append((snap.wall_s, snap.models["qwen-7b"]))
                if told and a.replicas["r-new"].window_full:
                    break
                await asyncio.sleep(0.1)
        finally:
            new.stop()
    assert untold, "the new replica's first window was never observed"
    # until its scrapes cover half its time since READY (file_sd picks it up, 1 s scrapes: ~2 s),
    # its count would be mostly extrapolation: a lower bound; from then on it is counted while it
    # became ready inside the window (later, a first scrape that came late leaves the window
    # partial for a replica ready before it: a lower bound again, until its samples cover it)
    counted = [(wall, m) for wall, m in told if 4.0 <= wall - ready_s < 9.5]
    assert len(counted) >= 2 and all(not m.stale for _, m in counted), \
        [(round(w - ready_s, 2), m.reasons) for w, m in counted if m.stale]
    # the true rate over the window (its count extrapolated from its last scrape, as rate() does)
    true = [(1.0 + min(wall - ready_s, 10.0) / 10.0, m.rate_rps) for wall, m in told if not m.stale]
    assert all(r is not None and abs(r - t) <= 0.1 for t, r in true), true
    assert all(m.stale and any("r-new" in x for x in m.reasons) for _, m in untold)


async def test_prometheus_restarted_with_empty_data_reads_unknown_not_zero(prom_lab, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 11 item 3: right after Prometheus comes back with empty data, the rate windows are empty
    or partial. Until they are covered, the model is stale (no scale-down) with its rate unknown or a
    lower bound, never a known under-read (an idle 0 rps before the fix)."""
    url, _exps, first = prom_lab
    port = int(url.rsplit(":", 1)[1])
    true_rps = 1.0  # r-trt: 1 request per wall second
    async with PromClient(url) as client:
        obs = Observer(client, ObserverConfig(window_s=5, history_s=30, history_step_s=1))

        async def steady() -> bool:
            m = (await obs.snapshot(["qwen-7b"])).models["qwen-7b"]
            return not m.stale and m.rate_rps == pytest.approx(true_rps, rel=0.15)

        await wait_for(steady, 30)
        stop_prometheus(first)
        shutil.rmtree(tmp_path / "tsdb")
        proc = start_prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", port)
        try:
            seen = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                snap = await obs.snapshot(["qwen-7b"])
                seen.append(snap.models["qwen-7b"])
                if snap.prometheus_ok and not seen[-1].stale:
                    break
                await asyncio.sleep(0.25)
        finally:
            stop_prometheus(proc)
    known = [m for m in seen if not m.stale]
    assert known, "the window never filled again"
    # every reading the planner may scale down on is a full-window one
    assert all(m.rate_rps == pytest.approx(true_rps, rel=0.2) for m in known), [m.rate_rps for m in known]
    # the window-filling period was observed: targets scraped, the window not yet covered
    partial = [m for m in seen if m.stale and m.replicas_up and any("window" in r for r in m.reasons)]
    assert partial
    # while stale, the rate is unknown or a lower bound (it may only raise capacity)
    assert all(m.rate_rps is None or m.rate_rps <= true_rps * 1.2 for m in partial)


@pytest.fixture
def sim_engines() -> Iterator[dict[str, tuple[str, int]]]:
    """A vLLM-persona and a TRT-LLM-persona simulated engine (time scale 20): persona -> (model, port)."""
    import sys

    engines: dict[str, tuple[str, int]] = {}
    procs = []
    try:
        for persona, model, tp in (("vllm", "llama-3.1-8b", "1"), ("trtllm", "llama-3.3-70b", "4")):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fleetplan", "sim-engine", "--persona", persona, "--model", model,
                 "--gpu", "h100", "--tp", tp, "--port", str(port), "--time-scale", "20", "--startup-s", "0",
                 "--replica-id", f"r-{persona}", "--min-chunk-interval-ms", "100"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            ))
            engines[persona] = (model, port)
        for _, port in engines.values():
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        yield engines
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)


async def test_observe_sim_engines_vllm_and_trtllm_personas(prometheus, sim_engines) -> None:  # type: ignore[no-untyped-def]
    """D's Prometheus fixture scraping two simulated engines (vLLM persona on /metrics, TRT-LLM persona on
    /prometheus/metrics via the file_sd `__metrics_path__` written by controller/routing.py)."""
    from fleetplan.controller.routing import ScrapeTarget, write_file_sd
    from fleetplan.sim.replay import run_load

    k = 20.0
    sd = prometheus.file_sd_dir / "observe-test.json"
    targets = [ScrapeTarget(f"127.0.0.1:{port}", model, persona, "host-a", f"r-{persona}")
               for persona, (model, port) in sim_engines.items()]
    write_file_sd(sd, targets)
    try:
        async with PromClient(prometheus.url) as client:
            async def scraped() -> bool:  # file_sd discovery takes up to ~5 s
                ups = await client.query('up{replica=~"r-vllm|r-trtllm"}')
                return len(ups) == 2 and all(u.value == 1 for u in ups)

            await wait_for(scraped, 30)
            # 1 simulated rps for 160 simulated s (8 s wall) on each engine, ISL 300 / OSL 40
            loads = [run_load([(i * 1.0, 300, 40) for i in range(160)], f"http://127.0.0.1:{port}", speed=k,
                              model=model) for model, port in sim_engines.values()]
            results = await asyncio.gather(*loads)
            bad = [r for rs in results for r in rs if r.outcome != "ok"]
            assert not bad, bad[:2]
            obs = Observer(client, ObserverConfig(window_s=6, history_s=20, history_step_s=1, time_scale=k))
            snap = await obs.snapshot(["llama-3.1-8b", "llama-3.3-70b"])
        print(render_snapshot(snap))
        for model in ("llama-3.1-8b", "llama-3.3-70b"):
            m = snap.models[model]
            assert m.replicas_up == 1 and m.replicas_down == 0
            assert m.isl == pytest.approx(300, rel=0.1) and m.osl == pytest.approx(40, rel=0.1)
            assert m.rate_rps == pytest.approx(1.0, rel=0.35)  # simulated rps over the last 6 s wall
            assert m.ttft_p50_ms is not None and m.ttft_p99_ms is not None and m.ttft_p50_ms <= m.ttft_p99_ms
            assert m.itl_p99_ms is not None and 1 < m.itl_p99_ms < 200
            assert m.kv_usage is not None and m.queue_depth is not None
    finally:
        sd.unlink(missing_ok=True)


def pool_text(model_name: str, gen_tokens: int, t: float) -> str:
    """One pool of a disaggregated vLLM deployment: 2 req/s of 100-token prompts, each with
    `gen_tokens` generated (1 on the prefill pool, the whole output on the decode pool)."""
    n = 2.0 * t
    lines = [
        f'vllm:request_success_total{{model_name="{model_name}",finished_reason="length"}} {n}',
        f'vllm:prompt_tokens_total{{model_name="{model_name}"}} {100 * n}',
        f'vllm:generation_tokens_total{{model_name="{model_name}"}} {gen_tokens * n}',
        f'vllm:num_requests_waiting{{model_name="{model_name}"}} 0',
        f'vllm:num_requests_running{{model_name="{model_name}"}} 1',
    ]
    for le in ("1.0", "128.0", "+Inf"):
        lines.append(f'vllm:request_prompt_tokens_bucket{{model_name="{model_name}",le="{le}"}} '
                     f'{0 if le == "1.0" else n}')
        lines.append(f'vllm:request_generation_tokens_bucket{{model_name="{model_name}",le="{le}"}} '
                     f'{n if gen_tokens <= float(le) else 0}')
    lines.append(f'vllm:request_prompt_tokens_sum{{model_name="{model_name}"}} {100 * n}')
    lines.append(f'vllm:request_prompt_tokens_count{{model_name="{model_name}"}} {n}')
    lines.append(f'vllm:request_generation_tokens_sum{{model_name="{model_name}"}} {gen_tokens * n}')
    lines.append(f'vllm:request_generation_tokens_count{{model_name="{model_name}"}} {n}')
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus not installed")
async def test_a_disaggregated_models_requests_are_counted_once(tmp_path: Path) -> None:
    """A request of a disaggregated model finishes on a prefill replica (one token) and again on a
    decode replica: the targets' `role` labels (controller/routing.py file_sd, written by the
    executor for pool replicas) make the model's rate and prompt lengths read where requests enter
    and its output lengths where they leave, so 2 req/s through both pools reads 2 req/s, 20 tokens out."""
    from fleetplan.controller.routing import ScrapeTarget, write_file_sd
    from fleetplan.planner.queries import ROLE_LABEL

    exps = {"r-pre": Exporter(lambda t: pool_text("pooled-8b", 1, t)),
            "r-dec": Exporter(lambda t: pool_text("pooled-8b", 20, t))}
    roles = {"r-pre": "prefill", "r-dec": "decode"}
    sd = tmp_path / "targets.json"
    write_file_sd(sd, [ScrapeTarget(f"127.0.0.1:{e.port}", "pooled-8b", "vllm", "host-a", rid,
                                    extra_labels=((ROLE_LABEL, roles[rid]),)) for rid, e in exps.items()])
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n  - job_name: engines\n"
                   f"    scrape_interval: 1s\n    file_sd_configs: [{{files: ['{sd}'], refresh_interval: 1s}}]\n")
    proc = start_prometheus(cfg, tmp_path / "tsdb", port)
    try:
        async with PromClient(f"http://127.0.0.1:{port}") as client:
            obs = Observer(client, ObserverConfig(window_s=5, length_window_s=5, history_s=30, history_step_s=1))

            async def ready() -> bool:
                s = await obs.snapshot(["pooled-8b"])
                m = s.models["pooled-8b"]
                return not m.stale and bool(m.rate_rps) and m.osl is not None and len(m.history) >= 6

            await wait_for(ready, 40)
            m = (await obs.snapshot(["pooled-8b"])).models["pooled-8b"]
            assert m.rate_rps == pytest.approx(2.0, rel=0.15)  # not 4: the decode pool's completions are not arrivals
            assert m.isl == pytest.approx(100, rel=0.05)
            assert m.osl == pytest.approx(20, rel=0.05)  # not 10.5: the prefill pool's one token is not an output
            assert m.history and m.history[-1][1] == pytest.approx(2.0, rel=0.2)
    finally:
        stop_prometheus(proc)
        for e in exps.values():
            e.stop()
