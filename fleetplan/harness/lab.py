"""The lab: real Mosquitto, Prometheus and nginx on free loopback ports, plus simulated GPU hosts.

Everything lives in one directory (a temp dir by default): generated configs, logs, the TSDB,
the broker's persistence, per-host workdirs, and ``lab.json`` describing ports, users and paths.
Each server runs in its own process group (``start_new_session``) so that stopping it leaves no
orphan (nginx workers included); `Lab.stop()` waits for every group to be empty.

    with Lab(hosts=2) as lab:
        lab.mqtt_port, lab.controller_user, lab.controller_password, lab.hosts[0].mqtt_user
        write_file_sd(lab.prometheus_file_sd_dir / "engines.json", targets)
        NginxRouter(lab.nginx_upstreams_path, lab.reload_nginx).apply({"m": ["127.0.0.1:8001"]})

CLI: ``fleetplan lab up --dir D [--hosts N] [--gpus-per-host 8] [--gpu h100]`` starts it in the
background and writes D/lab.json; ``fleetplan lab down --dir D`` stops it.

Every `Lab.start()` (every ``lab up``) is a new lab: new ports, new MQTT passwords, and every server
config regenerated (each file replaced atomically), also in the directory of a stopped lab. What the
servers keep in D is data, not config: the broker's retained messages, the TSDB, the logs (appended),
and any other file in D is left alone. Restarting one server (`MosquittoServer.restart`) keeps its
port and passwords.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fleetplan.models.names import GpuType, parse_gpu

if TYPE_CHECKING:
    from fleetplan.controller.daemon import ControllerSettings

LOOPBACK = "127.0.0.1"
LAB_JSON = "lab.json"
CONTROLLER_USER = "controller"

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

_HOST_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


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


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers themselves: a port held only by TIME_WAIT connections is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _tcp_open(host: str, port: int) -> bool:
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


def _worker_accepting(pid: int) -> bool:
    """An nginx worker that is alive and not yet gracefully shutting down (so it may accept)."""
    if not pid_alive(pid):
        return False
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"shutting down" not in title


def _tail(path: Path, lines: int = 30) -> str:
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
        return _tail(self.log_path, lines)

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


# --------------------------------------------------------------------------- Mosquitto


@dataclass(frozen=True)
class MqttUser:
    user: str
    password: str


class MosquittoServer:
    """Mosquitto 2.x on loopback: no anonymous access, password file, per-user ACL, client id = user
    name (``use_username_as_clientid``: one user's credentials cannot disconnect another's session).

    Users: ``controller`` (readwrite fleetplan/#), ``observer`` (read fleetplan/#: on-call's
    mosquitto_sub and the tests' watchers, never the controller's session) and ``agent-<host>`` per
    host (read fleetplan/hosts/<host>/desired, write fleetplan/hosts/<host>/status and .../ack).
    Persistence is on, so retained messages survive `restart()` (same port).
    """

    def __init__(self, workdir: Path, host_names: Sequence[str], port: int | None = None):
        self.workdir = workdir
        self.host = LOOPBACK
        self.port = port or free_port()
        self.controller = MqttUser(CONTROLLER_USER, secrets.token_urlsafe(12))
        self.observer = MqttUser("observer", secrets.token_urlsafe(12))
        self.agents = {h: MqttUser(f"agent-{h}", secrets.token_urlsafe(12)) for h in host_names}
        self.conf_path = workdir / "mosquitto.conf"
        self.passwd_path = workdir / "passwd"
        self.acl_path = workdir / "acl"
        self.proc: ManagedProcess | None = None

    @property
    def controller_user(self) -> str:
        return self.controller.user

    @property
    def controller_password(self) -> str:
        return self.controller.password

    def acl_text(self) -> str:
        lines = [
            "# Generated by fleetplan lab",
            f"user {self.controller.user}",
            "topic readwrite fleetplan/#",
            "",
            f"user {self.observer.user}",
            "topic read fleetplan/#",
            "",
        ]
        for host, agent in self.agents.items():
            lines += [
                f"user {agent.user}",
                f"topic read fleetplan/hosts/{host}/desired",
                f"topic write fleetplan/hosts/{host}/status",
                f"topic write fleetplan/hosts/{host}/ack",
                "",
            ]
        return "\n".join(lines)

    def write_config(self) -> None:
        """(Re)write passwd, acl and mosquitto.conf from this object's port and users, each atomically."""
        from fleetplan.shared.atomic import atomic_write_text

        self.workdir.mkdir(parents=True, exist_ok=True)
        users = [self.controller, self.observer, *self.agents.values()]
        # Hash a private temp copy, then rename it over the old file: a reader never sees plain text
        # or a half-written file.
        fd, tmp_name = tempfile.mkstemp(prefix=".passwd.", dir=self.workdir)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "w") as f:  # mkstemp: mode 0600
                f.write("".join(f"{u.user}:{u.password}\n" for u in users))
            proc = subprocess.run(
                [lab_binary("mosquitto_passwd"), "-U", str(tmp)], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                raise LabError(f"mosquitto_passwd -U {tmp} (for {self.passwd_path}) failed: {proc.stderr.strip()}")
            os.replace(tmp, self.passwd_path)
        finally:
            tmp.unlink(missing_ok=True)
        atomic_write_text(self.acl_path, self.acl_text(), mode=0o600)
        lines = [
            "# Generated by fleetplan lab",
            "per_listener_settings false",
            f"listener {self.port} {self.host}",
            "allow_anonymous false",
            f"password_file {self.passwd_path}",
            f"acl_file {self.acl_path}",
            # the client id is the user name: one agent's credentials cannot take over (disconnect)
            # another agent's session by connecting with its client id (mosquitto.conf(5))
            "use_username_as_clientid true",
            "persistence true",
            f"persistence_location {self.workdir}/",
            "autosave_interval 1",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
        ]
        if os.geteuid() == 0:  # otherwise mosquitto drops to user "mosquitto" and cannot read our files
            lines.append("user root")
        atomic_write_text(self.conf_path, "\n".join(lines) + "\n")

    def start(self) -> None:
        self.write_config()  # this object's port and passwords, never a stale file's
        self.proc = ManagedProcess(
            "mosquitto", [lab_binary("mosquitto"), "-c", str(self.conf_path)], self.workdir / "mosquitto.log"
        )
        self.proc.start()
        proc = self.proc
        # The log line, not only an open port: the port may belong to someone else.
        self.proc.wait_ready(
            lambda: " running" in proc.log_text() and _tcp_open(self.host, self.port),
            15.0,
            f"listening on {self.host}:{self.port}",
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port (clients see a broker restart; retained messages kept)."""
        self.stop()
        deadline = time.monotonic() + 10
        while not port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running()


# --------------------------------------------------------------------------- Prometheus


class PrometheusServer:
    """Prometheus 2.x: 1 s scrape of file_sd targets (``file_sd/*.json``), lifecycle API, TSDB in workdir."""

    def __init__(self, workdir: Path, port: int | None = None, *, scrape_interval_s: int = 1):
        self.workdir = workdir
        self.host = LOOPBACK
        self.port = port or free_port()
        self.scrape_interval_s = scrape_interval_s
        self.conf_path = workdir / "prometheus.yml"
        self.file_sd_dir = workdir / "file_sd"
        self.tsdb_dir = workdir / "tsdb"
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def write_config(self) -> None:
        self.file_sd_dir.mkdir(parents=True, exist_ok=True)
        self.tsdb_dir.mkdir(parents=True, exist_ok=True)
        interval = f"{self.scrape_interval_s}s"
        conf = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "scrape_configs": [
                {
                    "job_name": "fleetplan",
                    "file_sd_configs": [
                        {"files": [str(self.file_sd_dir / "*.json")], "refresh_interval": "1s"}
                    ],
                }
            ],
        }
        # JSON is YAML.
        from fleetplan.shared.atomic import atomic_write_text

        atomic_write_text(self.conf_path, json.dumps(conf, indent=2) + "\n")

    def start(self) -> None:
        self.write_config()
        argv = [
            lab_binary("prometheus"),
            f"--config.file={self.conf_path}",
            f"--storage.tsdb.path={self.tsdb_dir}",
            f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-lifecycle",
            "--web.enable-admin-api",
            "--storage.tsdb.retention.time=2d",
            "--log.level=warn",
        ]
        self.proc = ManagedProcess("prometheus", argv, self.workdir / "prometheus.log")
        self.proc.start()
        self.proc.wait_ready(self._ready, 60.0, f"ready at {self.url}/-/ready")

    def _ready(self) -> bool:
        import httpx

        return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running()

    def query(self, expr: str, *, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Instant query; returns the `result` list (raises LabError on an API error)."""
        import httpx

        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=timeout_s)
        body = resp.json()
        if body.get("status") != "success":
            raise LabError(f"PromQL {expr!r} failed: {body.get('error', resp.text)}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def active_targets(self) -> list[dict[str, Any]]:
        import httpx

        body = httpx.get(f"{self.url}/api/v1/targets", params={"state": "active"}, timeout=5.0).json()
        targets: list[dict[str, Any]] = body["data"]["activeTargets"]
        return targets


# --------------------------------------------------------------------------- nginx


class NginxServer:
    """nginx as the front load balancer; non-root friendly (pid, logs, temp paths in workdir).

    Runs with ``daemon off`` in its own process group. The upstreams include
    (`upstreams_path`) is what the controller rewrites (controller/routing.py); `reload()`
    tests the config (``nginx -t``), sends SIGHUP to the master and waits until a fresh
    connection is served by the new routing generation.
    """

    def __init__(self, workdir: Path, port: int | None = None, *, extra_http: str = ""):
        self.workdir = workdir
        self.host = LOOPBACK
        self.port = port or free_port()
        self.extra_http = extra_http  # more of the http {} block (tests: a TLS server in front of an API)
        self.conf_path = workdir / "nginx.conf"
        self.upstreams_path = workdir / "upstreams.conf"
        self.error_log = workdir / "error.log"
        self.proc: ManagedProcess | None = None
        self._reload_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def write_config(self, *, reset_routes: bool = False) -> None:
        """(Re)write nginx.conf atomically; the routing table (upstreams) only when missing or
        `reset_routes` (a new lab has no engines: a previous lab's routes point at dead ports)."""
        from fleetplan.controller.routing import render_nginx_front_server, render_nginx_upstreams
        from fleetplan.shared.atomic import atomic_write_text

        tmp = self.workdir / "tmp"
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
        if reset_routes or not self.upstreams_path.exists():
            atomic_write_text(self.upstreams_path, render_nginx_upstreams({}))
        user = "user root;\n" if os.geteuid() == 0 else ""
        conf = f"""# Generated by fleetplan lab
{user}daemon off;
master_process on;
worker_processes 1;
pid {self.workdir}/nginx.pid;
error_log {self.error_log} warn;
worker_shutdown_timeout 300s;
events {{
    worker_connections 1024;
}}
http {{
    access_log {self.workdir}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {self.upstreams_path};
{render_nginx_front_server(f"{self.host}:{self.port}")}
{self.extra_http}
}}
"""
        atomic_write_text(self.conf_path, conf)

    def _argv(self, *extra: str) -> list[str]:
        return [
            lab_binary("nginx"),
            "-p",
            f"{self.workdir}/",
            "-c",
            str(self.conf_path),
            "-e",
            str(self.error_log),
            *extra,
        ]

    def test_config(self) -> None:
        from fleetplan.controller.routing import NginxReloadError

        proc = subprocess.run(self._argv("-t", "-q"), capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode != 0:
            raise NginxReloadError(
                f"nginx -t rejected {self.conf_path} (upstreams {self.upstreams_path}): "
                f"{proc.stderr.strip() or _tail(self.error_log, 5)}"
            )

    def start(self) -> None:
        self.write_config()
        self.test_config()
        self.proc = ManagedProcess("nginx", self._argv(), self.workdir / "nginx.log")
        self.proc.start()
        self.proc.wait_ready(lambda: self.serving_generation() is not None, 15.0, f"serving at {self.url}")

    def serving_generation(self) -> str | None:
        import httpx

        from fleetplan.controller.routing import ROUTING_STATUS_PATH

        # A fresh connection each time: after a reload only new workers accept connections.
        resp = httpx.get(f"{self.url}{ROUTING_STATUS_PATH}", timeout=1.0, headers={"Connection": "close"})
        if resp.status_code != 200:
            return None
        gen = resp.json().get("generation")
        return str(gen) if gen else None

    @property
    def pid_path(self) -> Path:
        return self.workdir / "nginx.pid"

    def master_pid(self) -> int | None:
        """The running master, from nginx's own pid file (as `nginx -s reload` finds it): an nginx
        restarted by someone else (systemd, an operator, another process) is found as well as the
        one this object started. None when the file is missing or names no live nginx."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if pid_alive(pid) and b"nginx" in cmdline else None

    def reload(self, timeout_s: float = 15.0) -> None:
        """Graceful reload: nginx -t, SIGHUP the master (nginx's pid file), wait for the new routing generation."""
        with self._reload_lock:
            self._reload(timeout_s)

    def _reload(self, timeout_s: float) -> None:
        from fleetplan.controller.routing import NginxReloadError, read_generation

        master = self.master_pid()
        if master is None:
            raise NginxReloadError(
                f"nginx is not running (no live master in {self.pid_path}; log "
                f"{self.proc.log_path if self.proc else self.workdir})"
            )
        self.test_config()
        want = read_generation(self.upstreams_path.read_text())
        old_workers = [pid for pid in group_pids(master) if pid != master]
        os.kill(master, signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while True:
            # Done when the new workers serve the new table AND every old worker has stopped
            # accepting (it is gone or "shutting down": finishing its in-flight requests only).
            try:
                if (want is None or self.serving_generation() == want) and not [
                    pid for pid in old_workers if _worker_accepting(pid)
                ]:
                    return
            except Exception:  # a connection reset while workers switch; try again
                pass
            if time.monotonic() > deadline:
                raise NginxReloadError(
                    f"nginx did not switch to routing generation {want} within {timeout_s:.0f} s; "
                    f"error log {self.error_log}:\n{_tail(self.error_log, 10)}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running()


# --------------------------------------------------------------------------- hosts and the lab


@dataclass(frozen=True)
class LabHost:
    """A simulated GPU host: its agent connects as `mqtt_user` and starts engines on `port_range`."""

    name: str
    gpu: GpuType
    gpu_count: int
    mqtt_user: str
    mqtt_password: str
    port_range: tuple[int, int]  # inclusive [first, last]
    workdir: Path
    nvlink_groups: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return tuple(range(self.gpu_count))

    @property
    def ports(self) -> range:
        return range(self.port_range[0], self.port_range[1] + 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpu": self.gpu.value,
            "gpu_count": self.gpu_count,
            "gpu_indices": list(self.gpu_indices),
            "nvlink_groups": [list(g) for g in self.nvlink_groups],
            "mqtt_user": self.mqtt_user,
            "mqtt_password": self.mqtt_password,
            "port_range": list(self.port_range),
            "workdir": str(self.workdir),
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> LabHost:
        return LabHost(
            name=str(d["name"]),
            gpu=parse_gpu(str(d["gpu"])),
            gpu_count=int(d["gpu_count"]),
            mqtt_user=str(d["mqtt_user"]),
            mqtt_password=str(d["mqtt_password"]),
            port_range=(int(d["port_range"][0]), int(d["port_range"][1])),
            workdir=Path(d["workdir"]),
            nvlink_groups=tuple(tuple(int(i) for i in g) for g in d.get("nvlink_groups", ())),
        )


def default_host_names(n: int) -> tuple[str, ...]:
    """host-a, host-b, ... (host-aa after host-z)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    names = []
    for i in range(n):
        suffix = letters[i % 26] if i < 26 else letters[i // 26 - 1] + letters[i % 26]
        names.append(f"host-{suffix}")
    return tuple(names)


def allocate_port_ranges(count: int, size: int, exclude: Iterable[int] = ()) -> list[tuple[int, int]]:
    """`count` disjoint ranges of `size` currently free ports below the Linux ephemeral range."""
    excluded = set(exclude)
    rng = random.Random()
    ranges: list[tuple[int, int]] = []
    start = rng.randrange(20000, 30000 - count * size * 4)
    port = start
    while len(ranges) < count:
        block = range(port, port + size)
        if port + size >= 32768:
            raise LabError("no free port ranges below 32768")
        if all(p not in excluded and port_is_free(p) for p in block):
            ranges.append((block.start, block.stop - 1))
            port += size
        else:
            port += 1
    return ranges


SERVICES = ("mosquitto", "prometheus", "nginx")


class Lab:
    """Mosquitto + Prometheus + nginx on loopback and N simulated GPU hosts; a context manager.

    `dir`: where everything lives; a new temp dir (removed by `stop()`) when None.
    `hosts`: a count (names host-a, host-b, ...) or explicit names.
    `services`: which servers to start (all by default).
    """

    def __init__(
        self,
        dir: str | Path | None = None,
        *,
        hosts: int | Sequence[str] = 2,
        gpus_per_host: int = 8,
        gpu: GpuType | str = GpuType.H100,
        ports_per_host: int | None = None,
        services: Sequence[str] = SERVICES,
    ):
        unknown = set(services) - set(SERVICES)
        if unknown:
            raise ValueError(f"unknown lab services {sorted(unknown)}; expected some of {SERVICES}")
        self._own_dir = dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="fleetplan-lab-")) if dir is None else Path(dir).resolve()
        self.services = tuple(services)
        names = default_host_names(hosts) if isinstance(hosts, int) else tuple(hosts)
        for name in names:
            if not name or not set(name) <= _HOST_NAME_CHARS or name.startswith("-"):
                raise ValueError(f"lab host name {name!r}: use lowercase letters, digits and '-'")
        if len(set(names)) != len(names):
            raise ValueError(f"lab host names repeat: {names}")
        self._host_names = names
        self._gpus_per_host = gpus_per_host
        self._gpu = gpu if isinstance(gpu, GpuType) else parse_gpu(gpu)
        self._ports_per_host = ports_per_host or max(8, 2 * gpus_per_host)
        self.mosquitto: MosquittoServer | None = None
        self.prometheus: PrometheusServer | None = None
        self.nginx: NginxServer | None = None
        self.hosts: tuple[LabHost, ...] = ()
        self._started = False

    # ---- lifecycle

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> Lab:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            used: set[int] = set()
            if "mosquitto" in self.services:
                self.mosquitto = MosquittoServer(self.dir / "mosquitto", self._host_names)
                used.add(self.mosquitto.port)
            if "prometheus" in self.services:
                self.prometheus = PrometheusServer(self.dir / "prometheus", free_port(exclude=used))
                used.add(self.prometheus.port)
            if "nginx" in self.services:
                self.nginx = NginxServer(self.dir / "nginx", free_port(exclude=used))
                self.nginx.write_config(reset_routes=True)
                used.add(self.nginx.port)
            ranges = allocate_port_ranges(len(self._host_names), self._ports_per_host, exclude=used)
            hosts = []
            for name, port_range in zip(self._host_names, ranges, strict=True):
                workdir = self.dir / "hosts" / name
                workdir.mkdir(parents=True, exist_ok=True)
                agent = self.mosquitto.agents[name] if self.mosquitto else MqttUser(f"agent-{name}", "")
                hosts.append(
                    LabHost(
                        name=name,
                        gpu=self._gpu,
                        gpu_count=self._gpus_per_host,
                        mqtt_user=agent.user,
                        mqtt_password=agent.password,
                        port_range=port_range,
                        workdir=workdir,
                        nvlink_groups=(tuple(range(self._gpus_per_host)),),
                    )
                )
            self.hosts = tuple(hosts)
            # Start the slow one first without waiting would be faster; sequential keeps errors clear.
            for server in (self.mosquitto, self.nginx, self.prometheus):
                if server is not None:
                    self._start_with_port_retry(server, used)
            self._started = True
            self.write_json()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _start_with_port_retry(
        server: MosquittoServer | PrometheusServer | NginxServer, used: set[int]
    ) -> None:
        """Start; if another process took the free port meanwhile, take another one (3 tries)."""
        for attempt in range(3):
            try:
                server.start()
                return
            except LabError as exc:
                if attempt == 2 or "address already in use" not in str(exc).lower():
                    raise
            used.add(server.port)
            server.port = free_port(exclude=used)  # start() writes the config with it
            used.add(server.port)

    def stop(self) -> None:
        """Stop every server (process groups emptied) and remove the dir if the lab created it."""
        errors = []
        for server in (self.nginx, self.prometheus, self.mosquitto):
            if server is None:
                continue
            try:
                server.stop()
            except Exception as exc:  # keep stopping the others
                errors.append(str(exc))
        self._started = False
        if self._own_dir and not os.environ.get("FLEETPLAN_KEEP_LAB"):
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise LabError("; ".join(errors))

    # ---- the contract's attributes

    def _need(self, server: Any, name: str) -> Any:
        if server is None:
            raise LabError(f"this lab was started without {name} (services={self.services})")
        return server

    @property
    def mqtt_host(self) -> str:
        return str(self._need(self.mosquitto, "mosquitto").host)

    @property
    def mqtt_port(self) -> int:
        return int(self._need(self.mosquitto, "mosquitto").port)

    @property
    def controller_user(self) -> str:
        return str(self._need(self.mosquitto, "mosquitto").controller_user)

    @property
    def controller_password(self) -> str:
        return str(self._need(self.mosquitto, "mosquitto").controller_password)

    @property
    def observer(self) -> MqttUser:
        """Read-only MQTT credentials (fleetplan/#) that never share the controller's client id."""
        observer: MqttUser = self._need(self.mosquitto, "mosquitto").observer
        return observer

    @property
    def prometheus_url(self) -> str:
        return str(self._need(self.prometheus, "prometheus").url)

    @property
    def prometheus_file_sd_dir(self) -> Path:
        return Path(self._need(self.prometheus, "prometheus").file_sd_dir)

    @property
    def nginx_url(self) -> str:
        return str(self._need(self.nginx, "nginx").url)

    @property
    def nginx_upstreams_path(self) -> Path:
        return Path(self._need(self.nginx, "nginx").upstreams_path)

    @property
    def endpoints_path(self) -> Path:
        return self.dir / "endpoints.json"

    def reload_nginx(self) -> None:
        self._need(self.nginx, "nginx").reload()

    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no lab host {name!r}; hosts: {[h.name for h in self.hosts]}")

    def router(self) -> Any:
        """An NginxRouter on this lab's upstreams file and graceful reload."""
        from fleetplan.controller.routing import NginxRouter

        return NginxRouter(self.nginx_upstreams_path, self.reload_nginx)

    def process_groups(self) -> dict[str, int]:
        """Server name -> process group id (= the server's pid) of the running servers."""
        out = {}
        for name, server in (
            ("mosquitto", self.mosquitto),
            ("prometheus", self.prometheus),
            ("nginx", self.nginx),
        ):
            if server is not None and server.proc is not None and server.proc.pid is not None:
                out[name] = server.proc.pid
        return out

    # ---- lab.json

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"version": 1, "dir": str(self.dir), "hosts": [h.to_json() for h in self.hosts]}
        procs: dict[str, Any] = {}
        if self.mosquitto is not None:
            m = self.mosquitto
            doc["mqtt"] = {
                "host": m.host,
                "port": m.port,
                "controller_user": m.controller_user,
                "controller_password": m.controller_password,
                "observer_user": m.observer.user,
                "observer_password": m.observer.password,
                "conf": str(m.conf_path),
                "acl": str(m.acl_path),
            }
            if m.proc is not None:
                procs["mosquitto"] = m.proc.to_json()
        if self.prometheus is not None:
            p = self.prometheus
            doc["prometheus"] = {
                "url": p.url,
                "port": p.port,
                "file_sd_dir": str(p.file_sd_dir),
                "conf": str(p.conf_path),
            }
            if p.proc is not None:
                procs["prometheus"] = p.proc.to_json()
        if self.nginx is not None:
            n = self.nginx
            doc["nginx"] = {
                "url": n.url,
                "port": n.port,
                "upstreams_path": str(n.upstreams_path),
                "conf": str(n.conf_path),
                "prefix": str(n.workdir),
                "error_log": str(n.error_log),
                "reload": " ".join(n._argv("-s", "reload")),
            }
            if n.proc is not None:
                procs["nginx"] = n.proc.to_json()
        doc["endpoints_path"] = str(self.endpoints_path)
        doc["processes"] = procs
        return doc

    def write_json(self) -> Path:
        from fleetplan.shared.atomic import atomic_write_text

        path = self.dir / LAB_JSON
        atomic_write_text(path, json.dumps(self.to_json(), indent=2) + "\n", mode=0o600)
        return path

    @classmethod
    def attach(cls, dir: str | Path) -> Lab:
        """A Lab object for a lab started elsewhere (`fleetplan lab up`), from its lab.json."""
        path = Path(dir).resolve() / LAB_JSON
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise LabError(f"{path}: no lab.json (was `fleetplan lab up --dir {dir}` run?)") from None
        except json.JSONDecodeError as exc:
            raise LabError(f"{path}: invalid JSON: {exc}") from None
        hosts = [LabHost.from_json(h) for h in doc.get("hosts", [])]
        services = [
            s
            for s, key in (("mosquitto", "mqtt"), ("prometheus", "prometheus"), ("nginx", "nginx"))
            if key in doc
        ]
        lab = cls(doc["dir"], hosts=[h.name for h in hosts] or 0, services=services)
        lab.hosts = tuple(hosts)
        procs = doc.get("processes", {})
        if "mqtt" in doc:
            m = MosquittoServer(
                Path(doc["mqtt"]["conf"]).parent, [h.name for h in hosts], int(doc["mqtt"]["port"])
            )
            m.controller = MqttUser(doc["mqtt"]["controller_user"], doc["mqtt"]["controller_password"])
            if "observer_user" in doc["mqtt"]:
                m.observer = MqttUser(doc["mqtt"]["observer_user"], doc["mqtt"]["observer_password"])
            m.agents = {h.name: MqttUser(h.mqtt_user, h.mqtt_password) for h in hosts}
            m.proc = _attached_proc("mosquitto", procs.get("mosquitto"))
            lab.mosquitto = m
        if "prometheus" in doc:
            p = PrometheusServer(Path(doc["prometheus"]["conf"]).parent, int(doc["prometheus"]["port"]))
            p.proc = _attached_proc("prometheus", procs.get("prometheus"))
            lab.prometheus = p
        if "nginx" in doc:
            n = NginxServer(Path(doc["nginx"]["prefix"]), int(doc["nginx"]["port"]))
            n.proc = _attached_proc("nginx", procs.get("nginx"))
            lab.nginx = n
        lab._started = True
        return lab


def _attached_proc(name: str, info: Mapping[str, Any] | None) -> ManagedProcess | None:
    """A ManagedProcess for a server started by another process, if its pid still runs that binary."""
    if not info or info.get("pid") is None:
        return None
    proc = ManagedProcess(name, info["argv"], Path(info["log"]))
    pid = int(info["pid"])
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # nginx rewrites its title ("nginx: master process /usr/sbin/nginx -p ..."): look for the name.
    if not pid_alive(pid) or Path(info["argv"][0]).name.encode() not in cmdline:
        return None  # gone, or the pid was reused by something else
    proc.pid = pid
    return proc


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> None:
    lab = subparsers.add_parser(
        "lab", help="start/stop the lab: Mosquitto, Prometheus, nginx, simulated hosts"
    )
    lab_sub = lab.add_subparsers(dest="lab_command", metavar="ACTION", required=True)
    up = lab_sub.add_parser("up", help="start the lab in the background; writes DIR/lab.json")
    up.add_argument(
        "--dir", required=True, type=Path, help="lab directory (created; configs, logs, lab.json)"
    )
    up.add_argument("--hosts", type=int, default=4, help="simulated GPU hosts (default 4)")
    up.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (default 8)")
    up.add_argument("--gpu", default="h100", help="GPU type of the hosts (default h100)")
    up.set_defaults(handler=_cmd_up)
    down = lab_sub.add_parser("down", help="stop a lab started with `lab up`")
    down.add_argument("--dir", required=True, type=Path)
    down.set_defaults(handler=_cmd_down)
    status = lab_sub.add_parser("status", help="print lab.json and whether each server runs")
    status.add_argument("--dir", required=True, type=Path)
    status.set_defaults(handler=_cmd_status)


def _cmd_up(args: argparse.Namespace) -> int:
    if (args.dir / LAB_JSON).exists():
        try:
            existing = Lab.attach(args.dir)
        except LabError:
            existing = None
        if existing is not None and existing.process_groups():
            print(
                f"error: a lab is already running in {args.dir} (fleetplan lab down --dir {args.dir})",
                file=sys.stderr,
            )
            return 1
    if args.hosts < 0 or args.gpus_per_host < 1:
        print("error: --hosts must be >= 0 and --gpus-per-host >= 1", file=sys.stderr)
        return 2
    try:
        gpu = parse_gpu(args.gpu)
    except ValueError as exc:
        print(f"error: --gpu: {exc}", file=sys.stderr)
        return 2
    lab = Lab(args.dir, hosts=args.hosts, gpus_per_host=args.gpus_per_host, gpu=gpu)
    try:
        lab.start()
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {k: v for k, v in lab.to_json().items() if k != "hosts"} | {"hosts": [h.name for h in lab.hosts]},
            indent=2,
        )
    )
    print(f"lab up: {lab.dir / LAB_JSON}; stop with: fleetplan lab down --dir {args.dir}", file=sys.stderr)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    try:
        lab = Lab.attach(args.dir)
        lab.stop()
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"lab down: {args.dir}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        lab = Lab.attach(args.dir)
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    doc = lab.to_json()
    doc["running"] = {name: bool(group_pids(pgid)) for name, pgid in lab.process_groups().items()}
    print(json.dumps(doc, indent=2))
    return 0 if lab.process_groups() else 1


def settings_from_lab(settings: ControllerSettings) -> tuple[ControllerSettings, Callable[[], None] | None]:
    """Fill a ControllerSettings' Prometheus/MQTT/routing from lab.json when its `lab_dir` is set;
    returns the settings and the lab's nginx reloader (the daemon's `prepare` hook)."""
    from fleetplan.controller.daemon import RoutingSettings
    from fleetplan.controller.mqtt import MqttSettings

    if settings.lab_dir is None:
        return settings, None
    lab = Lab.attach(settings.lab_dir)
    routing = RoutingSettings(
        nginx_upstreams_path=lab.nginx_upstreams_path,
        endpoints_path=lab.endpoints_path,
        file_sd_path=lab.prometheus_file_sd_dir / "engines.json",
        router_url=lab.nginx_url,
    )
    mqtt = MqttSettings(
        host=lab.mqtt_host, port=lab.mqtt_port, username=lab.controller_user,
        password=lab.controller_password, keepalive_s=5, backoff_initial_s=0.2, backoff_max_s=2.0,
    )
    new = settings.model_copy(update={
        "prometheus_url": lab.prometheus_url, "mqtt": mqtt, "routing": routing,
        "default_host_address": settings.default_host_address or "127.0.0.1",
    })
    return new, lab.reload_nginx
