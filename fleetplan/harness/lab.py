"""The lab: real Mosquitto, Prometheus, nginx and the pool proxy on free loopback ports, plus
simulated GPU hosts.

The servers are in `fleetplan.harness.servers`, their processes in `fleetplan.harness.procs`; this
module holds the simulated hosts (`LabHost`), the `Lab` that starts them all, and `lab.json`.

Everything lives in one directory (a temp dir by default): generated configs, logs, the TSDB,
the broker's persistence, per-host workdirs, and ``lab.json`` describing ports, users and paths.
Each server runs in its own process group (``start_new_session``) so that stopping it leaves no
orphan (nginx workers included); `Lab.stop()` waits for every group to be empty.

    with Lab(hosts=2) as lab:
        lab.mqtt_port, lab.controller_user, lab.controller_password, lab.hosts[0].mqtt_user
        write_file_sd(lab.prometheus_file_sd_dir / "engines.json", targets)
        NginxRouter(lab.nginx_upstreams_path, lab.reload_nginx).apply({"m": ["127.0.0.1:8001"]})
        lab.pool_proxy_address, lab.pool_upstreams_path  # `fleetplan pool-proxy`, its upstreams file

CLI: ``fleetplan lab up --dir D [--hosts N] [--gpus-per-host 8] [--gpu h100]`` starts it in the
background and writes D/lab.json; ``fleetplan lab down --dir D`` stops it (fleetplan/harness/cli/lab.py).

Every `Lab.start()` (every ``lab up``) is a new lab: new ports, new MQTT passwords, and every server
config regenerated (each file replaced atomically; nginx's routes and the pool proxy's upstreams
start empty), also in the directory of a stopped lab. What the
servers keep in D is data, not config: the broker's retained messages, the TSDB, the logs (appended),
and any other file in D is left alone. Restarting one server (`MosquittoServer.restart`) keeps its
port and passwords.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fleetplan.harness.procs import (
    LabError,
    ManagedProcess,
    free_port,
    pid_alive,
    port_is_free,
    retry_if_port_taken,
)
from fleetplan.harness.servers import (
    MosquittoServer,
    MqttUser,
    NginxServer,
    PoolProxyServer,
    PrometheusServer,
)
from fleetplan.models.names import GpuType, parse_gpu

if TYPE_CHECKING:
    from fleetplan.controller.daemon import ControllerSettings

LAB_JSON = "lab.json"

_HOST_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


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


SERVICES = ("mosquitto", "prometheus", "nginx", "pool-proxy")


class Lab:
    """Mosquitto + Prometheus + nginx + the pool proxy on loopback and N simulated GPU hosts; a
    context manager.

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
        self.pool_proxy: PoolProxyServer | None = None
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
            if "pool-proxy" in self.services:
                self.pool_proxy = PoolProxyServer(self.dir / "pool-proxy", free_port(exclude=used))
                used.add(self.pool_proxy.port)
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
            for server in (self.mosquitto, self.nginx, self.prometheus, self.pool_proxy):
                if server is not None:
                    self._start_with_port_retry(server, used)
            self._scrape_pool_proxy()
            self._started = True
            self.write_json()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _start_with_port_retry(
        server: MosquittoServer | PrometheusServer | NginxServer | PoolProxyServer, used: set[int]
    ) -> None:
        """Start; if another process took the free port meanwhile, take another one (3 tries)."""
        def move() -> None:
            used.add(server.port)
            server.port = free_port(exclude=used)  # start() writes the config with it
            used.add(server.port)

        retry_if_port_taken(server.start,
                            lambda exc: isinstance(exc, LabError) and "address already in use" in str(exc).lower(),
                            move, tries=3)

    def _scrape_pool_proxy(self) -> None:
        """Prometheus scrapes the pool proxy's own metrics (labelled service="pool-proxy": no
        replica label, so the controller's per-replica queries do not see it)."""
        if self.prometheus is None or self.pool_proxy is None:
            return
        from fleetplan.shared.atomic import atomic_write_text

        doc = [{"targets": [self.pool_proxy.address], "labels": {"service": "pool-proxy"}}]
        atomic_write_text(self.prometheus.file_sd_dir / "pool-proxy.json", json.dumps(doc, indent=2) + "\n")

    def stop(self) -> None:
        """Stop every server (process groups emptied) and remove the dir if the lab created it."""
        errors = []
        for server in (self.pool_proxy, self.nginx, self.prometheus, self.mosquitto):
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
    def pool_proxy_address(self) -> str:
        """host:port of the pool proxy: what the controller puts in a pooled model's nginx upstream."""
        return str(self._need(self.pool_proxy, "pool-proxy").address)

    @property
    def pool_upstreams_path(self) -> Path:
        """The pool proxy's upstreams file (the controller writes it)."""
        return Path(self._need(self.pool_proxy, "pool-proxy").upstreams_path)

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
            ("pool-proxy", self.pool_proxy),
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
        if self.pool_proxy is not None:
            pp = self.pool_proxy
            doc["pool_proxy"] = {"url": pp.url, "port": pp.port, "address": pp.address,
                                 "upstreams_path": str(pp.upstreams_path), "poll_s": pp.poll_s}
            if pp.proc is not None:
                procs["pool-proxy"] = pp.proc.to_json()
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
            for s, key in (("mosquitto", "mqtt"), ("prometheus", "prometheus"), ("nginx", "nginx"),
                           ("pool-proxy", "pool_proxy"))
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
        if "pool_proxy" in doc:
            pd = doc["pool_proxy"]
            pp = PoolProxyServer(Path(pd["upstreams_path"]).parent, int(pd["port"]), poll_s=float(pd["poll_s"]))
            pp.proc = _attached_proc("pool-proxy", procs.get("pool-proxy"))
            lab.pool_proxy = pp
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


def settings_from_lab(settings: ControllerSettings) -> tuple[ControllerSettings, Callable[[], None] | None]:
    """Fill a ControllerSettings' Prometheus/MQTT/routing (the pool proxy's too) from lab.json when its
    `lab_dir` is set (a `prometheus_url` the settings name wins: e.g. a proxy in front of the lab's
    Prometheus);
    returns the settings and the lab's nginx reloader (the daemon's `prepare` hook)."""
    from fleetplan.controller.daemon import RoutingSettings
    from fleetplan.controller.mqtt import MqttSettings
    from fleetplan.controller.settings import PoolProxySettings

    if settings.lab_dir is None:
        return settings, None
    lab = Lab.attach(settings.lab_dir)
    routing = RoutingSettings(
        nginx_upstreams_path=lab.nginx_upstreams_path,
        endpoints_path=lab.endpoints_path,
        file_sd_path=lab.prometheus_file_sd_dir / "engines.json",
        router_url=lab.nginx_url,
        pool_proxy=(PoolProxySettings(upstreams_path=lab.pool_upstreams_path, address=lab.pool_proxy_address)
                    if lab.pool_proxy is not None else None),
    )
    mqtt = MqttSettings(
        host=lab.mqtt_host, port=lab.mqtt_port, username=lab.controller_user,
        password=lab.controller_password, keepalive_s=5, backoff_initial_s=0.2, backoff_max_s=2.0,
    )
    new = settings.model_copy(update={
        "prometheus_url": (settings.prometheus_url if "prometheus_url" in settings.model_fields_set
                           else lab.prometheus_url),
        "mqtt": mqtt, "routing": routing,
        "default_host_address": settings.default_host_address or "127.0.0.1",
    })
    return new, lab.reload_nginx
