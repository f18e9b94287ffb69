"""CLI: `fleetplan pool-proxy`, the front of disaggregated models' prefill and decode pools.

register() stays light: aiohttp and the proxy are imported inside the handler.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "pool-proxy",
        help="serve disaggregated models: each request's prefill leg to a prefill replica, its decode leg "
        "(streamed) to a decode replica",
        description="An OpenAI-compatible proxy in front of the prefill and decode pools of disaggregated "
        "models (vLLM with a KV connector such as NixlConnector, or `fleetplan sim-engine --role`). The "
        "pools are read from a JSON file, re-read when it changes: "
        '{"models": {"NAME": {"prefill": ["http://host:port", ...], "decode": [...]}}}.',
    )
    p.add_argument("--upstreams", required=True, help="the JSON file of each model's prefill and decode replicas")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--poll-s", type=_positive_float, default=0.5,
                   help="how often the file is checked for changes (wall seconds, default 0.5)")
    p.add_argument("--connect-timeout-s", type=_positive_float, default=5.0,
                   help="connecting to a replica (default 5; a refused or timed-out leg is retried once elsewhere)")
    p.set_defaults(handler=_pool_proxy)


def _pool_proxy(args: argparse.Namespace) -> int:
    from fleetplan.controller.pool_proxy import ProxySettings, run_pool_proxy

    settings = ProxySettings(Path(args.upstreams), poll_s=args.poll_s, connect_timeout_s=args.connect_timeout_s)
    return int(asyncio.run(run_pool_proxy(settings, args.host, args.port)))
