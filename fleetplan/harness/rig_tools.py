"""Open-loop Poisson load through nginx whose rate can change while it runs (simulated rps).

One connection per request (no keep-alive): a graceful nginx reload closes idle keep-alive
connections, and a client that reuses one at that instant gets "Can not write request body"
before nginx ever saw the request. Real clients retry such connection-level errors; this load
generator counts every failure, so it does not reuse connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import aiohttp

from fleetplan.sim.replay import RequestResult, run_load


class Load:
    def __init__(self, base_url: str, model: str, *, speed: float, isl: int, osl: int, seed: int = 0) -> None:
        self.url = f"{base_url.rstrip('/')}/m/{model}"
        self.model = model
        self.speed = speed
        self.isl, self.osl = isl, osl
        self.rate_rps = 0.0
        self.results: list[RequestResult] = []
        self._rng = random.Random(seed)
        self._chunks: list[asyncio.Task[Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self, rate_rps: float) -> None:
        self.rate_rps = rate_rps
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1000, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        chunk_wall = 1.0
        while True:
            span = chunk_wall * self.speed  # simulated seconds in this chunk
            reqs = []
            t = 0.0
            if self.rate_rps > 0:
                while True:
                    t += self._rng.expovariate(self.rate_rps)
                    if t >= span:
                        break
                    p = max(16, int(self._rng.gauss(self.isl, self.isl * 0.2)))
                    o = max(8, int(self._rng.gauss(self.osl, self.osl * 0.2)))
                    reqs.append((t, p, o, self.model))
            if reqs:
                self._chunks.append(asyncio.create_task(
                    run_load(reqs, self.url, speed=self.speed, timeout_s=120, on_result=self.results.append,
                             session=self._session)))
            await asyncio.sleep(chunk_wall)

    async def stop(self) -> list[RequestResult]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._chunks:
            await asyncio.gather(*self._chunks)
        if self._session is not None:
            await self._session.close()
        return self.results

    def failures(self) -> list[RequestResult]:
        return [r for r in self.results if r.outcome != "ok"]
