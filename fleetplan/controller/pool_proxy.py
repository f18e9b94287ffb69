"""The pool proxy: an OpenAI-compatible front for the prefill and decode pools of disaggregated models.

A request for a pooled model takes two legs, as vLLM's disaggregated serving proxies do with the
NixlConnector:

1. **Prefill leg**: the client's body with `max_tokens` (and `max_completion_tokens`) 1, streaming
   off, no `stream_options` / `min_tokens`, and `kv_transfer_params` `{"do_remote_decode": true,
   ...}`, to the prefill replica with the fewest legs in flight. Its JSON response carries
   `kv_transfer_params` (where the prompt's KV blocks wait).
2. **Decode leg**: the client's body as sent, plus those `kv_transfer_params`, to the decode replica
   with the fewest legs in flight; its response (SSE or JSON) is passed through to the client as it
   arrives.

Both legs carry the same `X-Request-Id`. A leg that fails transiently (connection refused or reset,
502 / 503 / 504) before any byte reached the client is retried once, on another replica of that side
when there is one, after a jittered backoff; any other upstream error is passed to the client as the
upstream sent it. A side with no replica is a 503 naming the model, the side and the file.

The upstreams file (`fleetplan.controller.pool_table`) is re-read when it changes (polled); a leg in
flight keeps its replica. `/health` answers 200 with the models' pool sizes and the generation of
the table it serves (`pool_table.table_generation`: a writer waits for it before sending requests); `/metrics` the proxy's
own series (fresh registry, base units):

- `fleetplan_pool_proxy_requests_total{model}`: requests for a pooled model;
- `fleetplan_pool_proxy_failures_total{model, side}`: requests that failed on that side's leg;
- `fleetplan_pool_proxy_upstream_errors_total{side}`, `fleetplan_pool_proxy_retries_total{side}`:
  transient leg failures and the retries they caused;
- `fleetplan_pool_proxy_leg_seconds{side}`: wall seconds of each successful leg (the decode leg to
  its response's last byte);
- `fleetplan_pool_proxy_upstreams{model, side}`: replicas in the file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetplan.controller.mqtt import Backoff
from fleetplan.controller.pool_table import ModelPools, Side, TableError, Upstream, UpstreamsFile

log = logging.getLogger(__name__)

__all__ = ["PoolProxy", "ProxySettings", "prefill_body", "run_pool_proxy"]

TRANSIENT_STATUS = frozenset({502, 503, 504})
ATTEMPTS = 2  # a leg that fails transiently is retried once
LEG_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# headers of an upstream response not passed through (aiohttp sets its own framing)
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding",
                          "date", "server"})


@dataclass(frozen=True)
class ProxySettings:
    upstreams_file: Path
    poll_s: float = 0.5  # how often the file's stamp is checked (wall)
    connect_timeout_s: float = 5.0
    retry_initial_s: float = 0.05  # the retry's backoff: jittered in [x/2, x]
    retry_max_s: float = 1.0


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fleetplan_pool_proxy_requests", "requests for a pooled model", ["model"], registry=r)
        self.failures = Counter("fleetplan_pool_proxy_failures", "requests that failed on a side's leg",
                                ["model", "side"], registry=r)
        self.upstream_errors = Counter("fleetplan_pool_proxy_upstream_errors", "transient leg failures",
                                       ["side"], registry=r)
        self.retries = Counter("fleetplan_pool_proxy_retries", "legs retried after a transient failure",
                               ["side"], registry=r)
        self.leg_seconds = Histogram("fleetplan_pool_proxy_leg_seconds", "wall seconds of a successful leg",
                                     ["side"], registry=r, buckets=LEG_BUCKETS_S)
        self.upstreams = Gauge("fleetplan_pool_proxy_upstreams", "replicas in the upstreams file",
                               ["model", "side"], registry=r)
        # where a decode leg went: to the prefill replica's host (KV over NVLink), another host (the
        # network), or unknown (the file names no host for one of them)
        self.handoffs = Counter("fleetplan_pool_proxy_kv_handoffs", "decode legs by where the KV went",
                                ["model", "link"], registry=r)
        for side in Side:
            self.upstream_errors.labels(side.value)
            self.retries.labels(side.value)


class _LegFailed(Exception):
    """A leg failed: `response` is what the client gets."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class _Transient(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _error(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": err_type, "param": None, "code": status,
                              "error": {"message": message, "type": err_type, "code": status}}, status=status)


