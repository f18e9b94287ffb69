"""Timed, streaming load against an OpenAI-compatible endpoint (trace replay).

Library use (the demo and e2e tests drive load with it):

    results = await run_load([(0.0, 467, 64), (0.5, 1000, 128)], "http://127.0.0.1:8080",
                             speed=20.0, model="llama-3.1-8b")
    print(summarize(results))

Every request is a streaming `/v1/completions` call with `max_tokens` = `min_tokens` = the recorded
output length and `ignore_eos` (vLLM's and trtllm-serve's sampling extensions: the engine generates
exactly that many tokens). The prompt (`PromptStyle`): by default a short text plus the
`prompt_tokens` hint only fleetplan's simulated engines read; `TOKEN_IDS` sends the recorded prompt
length as a list of token ids (exact; vLLM, trtllm-serve and the simulated engines accept it), `WORDS`
as text of common words (about one token each). Times are measured on the wall clock and multiplied
by `speed` (= the engines' --time-scale), so they are simulated seconds.

Prefix reuse: a request with block ids (a trace's `hash_ids`, Mooncake) gets, for each 512-token
block, the same tokens wherever the same id appears, so an engine's prefix cache sees the trace's
reuse (a simulated engine in HINT mode gets the ids as `block_hashes`); `unique_prompts` (CLI
`--unique-prompts`) restores one different prompt per request (no reuse).

Output tokens: the server's own count, `usage.completion_tokens` of the final chunk (requested with
`stream_options.include_usage`), because a chunk may carry several tokens (vLLM merges the tokens of
a step, or of several steps when the client reads slowly). Per chunk, for the timing of each token:
the simulated engines' `n_tokens` field, else the growth of `usage.completion_tokens` when the
server reports it on every chunk (`continuous_usage_stats`, vLLM and trtllm-serve), else one token
per non-empty chunk. Chunk counting decides the total only when the server sends no usage.

CLI: `fleetplan replay-load --trace FILE --target URL [--speed K] [--duration-s S] ...`: bounded
by --max-requests and --duration-s (trace seconds), loopback targets only unless --allow-remote.

Clock: against fleetplan's simulated engines the latencies are read from the engine's own
simulated clock (each SSE chunk's `sim_time_s`, the `X-Sim-Arrival-S` header) by default, so
they do not depend on this host's CPU load; `engine_clock=False` (CLI `--wall-clock`) measures
wall time x speed as with any other server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from fleetplan.sim.prefix_cache import PREFIX_BLOCK_TOKENS

log = logging.getLogger(__name__)


class TargetError(ValueError):
    """A target URL that is refused (not loopback without allow_remote, or malformed)."""


class PromptStyle(Enum):
    """How a request carries the recorded prompt length."""

    HINT = "hint"  # "fleetplan replay" + the `prompt_tokens` field: fleetplan's simulated engines only
    TOKEN_IDS = "token-ids"  # a list of that many token ids: exact (OpenAI completions `prompt: int[]`)
    WORDS = "words"  # text of that many common words: ~1 token each, for servers that take text only


# Token ids of a TOKEN_IDS prompt: ordinary tokens in the vocabularies served here (Llama-2/Mistral put
# special and byte-fallback tokens below 259, Llama-3 and Qwen above 128000) and below 4096, so that
# small test vocabularies (the 4096-token tiny Llama of the vLLM CPU test) accept them too.
PROMPT_TOKEN_IDS = (1000, 4000)
# Words that are one token each (with their leading space) in common BPE vocabularies.
PROMPT_WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "it", "by", "at", "from",
    "this", "be", "or", "an", "not", "are", "we", "can", "all", "one", "time", "new", "more", "if", "will",
    "has", "but", "have", "which", "their", "so", "other", "was", "its", "there", "also", "into", "use",
    "data", "each", "may", "some", "these", "any", "return", "self", "name", "value", "list", "type",
)


@dataclass(frozen=True)
class LoadRequest:
    t_s: float  # arrival, simulated seconds from the start
    prompt_tokens: int
    output_tokens: int
    model: str | None = None
    # the prompt's 512-token block ids (a trace's hash_ids): equal ids, equal prompt text (see request_prompt)
    blocks: tuple[int, ...] | None = None


@dataclass
class RequestResult:
    index: int
    t_s: float  # scheduled arrival (simulated s)
    model: str | None
    prompt_tokens: int
    output_tokens_requested: int
    outcome: str = "pending"  # ok | http_<status> | timeout | refused | error | incomplete
    status: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None  # simulated seconds
    itl_mean_s: float | None = None  # (last - first) / (tokens - 1)
    itl_max_s: float | None = None  # largest gap between tokens (a coalesced chunk's gap / its tokens)
    e2e_s: float | None = None
    late_s: float = 0.0  # sent later than scheduled (client saturated), simulated s
    sim_start_s: float | None = None  # engine clock at arrival / last token (simulated engines only)
    sim_end_s: float | None = None
    error: str | None = None
    server_prompt_tokens: int | None = None  # usage.prompt_tokens as the server counted them (None: not sent)
    itls_s: list[float] | None = field(default=None, repr=False)  # the gaps between tokens (tokens - 1), keep_itls


def check_target(url: str, allow_remote: bool = False) -> str:
    """The base URL without a trailing slash; raises TargetError for non-loopback hosts."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"target {url!r}: expected http://HOST:PORT")
    host = parts.hostname
    if not allow_remote:
        loopback = host == "localhost"
        with contextlib.suppress(ValueError):
            loopback = loopback or ipaddress.ip_address(host).is_loopback
        if not loopback:
            raise TargetError(f"target {url!r} is not a loopback address; pass --allow-remote to load it")
    return url.rstrip("/")


