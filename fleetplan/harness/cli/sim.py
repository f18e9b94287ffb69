"""CLI: `fleetplan sim-engine`, `fleetplan replay-load`, `fleetplan bench-engine`.

register() stays light: aiohttp, numpy and the engine are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "sim-engine",
        help="run a simulated vLLM / TensorRT-LLM engine (OpenAI API, Prometheus metrics)",
        description="A simulated LLM engine: continuous batching on a roofline step-time model, "
        "served over the OpenAI API with vLLM (and trtllm-serve) metrics. Times it reports are "
        "simulated seconds; --time-scale K runs the simulated clock K times faster than wall time.",
    )
    p.add_argument("--persona", required=True, help="vllm | trtllm")
    p.add_argument("--model", required=True, help="served model name, e.g. llama-3.1-8b")
    p.add_argument("--gpu", required=True, help="GPU type, e.g. h100")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, help="simulated seconds per wall second")
    p.add_argument("--startup-s", type=float, default=None,
                   help="simulated startup delay (default: the persona's load time, plus the engine build "
                   "for trtllm without a cached engine)")
    cached = p.add_mutually_exclusive_group()
    cached.add_argument("--engine-cached", dest="engine_cached", action="store_true", default=True,
                        help="trtllm: a built engine is cached (default)")
    cached.add_argument("--no-engine-cached", dest="engine_cached", action="store_false",
                        help="trtllm: build the engine at startup (adds the build time)")
    p.add_argument("--engine-dir", default=None,
                   help="trtllm: serve the engine built into this directory; exit 1 when it holds none "
                   "(as trtllm-serve does): the lab's stand-in for an agent's {engine_dir}")
    p.add_argument("--replica-id", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-chunk-interval-ms", type=float, default=0.0,
                   help="coalesce tokens into one SSE chunk when steps are shorter than this (wall ms)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--drain-timeout-s", type=float, default=600.0,
                   help="on SIGTERM, wait at most this long (wall) for in-flight requests (default 600)")
    p.add_argument("--gpu-indices", default=None, help="accepted for launch templates; informational")
    p.add_argument("--role", default="aggregated", choices=("aggregated", "prefill", "decode"),
                   help="an instance of a disaggregated deployment: prefill (answers one token and the "
                   "kv_transfer_params a decode instance takes) or decode (takes them and skips the prompt's "
                   "compute after the KV transfer time); default aggregated")
    p.set_defaults(handler=_sim_engine)

    r = subparsers.add_parser(
        "replay-load",
        help="replay a request trace (Azure, Mooncake, BurstGPT) against an OpenAI endpoint",
    )
    r.add_argument("--trace", required=True, help="trace file (format detected from its content)")
    r.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    r.add_argument("--speed", type=_positive_float, default=1.0,
                   help="trace seconds per wall second; match the engines' --time-scale")
    r.add_argument("--duration-s", type=_positive_float, default=600.0,
                   help="replay at most this many TRACE seconds (default 600)")
    r.add_argument("--max-requests", type=int, default=10000, help="send at most this many requests")
    r.add_argument("--rate-scale", type=_positive_float, default=1.0,
                   help="multiply the trace's request rate (arrival times divided by R)")
    r.add_argument("--model", default=None, help="model field of the requests (default: the trace's, else "
                   "the target's first /v1/models entry)")
    r.add_argument("--out", default=None, help="per-request JSONL output")
    r.add_argument("--concurrency-limit", type=int, default=2000, help="max requests in flight")
    r.add_argument("--timeout-s", type=float, default=600.0, help="per-request wall timeout")
    r.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    r.add_argument("--wall-clock", action="store_true",
                   help="measure wall time x speed even when the target reports its simulated clock")
    r.add_argument("--prompts", choices=("token-ids", "words", "hint"), default="token-ids",
                   help="how each request carries the trace's prompt length: token-ids (default; a list of "
                   "that many token ids, exact: vLLM, trtllm-serve, sim-engine), words (text of that many "
                   "common words, about one token each, for servers that take text only), hint (a short "
                   "prompt plus the prompt_tokens field only fleetplan's sim-engine reads)")
    r.add_argument("--unique-prompts", action="store_true",
                   help="a different prompt for every request (no prefix-cache hits); default: requests that "
                   "share a trace's block hashes (hash_ids) share those prefixes, so a server's prefix cache "
                   "sees the trace's reuse")
    r.add_argument("--prefix-salt", default="",
                   help="other text for the same blocks (a second replay that should not hit the first's cache)")
    r.set_defaults(handler=_replay_load)

    b = subparsers.add_parser(
        "bench-engine",
        help="sweep concurrency against an OpenAI endpoint; write `vllm bench serve` result JSON",
    )
    b.add_argument("--target", required=True)
    b.add_argument("--isl", type=int, required=True)
    b.add_argument("--osl", type=int, required=True)
    b.add_argument("--concurrency", required=True, help="comma-separated, e.g. 1,4,16,64")
    b.add_argument("--num-prompts", type=int, default=None, help="requests per point (default max(50, 8 x c))")
    b.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="the engine's --time-scale; wall measurements are multiplied by it")
    b.add_argument("--model", default=None)
    b.add_argument("--out", required=True, help="output directory")
    b.add_argument("--label", default=None, help="the result files' \"label\" field")
    b.add_argument("--engine", default=None, help="for the file names (default: the simulator's own)")
    b.add_argument("--gpu", default=None)
    b.add_argument("--tp", type=int, default=None)
    b.add_argument("--precision", default=None)
    b.add_argument("--allow-remote", action="store_true")
    b.add_argument("--wall-clock", action="store_true",
                   help="measure wall time x time scale even when the target reports its simulated clock")
    b.set_defaults(handler=_bench_engine)


def _sim_engine(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleetplan.models.config_key import Role
    from fleetplan.models.names import UnknownNameError, parse_engine, parse_gpu, parse_precision
    from fleetplan.sim.engine import EngineConfig, run_engine

    if args.engine_dir is not None:
        from fleetplan.controller.agent_config import holds_engine

        d = Path(args.engine_dir)
        try:
            held = holds_engine(d)
        except OSError as exc:
            print(f"sim-engine: --engine-dir {d}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if not held:
            print(f"sim-engine: --engine-dir {d}: no engine there (build it first)", file=sys.stderr)
            return 1
    try:
        cfg = EngineConfig(
            persona=parse_engine(args.persona),
            model=args.model,
            gpu=parse_gpu(args.gpu),
            tp=args.tp,
            precision=parse_precision(args.precision),
            time_scale=args.time_scale,
            startup_s=args.startup_s,
            engine_cached=args.engine_cached,
            replica_id=args.replica_id,
            seed=args.seed,
            min_chunk_interval_ms=args.min_chunk_interval_ms,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            drain_timeout_s=args.drain_timeout_s,
            role=Role(args.role),
        )
        cfg.params()  # validate the model / GPU / TP combination up front
    except (UnknownNameError, ValueError) as exc:
        print(f"sim-engine: {exc}", file=sys.stderr)
        return 2
    return int(asyncio.run(run_engine(cfg, args.host, args.port)))


def _replay_load(args: argparse.Namespace) -> int:
    from fleetplan.sim.replay import replay_main

    return replay_main(args)


def _bench_engine(args: argparse.Namespace) -> int:
    from fleetplan.sim.benchclient import bench_main

    return bench_main(args)
