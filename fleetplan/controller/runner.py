"""Running the controller as a service: signals in one place (uvicorn's shape), the interval loop,
sd_notify (controller/sdnotify.py), and the `fleetplan controller` command's setup (settings, token, state store).

SIGHUP reloads the policy before the next cycle (validated first; an invalid file keeps the old
policy and the error shows in reports; a changed `scaling.cycle_s` takes effect from the next
interval); SIGTERM/SIGINT finish the current step and stop cleanly within `stop_deadline_s`
(drains in progress are resumed by the next start); a second SIGTERM/SIGINT exits at once.
sd_notify READY=1, WATCHDOG=1, STOPPING=1 via $NOTIFY_SOCKET.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fleetplan.controller.reporting import audit_log
from fleetplan.controller.sdnotify import sd_notify
from fleetplan.controller.settings import ControllerSettings, SettingsError, load_settings
from fleetplan.controller.state import StateStore

if TYPE_CHECKING:
    from fleetplan.controller.daemon import Controller

log = logging.getLogger(__name__)


@dataclass
class Signals:
    """What the signals asked for; the loop acts on it between cycles (uvicorn's shape)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stop: bool = False
    reload: bool = False


def _install_signals(ctrl: Controller, sig: Signals) -> None:
    """All signal handling in one place: SIGHUP asks for a policy reload (applied between cycles,
    never inside one); SIGTERM/SIGINT ask for a graceful stop (the current cycle finishes, within
    `stop_deadline_s`); a second SIGTERM/SIGINT forces the exit at once."""
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        log.info("SIGHUP: the policy (%s) is reloaded before the next cycle", ctrl.policy_path)
        sig.reload = True
        sig.wake.set()

    def on_term() -> None:
        if sig.stop:
            log.warning("second stop signal: exiting now")
            sd_notify("STOPPING=1")
            os._exit(1)
        log.info("stop signal: finishing the current cycle (at most %.0f s)", ctrl.settings.stop_deadline_s)
        sig.stop = True
        sig.wake.set()

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_term)


async def _cycle_loop(ctrl: Controller, sig: Signals, interval_s: Callable[[], float]) -> None:
    """One interval job on a plain asyncio loop: cycles never overlap, a late cycle is not made up
    for (the next starts one interval after the late one began), a reload lands between cycles."""
    loop = asyncio.get_running_loop()
    next_s = loop.time()
    while not sig.stop:
        if sig.reload:
            sig.reload = False
            try:  # a reload that cannot record its result (a full disk) must not end the loop
                await ctrl.reload_policy()
            except Exception:
                log.exception("policy reload failed")
        if loop.time() >= next_s:
            next_s = loop.time() + interval_s()  # read each time: a reload may change cycle_s
            try:  # the cycle handles its own errors; this is the last line: the loop never dies of one
                await ctrl.cycle()
            except Exception:
                log.exception("cycle raised")
            continue
        sig.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sig.wake.wait(), next_s - loop.time())


async def run_controller(ctrl: Controller, *, once: bool = False, cycle_wall_s: float | None = None) -> int:
    await ctrl.start()
    sig = Signals()
    _install_signals(ctrl, sig)
    if once:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctrl.link.connected.wait(), 10.0)
        await ctrl.cycle()
        await ctrl.stop()
        return 0

    def interval() -> float:
        return cycle_wall_s or max(0.5, ctrl.cycle_s() / ctrl.time_scale)

    log.info("controller running: cycle every %.2f s wall (time scale %g), report at %s", interval(),
             ctrl.time_scale, ctrl.report_url)
    cycles = asyncio.create_task(_cycle_loop(ctrl, sig, interval), name="cycles")
    try:
        await cycles
    finally:
        log.info("stopping: finishing the current step")
        try:
            await asyncio.wait_for(ctrl.stop(), ctrl.settings.stop_deadline_s)
        except TimeoutError:
            log.error("stop did not finish within %.0f s; exiting anyway", ctrl.settings.stop_deadline_s)
    return 0


def _parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


DEFAULT_CONFIG = Path("/etc/fleetplan/controller.yaml")


# Fills in settings from outside the controller (the lab harness passes its lab.json reader) and
# returns the nginx reloader to use, or None for the settings' own nginx_reload_command.
SettingsHook = Callable[[ControllerSettings], tuple[ControllerSettings, Callable[[], None] | None]]


def _run_reload(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def run_from_args(args: argparse.Namespace, prepare: SettingsHook | None = None) -> int:
    for noisy in ("httpx", "apscheduler", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not audit_log.handlers:  # the decision lines reach the journal whatever the verbosity
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        audit_log.addHandler(handler)
        audit_log.setLevel(logging.INFO)
        audit_log.propagate = False
    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    try:
        settings = load_settings(config)
    except SettingsError as exc:
        raise SystemExit(str(exc)) from None
    reload: Callable[[], None] | None = None
    if prepare is not None:
        settings, reload = prepare(settings)
    if reload is None and settings.routing.nginx_reload_command:
        reload = functools.partial(_run_reload, list(settings.routing.nginx_reload_command))

    token = None
    token_file = args.report_token_file or settings.report_token_file
    if token_file:
        token = Path(token_file).read_text().strip()
    host, _ = _parse_listen(args.report_listen)
    if host not in ("127.0.0.1", "::1", "localhost") and not token:
        raise SystemExit(
            f"--report-listen {args.report_listen}: a bearer token is required when not bound to loopback "
            "(--report-token-file)"
        )
    from fleetplan.controller.clocks import SteadyClock
    from fleetplan.controller.daemon import Controller

    clocks = SteadyClock()  # one clock that never steps for the controller and its records
    store = StateStore(args.state_db, clock=clocks.now)
    ctrl = Controller(
        settings=settings, policy_path=Path(args.policy), profiles_path=Path(args.profiles) if args.profiles else None,
        store=store, time_scale=args.time_scale, nginx_reload=reload, report_listen=args.report_listen,
        report_token=token, clocks=clocks,
    )
    return asyncio.run(run_controller(ctrl, once=args.once))