def _as_load_request(item: Any) -> LoadRequest:
    if isinstance(item, LoadRequest):
        return item
    if isinstance(item, tuple | list):
        t, isl, osl = item[0], item[1], item[2]
        model = item[3] if len(item) > 3 else None
        blocks = tuple(item[4]) if len(item) > 4 and item[4] is not None else None
        return LoadRequest(float(t), int(isl), int(osl), model, blocks)
    # fleetplan.sim.traces.TraceRequest or anything with those attributes
    blocks = getattr(item, "blocks", None)
    return LoadRequest(float(item.t_s), int(item.prompt_tokens), int(item.output_tokens), getattr(item, "model", None),
                       tuple(blocks) if blocks is not None else None)


def _salted(block_id: int, salt: str) -> int:
    if not salt:
        return int(block_id)
    return int.from_bytes(hashlib.blake2b(f"{salt}:{block_id}".encode(), digest_size=8).digest(), "little") >> 1


def request_url(base: str, path: str, model: str | None) -> str:
    """`base` + `path`; a `{model}` in base is replaced by the request's model (URL-quoted), so that
    one replay of a multi-model trace routes each request, e.g. `http://127.0.0.1:8080/m/{model}`."""
    if "{model}" in base:
        if model is None:
            raise ValueError(f"target {base!r} has {{model}} but the request has no model")
        base = base.replace("{model}", quote(model, safe=""))
    return base + path


def _block_rng(block_id: int, salt: str) -> random.Random:
    return random.Random(f"fleetplan-block:{salt}:{block_id}")  # str seeds hash with sha512: stable across runs


def request_prompt(req: LoadRequest, style: PromptStyle, seed: int = 0, *, unique: bool = False,
                   salt: str = "") -> str | list[int]:
    """The prompt of `req` in `style`.

    With block ids (`req.blocks`, a trace's hash_ids) and not `unique`: block i is
    PREFIX_BLOCK_TOKENS (512) tokens (the last one the rest of the prompt) drawn from a generator
    seeded by its id (and `salt`), so requests whose blocks repeat share their prompt prefix token
    for token and a real engine's prefix cache sees the trace's reuse (the ids are chained: an
    equal id means an equal prefix). Otherwise (no blocks, or `unique`) TOKEN_IDS and WORDS prompts
    differ per `seed` (the request's index), so that a server's prefix cache sees no reuse."""
    if style is PromptStyle.HINT:
        return "fleetplan replay"
    n = max(1, req.prompt_tokens)
    lo, hi = PROMPT_TOKEN_IDS
    if req.blocks and not unique:
        ids: list[int] = []
        words: list[str] = []
        for i, h in enumerate(req.blocks):
            k = min(PREFIX_BLOCK_TOKENS, n - i * PREFIX_BLOCK_TOKENS)
            if k <= 0:
                break
            rng = _block_rng(h, salt)
            if style is PromptStyle.TOKEN_IDS:
                ids += [rng.randrange(lo, hi) for _ in range(k)]
            else:
                words += [rng.choice(PROMPT_WORDS) for _ in range(k)]
        rng = random.Random(seed)  # a prompt longer than its blocks: the rest is its own
        short = n - max(len(ids), len(words))
        if style is PromptStyle.TOKEN_IDS:
            return ids + [rng.randrange(lo, hi) for _ in range(short)]
        return " ".join(words + [rng.choice(PROMPT_WORDS) for _ in range(short)])
    rng = random.Random(seed)
    if style is PromptStyle.TOKEN_IDS:
        return [rng.randrange(lo, hi) for _ in range(n)]
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(n))


