"""How the agent starts and stops engine instances: as detached processes or as systemd units.

An instance is a replica (a serving engine) or a build. The agent gives an actuator a
:class:`LaunchSpec` — an argv list already substituted from the agent's own templates (never a
shell string), extra environment (CUDA_VISIBLE_DEVICES, template env) and a working directory —
and gets back a :class:`Handle` it records in its state directory, so that after the agent's own
restart it can :meth:`Actuator.adopt` what still runs instead of starting a duplicate.

- :class:`ProcessActuator` (lab, tests): a subprocess in its own session (so it survives the
  agent and SIGTERM to the agent does not reach it), output appended to ``<log_dir>/<id>.log``.
  Adoption checks that the pid is alive, not a zombie, has the same kernel start time and
  the same cmdline as recorded.
- :class:`SystemdActuator` (real hosts): the template unit ``fleetplan-engine@<id>.service`` with
  a per-instance environment file ``<env_dir>/<id>.env`` written atomically; the unit's
  ExecStart runs ``python -m fleetplan.controller.actuators exec``, which execs the argv from the
  environment file. Engines are then independent of the agent's cgroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fleetplan.shared.atomic import atomic_write_text

log = logging.getLogger(__name__)

ARGV_ENV = "FLEETPLAN_ENGINE_ARGV"
CWD_ENV = "FLEETPLAN_ENGINE_CWD"


@dataclass(frozen=True)
class LaunchSpec:
    instance_id: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to (process) / only env (systemd)
    cwd: str | None = None


@dataclass(frozen=True)
class Handle:
    """What identifies a running instance; JSON-able so that it survives the agent's restart."""

    instance_id: str
    argv: tuple[str, ...]
    pid: int | None = None
    start_ticks: int | None = None  # /proc/<pid>/stat field 22: guards against pid reuse
    unit: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {"instance_id": self.instance_id, "argv": list(self.argv), "pid": self.pid,
                "start_ticks": self.start_ticks, "unit": self.unit}

    @staticmethod
    def from_dict(data: Mapping[str, object]) -> Handle:
        argv = data.get("argv")
        pid = data.get("pid")
        ticks = data.get("start_ticks")
        unit = data.get("unit")
        return Handle(
            instance_id=str(data["instance_id"]),
            argv=tuple(str(a) for a in argv) if isinstance(argv, list) else (),
            pid=pid if isinstance(pid, int) else None,
            start_ticks=ticks if isinstance(ticks, int) else None,
            unit=unit if isinstance(unit, str) else None,
        )


@dataclass(frozen=True)
class Exited:
    """An instance is no longer running. `code` None: unknown (e.g. an adopted process)."""

    code: int | None
    detail: str


class StartError(RuntimeError):
    """The instance could not be started at all (binary missing, systemctl failed...)."""


class Actuator(Protocol):
    async def start(self, spec: LaunchSpec) -> Handle: ...

    async def poll(self, handle: Handle) -> Exited | None:
        """None while the instance runs."""
        ...

    async def stop(self, handle: Handle, timeout_s: float) -> Exited:
        """SIGTERM (or systemctl stop), wait up to timeout_s, then SIGKILL."""
        ...

    async def adopt(self, handle: Handle) -> Handle | None:
        """The handle when the recorded instance is still this instance and running; else None."""
        ...

    def log_tail(self, instance_id: str, max_bytes: int = 2000) -> str: ...


# ------------------------------------------------------------------------------------------
# /proc helpers (Linux)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) of a pid, None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces/parens: split after the LAST ')'
    rest = text[text.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


def _proc_cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1])


def pid_alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


# ------------------------------------------------------------------------------------------


