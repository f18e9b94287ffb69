"""A Prometheus-like HTTP API on loopback (aiohttp) that can fall sick on command: answer late,
trickle its answer a byte at a time, or answer valid JSON of the wrong shape. Healthy, it answers
`time()` from its own clock, the request rate per model (the Observer's `clamp_min(...)` arrival
query) and a flat request-rate history; every other query gets an empty vector."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

SICK_ANSWERS: dict[str, Any] = {
    "null": {"status": "success", "data": None},
    "list": [],
    "no_result": {"status": "success", "data": {"resultType": "vector"}},
    "result_not_list": {"status": "success", "data": {"resultType": "vector", "result": {"a": 1}}},
    "bad_sample": {"status": "success", "data": {"resultType": "vector",
                                                 "result": [{"metric": {"model": "x"}, "value": "1"}]}},
}


class FakePrometheus:
    def __init__(self, demand_rps: dict[str, float], clock: Callable[[], float] = time.time) -> None:
        self.demand_rps = demand_rps
        self.clock = clock  # Prometheus's own clock
        self.mode = "ok"  # "ok", "late", "trickle" or a key of SICK_ANSWERS
        self.sick_match = ""  # the fault hits queries containing this (all when empty)
        self.late_s = 20.0
        self.trickle_byte_s = 0.1
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/query", self._query)
        app.router.add_get("/api/v1/query_range", self._query_range)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _vector(self, expr: str, at_s: float) -> list[dict[str, Any]]:
        if expr.startswith("clamp_min("):
            return [{"metric": {"model": m}, "value": [at_s, repr(r)]} for m, r in self.demand_rps.items()]
        return []

    async def _answer(self, request: web.Request, healthy: dict[str, Any]) -> web.StreamResponse:
        self.requests += 1
        expr = request.query.get("query", "")
        if self.mode == "ok" or self.sick_match not in expr:
            return web.json_response(healthy)
        if self.mode == "late":
            await asyncio.sleep(self.late_s)
            return web.json_response(healthy)
        if self.mode == "trickle":
            body = json.dumps(healthy).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):  # the client gave up: as it should
                for i in range(len(body)):
                    await resp.write(body[i:i + 1])
                    await asyncio.sleep(self.trickle_byte_s)
                await resp.write_eof()
            return resp
        return web.json_response(SICK_ANSWERS[self.mode])

    async def _query(self, request: web.Request) -> web.StreamResponse:
        expr = request.query.get("query", "")
        at = float(request.query.get("time", self.clock()))
        if expr == "time()":
            data: dict[str, Any] = {"resultType": "scalar", "result": [at, repr(at)]}
        else:
            data = {"resultType": "vector", "result": self._vector(expr, at)}
        return await self._answer(request, {"status": "success", "data": data})

    async def _query_range(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
        if end < start:  # as Prometheus answers it
            return web.json_response({"status": "error", "errorType": "bad_data",
                                      "error": "end timestamp must not be before start time"}, status=400)
        times = [start + i * step for i in range(int((end - start) // step) + 1)]
        result = [{"metric": {"model": m}, "values": [[t, repr(r)] for t in times]}
                  for m, r in self.demand_rps.items()] if "request_success" in q.get("query", "") else []
        return await self._answer(request, {"status": "success", "data": {"resultType": "matrix", "result": result}})
