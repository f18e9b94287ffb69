"""The simulated engine server: an OpenAI-compatible HTTP server driving a BatchCore.

This module holds the engine (`SimEngine`: the step loop and the request handlers) and `run_engine`;
its configuration is `fleetplan.sim.engine_config.EngineConfig`, its clock and status and metrics
endpoints `fleetplan.sim.engine_endpoints`, its metrics `fleetplan.sim.engine_metrics`, the parsing
of request bodies `fleetplan.sim.engine_requests`.

One process (or one in-process server) per replica. Persona vllm serves `/v1/completions`,
`/v1/chat/completions` (SSE streaming and not), `/v1/models`, `/health` (503 while starting or
draining) and `/metrics` with vLLM's metric names, labels (`model_name`, `engine`) and histogram
bucket edges. Persona trtllm serves, as `trtllm-serve` does, `/prometheus/metrics` with the names,
types, labels and bucket edges of TensorRT-LLM's MetricsCollector, and on `/metrics` the JSON
iteration stats (see `fleetplan.sim.engine_metrics.TrtllmCollector` for the source and what the
simulation keeps).

Time: the simulated clock runs `time_scale` times faster than wall time. Everything the engine
reports (histograms, startup delay) is in SIMULATED seconds. The engine keeps its own simulated
clock: it advances by the modelled step durations and sleeps whenever it is ahead of
`time_scale` x wall time. When the host CPU cannot keep up, the simulated clock falls behind (the
engine effectively runs at a lower time scale; requests arriving meanwhile are stamped with the
engine's clock, never in its future); it catches up when the engine goes idle. With a finite
`lag_tolerance_s` it instead jumps forward when it lags by more than that much wall time (counted
in `/sim/state` as lag events). A request is never admitted before its arrival.

Each SSE chunk carries `sim_time_s`, the engine's simulated time of its last token (the first
chunk also `sim_first_token_s`; a chunk of several tokens `sim_token_times_s`, one per token), and
the response header `X-Sim-Arrival-S` the request's simulated arrival: clients can measure in exact
simulated time (fleetplan.sim.replay does when they are present) instead of wall time x time scale.

Prompt length: the request's `prompt_tokens` field when present (an extension; also accepted
inside `"fleetplan": {...}`), else the length of a token-id list prompt, else one token per
whitespace-separated word. Output length: `max_tokens` (`max_completion_tokens` for chat) when
`ignore_eos` is true; otherwise a seeded "natural" length (lognormal, mean ~ `natural_mean_tokens`)
clamped to [min_tokens, max_tokens]. Every SSE chunk carries `n_tokens`, the tokens it holds
(chunks coalesce tokens when steps are shorter than `min_chunk_interval_ms` of wall time).

Role (`EngineConfig.role`): a prefill or a decode instance of a disaggregated deployment, as vLLM's
with a KV connector; `fleetplan.sim.engine_roles` describes the `kv_transfer_params` exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import time
import uuid
from collections import deque
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, model_key
from fleetplan.sim.batching import BatchCore, StepResult
from fleetplan.sim.engine_config import EngineConfig
from fleetplan.sim.engine_endpoints import EngineEndpoints
from fleetplan.sim.engine_metrics import EngineStats, TrtllmCollector, VllmCollector
from fleetplan.sim.engine_requests import (
    RequestError,
    error_response,
    filler_text,
    prompt_blocks,
    prompt_length,
)
from fleetplan.sim.engine_roles import PrefillTickets, kv_params_of, transfer_s

log = logging.getLogger(__name__)

__all__ = ["EngineConfig", "SimEngine", "run_engine"]


class _Req:
    __slots__ = (
        "arrival", "blocks", "cached", "chat", "done", "done_event", "event", "finish_reason", "first", "last",
        "max_tokens_param", "out_tokens", "pending", "pending_times", "prefilled", "prompt_tokens", "ready_at", "rid",
        "scheduled",
    )

    def __init__(self, rid: str, prompt_tokens: int, out_tokens: int, max_tokens_param: int, arrival: float,
                 chat: bool, blocks: tuple[int, ...] | None = None) -> None:
        self.rid = rid
        self.blocks = blocks  # the prompt's block hashes (prefix cache), None: not cacheable
        self.cached = 0  # prompt tokens found in the prefix cache at admission
        self.prompt_tokens = prompt_tokens
        self.out_tokens = out_tokens
        self.max_tokens_param = max_tokens_param
        self.arrival = arrival
        self.ready_at = arrival  # + the frontend overhead: when the scheduler sees it
        self.chat = chat
        self.prefilled = False  # the prompt's KV came from a prefill instance (a decode instance's request)
        self.scheduled: float | None = None
        self.first: float | None = None
        self.last = 0.0
        self.pending = 0
        self.pending_times: list[float] = []  # engine time of each pending token (sent with coalesced chunks)
        self.done = False
        self.finish_reason = "length"
        self.event = asyncio.Event()
        self.done_event = asyncio.Event()  # wakes a coalescing stream early: the last chunk goes out at once


class SimEngine(EngineEndpoints):
    """The engine state and its HTTP app. Use `start()` / `stop()` (or run `run_engine`)."""

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {cfg.time_scale}")
        self.cfg = cfg
        self.params = cfg.params()
        self.core = BatchCore(self.params, seed=cfg.seed)
        self.stats = EngineStats(self.params.max_model_len)
        self._rng = random.Random(cfg.seed + 7919)
        self.incoming: deque[_Req] = deque()
        self.reqs: dict[str, _Req] = {}
        self._wake = asyncio.Event()
        self._all_done = asyncio.Event()
        self._t0_wall = time.monotonic()
        self._sim_t = 0.0
        self.startup_sim_s = cfg.startup_sim_s(self.params)
        self.draining = False
        self.lag_events = 0
        self.lag_sim_s = 0.0
        self.behind_max_wall_s = 0.0  # the most the simulated clock fell behind time_scale x wall
        self._warned_behind = False
        self.steps = 0
        self.last_step_s = 0.0  # simulated duration of the last engine step
        self._driver: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.tickets: PrefillTickets | None = None  # a prefill instance's kv_transfer_params (set by start)
        self.vllm_registry = CollectorRegistry(auto_describe=False)
        self.vllm_registry.register(VllmCollector(self))
        self.trtllm_registry = CollectorRegistry(auto_describe=False)
        self.trtllm_registry.register(TrtllmCollector(self))

    # -- lifecycle -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/ping", self.h_health)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/version", self.h_version)
        if self.cfg.persona is Engine.TRTLLM:
            app.router.add_get("/metrics", self.h_trt_iteration_stats)
            app.router.add_get("/prometheus/metrics", self.h_trt_metrics)
        else:
            app.router.add_get("/metrics", self.h_metrics)
        app.router.add_post("/v1/completions", self.h_completions)
        app.router.add_post("/v1/chat/completions", self.h_chat)
        app.router.add_get("/sim/state", self.h_state)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._t0_wall = time.monotonic()
        self._driver = asyncio.create_task(self._drive(), name="sim-engine-driver")
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        self.tickets = PrefillTickets(self.cfg.replica_id or uuid.uuid4().hex, host, int(self.port or 0),
                                      self.cfg.tp, self.params.block_size)
        log.info("sim-engine %s %s (%s) on %s:%s startup %.0f sim s", self.cfg.persona.value, self.cfg.model,
                 self.cfg.role.value, host, self.port, self.startup_sim_s)
        return int(self.port or 0)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Stop accepting requests; wait (wall) until the in-flight ones finish. True when all did."""
        self.draining = True
        if self.reqs:
            self._all_done.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_done.wait(),
                                       self.cfg.drain_timeout_s if timeout_s is None else timeout_s)
        return not self.reqs

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._driver is not None:
            driver, self._driver = self._driver, None
            driver.cancel()
            try:
                await driver
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # stop() itself was cancelled: propagate

    # -- the driver ----------------------------------------------------------------------------
    async def _drive(self) -> None:
        core = self.core
        k = self.cfg.time_scale
        tol = self.cfg.lag_tolerance_s * k
        incoming = self.incoming
        while True:
            if core.idle() and not incoming:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.wall_sim_now()
            if core.idle():
                self._sim_t = max(self._sim_t, incoming[0].ready_at)
            else:
                behind = (now - self._sim_t) / k  # wall seconds the simulated clock is behind
                if behind > self.behind_max_wall_s:
                    self.behind_max_wall_s = behind
                    if behind > 1.0 and not self._warned_behind:
                        self._warned_behind = True
                        log.warning("the host CPU cannot keep up at time scale %g: the simulated clock is %.1f "
                                    "wall s behind (lower --time-scale or the request rate, or raise "
                                    "--min-chunk-interval-ms)", k, behind)
            if not core.idle() and now - self._sim_t > tol:  # never when tol is inf
                self.lag_events += 1
                self.lag_sim_s += now - tol - self._sim_t
                self._sim_t = now - tol
            t = self._sim_t
            while incoming and incoming[0].ready_at <= t:
                r = incoming.popleft()
                if r.rid in self.reqs:  # not cancelled meanwhile
                    core.submit(r.rid, r.prompt_tokens, r.out_tokens, r.arrival, r.blocks, prefilled=r.prefilled)
            res = core.step(t)
            if res.duration_s <= 0.0:
                await asyncio.sleep(0.001)
                continue
            end = t + res.duration_s
            self._sim_t = end
            self.steps += 1
            self.last_step_s = res.duration_s
            ahead_wall = (end - self.wall_sim_now()) / k
            await asyncio.sleep(ahead_wall if ahead_wall > 0.0005 else 0)
            self._emit(res, t, end)

    def _emit(self, res: StepResult, start: float, end: float) -> None:
        s = self.stats
        reqs = self.reqs
        s.iter_tokens.observe(res.prefill_tokens + res.decode_seqs)
        s.preemptions += len(res.preempted)
        for rid in res.admitted:
            r0 = reqs.get(rid)
            if r0 is not None and r0.scheduled is None:
                r0.scheduled = start
        for rid, cached in res.cached:
            r0 = reqs.get(rid)
            if r0 is not None:
                r0.cached = cached
        itl_obs = 0
        for rid, n in res.tokens:
            r = reqs.get(rid)
            if r is None:
                continue
            if r.first is None:
                r.first = end
                s.ttft.observe(end - r.arrival)
                s.prompt_tokens += r.prompt_tokens
            else:
                gap = end - r.last
                if abs(gap - res.duration_s) < 1e-12:
                    itl_obs += n
                else:
                    s.itl.observe(gap, n)
            r.last = end
            r.pending += n
            r.pending_times.append(end)
            s.generation_tokens += n
            r.event.set()
        if itl_obs:
            s.itl.observe(res.duration_s, itl_obs)
        for rid in res.finished:
            r = reqs.get(rid)
            if r is None:
                continue
            r.done = True
            r.done_event.set()
            self._finish_stats(r, end)
            r.event.set()

    def _finish_stats(self, r: _Req, end: float) -> None:
        s = self.stats
        first = r.first if r.first is not None else end
        sched = r.scheduled if r.scheduled is not None else first
        s.success[r.finish_reason] += 1
        s.ttft_finished.observe(first - r.arrival)
        s.prompt_tokens_finished += r.prompt_tokens
        s.prompt_cached_tokens_finished += min(r.cached, r.prompt_tokens)
        s.generation_tokens_finished += r.out_tokens
        s.e2e.observe(end - r.arrival)
        s.queue.observe(max(0.0, sched - r.arrival))
        s.prefill.observe(first - sched)
        s.prefill_trt.observe(first - sched)
        s.decode.observe(end - first)
        s.inference.observe(end - sched)
        s.prompt_req.observe(r.prompt_tokens)
        s.gen_req.observe(r.out_tokens)
        s.max_tokens_req.observe(r.max_tokens_param)
        if r.out_tokens > 1:
            s.tpot_req.observe((end - first) / (r.out_tokens - 1))


    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    def _output_length(self, body: dict[str, Any], chat: bool, prompt: int) -> tuple[int, int]:
        """(tokens to generate, the max_tokens parameter)."""
        raw = body.get("max_completion_tokens") if chat else None
        if raw is None:
            raw = body.get("max_tokens")
        room = self.params.max_model_len - prompt
        if raw is None:
            max_tokens = 16 if not chat else room
        else:
            try:
                max_tokens = int(raw)
            except (TypeError, ValueError) as exc:
                raise RequestError(400, f"max_tokens must be an integer, got {raw!r}") from exc
            if max_tokens < 1:
                raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}")
        min_tokens = int(body.get("min_tokens") or 0)
        if min_tokens > max_tokens:
            raise RequestError(400, f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
        if prompt + max_tokens > self.params.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.params.max_model_len} tokens. However, you requested "
                f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion).",
            )
        if body.get("ignore_eos") or (body.get("fleetplan") or {}).get("ignore_eos"):
            return max_tokens, max_tokens
        mean = self.cfg.natural_mean_tokens
        natural = max(1, round(self._rng.lognormvariate(math.log(mean) - 0.5 * 0.8**2, 0.8)))
        return max(min_tokens, min(max_tokens, natural)), max_tokens

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if self.draining:
            return error_response(503, "the engine is shutting down", "ServiceUnavailableError")
        if not self.ready:
            return error_response(503, "the engine is starting", "ServiceUnavailableError")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            model = body.get("model")
            if model is not None and model_key(str(model)) != model_key(self.cfg.model):
                raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
            prompt = prompt_length(body, chat)
            blocks = prompt_blocks(body, chat) if self.cfg.prefix_caching else None
            out, max_tokens = self._output_length(body, chat, prompt)
            kv = kv_params_of(body)
            if self.cfg.role is Role.PREFILL:
                out = 1  # a prefill instance computes the prompt and answers its first token
            prefilled = self.cfg.role is Role.DECODE and kv is not None and kv.remote_prefill
            if self.core.blocks_for(prompt + out) > self.params.kv_blocks:
                raise RequestError(400, f"prompt + output ({prompt + out} tokens) exceeds the KV cache")
        except json.JSONDecodeError:
            return error_response(400, "the request body is not valid JSON")
        except RequestError as exc:
            return error_response(exc.status, exc.message, exc.err_type)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        arrival = self.wall_sim_now()
        if not self.core.idle():
            arrival = min(arrival, self._sim_t)  # the engine's clock lags: arrive at its "now"
        r = _Req(rid, prompt, out, max_tokens, arrival, chat, blocks)
        r.ready_at = r.arrival + self.params.factors.ttft_overhead_s
        if prefilled:  # the scheduler sees it once the prompt's KV arrived
            r.prefilled = True
            r.blocks = None
            r.ready_at += transfer_s(self.cfg, self.params, prompt)
        r.finish_reason = "length" if out >= max_tokens else "stop"
        self.reqs[rid] = r
        incoming = self.incoming
        i = len(incoming)
        while i > 0 and incoming[i - 1].ready_at > r.ready_at:  # transfers of other lengths: keep ready order
            i -= 1
        incoming.insert(i, r)
        self._wake.set()
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            if stream:
                return await self._stream(request, r, include_usage)
            while not r.done:
                await r.event.wait()
                r.event.clear()
            full = self._full_response(r)
            if self.cfg.role is Role.PREFILL and self.tickets is not None:
                full["kv_transfer_params"] = self.tickets.issue(r.prompt_tokens)
            return web.json_response(full)
        finally:
            if not r.done:
                self.core.cancel(rid)
                self.stats.success["abort"] += 1
            self.reqs.pop(rid, None)
            if not self.reqs:
                self._all_done.set()

    def _usage(self, r: _Req) -> dict[str, int]:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.out_tokens,
                "total_tokens": r.prompt_tokens + r.out_tokens}

    def _full_response(self, r: _Req) -> dict[str, Any]:
        text = filler_text(r.out_tokens, 0)
        created = int(time.time())
        if r.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": r.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason}
            obj = "text_completion"
        return {"id": r.rid, "object": obj, "created": created, "model": self.cfg.model, "choices": [choice],
                "usage": self._usage(r)}

    async def _stream(self, request: web.Request, r: _Req, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Sim-Arrival-S": repr(r.arrival)})
        await resp.prepare(request)
        created = int(time.time())
        min_gap = self.cfg.min_chunk_interval_ms / 1000.0
        last_write = 0.0
        sent = 0
        obj = "chat.completion.chunk" if r.chat else "text_completion"
        while True:
            await r.event.wait()
            r.event.clear()
            if min_gap > 0 and not r.done:
                wait = last_write + min_gap - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(r.done_event.wait(), wait)
            n = r.pending
            r.pending = 0
            times = r.pending_times
            r.pending_times = []
            final = r.done and sent + n >= r.out_tokens
            if n == 0 and not final:
                continue
            text = filler_text(n, sent)
            finish = r.finish_reason if final else None
            if r.chat:
                delta: dict[str, Any] = {"content": text}
                if sent == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            is_first = sent == 0
            sent += n
            chunk = {"id": r.rid, "object": obj, "created": created, "model": self.cfg.model,
                     "choices": [choice], "n_tokens": n, "sim_time_s": r.last}
            if is_first:
                chunk["sim_first_token_s"] = r.first
            if n > 1:
                chunk["sim_token_times_s"] = times
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            last_write = time.monotonic()
            if final:
                break
        if include_usage:
            usage_chunk = {"id": r.rid, "object": obj, "created": created, "model": self.cfg.model, "choices": [],
                           "usage": self._usage(r)}
            await resp.write(b"data: " + json.dumps(usage_chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def run_engine(cfg: EngineConfig, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT; then drain gracefully (finish in-flight requests) and exit 0."""
    engine = SimEngine(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await engine.start(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", host, port, exc)
        print(f"sim-engine: cannot listen on {host}:{port}: {exc}", flush=True)
        return 1
    print(f"sim-engine {cfg.persona.value} {cfg.model} listening on http://{host}:{engine.port} "
          f"(time scale {cfg.time_scale:g}, startup {engine.startup_sim_s:.0f} simulated s)", flush=True)
    try:
        await stop.wait()
        log.info("signal received: draining %d requests", len(engine.reqs))
        ok = await engine.drain()
        if not ok:
            log.warning("drain timeout: %d requests still in flight", len(engine.reqs))
    finally:
        await engine.stop()
    return 0
