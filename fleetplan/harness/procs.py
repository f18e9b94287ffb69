"""The lab's processes: server binaries, free loopback ports, process groups (`group_pids`,
`stop_group`) and `ManagedProcess`, one server in its own process group with its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

LOOPBACK = "127.0.0.1"

# Where Debian's packages put the servers; FLEETPLAN_<NAME> overrides one (read when a server
# starts, not at import).
DEFAULT_BINARIES = {
    "mosquitto": "/usr/sbin/mosquitto",
    "mosquitto_passwd": "/usr/bin/mosquitto_passwd",
    "prometheus": "/usr/bin/prometheus",
    "nginx": "/usr/sbin/nginx",
}


def lab_binary(name: str) -> str:
    """The path of a lab server binary: $FLEETPLAN_<NAME>, else the Debian path, else $PATH."""
    override = os.environ.get(f"FLEETPLAN_{name.upper()}")
    if override:
        return override
    default = DEFAULT_BINARIES[name]
    if Path(default).exists():
        return default
    return shutil.which(name) or default


class LabError(RuntimeError):
    """A lab server failed to start, become ready or stop; the message carries its log tail."""


# --------------------------------------------------------------------------- processes


def free_port(host: str = LOOPBACK, exclude: Iterable[int] = ()) -> int:
    """A currently free TCP port on `host` (the OS picks it)."""
    excluded = set(exclude)
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in excluded:
            return port
    raise LabError("no free port found")


_T = TypeVar("_T")


def retry_if_port_taken(start: Callable[[], _T], taken: Callable[[Exception], bool], move: Callable[[], None],
                        tries: int) -> _T:
    """`start()`; when it fails because another process took its port meanwhile (`taken(exc)`: a free
    port is only free until someone binds it), `move()` to another port and start again, `tries` times
    in all. Any other failure, and the last one, propagates."""
    for attempt in range(tries):
        try:
            return start()
        except Exception as exc:
            if attempt == tries - 1 or not taken(exc):
                raise
        move()
    raise AssertionError("unreachable: the last attempt returns or raises")


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers themselves: a port held only by TIME_WAIT connections is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, pgrp) of a pid from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[2])


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None and stat[1] == pgid and stat[0] != "Z":
            found.append(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def file_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    tail = text.strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else f"(empty log {path})"


def stop_group(pgid: int, *, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal a whole process group, wait until it is empty, SIGKILL what is left after `timeout_s`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_pids(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    left = group_pids(pgid)
    if left:
        raise LabError(f"process group {pgid} still has processes {left} after SIGKILL")


class ManagedProcess:
    """One server process in its own process group, output to a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.popen: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self._log_offset = 0

    def start(self) -> None:
        if shutil.which(self.argv[0]) is None:
            raise LabError(f"{self.name}: binary {self.argv[0]} not found (install the Debian package)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._log_offset = log_file.tell()  # this run's output starts here (the log is appended)
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
                close_fds=True,
            )
        self.pid = self.popen.pid

    def exited(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        if self.pid is not None and not pid_alive(self.pid):
            return -1
        return None

    def running(self) -> bool:
        return self.pid is not None and self.exited() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes()[self._log_offset :].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return file_tail(self.log_path, lines)

    def wait_ready(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll `check` until true; on exit or timeout stop the process and raise LabError with its log."""
        try:
            self._wait_ready(check, timeout_s, what)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.exited()
            if code is not None:
                raise LabError(
                    f"{self.name} exited with code {code} before {what} ({' '.join(self.argv)}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if check():
                    return
            except Exception:  # not ready yet: connection refused, 503, ...
                pass
            if time.monotonic() > deadline:
                raise LabError(
                    f"{self.name} not {what} after {timeout_s:.0f} s ({' '.join(self.argv)}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if self.pid is None:
            return
        try:
            stop_group(self.pid, timeout_s=timeout_s, sig=sig)
        finally:
            if self.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=5)
            self.popen = None
            self.pid = None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "pgid": self.pid, "argv": self.argv, "log": str(self.log_path)}
