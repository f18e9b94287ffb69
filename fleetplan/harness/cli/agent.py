"""`fleetplan agent --config /etc/fleetplan/agent.yaml`: the per-host agent."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="run the per-host agent (MQTT desired state -> engine instances)",
        description="Run the per-host agent: subscribes to its desired state over MQTT, starts/stops "
        "engines from its own launch templates, reports status. SIGTERM stops the agent, not the engines.",
    )
    parser.add_argument("--config", type=Path, default=Path("/etc/fleetplan/agent.yaml"),
                        help="agent config (see config/agent.example.yaml)")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.set_defaults(handler=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from fleetplan.controller.agent import Agent
    from fleetplan.controller.agent_config import AgentConfigError, load_agent_config

    try:
        config = load_agent_config(args.config)
    except AgentConfigError as exc:
        print(f"fleetplan agent: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: OK (host {config.host}, {config.gpu_count}x {config.gpu.value}, "
              f"{len(config.launch_templates)} launch templates, {len(config.build_templates)} build templates)")
        return 0

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Agent(config).run(stop)

    asyncio.run(main())
    return 0
