"""fleetplan.sim.replay against servers that behave like the real ones, not like fleetplan's sim-engine.

A real vLLM streams several tokens in one SSE chunk (the tokens of one engine step, or of several
when the client reads slowly) and marks none of them with a count: the number of output tokens is
the final chunk's `usage.completion_tokens` (`stream_options.include_usage`, a chunk with
`choices: []`; with `continuous_usage_stats` every chunk carries the running count) -- see
vllm/entrypoints/openai/completion/serving.py, completion_stream_generator. trtllm-serve forbids
unknown request fields (OpenAIBaseModel `extra="forbid"` in tensorrt_llm/serve/openai_protocol.py)
and takes `prompt` as a string or a list of token ids, like vLLM.

Seen with the vLLM CPU build (tiny Llama, one request, max_tokens 64, ignore_eos): the old request
("fleetplan replay" + a `prompt_tokens` field vLLM ignores) was an 8-token prompt, and 9 of the 64
chunks had empty text (byte-level tokens that decode to nothing yet), so chunk counting saw 55 tokens
("incomplete") while `usage.completion_tokens` said 64. With a 300-id prompt vLLM counted 300 prompt
tokens, and `continuous_usage_stats` gave the count of every chunk.

`OpenAIServer` below is such a server on a loopback port: it merges `merge` tokens per chunk, sends
usage only when asked and when `usage` is on, counts a token-id prompt by its length (a text prompt
by its words), honours `continuous_usage_stats` when `continuous_usage` is on and answers 400 to
fields it does not know.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fleetplan.sim.replay import PromptStyle, run_load

REPO = Path(__file__).resolve().parents[2]

KNOWN_FIELDS = {"model", "prompt", "max_tokens", "min_tokens", "ignore_eos", "stream", "stream_options",
                "temperature", "top_p", "seed", "n"}


class OpenAIServer:
    """A streaming /v1/completions server with vLLM's chunking and usage rules (see the module doc)."""

    def __init__(self, *, merge: int = 3, usage: bool = True, continuous_usage: bool = True,
                 step_s: float = 0.002) -> None:
        self.merge = merge
        self.usage = usage
        self.continuous_usage = continuous_usage
        self.step_s = step_s
        self.bodies: list[dict[str, Any]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> OpenAIServer:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if unknown:
            return web.json_response({"object": "error", "message": f"Extra inputs are not permitted: {unknown}",
                                      "type": "BadRequestError", "code": 400}, status=400)
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        out = int(body["max_tokens"]) if body.get("ignore_eos") else 2
        options = body.get("stream_options") or {}
        final_usage = self.usage and bool(options.get("include_usage"))
        continuous = final_usage and self.continuous_usage and bool(options.get("continuous_usage_stats"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        while sent < out:
            n = min(self.merge, out - sent)
            await asyncio.sleep(self.step_s * n)
            sent += n
            choice = {"index": 0, "text": " tok" * n, "logprobs": None,
                      "finish_reason": "length" if sent == out else None}
            chunk: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                                     "choices": [choice]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                                  "total_tokens": prompt_tokens + sent}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if final_usage:
            last = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny", "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": out,
                              "total_tokens": prompt_tokens + out}}
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("continuous", [False, True], ids=["final-usage", "usage-every-chunk"])
async def test_merged_chunks_are_complete_by_the_servers_usage(continuous: bool) -> None:
    # continuous False: a server that ignores continuous_usage_stats sends usage only at the end
    server = await OpenAIServer(merge=3, usage=True, continuous_usage=continuous).start()
    try:
        reqs = [(0.0, 40, 10), (0.01, 7, 1), (0.02, 25, 31)]
        results = await run_load(reqs, server.url, model="tiny", prompts=PromptStyle.TOKEN_IDS, keep_itls=True)
    finally:
        await server.stop()
    for r, (_, isl, osl) in zip(results, reqs, strict=True):
        assert r.outcome == "ok", r
        assert r.output_tokens == osl and r.server_prompt_tokens == isl
        assert r.ttft_s is not None and r.ttft_s > 0
        if osl > 1:
            assert r.itl_mean_s is not None and r.itl_mean_s > 0
            # every token's gap is known when the server counts per chunk; else one gap per chunk
            assert r.itls_s is not None and len(r.itls_s) == (osl - 1 if continuous else -(-osl // 3) - 1)


async def test_without_usage_chunks_are_counted() -> None:
    server = await OpenAIServer(merge=1, usage=False).start()
    try:
        one_per_chunk = await run_load([(0.0, 10, 12)], server.url, model="tiny", prompts=PromptStyle.WORDS)
        server.merge = 4
        merged = await run_load([(0.0, 10, 12)], server.url, model="tiny", prompts=PromptStyle.WORDS)
    finally:
        await server.stop()
    assert one_per_chunk[0].outcome == "ok" and one_per_chunk[0].output_tokens == 12
    assert one_per_chunk[0].server_prompt_tokens is None
    # no usage and no per-chunk count: 3 chunks are all the client can know of
    assert merged[0].outcome == "incomplete" and merged[0].output_tokens == 3


@pytest.fixture
def strict_server() -> Iterator[OpenAIServer]:
    """The server on its own event loop in a thread, for a `fleetplan replay-load` process."""
    loop = asyncio.new_event_loop()
    server = OpenAIServer(merge=5, usage=True)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_replay_load_sends_the_traces_prompt_and_output_lengths(strict_server: OpenAIServer, tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lengths = [(300 + 37 * i, 20 + 3 * i) for i in range(6)]
    rows += [f"2023-11-16 18:15:{i:02d}.5000000,{isl},{osl}" for i, (isl, osl) in enumerate(lengths)]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "results.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "fleetplan", "replay-load", "--trace", str(trace), "--target", strict_server.url,
         "--speed", "20", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    bodies = sorted(strict_server.bodies, key=lambda b: b["max_tokens"])
    assert [(len(b["prompt"]), b["max_tokens"]) for b in bodies] == lengths
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] and b["model"] == "tiny" for b in bodies)
    assert all(isinstance(t, int) for b in bodies for t in b["prompt"])
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["server_prompt_tokens"], r["output_tokens"], r["outcome"]) for r in results] == [
        (isl, osl, "ok") for isl, osl in lengths]