async def _relay(out: web.StreamResponse, chunk: bytes | None) -> bool:
    """Write a chunk of the decode leg to the client (None: the end); False when the client is gone
    (it may close as soon as it read the last event: not an upstream failure)."""
    try:
        if chunk is None:
            await out.write_eof()
        else:
            await out.write(chunk)
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one too
        log.debug("pool proxy: the client went away: %s", exc)
        return False
    return True


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, no streaming, the remote-decode request."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return leg


class PoolProxy:
    """The proxy's state and HTTP app. `start()` / `stop()`, or `run_pool_proxy`."""

    def __init__(self, settings: ProxySettings, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.file = UpstreamsFile(settings.upstreams_file, rng)  # rng: the picks' tie breaks
        self.metrics = ProxyMetrics()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._watch: asyncio.Task[None] | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", self.h_metrics)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_post("/v1/completions", self.h_proxy)
        app.router.add_post("/v1/chat/completions", self.h_proxy)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Read the upstreams file (OSError / TableError when it cannot be), then listen."""
        self.file.load()
        self._gauge()
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                              auto_decompress=False)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        self._watch = asyncio.create_task(self._watch_file(), name="pool-proxy-watch")
        return self.port

    async def stop(self) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.cancel()
            try:
                await watch
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # stop() itself was cancelled: propagate
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_s)
            if self.file.refresh():
                self._gauge()

    def _gauge(self) -> None:
        self.metrics.upstreams.clear()
        for pools in self.file.table.values():
            for side in Side:
                self.metrics.upstreams.labels(pools.name, side.value).set(len(pools.side(side)))

    # -- handlers ------------------------------------------------------------------------------
    async def h_health(self, request: web.Request) -> web.Response:
        models = {p.name: {"prefill": len(p.prefill), "decode": len(p.decode)} for p in self.file.table.values()}
        return web.json_response({"status": "ok", "models": models, "generation": self.file.generation})

    async def h_metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def h_models(self, request: web.Request) -> web.Response:
        data = [{"id": p.name, "object": "model", "owned_by": "fleetplan"} for p in self.file.table.values()]
        return web.json_response({"object": "list", "data": data})

    async def h_proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the request body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        model = body.get("model")
        pools = self.file.pools(str(model)) if model is not None else None
        if pools is None:
            known = sorted(p.name for p in self.file.table.values())
            return _error(404, f"The model `{model}` is not pooled here (pooled: {known}; "
                          f"{self.settings.upstreams_file})", "NotFoundError")
        self.metrics.requests.labels(pools.name).inc()
        for side in Side:  # both sides before any leg: no prefill is spent on a request that cannot decode
            if not pools.side(side):
                return self._no_upstream(pools, side).response
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        if "Authorization" in request.headers:  # engines started with --api-key check it on both legs
            headers["Authorization"] = request.headers["Authorization"]
        try:
            first, prefilled_on = await self._prefill(request.path, pools, body, headers)
            decode = dict(body)
            kv = first.get("kv_transfer_params")
            if isinstance(kv, dict):
                decode["kv_transfer_params"] = kv
            return await self._decode(request, pools, decode, headers, prefilled_on)
        except _LegFailed as exc:
            return exc.response

    # -- the legs ------------------------------------------------------------------------------
    def _no_upstream(self, pools: ModelPools, side: Side) -> _LegFailed:
        self.metrics.failures.labels(pools.name, side.value).inc()
        return _LegFailed(_error(503, f"model {pools.name}: no {side.value} upstream in "
                                 f"{self.settings.upstreams_file}", "ServiceUnavailableError"))

    def _gave_up(self, pools: ModelPools, side: Side, detail: str) -> _LegFailed:
        self.metrics.failures.labels(pools.name, side.value).inc()
        return _LegFailed(_error(502, f"model {pools.name}: the {side.value} leg failed: {detail}", "BadGatewayError"))

    def _pick(self, pools: ModelPools, side: Side, tried: list[str], near: str | None = None) -> Upstream:
        """The replica for a leg's next attempt: the least outstanding (a decode leg: on the host of
        the prefill replica `near` while within the load bound), another than those tried when there
        is one; a side with no replica raises the 503."""
        up = self.file.pick(pools, side, exclude=tried, near=near)
        if up is None:
            raise self._no_upstream(pools, side)
        if tried:
            self.metrics.retries.labels(side.value).inc()
        tried.append(up.url)
        return up

    def _transient(self, pools: ModelPools, side: Side, headers: dict[str, str], up: Upstream,
                   exc: Exception) -> str:
        detail = exc.detail if isinstance(exc, _Transient) else f"{up.url}: {type(exc).__name__}: {exc}"
        self.metrics.upstream_errors.labels(side.value).inc()
        log.warning("pool proxy: %s %s leg %s failed: %s", pools.name, side.value, headers["X-Request-Id"], detail)
        return detail

    def _backoff(self) -> Backoff:
        return Backoff(self.settings.retry_initial_s, self.settings.retry_max_s)

    async def _prefill(self, path: str, pools: ModelPools, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[dict[str, Any], str]:
        """The prefill leg's response, and the URL of the replica that gave it."""
        assert self._session is not None
        leg = prefill_body(body)
        detail = ""
        tried: list[str] = []
        backoff = self._backoff()
        for attempt in range(ATTEMPTS):
            if attempt:
                await asyncio.sleep(backoff.next_delay_s())
            up = self._pick(pools, Side.PREFILL, tried)
            t0 = time.monotonic()
            up.outstanding += 1
            try:
                async with self._session.post(up.url + path, json=leg, headers=headers) as resp:
                    if resp.status in TRANSIENT_STATUS:
                        raise _Transient(f"{up.url}: HTTP {resp.status}")
                    raw = await resp.read()
                    if resp.status != 200:
                        self.metrics.failures.labels(pools.name, Side.PREFILL.value).inc()
                        raise _LegFailed(web.Response(status=resp.status, body=raw,
                                                      content_type=resp.content_type or "application/json"))
                out = json.loads(raw)
                if not isinstance(out, dict):
                    raise _Transient(f"{up.url}: the response is not a JSON object")
                self.metrics.leg_seconds.labels(Side.PREFILL.value).observe(time.monotonic() - t0)
                return out, up.url
            except (_Transient, aiohttp.ClientError, ValueError) as exc:  # ValueError: not JSON / UTF-8
                detail = self._transient(pools, Side.PREFILL, headers, up, exc)
            finally:
                up.outstanding -= 1
        raise self._gave_up(pools, Side.PREFILL, detail)

    async def _decode(self, request: web.Request, pools: ModelPools, body: dict[str, Any],
                      headers: dict[str, str], prefilled_on: str) -> web.StreamResponse:
        assert self._session is not None
        detail = ""
        tried: list[str] = []
        backoff = self._backoff()
        for attempt in range(ATTEMPTS):
            if attempt:
                await asyncio.sleep(backoff.next_delay_s())
            up = self._pick(pools, Side.DECODE, tried, near=prefilled_on)
            src, dst = pools.host(prefilled_on), pools.host(up.url)
            link = "unknown" if src is None or dst is None else "host" if src == dst else "network"
            self.metrics.handoffs.labels(pools.name, link).inc()
            t0 = time.monotonic()
            up.outstanding += 1
            out: web.StreamResponse | None = None
            try:
                async with self._session.post(up.url + request.path, json=body, headers=headers) as resp:
                    if resp.status in TRANSIENT_STATUS:
                        raise _Transient(f"{up.url}: HTTP {resp.status}")
                    out = web.StreamResponse(status=resp.status, headers={
                        k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS})
                    await out.prepare(request)
                    async for chunk in resp.content.iter_any():
                        if not await _relay(out, chunk):
                            return out  # the client is gone: the upstream response is closed on exit
                    await _relay(out, None)  # a client that closed once it read the last event was served
                if resp.status == 200:
                    self.metrics.leg_seconds.labels(Side.DECODE.value).observe(time.monotonic() - t0)
                else:
                    self.metrics.failures.labels(pools.name, Side.DECODE.value).inc()
                return out
            except (_Transient, aiohttp.ClientError) as exc:
                detail = self._transient(pools, Side.DECODE, headers, up, exc)
                if out is not None:  # bytes reached the client: no retry, the stream ends short
                    self.metrics.failures.labels(pools.name, Side.DECODE.value).inc()
                    return out
            finally:
                up.outstanding -= 1
        raise self._gave_up(pools, Side.DECODE, detail)


async def run_pool_proxy(settings: ProxySettings, host: str, port: int) -> int:
    """Serve until SIGTERM / SIGINT. Exit 1 when the file cannot be read or the port taken."""
    proxy = PoolProxy(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await proxy.start(host, port)
    except TableError as exc:
        print(f"pool-proxy: {exc}", flush=True)
        await proxy.stop()
        return 1
    except OSError as exc:
        print(f"pool-proxy: {exc.filename or f'{host}:{port}'}: {exc.strerror or exc}", flush=True)
        await proxy.stop()
        return 1
    print(f"pool-proxy listening on http://{host}:{proxy.port} ({len(proxy.file.table)} models from "
          f"{settings.upstreams_file})", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.stop()
    return 0

