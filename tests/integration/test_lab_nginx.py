"""The lab's nginx front: per-model routing, graceful reload, failed reloads keep the old table.

The backends are small aiohttp servers in the test process (real HTTP on loopback) that say
who they are and can stream slowly, like an engine answering a long generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiohttp import web
from pydantic import ValidationError

from fleetplan.controller.routing import NginxReloadError, NginxRouter, read_generation
from fleetplan.controller.settings import ControllerSettings
from fleetplan.harness.servers import NginxServer

Backend = tuple[str, list[str]]  # (host:port, paths it received)


@pytest.fixture
async def backends() -> AsyncIterator[Callable[[str], Awaitable[Backend]]]:
    runners: list[web.AppRunner] = []

    async def start(name: str) -> Backend:
        seen: list[str] = []

        async def answer(request: web.Request) -> web.StreamResponse:
            seen.append(request.path_qs)
            chunks = int(request.query.get("chunks", "0"))
            if not chunks:
                return web.json_response({"backend": name, "path": request.path_qs})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(chunks):
                await resp.write(f"data: {json.dumps({'backend': name, 'i': i})}\n\n".encode())
                await asyncio.sleep(float(request.query.get("gap", "0.05")))
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"127.0.0.1:{port}", seen

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_routes_per_model_by_path_prefix_and_header(
    nginx: NginxServer, backends: Callable[[str], Awaitable[Backend]]
) -> None:
    (a, _), (b1, _), (b2, _) = await backends("a"), await backends("b1"), await backends("b2")
    router = NginxRouter(nginx.upstreams_path, nginx.reload)
    table = {"llama-3.1-8b": [a], "meta-llama/Llama-3.1-70B": [b1, b2], "idle-model": []}
    assert await asyncio.to_thread(router.apply, table)
    assert not await asyncio.to_thread(router.apply, table)  # unchanged: no rewrite, no reload
    async with httpx.AsyncClient(base_url=nginx.url, timeout=5) as client:
        r = await client.post("/m/llama-3.1-8b/v1/completions?x=1", json={"model": "llama-3.1-8b"})
        assert r.status_code == 200
        assert r.json() == {"backend": "a", "path": "/v1/completions?x=1"}

        r = await client.post("/v1/chat/completions", headers={"X-Model": "llama-3.1-8b"}, json={})
        assert r.json() == {"backend": "a", "path": "/v1/chat/completions"}

        hit = set()
        for _ in range(8):
            r = await client.post("/m/meta-llama/Llama-3.1-70B/v1/completions", json={})
            assert r.status_code == 200 and r.json()["path"] == "/v1/completions"
            hit.add(r.json()["backend"])
        assert hit == {"b1", "b2"}  # both replicas of the model take traffic, never model a's

        r = await client.post("/m/idle-model/v1/completions", json={})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "unavailable" and "idle-model" in r.json()["error"]["message"]

        r = await client.post("/m/unknown/v1/completions", json={})
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
        r = await client.post("/v1/completions", json={"model": "llama-3.1-8b"})
        assert r.status_code == 400 and "X-Model" in r.json()["error"]["message"]

        models = (await client.get("/v1/models")).json()
        assert {m["id"]: m["replicas"] for m in models["data"]} == {
            "idle-model": 0,
            "llama-3.1-8b": 1,
            "meta-llama/Llama-3.1-70B": 2,
        }


async def test_reload_after_upstream_change_drops_no_inflight_request(
    nginx: NginxServer, backends: Callable[[str], Awaitable[Backend]]
) -> None:
    (old, _), (new, new_seen) = await backends("old"), await backends("new")
    router = NginxRouter(nginx.upstreams_path, nginx.reload)
    await asyncio.to_thread(router.apply, {"m": [old]})

    async def stream(client: httpx.AsyncClient) -> tuple[int, list[str]]:
        got = []
        async with client.stream("POST", "/m/m/v1/completions?chunks=20&gap=0.05", json={}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    got.append(line[6:])
            return resp.status_code, got

    async with httpx.AsyncClient(base_url=nginx.url, timeout=10) as client:
        inflight = [asyncio.create_task(stream(client)) for _ in range(6)]
        await asyncio.sleep(0.3)  # every stream is mid-way (1 s each)
        assert not any(t.done() for t in inflight)
        # Drain "old": remove it from the upstream and reload while its streams run.
        await asyncio.to_thread(router.apply, {"m": [new]})
        assert not all(t.done() for t in inflight), "reload should not wait for in-flight streams"
        after = await client.post("/m/m/v1/completions", json={})
        results = await asyncio.gather(*inflight)
    assert after.json()["backend"] == "new"
    assert new_seen == ["/v1/completions"]
    for status, chunks in results:
        assert status == 200
        assert len(chunks) == 21 and chunks[-1] == "[DONE]"
        assert all(json.loads(c)["backend"] == "old" for c in chunks[:-1])


async def test_failed_reload_keeps_old_file_and_routing(
    nginx: NginxServer, backends: Callable[[str], Awaitable[Backend]]
) -> None:
    (a, _) = await backends("a")
    router = NginxRouter(nginx.upstreams_path, nginx.reload)
    await asyncio.to_thread(router.apply, {"m": [a]})
    before = nginx.upstreams_path.read_text()
    # A host nginx cannot resolve: `nginx -t` fails, nothing is signalled.
    with pytest.raises(NginxReloadError, match=r"no-such-host\.invalid"):
        await asyncio.to_thread(router.apply, {"m": ["no-such-host.invalid:8000"]})
    assert nginx.upstreams_path.read_text() == before
    assert await asyncio.to_thread(nginx.serving_generation) == read_generation(before)
    async with httpx.AsyncClient(base_url=nginx.url, timeout=5) as client:
        r = await client.post("/m/m/v1/completions", json={})
    assert r.json()["backend"] == "a"


async def test_model_names_with_slashes_dots_colons_route_exactly(
    nginx: NginxServer, backends: Callable[[str], Awaitable[Backend]]
) -> None:
    names = ["a", "a/b", "meta-llama/Llama-3.1-8B-Instruct", "qwen2.5:7b", "x+y", "a.b"]
    started = {name: await backends(name) for name in names}
    router = NginxRouter(nginx.upstreams_path, nginx.reload)
    await asyncio.to_thread(router.apply, {name: [addr] for name, (addr, _) in started.items()})
    async with httpx.AsyncClient(base_url=nginx.url, timeout=5) as client:
        for name in names:
            r = await client.post(f"/m/{name}/v1/completions", json={})
            assert r.json() == {"backend": name, "path": "/v1/completions"}, name
            r = await client.post("/v1/completions", headers={"X-Model": name}, json={})
            assert r.json()["backend"] == name
        # "a.b" is a name, not a regex: "/m/aXb/" routes nowhere.
        assert (await client.post("/m/aXb/v1/completions", json={})).status_code == 404


async def test_affinity_keeps_a_session_on_one_replica_through_real_nginx(
    nginx: NginxServer, backends: Callable[[str], Awaitable[Backend]]
) -> None:
    """Issue 20: `routing.affinity_headers` in the controller's settings -> nginx hashes the session
    header on a consistent ring: one conversation's turns reach the replica holding its prefix
    cache; sessions spread over the replicas; a request without the header is still served."""
    (b1, _), (b2, _), (b3, _) = await backends("b1"), await backends("b2"), await backends("b3")
    settings = ControllerSettings.model_validate({"routing": {"affinity_headers": {"m": "X-Session-Id"}}})
    router = NginxRouter(nginx.upstreams_path, nginx.reload, affinity=settings.routing.affinity_headers)
    assert await asyncio.to_thread(router.apply, {"m": [b1, b2, b3]})
    async with httpx.AsyncClient(base_url=nginx.url, timeout=5) as client:
        where: dict[str, set[str]] = {}
        for turn in range(4):
            for s in range(12):
                r = await client.post("/m/m/v1/completions", headers={"X-Session-Id": f"conv-{s}"},
                                      json={"turn": turn})
                assert r.status_code == 200
                where.setdefault(f"conv-{s}", set()).add(r.json()["backend"])
        assert all(len(b) == 1 for b in where.values()), where  # every turn of a session: one replica
        assert len(set().union(*where.values())) >= 2  # sessions spread
        r = await client.post("/m/m/v1/completions", json={})
        assert r.status_code == 200
    with pytest.raises(ValidationError, match="affinity header"):
        ControllerSettings.model_validate({"routing": {"affinity_headers": {"m": "bad header;"}}})
