"""The systemd notify protocol (READY=1, WATCHDOG=1, STOPPING=1) over $NOTIFY_SOCKET, with no
dependency: the daemon and its runner both tell systemd where they are."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def sd_notify(message: str) -> bool:
    """systemd notify protocol over $NOTIFY_SOCKET (no dependency); False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)  # never block the event loop on a receiver that does not read
            s.connect(addr)
            s.send(message.encode())
        return True
    except BlockingIOError:
        log.warning("sd_notify(%s): notify socket full, message dropped", message.split("\n")[0])
        return False
    except OSError as exc:
        log.warning("sd_notify(%s) failed: %s", message.split("\n")[0], exc)
        return False
