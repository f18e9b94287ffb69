"""A sick Prometheus for the fault suite: a proxy in front of the lab's Prometheus that passes every
request through until its mode file says otherwise.

    python -m fleetplan.harness.prom_proxy --port P --upstream http://127.0.0.1:9090 --mode-file F

The mode file holds one `Sickness` value; it is read on every request, so a suite switches the
proxy's behaviour by rewriting it (atomically). `PromProxy` starts and stops the child process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from enum import Enum
from pathlib import Path

import httpx

from fleetplan.harness.procs import ManagedProcess, free_port
from fleetplan.shared.atomic import atomic_write_text

TRICKLE_EVERY_S = 0.1  # one byte of the answer this often
LATE_S = 20.0  # a late answer comes this much later than Prometheus gave it
WRONG_SHAPE = b'{"status":"success","data":null}'


class Sickness(Enum):
    """What the proxy does with a request (the mode file holds the value)."""

    PASS = "pass"  # Prometheus's answer as it is
    TRICKLE = "trickle"  # Prometheus's answer, one byte every TRICKLE_EVERY_S
    WRONG_SHAPE = "wrong_shape"  # valid JSON of the wrong shape at once
    LATE = "late"  # Prometheus's answer, LATE_S later


def _mode(path: Path) -> Sickness:
    try:
        return Sickness(path.read_text().strip())
    except (OSError, ValueError):
        return Sickness.PASS


async def serve(port: int, upstream: str, mode_file: Path) -> None:
    from aiohttp import web

    client = httpx.AsyncClient(base_url=upstream, timeout=30.0)

    async def handle(request: web.Request) -> web.StreamResponse:
        mode = _mode(mode_file)
        if mode is Sickness.WRONG_SHAPE:
            return web.Response(body=WRONG_SHAPE, content_type="application/json")
        body = await request.read()
        try:
            up = await client.request(request.method, request.path, params=list(request.query.items()),
                                      content=body or None,
                                      headers={k: v for k, v in request.headers.items()
                                               if k.lower() in ("content-type", "authorization")})
        except httpx.HTTPError as exc:
            return web.Response(status=502, text=f"proxy: upstream {upstream}: {exc!r}")
        ctype = up.headers.get("content-type", "application/json")
        if mode is Sickness.LATE:
            await asyncio.sleep(LATE_S)
        if mode is not Sickness.TRICKLE:
            return web.Response(status=up.status_code, body=up.content, headers={"Content-Type": ctype})
        resp = web.StreamResponse(status=up.status_code, headers={"Content-Type": ctype})
        resp.content_length = len(up.content)
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client gave up (its deadline)
            for i in range(len(up.content)):
                await resp.write(up.content[i:i + 1])
                await asyncio.sleep(TRICKLE_EVERY_S)
            await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await client.aclose()


class PromProxy:
    """The proxy as a child process on a free loopback port; `set` switches its behaviour."""

    def __init__(self, workdir: Path, upstream: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode_file = workdir / "prom-proxy.mode"
        self.upstream = upstream
        workdir.mkdir(parents=True, exist_ok=True)
        self.set(Sickness.PASS)
        self.proc = ManagedProcess("prom-proxy", [sys.executable, "-m", "fleetplan.harness.prom_proxy",
                                                  "--port", str(self.port), "--upstream", upstream,
                                                  "--mode-file", str(self.mode_file)],
                                   workdir / "prom-proxy.log")

    def set(self, mode: Sickness) -> None:
        atomic_write_text(self.mode_file, mode.value + "\n")

    def start(self) -> PromProxy:
        self.proc.start()
        self.proc.wait_ready(self._answers, 30, f"the Prometheus proxy on {self.url}")
        return self

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--mode-file", type=Path, required=True)
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.upstream, args.mode_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
