"""The `fleetplan` command line. Every command-line module lives in this package.

Each command group lives in its own module of this package exposing `register(subparsers)`; a registered
subparser sets `handler` to a callable taking the parsed args and returning the exit code.
Register functions stay light: heavy imports (ortools, aiohttp, numpy) happen inside handlers,
so `fleetplan --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

# Modules that contribute commands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "fleetplan.harness.cli.models",  # models fit | predict | capacity
    "fleetplan.harness.cli.plan",  # policy check, plan
    "fleetplan.harness.cli.whatif",  # what-if
    "fleetplan.harness.cli.sim",  # sim-engine, replay-load, bench-engine
    "fleetplan.harness.cli.proxy",  # pool-proxy
    "fleetplan.harness.cli.lab",  # lab up | down
    "fleetplan.harness.cli.agent",  # agent
    "fleetplan.harness.cli.daemon",  # controller, report, explain, observe, demo
    "fleetplan.harness.cli.ops",  # pause, resume, history
    "fleetplan.harness.cli.hosts",  # hosts confirm | list
    "fleetplan.harness.cli.evaluate",  # evaluate
    "fleetplan.harness.cli.trace",  # trace build | coding | from-prometheus
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetplan",
        description="Right-size a bare-metal GPU fleet serving LLMs (vLLM vs TensorRT-LLM).",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a command group not built yet
                continue
            raise
        module.register(sub)
    return parser


def configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# The exit status of a process killed by SIGPIPE as a shell reports it (128 + 13), so that
# `fleetplan explain m | head -1` under `set -o pipefail` looks like any other writer to a closed pipe.
EXIT_BROKEN_PIPE = 128 + int(signal.SIGPIPE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A reader that closes stdout early (`| head`) ends the command quietly with
    EXIT_BROKEN_PIPE, as the Python docs recommend for SIGPIPE (library/signal.html, "Note on
    SIGPIPE"): stdout is pointed at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: a pipe closed after the last print fails here, not at exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return code


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself ignores a closed pipe for --help and usage
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    configure_logging(args.verbose)
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