class ProcessActuator:
    """Detached subprocesses (own session), logs in `log_dir`. For the lab and tests."""

    logs_are_cheap = True  # log_tail() reads a local file: fine to call every reconcile pass

    def __init__(self, log_dir: Path, *, base_env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.base_env = dict(os.environ if base_env is None else base_env)
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def _log_path(self, instance_id: str) -> Path:
        return self.log_dir / f"{instance_id}.log"

    async def start(self, spec: LaunchSpec) -> Handle:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**self.base_env, **spec.env}
        try:
            with self._log_path(spec.instance_id).open("ab") as logf:
                logf.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start {list(spec.argv)}\n".encode())
                logf.flush()
                proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec only, returns at once
                    list(spec.argv), env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL, stdout=logf,
                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                )
        except OSError as exc:
            raise StartError(f"cannot start {spec.argv[0]!r}: {exc.strerror or exc}") from None
        self._children[proc.pid] = proc
        stat = _proc_stat(proc.pid)
        return Handle(spec.instance_id, tuple(spec.argv), pid=proc.pid,
                      start_ticks=stat[1] if stat else None)

    async def poll(self, handle: Handle) -> Exited | None:
        assert handle.pid is not None
        child = self._children.get(handle.pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            del self._children[handle.pid]
            return Exited(code, _describe_code(code))
        if self._same_process(handle):
            return None
        return Exited(None, "process is gone (exit status unknown: started by a previous agent)")

    def _same_process(self, handle: Handle) -> bool:
        if handle.pid is None:
            return False
        stat = _proc_stat(handle.pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return handle.start_ticks is None or stat[1] == handle.start_ticks

    async def stop(self, handle: Handle, timeout_s: float) -> Exited:
        assert handle.pid is not None
        exited = await self.poll(handle)
        if exited is not None:
            return exited
        self._signal_group(handle.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            exited = await self.poll(handle)
            if exited is not None:
                return exited
            await asyncio.sleep(0.1)
        log.warning("instance %s (pid %s) ignored SIGTERM for %.0fs: SIGKILL", handle.instance_id,
                    handle.pid, timeout_s)
        self._signal_group(handle.pid, signal.SIGKILL)
        for _ in range(50):
            exited = await self.poll(handle)
            if exited is not None:
                return exited
            await asyncio.sleep(0.1)
        return Exited(None, "did not exit after SIGKILL")

    @staticmethod
    def _signal_group(pid: int, sig: signal.Signals) -> None:
        # The instance leads its own session/process group: signal the group (engine workers too).
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def adopt(self, handle: Handle) -> Handle | None:
        if handle.pid is None or not self._same_process(handle):
            return None
        cmdline = _proc_cmdline(handle.pid)
        for _ in range(25):  # empty while the process is still inside execve(): ask again
            if cmdline:
                break
            await asyncio.sleep(0.02)
            cmdline = _proc_cmdline(handle.pid)
        if cmdline != handle.argv:
            log.warning("not adopting %s: pid %s runs %s, recorded %s", handle.instance_id, handle.pid,
                        cmdline, list(handle.argv))
            return None
        return handle

    def log_tail(self, instance_id: str, max_bytes: int = 2000) -> str:
        return _tail(self._log_path(instance_id), max_bytes)


def _describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path: Path, max_bytes: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


# ------------------------------------------------------------------------------------------


def render_env_file(env: Mapping[str, str]) -> str:
    """A systemd EnvironmentFile: KEY="value" lines, quotes and backslashes escaped."""
    lines = []
    for key, value in env.items():
        if not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ValueError(f"environment variable name {key!r} is not valid")
        if "\n" in value or "\r" in value or "\0" in value:
            raise ValueError(f"environment variable {key} contains a newline or NUL")
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{key}="{escaped}"')
    return "\n".join(lines) + "\n"


class SystemdActuator:
    """`systemctl start/stop <unit_prefix>@<id>.service` + `<env_dir>/<id>.env` per instance.

    `systemctl` is the path of the binary (injectable: tests use a recording fake); `journalctl`
    (None: no log tails) gives the last lines of a failed instance's output.
    """

    logs_are_cheap = False

    def __init__(self, env_dir: Path, *, systemctl: str = "/usr/bin/systemctl",
                 unit_prefix: str = "fleetplan-engine", journalctl: str | None = "/usr/bin/journalctl",
                 timeout_s: float = 90.0, poll_interval_s: float = 2.0) -> None:
        self.env_dir = env_dir
        self.poll_interval_s = poll_interval_s  # `systemctl is-active` at most this often per unit
        self._running_seen: dict[str, float] = {}  # unit -> monotonic time it was last seen active
        self.systemctl = systemctl
        self.unit_prefix = unit_prefix
        self.journalctl = journalctl
        self.timeout_s = timeout_s

    def unit(self, instance_id: str) -> str:
        return f"{self.unit_prefix}@{instance_id}.service"

    def env_path(self, instance_id: str) -> Path:
        return self.env_dir / f"{instance_id}.env"

    async def _run(self, *args: str, check: bool = True) -> tuple[int, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.systemctl, *args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        except OSError as exc:
            raise StartError(f"cannot run {self.systemctl}: {exc.strerror or exc}") from None
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=self.timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise StartError(f"systemctl {' '.join(args)} timed out after {self.timeout_s:.0f}s") from None
        text = out.decode(errors="replace").strip()
        code = proc.returncode if proc.returncode is not None else -1
        if check and code != 0:
            raise StartError(f"systemctl {' '.join(args)} failed ({code}): {text[:300]}")
        return code, text

    async def start(self, spec: LaunchSpec) -> Handle:
        env = {**spec.env, ARGV_ENV: json.dumps(list(spec.argv))}
        if spec.cwd:
            env[CWD_ENV] = spec.cwd
        self.env_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.env_path(spec.instance_id), render_env_file(env), mode=0o640)
        unit = self.unit(spec.instance_id)
        await self._run("reset-failed", unit, check=False)
        # Type=exec: returns once the engine is exec'd (not when healthy: the agent health-waits).
        await self._run("start", unit)
        pid = await self._main_pid(unit)
        return Handle(spec.instance_id, tuple(spec.argv), pid=pid, unit=unit)

    async def _main_pid(self, unit: str) -> int | None:
        _, text = await self._run("show", "-p", "MainPID", "--value", unit, check=False)
        try:
            pid = int(text.splitlines()[0]) if text else 0
        except ValueError:
            return None
        return pid or None

    async def poll(self, handle: Handle) -> Exited | None:
        unit = handle.unit or self.unit(handle.instance_id)
        seen = self._running_seen.get(unit)
        if seen is not None and time.monotonic() - seen < self.poll_interval_s:
            return None
        _, state = await self._run("is-active", unit, check=False)
        if state.splitlines()[:1] in (["active"], ["activating"], ["reloading"]):
            self._running_seen[unit] = time.monotonic()
            return None
        self._running_seen.pop(unit, None)
        _, status = await self._run("show", "-p", "ExecMainStatus", "--value", unit, check=False)
        try:
            code: int | None = int(status.splitlines()[0])
        except (ValueError, IndexError):
            code = None
        return Exited(code, f"unit {unit} is {state or 'unknown'}" + (f", exit status {code}" if code else ""))

    async def stop(self, handle: Handle, timeout_s: float) -> Exited:
        # systemd sends SIGTERM, waits TimeoutStopSec, then SIGKILL (KillMode=control-group).
        unit = handle.unit or self.unit(handle.instance_id)
        code, text = await self._run("stop", unit, check=False)
        self._running_seen.pop(unit, None)
        with contextlib.suppress(FileNotFoundError):
            self.env_path(handle.instance_id).unlink()
        if code != 0:
            return Exited(None, f"systemctl stop {unit} failed ({code}): {text[:200]}")
        return Exited(None, f"unit {unit} stopped")

    async def adopt(self, handle: Handle) -> Handle | None:
        unit = handle.unit or self.unit(handle.instance_id)
        if await self.poll(Handle(handle.instance_id, handle.argv, unit=unit)) is not None:
            return None
        return Handle(handle.instance_id, handle.argv, pid=await self._main_pid(unit), unit=unit)

    def log_tail(self, instance_id: str, max_bytes: int = 2000) -> str:
        if self.journalctl is None:
            return ""
        try:
            out = subprocess.run(
                [self.journalctl, "-u", self.unit(instance_id), "-n", "20", "--no-pager", "-o", "cat"],
                capture_output=True, timeout=3, check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out[-max_bytes:].decode(errors="replace")


def exec_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Unit ExecStart helper: exec the argv in $FLEETPLAN_ENGINE_ARGV (JSON list), no shell."""
    env = dict(os.environ if environ is None else environ)
    raw = env.pop(ARGV_ENV, None)
    if raw is None:
        raise SystemExit(f"{ARGV_ENV} is not set (is the instance's EnvironmentFile missing?)")
    argv = json.loads(raw)
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise SystemExit(f"{ARGV_ENV} must be a non-empty JSON list of strings")
    cwd = env.pop(CWD_ENV, None)
    if cwd:
        os.chdir(cwd)
    os.execvpe(argv[0], argv, env)


def _main(argv: Sequence[str]) -> int:
    if list(argv) == ["exec"]:
        exec_from_env()
    print("usage: python -m fleetplan.controller.actuators exec", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