def request_body(
    req: LoadRequest, model: str | None, prompts: PromptStyle = PromptStyle.HINT, seed: int = 0, *,
    unique: bool = False, salt: str = "",
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": request_prompt(req, prompts, seed, unique=unique, salt=salt),
        "max_tokens": req.output_tokens,
        "min_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
        # vLLM: usage in a final chunk (choices []) and, with continuous_usage_stats, on every chunk
        # (vllm/entrypoints/openai/completion/serving.py, completion_stream_generator); trtllm-serve
        # has the same StreamOptions (tensorrt_llm/serve/openai_protocol.py).
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0.0,
    }
    if prompts is PromptStyle.HINT:
        # An extension only the simulated engines read; trtllm-serve rejects unknown fields.
        body["prompt_tokens"] = req.prompt_tokens
        if req.blocks and not unique:
            # the simulated engines' prefix cache: the block ids themselves (salted like the text)
            body["block_hashes"] = [_salted(h, salt) for h in req.blocks]
    m = req.model or model
    if m is not None:
        body["model"] = m
    return body


def _completion_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict) or usage.get("completion_tokens") is None:
        return None
    return int(usage["completion_tokens"])


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    res: RequestResult,
    speed: float,
    timeout_s: float,
    keep_itls: bool,
    engine_clock: bool,
) -> None:
    """One streaming request. Times in simulated seconds: the engine's own clock when it reports
    it (`X-Sim-Arrival-S` header, `sim_time_s` per chunk) and engine_clock is on, else wall x speed."""
    t0 = time.monotonic()
    origin: float | None = None  # the request's start on the measuring clock
    first: float | None = None
    last: float | None = None
    tokens = 0  # counted from the chunks
    usage_tokens: int | None = None  # the server's count (the last usage seen: the final chunk's)
    per_chunk_usage: bool | None = None  # decided by the first chunk with tokens: continuous usage stats
    max_gap = 0.0
    gaps: list[float] | None = [] if keep_itls else None
    finished = False
    use_sim = False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body) as resp:
                res.status = resp.status
                if resp.status != 200:
                    res.outcome = f"http_{resp.status}"
                    res.error = (await resp.text())[:300]
                    return
                hdr = resp.headers.get("X-Sim-Arrival-S")
                use_sim = engine_clock and hdr is not None
                origin = float(hdr) if use_sim and hdr is not None else 0.0
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        finished = True
                        break
                    chunk = json.loads(data)
                    usage = chunk.get("usage")
                    so_far = _completion_tokens(usage)
                    if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
                        res.server_prompt_tokens = int(usage["prompt_tokens"])
                    choices = chunk.get("choices") or []
                    if not choices:  # the final usage chunk
                        if so_far is not None:
                            usage_tokens = so_far
                        continue
                    ch = choices[0]
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content")
                    n_field = chunk.get("n_tokens")
                    if per_chunk_usage is None and (text or so_far):
                        per_chunk_usage = so_far is not None
                    if n_field is not None:
                        n = int(n_field)
                    elif per_chunk_usage and so_far is not None:
                        n = so_far - (usage_tokens or 0)
                    else:
                        n = 1 if text else 0
                    if so_far is not None:
                        usage_tokens = so_far
                    if n <= 0:
                        continue
                    sim_t = chunk.get("sim_time_s")
                    now = float(sim_t) if use_sim and sim_t is not None else (time.monotonic() - t0) * speed
                    times = chunk.get("sim_token_times_s") if use_sim else None
                    if not (isinstance(times, list) and len(times) == n):
                        times = None
                    if first is None:
                        ft = chunk.get("sim_first_token_s")
                        first = float(ft) if use_sim and ft is not None else now
                        prev = first
                        rest = times[1:] if times is not None else None
                        k_rest = n - 1
                    else:
                        assert last is not None
                        prev = last
                        rest = times
                        k_rest = n
                    if k_rest > 0:
                        if rest is not None:  # exact per-token times from the engine
                            chunk_gaps = []
                            for tt in rest:
                                chunk_gaps.append(float(tt) - prev)
                                prev = float(tt)
                        else:  # spread the chunk's gap evenly over its tokens
                            chunk_gaps = [(now - prev) / k_rest] * k_rest
                        max_gap = max(max_gap, *chunk_gaps)
                        if gaps is not None:
                            gaps.extend(chunk_gaps)
                    last = now
                    tokens += n
    except TimeoutError:
        res.outcome = "timeout"
    except aiohttp.ClientConnectorError as exc:
        res.outcome = "refused"
        res.error = str(exc)[:300]
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        res.outcome = "error"
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    if usage_tokens is not None:
        tokens = usage_tokens  # the server's count: chunks may have merged tokens
    res.output_tokens = tokens
    if first is not None and origin is not None:
        assert last is not None
        res.ttft_s = first - origin
        res.e2e_s = last - origin
        if use_sim:
            res.sim_start_s, res.sim_end_s = origin, last
        if tokens > 1:
            res.itl_mean_s = (last - first) / (tokens - 1)
            res.itl_max_s = max_gap
    res.itls_s = gaps
    if res.outcome == "pending":
        res.outcome = "ok" if finished and tokens >= res.output_tokens_requested else "incomplete"


