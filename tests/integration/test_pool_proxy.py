"""`fleetplan pool-proxy` in front of `fleetplan sim-engine --role prefill|decode` processes: every
request takes a prefill leg then a streamed decode leg; the upstreams file is re-read under load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetplan.shared.atomic import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _process(args: list[str], ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """A `fleetplan` process once it printed `ready`; SIGTERM at the end (exit 0), else killed."""
    proc = subprocess.Popen([sys.executable, "-m", "fleetplan", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert ready in line, line
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _engine(role: str, port: int) -> list[str]:
    return ["sim-engine", "--persona", "vllm", "--model", MODEL, "--gpu", "h100", "--port", str(port),
            "--time-scale", "20", "--startup-s", "0", "--min-chunk-interval-ms", "20", "--role", role,
            "--replica-id", f"{role}-{port}"]


@dataclass
class Rig:
    proxy: str
    prefill: list[str]
    decode: list[str]
    upstreams: Path

    def write(self, models: dict[str, Any]) -> None:
        atomic_write_text(self.upstreams, json.dumps({"models": models}))


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    ports = [_free_port() for _ in range(4)]
    prefill = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    decode = [f"http://127.0.0.1:{ports[2]}"]
    upstreams = tmp_path_factory.mktemp("pool") / "upstreams.json"
    r = Rig(f"http://127.0.0.1:{ports[3]}", prefill, decode, upstreams)
    r.write({MODEL: {"prefill": prefill, "decode": decode}})
    with contextlib.ExitStack() as stack:
        for role, port in (("prefill", ports[0]), ("prefill", ports[1]), ("decode", ports[2])):
            stack.enter_context(_process(_engine(role, port), "listening on http://127.0.0.1:"))
        stack.enter_context(_process(["pool-proxy", "--upstreams", str(upstreams), "--port", str(ports[3]),
                                      "--poll-s", "0.1"], "pool-proxy listening on"))
        yield r


async def _complete(s: aiohttp.ClientSession, rig: Rig, i: int) -> int:
    """One completion through the proxy (odd i streamed); the tokens of its answer (0: failed)."""
    want = 4 + i % 13
    body = {"model": MODEL, "prompt_tokens": 200 + 37 * (i % 50), "max_tokens": want, "ignore_eos": True,
            "stream": bool(i % 2)}
    chat = i % 5 == 0
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    url = rig.proxy + ("/v1/chat/completions" if chat else "/v1/completions")
    async with s.post(url, json=body) as resp:
        if resp.status != 200:
            return 0
        if not body["stream"]:
            out = await resp.json()
            choice = out["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            assert out["usage"]["completion_tokens"] == want
            return len(text.split())
        words = 0
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line:
                continue
            if line == b"data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]
            words += len(((delta["delta"].get("content") or "") if chat else delta["text"]).split())
        return words if done else 0


def _series(text: str, name: str, **labels: str) -> float:
    return sum(smp.value for f in text_string_to_metric_families(text) for smp in f.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


async def _metric(s: aiohttp.ClientSession, base: str, name: str, **labels: str) -> float:
    async with s.get(base + "/metrics") as resp:
        return _series(await resp.text(), name, **labels)


async def _served(s: aiohttp.ClientSession, base: str) -> float:
    return await _metric(s, base, "vllm:request_success_total")


async def _prefill_count(s: aiohttp.ClientSession, rig: Rig) -> int:
    async with s.get(rig.proxy + "/health") as resp:
        return int((await resp.json())["models"][MODEL]["prefill"])


async def _reloaded(s: aiohttp.ClientSession, rig: Rig, done: Callable[[dict[str, Any]], bool]) -> None:
    """Wait (at most 10 s) until the proxy's /health shows the file's new content."""
    for _ in range(200):
        async with s.get(rig.proxy + "/health") as resp:
            if done((await resp.json())["models"]):
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the proxy did not re-read {rig.upstreams}")


async def test_two_legs_under_load_and_an_upstream_removed_mid_load(rig: Rig) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        base = [await _served(s, u) for u in (*rig.prefill, *rig.decode)]
        n = 300
        got = await asyncio.gather(*(_complete(s, rig, i) for i in range(n)))
        assert [i for i, g in enumerate(got) if g != 4 + i % 13] == []
        served = [await _served(s, u) - b for u, b in zip((*rig.prefill, *rig.decode), base, strict=True)]
        assert served[0] > 0 and served[1] > 0 and served[0] + served[1] == n
        assert served[2] == n  # every request decoded on the decode replica

        # remove the second prefill replica while 200 requests are arriving
        async def remove_later() -> None:
            await asyncio.sleep(0.5)
            rig.write({MODEL: {"prefill": rig.prefill[:1], "decode": rig.decode}})

        async def paced(i: int) -> int:
            await asyncio.sleep(0.005 * i)
            return await _complete(s, rig, i)

        got2, _ = await asyncio.gather(asyncio.gather(*(paced(i) for i in range(200))), remove_later())
        assert [i for i, g in enumerate(got2) if g != 4 + i % 13] == []
        assert await _prefill_count(s, rig) == 1
        # after the reload, the removed replica gets nothing
        removed = await _served(s, rig.prefill[1])
        got3 = await asyncio.gather(*(_complete(s, rig, i) for i in range(40)))
        assert [i for i, g in enumerate(got3) if g != 4 + i % 13] == []
        assert await _served(s, rig.prefill[1]) == removed
        assert await _served(s, rig.decode[0]) - base[2] == n + 200 + 40
        assert await _metric(s, rig.proxy, "fleetplan_pool_proxy_requests_total", model=MODEL) >= n + 240
        assert await _metric(s, rig.proxy, "fleetplan_pool_proxy_failures_total") == 0
        assert await _metric(s, rig.proxy, "fleetplan_pool_proxy_leg_seconds_count", side="decode") >= n + 240
        rig.write({MODEL: {"prefill": rig.prefill, "decode": rig.decode}})
        await _reloaded(s, rig, lambda models: models[MODEL]["prefill"] == 2)


async def test_a_dead_replica_is_retried_elsewhere_and_an_empty_side_is_a_503(rig: Rig) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"  # nobody listens: connection refused
    rig.write({MODEL: {"prefill": [dead, rig.prefill[0]], "decode": rig.decode},
               "other-model": {"prefill": rig.prefill, "decode": []}})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await _reloaded(s, rig, lambda models: "other-model" in models)
        got = await asyncio.gather(*(_complete(s, rig, i) for i in range(40)))
        assert [i for i, g in enumerate(got) if g != 4 + i % 13] == []
        assert await _metric(s, rig.proxy, "fleetplan_pool_proxy_upstream_errors_total", side="prefill") > 0
        assert await _metric(s, rig.proxy, "fleetplan_pool_proxy_retries_total", side="prefill") > 0

        async with s.post(rig.proxy + "/v1/completions", json={"model": "other-model", "prompt": "hi"}) as resp:
            assert resp.status == 503
            msg = (await resp.json())["message"]
            assert "no decode upstream" in msg and str(rig.upstreams) in msg
        async with s.post(rig.proxy + "/v1/completions", json={"model": "nope", "prompt": "hi"}) as resp:
            assert resp.status == 404
        assert await _metric(s, rig.proxy, "fleetplan_pool_proxy_failures_total", model="other-model",
                             side="decode") == 1
    rig.write({MODEL: {"prefill": rig.prefill, "decode": rig.decode}})


async def test_the_legs_bodies_and_a_503_decode_retried_on_the_other_replica(tmp_path: Path) -> None:
    """In-process: fake replicas record what the proxy sends them; a draining decode replica's 503
    is retried on the other one before any byte reached the client."""
    from aiohttp import web

    from fleetplan.controller.pool_proxy import PoolProxy, ProxySettings

    seen: dict[str, list[dict[str, Any]]] = {"prefill": [], "draining": [], "decode": []}
    kv = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [0, 1], "remote_host": "h",
          "remote_port": 5600}

    async def prefill(request: web.Request) -> web.Response:
        seen["prefill"].append({**await request.json(), "rid": request.headers["X-Request-Id"]})
        return web.json_response({"choices": [{"text": " a"}], "kv_transfer_params": kv})

    async def draining(request: web.Request) -> web.Response:
        seen["draining"].append(await request.json())
        return web.json_response({"message": "the engine is shutting down"}, status=503)

    async def decode(request: web.Request) -> web.StreamResponse:
        seen["decode"].append({**await request.json(), "rid": request.headers["X-Request-Id"]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("a", "b", "c"):
            await resp.write(f'data: {{"choices": [{{"text": " {word}"}}]}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    runners = []
    urls = []
    for handler in (prefill, draining, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
    f = tmp_path / "pools.json"
    atomic_write_text(f, json.dumps({"models": {"m": {"prefill": urls[:1], "decode": urls[1:]}}}))
    proxy = PoolProxy(ProxySettings(f), rng=random.Random(3))
    port = await proxy.start()
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True, "min_tokens": 3,
                        "stream_options": {"include_usage": True}}
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.read()).count(b"data: ") == 4
            async with s.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
    finally:
        await proxy.stop()
        for runner in runners:
            await runner.cleanup()
    assert len(seen["prefill"]) == 6 and len(seen["decode"]) == 6
    for leg in seen["prefill"]:
        assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
        assert "min_tokens" not in leg and leg["kv_transfer_params"]["do_remote_decode"] is True
    for leg, first in zip(seen["decode"], seen["prefill"], strict=True):
        assert leg["kv_transfer_params"] == kv and leg["max_tokens"] == 3 and leg["stream"] is True
        assert leg["stream_options"] == {"include_usage": True} and leg["rid"] == first["rid"]
    # least outstanding, ties at random: some requests first went to the draining replica, each retried once
    retried = len(seen["draining"])
    assert 0 < retried < 6
    assert _series(text, "fleetplan_pool_proxy_retries_total", side="decode") == retried
    assert _series(text, "fleetplan_pool_proxy_upstream_errors_total", side="decode") == retried
    assert _series(text, "fleetplan_pool_proxy_failures_total") == 0


async def test_a_decode_leg_goes_to_the_prefill_replicas_host(tmp_path: Path) -> None:
    """In-process: two hosts with a prefill and a decode replica each, the file naming their hosts.
    Each request's KV goes to the decode replica on the host its prefill ran on (NVLink, not the
    network: planner/kv_route.py), counted by `fleetplan_pool_proxy_kv_handoffs_total{link}`;
    a file without hosts spreads the legs over both."""
    from aiohttp import web

    from fleetplan.controller.pool_proxy import PoolProxy, ProxySettings

    pairs: list[tuple[str, str]] = []  # (the prefill's host, the decode's host) per request

    def prefill(host: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"choices": [{"text": " a"}], "kv_transfer_params": {"remote_host": host}})
        return handler

    def decode(host: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            pairs.append((body["kv_transfer_params"]["remote_host"], host))
            return web.json_response({"choices": [{"text": " a b"}]})
        return handler

    runners = []
    urls: dict[tuple[str, str], str] = {}
    for role, host in (("prefill", "gpu-a"), ("prefill", "gpu-b"), ("decode", "gpu-a"), ("decode", "gpu-b")):
        app = web.Application()
        app.router.add_post("/v1/completions", (prefill if role == "prefill" else decode)(host))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls[role, host] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    f = tmp_path / "pools.json"

    def entries(role: str, hosts: bool) -> list[object]:
        return [{"url": u, "host": h} if hosts else u for (r, h), u in urls.items() if r == role]

    async def run(hosts: bool) -> str:
        atomic_write_text(f, json.dumps({"models": {"m": {"prefill": entries("prefill", hosts),
                                                          "decode": entries("decode", hosts)}}}))
        proxy = PoolProxy(ProxySettings(f), rng=random.Random(5))
        port = await proxy.start()
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(40):
                    body = {"model": "m", "prompt": "x", "max_tokens": 2}
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                async with s.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    return await resp.text()
        finally:
            await proxy.stop()

    try:
        text = await run(hosts=True)
        assert len(pairs) == 40 and all(src == dst for src, dst in pairs)
        assert {src for src, _ in pairs} == {"gpu-a", "gpu-b"}  # both prefill replicas served
        assert _series(text, "fleetplan_pool_proxy_kv_handoffs_total", model="m", link="host") == 40
        pairs.clear()
        text = await run(hosts=False)
        assert len(pairs) == 40 and any(src != dst for src, dst in pairs)
        assert _series(text, "fleetplan_pool_proxy_kv_handoffs_total", model="m", link="unknown") == 40
    finally:
        for runner in runners:
            await runner.cleanup()
