"""`fleetplan bench-engine`: a concurrency sweep that writes `vllm bench serve --save-result` JSON.

For each concurrency c: `num_prompts` requests of exactly `isl` prompt / `osl` output tokens, all
ready at t=0 (request rate inf) and at most c in flight (`--max-concurrency c` of vllm bench serve).
Every `*_ms` field and the duration are SIMULATED: read from a simulated engine's own clock when
it reports it (see fleetplan.sim.replay), else wall measurements x `--time-scale` (the engine's). One file per concurrency, named so that `fleetplan models fit` finds the
metadata the JSON lacks (engine, GPU, TP, precision) in the name:
`<model>_<engine>_<gpu>_tp<N>_<precision>_isl<I>_osl<O>_conc<c>.json`. Engine, GPU, TP and
precision come from the simulator's `/sim/state` when the target is a sim engine, else from flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from fleetplan.sim.replay import RequestResult, TargetError, check_target, run_load


def _pct(xs: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile, as vllm bench serve uses."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(prefix: str, xs_s: Sequence[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in xs_s]
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{prefix}_ms": _pct(ms, 50) if ms else 0.0,
        f"std_{prefix}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
        f"p99_{prefix}_ms": _pct(ms, 99) if ms else 0.0,
    }


def result_json(
    results: Sequence[RequestResult],
    *,
    duration_s: float,
    model: str,
    concurrency: int,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """One `vllm bench serve --save-result` document (times simulated)."""
    ok = [r for r in results if r.outcome == "ok"]
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.itl_mean_s for r in ok if r.itl_mean_s is not None]
    itls = [g for r in ok for g in (r.itls_s or [])]  # every gap between consecutive tokens
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    dur = max(duration_s, 1e-9)
    doc: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": meta.get("engine") or "openai",
        "label": meta.get("label") or ("fleetplan-sim" if meta.get("simulated") else None),
        "model_id": model,
        "tokenizer_id": model,
        "num_prompts": len(results),
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": concurrency,
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur,
        "request_goodput": None,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "latencies": e2e,
        "queue_times": [r.late_s for r in ok],
        "max_output_tokens_per_s": out_tok / dur,
        "max_concurrent_requests": min(concurrency, len(results)),
        "rtfx": 0.0,
        **_stats("ttft", ttfts),
        **_stats("tpot", tpots),
        **_stats("itl", itls),
        **_stats("e2el", e2e),
        # fleetplan additions (ignored by other readers)
        "tensor_parallel_size": meta.get("tp"),
        "gpu": meta.get("gpu"),
        "precision": meta.get("precision"),
        "time_scale": meta.get("time_scale"),
        "errors": sorted({r.error or r.outcome for r in results if r.outcome != "ok"})[:5],
    }
    return doc


def file_name(model: str, meta: dict[str, Any], isl: int, osl: int, concurrency: int) -> str:
    from fleetplan.models.names import model_key

    parts = [model_key(model) or "model"]
    for key, fmt in (("engine", "{}"), ("gpu", "{}"), ("tp", "tp{}"), ("precision", "{}")):
        if meta.get(key) is not None:
            parts.append(fmt.format(meta[key]))
    parts += [f"isl{isl}", f"osl{osl}", f"conc{concurrency}"]
    return "_".join(parts) + ".json"


async def _sim_state(base: str) -> dict[str, Any] | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
                s.get(base + "/sim/state") as resp:
            if resp.status != 200:
                return None
            data = await resp.json()
            return data if isinstance(data, dict) else None
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
        return None


async def sweep(
    target: str,
    *,
    isl: int,
    osl: int,
    concurrencies: Sequence[int],
    num_prompts: int | None = None,
    time_scale: float = 1.0,
    model: str | None = None,
    meta: dict[str, Any] | None = None,
    allow_remote: bool = False,
    engine_clock: bool = True,
) -> list[dict[str, Any]]:
    """Run the sweep; one result document per concurrency (in the given order)."""
    base = check_target(target, allow_remote)
    meta = dict(meta or {})
    state = await _sim_state(base)
    if state is not None:
        meta.setdefault("simulated", True)
        meta.setdefault("engine", state.get("persona"))
        meta.setdefault("time_scale", state.get("time_scale"))
        model = model or state.get("model")
    meta.setdefault("time_scale", time_scale)
    if model is None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                s.get(base + "/v1/models") as resp:
            model = str((await resp.json())["data"][0]["id"])
    docs = []
    for c in concurrencies:
        n = num_prompts or max(50, 8 * c)
        reqs = [(0.0, isl, osl)] * n
        t0 = time.monotonic()
        results = await run_load(reqs, base, speed=time_scale, model=model, max_in_flight=c, keep_itls=True,
                                 allow_remote=allow_remote, engine_clock=engine_clock)
        duration = (time.monotonic() - t0) * time_scale
        starts = [r.sim_start_s for r in results if r.sim_start_s is not None]
        ends = [r.sim_end_s for r in results if r.sim_end_s is not None]
        if engine_clock and len(starts) == len(results) and ends:
            duration = max(ends) - min(starts)  # the engine's simulated clock
        docs.append(result_json(results, duration_s=duration, model=model, concurrency=c, meta=meta))
    return docs


def bench_main(args: argparse.Namespace) -> int:
    from fleetplan.shared.atomic import atomic_write_text

    try:
        concs = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        print(f"bench-engine: --concurrency must be comma-separated integers, got {args.concurrency!r}",
              file=sys.stderr)
        return 2
    if not concs or min(concs) < 1:
        print(f"bench-engine: --concurrency values must be >= 1, got {args.concurrency!r}", file=sys.stderr)
        return 2
    try:
        check_target(args.target, args.allow_remote)
    except TargetError as exc:
        print(f"bench-engine: {exc}", file=sys.stderr)
        return 2
    meta: dict[str, Any] = {"label": args.label} if args.label else {}
    for key in ("engine", "gpu", "tp", "precision"):
        if getattr(args, key, None) is not None:
            meta[key] = getattr(args, key)

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        base = args.target.rstrip("/")
        state = await _sim_state(base)
        if state is not None:
            # the simulator knows its configuration; flags win
            for key, skey in (("engine", "persona"), ("gpu", "gpu"), ("tp", "tp"), ("precision", "precision")):
                if key not in meta and state.get(skey) is not None:
                    meta[key] = state[skey]
        docs = await sweep(base, isl=args.isl, osl=args.osl, concurrencies=concs, num_prompts=args.num_prompts,
                           time_scale=args.time_scale, model=args.model, meta=meta,
                           allow_remote=args.allow_remote, engine_clock=not args.wall_clock)
        return docs, meta

    docs, meta = asyncio.run(go())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for c, doc in zip(concs, docs, strict=True):
        path = out / file_name(doc["model_id"], meta, args.isl, args.osl, c)
        atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
        bad += doc["failed"]
        print(f"conc {c:4d}: {doc['completed']}/{doc['num_prompts']} ok, {doc['request_throughput']:.2f} req/s, "
              f"{doc['output_throughput']:.0f} tok/s, TTFT mean {doc['mean_ttft_ms']:.1f} ms p99 "
              f"{doc['p99_ttft_ms']:.1f}, ITL mean {doc['mean_itl_ms']:.2f} ms p99 {doc['p99_itl_ms']:.2f} -> {path}")
    return 0 if bad == 0 else 1
