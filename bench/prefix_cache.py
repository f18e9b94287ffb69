"""Prefix-cache hit rate of a fixed fleet on a trace with block hashes (Mooncake conversation), by router.

N replicas (FastCore, the replay's replica core, with its prefix cache) serve the trace open loop;
a router (fleetplan.sim.router) picks each request's replica: round-robin (nginx's default),
least-loaded (the replay's rule) or affinity (bounded-load consistent hashing on the prompt's
first blocks). Printed per (N, router): the token hit rate (vLLM's prefix_cache_hits /
prefix_cache_queries), the share of prompt blocks hit (comparable to the trace's single-replica
bound, `block_reuse_share`: 36.6 % for Mooncake conversation), TTFT p50/p99, mean ITL, and the
prefill tokens computed. `--no-cache`: the same without block hashes (every prompt computed).

    .venv/bin/python bench/prefix_cache.py [--trace FILE] [--replicas 2,4,8] [--routers rr,ll,aff]
        [--model llama-3.1-8b] [--gpu h100] [--engine vllm] [--rate-scale 1] [--max-requests N] [--json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fleetplan.models.names import Engine, GpuType
from fleetplan.sim.core import FastCore
from fleetplan.sim.groundtruth import EngineParams, RequestTooLongError, build_params
from fleetplan.sim.prefix_cache import PREFIX_BLOCK_TOKENS
from fleetplan.sim.router import RouteMode, Router, affinity_key
from fleetplan.sim.traces import TraceRequest, block_reuse_share, read_trace, reshape

ROUTERS = {"rr": RouteMode.ROUND_ROBIN, "ll": RouteMode.LEAST_LOADED, "aff": RouteMode.AFFINITY}
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "data" / "traces" / "mooncake_conversation.jsonl"  # data/SOURCES.md


def run_fleet(params: EngineParams, reqs: Sequence[TraceRequest], n: int, mode: RouteMode, *,
              cache: bool = True, seed: int = 0, balance: float = 1.25) -> dict[str, object]:
    """Serve `reqs` on n replicas routed by `mode`; the fleet's figures (see the module doc)."""
    cores = [FastCore(params, seed=seed * 1000 + i) for i in range(n)]
    ids = [f"r{i}" for i in range(n)]
    router = Router(mode, balance=balance)
    loads = [0] * n
    oh = params.factors.ttft_overhead_s
    m = len(reqs)
    arr_t = [r.t_s + oh for r in reqs]
    first = np.full(m, np.nan)
    fin = np.full(m, np.nan)
    where = np.zeros(m, dtype=int)
    heap: list[tuple[float, int, int]] = []  # (step end, replica, version)
    version = [0] * n
    rejected = 0

    def start(i: int, now: float) -> None:
        c = cores[i]
        if c.busy or c.idle():
            return
        te = c.begin(now)
        if te is not None:
            version[i] += 1
            heapq.heappush(heap, (te, i, version[i]))

    k = 0
    while k < m or heap:
        ta = arr_t[k] if k < m else math.inf
        if heap and heap[0][0] < ta:
            te, i, v = heapq.heappop(heap)
            if v != version[i]:
                continue
            firsts, fins, _g, _c = cores[i].end()
            for j in firsts:
                first[j] = te
            for j in fins:
                fin[j] = te
                loads[i] -= 1
            start(i, te)
            continue
        r = reqs[k]
        blocks = r.blocks if cache else None
        i = router.pick(ids, loads, affinity_key(r.blocks))
        c = cores[i]
        try:
            c.submit(k, r.prompt_tokens, r.output_tokens, blocks)
        except RequestTooLongError:
            rejected += 1
            k += 1
            continue
        loads[i] += 1
        where[k] = i
        if c.busy and c._k > 0 and ta < c.t_end:  # a macro-step: split at the arrival
            te = c.split(ta)
            version[i] += 1
            heapq.heappush(heap, (te, i, version[i]))
        else:
            start(i, ta)
        k += 1
    q = sum(c.prefix_queries_tokens for c in cores)
    h = sum(c.prefix_hit_tokens for c in cores)
    ttft = (first - np.array(arr_t) + oh)
    outs = np.array([r.output_tokens for r in reqs], dtype=float)
    tpot = np.where(outs > 1, (fin - first) / np.maximum(outs - 1, 1), np.nan)
    ok = ~np.isnan(ttft)
    prompt_tokens = sum(r.prompt_tokens for r in reqs)
    per_replica = [sum(1 for w in where if w == i) for i in range(n)]
    return {
        "replicas": n,
        "router": mode.value,
        "cache": cache,
        "requests": m,
        "rejected": rejected,
        "hit_rate_tokens": round(h / q, 4) if q else 0.0,
        "hit_rate_prompt_tokens": round(h / prompt_tokens, 4),
        "prefill_tokens_computed": int(prompt_tokens - h),
        "ttft_p50_s": round(float(np.quantile(ttft[ok], 0.5)), 3),
        "ttft_p99_s": round(float(np.quantile(ttft[ok], 0.99)), 3),
        "itl_mean_ms": round(float(np.nanmean(tpot)) * 1000, 2),
        "preemptions": sum(c.preemptions for c in cores),
        "evicted_blocks": sum(c.prefix.evicted for c in cores if c.prefix is not None),
        "max_share": round(max(per_replica) / max(1, sum(per_replica)) * n, 3),  # 1.0 = perfectly even
        "spilled": router.spilled,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--routers", default="rr,ll,aff")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=0)
    ap.add_argument("--balance", type=float, default=1.25)
    ap.add_argument("--no-cache-baseline", action="store_true", help="also run each point without the cache")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    trace = read_trace(a.trace)
    if a.rate_scale != 1.0:
        trace = reshape(trace, duration_s=trace.duration_s, rate_scale=a.rate_scale)
    reqs = list(trace.requests[: a.max_requests] if a.max_requests else trace.requests)
    params = build_params(Engine(a.engine), a.model, GpuType(a.gpu))
    bound = block_reuse_share(reqs)
    print(f"# {len(reqs)} requests over {reqs[-1].t_s:.0f} s; single-replica reuse bound "
          f"{(bound or 0) * 100:.1f}% of {PREFIX_BLOCK_TOKENS}-token blocks; {a.model} {a.engine} {a.gpu}: "
          f"{params.kv_blocks * params.block_size} KV tokens per replica", file=sys.stderr)
    # what GPU memory alone can reach: one replica whose whole KV cache keeps freed blocks (LRU)
    for mult in (1, 2, 4, 8):
        cap = params.kv_blocks * params.block_size * mult // PREFIX_BLOCK_TOKENS
        lru = block_reuse_share(reqs, capacity_blocks=cap)
        print(f"# one replica, a cache of {mult} x its KV memory ({cap * PREFIX_BLOCK_TOKENS} tokens, LRU): "
              f"reuse bound {(lru or 0) * 100:.1f}%", file=sys.stderr)
    rows = []
    for n in (int(x) for x in a.replicas.split(",")):
        for name in a.routers.split(","):
            for cache in ((True, False) if a.no_cache_baseline else (True,)):
                t0 = time.perf_counter()
                row = run_fleet(params, reqs, n, ROUTERS[name], cache=cache, balance=a.balance)
                row["bound"] = round(bound or 0.0, 4)
                row["wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                if not a.json:
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