async def run_load(
    requests: Sequence[Any],
    target: str,
    *,
    speed: float = 1.0,
    model: str | None = None,
    max_in_flight: int = 2000,
    timeout_s: float = 600.0,
    allow_remote: bool = False,
    prompts: PromptStyle = PromptStyle.HINT,
    keep_itls: bool = False,
    engine_clock: bool = True,
    path: str = "/v1/completions",
    on_result: Callable[[RequestResult], None] | None = None,
    session: aiohttp.ClientSession | None = None,
    unique_prompts: bool = False,
    prefix_salt: str = "",
) -> list[RequestResult]:
    """Send each request at its time (t_s simulated seconds / speed of wall time), streaming.

    `requests`: (t_s, prompt_tokens, output_tokens[, model[, blocks]]) tuples, LoadRequest or
    TraceRequest. Requests with block ids (a trace's hash_ids) share prompt prefixes as the trace
    says (request_prompt) unless `unique_prompts`; `prefix_salt` draws other text for the same
    ids (a second replay against a server whose cache still holds the first).
    Returns one RequestResult per request, in input order. Timeouts are per request (wall s).
    engine_clock: measure latencies on a simulated engine's own clock when it reports it (exact
    simulated seconds, immune to this host's CPU load); False: wall time x speed.
    """
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    base = check_target(target, allow_remote)
    reqs = [_as_load_request(r) for r in requests]
    if "{model}" in base and model is None and any(r.model is None for r in reqs):
        raise ValueError(f"target {base!r} has a {{model}} placeholder but some requests have no model")
    results = [
        RequestResult(i, r.t_s, r.model or model, r.prompt_tokens, r.output_tokens) for i, r in enumerate(reqs)
    ]
    sem = asyncio.Semaphore(max(1, max_in_flight))
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(1, max_in_flight), force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
    start = time.monotonic()

    async def fire(i: int) -> None:
        req, res = reqs[i], results[i]
        async with sem:
            res.late_s = max(0.0, (time.monotonic() - start) * speed - req.t_s)
            url = request_url(base, path, req.model or model)
            await _one(session, url, request_body(req, model, prompts, seed=i, unique=unique_prompts, salt=prefix_salt), res, speed, timeout_s, keep_itls,
                       engine_clock)
        if on_result is not None:
            on_result(res)

    tasks: list[asyncio.Task[None]] = []
    try:
        for i in sorted(range(len(reqs)), key=lambda j: reqs[j].t_s):
            delay = start + reqs[i].t_s / speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i)))
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:  # cancelled from outside: let the requests unwind before the session closes
            await asyncio.gather(*pending, return_exceptions=True)
        if own:
            await session.close()
    return results


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(results: Sequence[RequestResult], *, duration_s: float | None = None) -> dict[str, Any]:
    """Counts by outcome and latency figures (simulated seconds) of the successful requests."""
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    ok = [r for r in results if r.outcome == "ok"]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [r.itl_mean_s for r in ok if r.itl_mean_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    if duration_s is None and results:
        ends = [r.t_s + r.late_s + (r.e2e_s or 0.0) for r in results]
        duration_s = max(ends) - min(r.t_s for r in results) if ends else None

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000.0, 3)

    return {
        "requests": len(results),
        "outcomes": outcomes,
        "ok": len(ok),
        "duration_s": duration_s,
        "request_rps": (len(ok) / duration_s) if duration_s else None,
        "output_tok_s": (out_tokens / duration_s) if duration_s else None,
        "ttft_mean_ms": ms(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_p50_ms": ms(_q(ttft, 0.5)),
        "ttft_p99_ms": ms(_q(ttft, 0.99)),
        "itl_mean_ms": ms(sum(itl) / len(itl)) if itl else None,
        "itl_p50_ms": ms(_q(itl, 0.5)),
        "itl_p99_ms": ms(_q(itl, 0.99)),
        "late_max_s": max((r.late_s for r in results), default=0.0),
    }


def results_jsonl(results: Sequence[RequestResult]) -> str:
    lines = []
    for r in results:
        d = asdict(r)
        d.pop("itls_s", None)
        lines.append(json.dumps(d))
    return "\n".join(lines) + ("\n" if lines else "")


async def _first_model(base: str) -> str | None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, s.get(base + "/v1/models") as resp:
        if resp.status != 200:
            return None
        data = await resp.json()
        items = data.get("data") or []
        return str(items[0]["id"]) if items else None


def replay_main(args: argparse.Namespace) -> int:
    from fleetplan.shared.atomic import atomic_write_text
    from fleetplan.sim.traces import TraceError, read_trace

    try:
        base = check_target(args.target, args.allow_remote)
    except TargetError as exc:
        print(f"replay-load: {exc}", file=sys.stderr)
        return 2
    try:
        trace = read_trace(args.trace)
    except TraceError as exc:
        print(f"replay-load: {exc}", file=sys.stderr)
        return 2
    reqs: list[LoadRequest] = []
    for tr in trace.requests:
        t = tr.t_s / args.rate_scale
        if t > args.duration_s or len(reqs) >= args.max_requests:
            break
        per_model = "{model}" in base and args.model is None  # route each request by the trace's model
        reqs.append(LoadRequest(t, tr.prompt_tokens, tr.output_tokens, tr.model if per_model else None, tr.blocks))
    if not reqs:
        print(f"replay-load: {args.trace}: no request within --duration-s {args.duration_s}", file=sys.stderr)
        return 2

    async def go() -> list[RequestResult]:
        model = args.model
        if model is None and "{model}" not in base:
            try:
                model = await _first_model(base)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("cannot read %s/v1/models: %s", base, exc)
        return await run_load(
            reqs, base, speed=args.speed, model=model, max_in_flight=args.concurrency_limit,
            timeout_s=args.timeout_s, allow_remote=args.allow_remote, engine_clock=not args.wall_clock,
            prompts=PromptStyle(args.prompts), unique_prompts=bool(getattr(args, "unique_prompts", False)),
            prefix_salt=str(getattr(args, "prefix_salt", "") or ""),
        )

    print(f"replay-load: {len(reqs)} requests over {reqs[-1].t_s:.0f} trace s "
          f"({reqs[-1].t_s / args.speed:.0f} wall s at speed {args.speed:g}) -> {base}", flush=True)
    results = asyncio.run(go())
    summary = summarize(results)
    if args.out:
        atomic_write_text(args.out, results_jsonl(results))
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] == len(results) else 1
