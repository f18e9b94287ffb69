"""Routing outputs: nginx upstreams per model, Prometheus file_sd targets, an endpoints JSON.

All three are regenerated from the fleet and written atomically (controller/atomic.py); nginx
is reloaded gracefully (old workers finish in-flight requests, new workers take the new config).

How nginx picks a model (stock Debian nginx, no njs: nginx cannot read the JSON body before it
chooses an upstream):

* path prefix: ``/m/<model>/v1/chat/completions`` -> upstream of <model>, forwarded as
  ``/v1/chat/completions`` (query string kept). An OpenAI client just uses
  ``base_url = http://front/m/<model>/v1``.
* header: ``X-Model: <model>`` on a plain ``/v1/...`` request -> upstream of <model>, path unchanged.
* ``GET /v1/models`` without either lists every routed model (OpenAI list format).

Unknown model -> 404 JSON; known model with no replica -> 503 JSON (``Retry-After``); a plain
``/v1/...`` request naming no model -> 400 JSON. ``GET /-/fleetplan/routing`` returns the
generation (content hash) of the routing table a worker is using: a reload is complete when
a fresh connection sees the new generation.

The upstreams file (`render_nginx_upstreams`) holds only http-level directives (``upstream`` and
``map`` blocks) and is rewritten on every fleet change; the front ``server`` block
(`render_nginx_front_server`) is static and is written once into nginx.conf next to an
``include`` of the upstreams file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetplan.shared.atomic import atomic_write_text

log = logging.getLogger(__name__)

MODEL_HEADER = "X-Model"
PATH_PREFIX = "/m/"
ROUTING_STATUS_PATH = "/-/fleetplan/routing"
TRTLLM_METRICS_PATH = "/prometheus/metrics"

_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+-]{0,199}$")
_ENDPOINT_RE = re.compile(
    r"^(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})$"
)
_GENERATION_RE = re.compile(r"^# fleetplan-generation: (?P<gen>[0-9a-f]+)$", re.MULTILINE)
_NO_REPLICA = "-"


class RoutingError(ValueError):
    """Invalid routing input (model name, endpoint); the message names the value."""


class NginxReloadError(RuntimeError):
    """nginx rejected the new configuration or did not reload; the message carries nginx's stderr."""


def validate_model_name(model: str) -> str:
    if not _MODEL_RE.fullmatch(model) or ".." in model or "//" in model or model.endswith("/"):
        raise RoutingError(
            f"model name {model!r} cannot be routed: use letters, digits and . _ : / + - "
            "(no '..', '//' or trailing '/'), at most 200 characters"
        )
    return model


def validate_endpoint(endpoint: str) -> str:
    match = _ENDPOINT_RE.fullmatch(endpoint)
    if not match or not 0 < int(match["port"]) < 65536:
        raise RoutingError(f"endpoint {endpoint!r} is not host:port (e.g. 127.0.0.1:8001)")
    return endpoint


def upstream_name(model: str) -> str:
    """A stable nginx upstream name for a model: fp_<slug>_<hash8>."""
    slug = re.sub(r"[^a-z0-9]+", "_", model.lower()).strip("_")[:40]
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"fp_{slug}_{digest}"


def _normalise(endpoints: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for model in sorted(endpoints):
        validate_model_name(model)
        out[model] = sorted({validate_endpoint(e) for e in endpoints[model]})
    return out


def routing_generation(endpoints: Mapping[str, Sequence[str]]) -> str:
    """Content hash of a routing table (same table -> same generation)."""
    canonical = json.dumps(_normalise(endpoints), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def read_generation(upstreams_text: str) -> str | None:
    """The generation recorded in a rendered upstreams file, or None."""
    match = _GENERATION_RE.search(upstreams_text)
    return match["gen"] if match else None


HEADER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


def _affinity_var(header: str) -> str:
    return "$fleetplan_affinity_" + header.lower().replace("-", "_")


def render_nginx_upstreams(endpoints: Mapping[str, Sequence[str]], *,
                           affinity: Mapping[str, str] | None = None) -> str:
    """The http-level include: one ``upstream`` per model with replicas, and the routing maps.

    `endpoints`: model -> ["host:port", ...]; a model with an empty list is known but has no
    replica (503). Deterministic: the same table renders the same text.
    `affinity`: model -> a request header (e.g. "X-Session-Id"): that model's upstream hashes the
    header's value on nginx's consistent-hash ring (``hash ... consistent``: one conversation's
    requests reach the replica holding its prefix cache; a replica added or removed moves only
    its share of the keys) instead of ``least_conn``; a request without the header hashes its
    own $request_id (spread at random). nginx bounds no replica's load (the simulator's router
    does: fleetplan.sim.router). Off (least_conn) for every model not named.
    """
    table = _normalise(endpoints)
    generation = routing_generation(table)
    lines = [
        "# Generated by fleetplan (controller/routing.py); rewritten on every fleet change. Do not edit.",
        f"# fleetplan-generation: {generation}",
        "",
    ]
    hashed = {m: h for m, h in (affinity or {}).items() if table.get(m)}
    for header in sorted(set(hashed.values())):
        if not HEADER_RE.match(header):
            raise ValueError(f"affinity header {header!r}: expected letters, digits and '-'")
        http_var = "$http_" + header.lower().replace("-", "_")
        lines += [f"map {http_var} {_affinity_var(header)} {{", '    "" $request_id;', f"    default {http_var};",
                  "}", ""]
    for model, servers in table.items():
        if not servers:
            continue
        lines.append(f"# model {model}")
        lines.append(f"upstream {upstream_name(model)} {{")
        key_header = hashed.get(model)
        lines.append(f"    hash {_affinity_var(key_header)} consistent;" if key_header else "    least_conn;")
        for server in servers:
            lines.append(f"    server {server} max_fails=1 fail_timeout=2s;")
        lines.append("    keepalive 16;")
        lines.append("}")
        lines.append("")

    def target(model: str) -> str:
        return upstream_name(model) if table[model] else _NO_REPLICA

    # Path prefix: /m/<model>/rest -> upstream, with the rest of the raw request URI captured.
    lines.append("map $request_uri $fleetplan_path_upstream {")
    lines.append('    default "";')
    # Defines $fleetplan_rest even when no model is routed (never matches a request).
    lines.append('    "~^/-/fleetplan/none(?<fleetplan_rest>/.*)$" "";')
    # Longest model names first so that "a/b" wins over "a" for /m/a/b/...
    for model in sorted(table, key=lambda m: (-len(m), m)):
        pattern = f"~^{re.escape(PATH_PREFIX + model)}(?<fleetplan_rest>/.*)$"
        lines.append(f'    "{pattern}" {target(model)};')
    lines.append("}")
    lines.append("")
    lines.append("map $request_uri $fleetplan_path_model {")
    lines.append('    default "";')
    for model in sorted(table, key=lambda m: (-len(m), m)):
        lines.append(f'    "~^{re.escape(PATH_PREFIX + model)}/" "{model}";')
    lines.append("}")
    lines.append("")
    lines.append(f"map $http_{MODEL_HEADER.lower().replace('-', '_')} $fleetplan_header_upstream {{")
    lines.append('    default "";')
    for model in table:
        lines.append(f'    "{model}" {target(model)};')
    lines.append("}")
    lines.append("")
    models_json = json.dumps(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "owned_by": "fleetplan", "replicas": len(s)}
                for m, s in table.items()
            ],
        },
        separators=(",", ":"),
    )
    lines.append('map "" $fleetplan_models_json {')
    lines.append(f"    default '{models_json}';")
    lines.append("}")
    lines.append('map "" $fleetplan_generation {')
    lines.append(f'    default "{generation}";')
    lines.append("}")
    lines.append("")
    return "\n".join(lines)


def _json_error(status: int, message: str, kind: str) -> str:
    # nginx `return` bodies are single-quoted strings; messages contain no single quotes.
    body = '{"error":{"message":"' + message + '","type":"' + kind + '","code":' + str(status) + "}}"
    return f"return {status} '{body}\\n';"


def render_nginx_front_server(listen: str, *, read_timeout_s: int = 600) -> str:
    """The static front ``server`` block (http level) that routes with the maps of the upstreams file.

    `listen`: an nginx listen address, e.g. "127.0.0.1:8080".
    """
    return f"""server {{
    listen {listen};
    default_type application/json;
    client_max_body_size 64m;

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_set_header Host $proxy_host;
    proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
    proxy_buffering off;
    proxy_request_buffering off;
    proxy_read_timeout {read_timeout_s}s;
    proxy_send_timeout {read_timeout_s}s;
    proxy_connect_timeout 2s;
    proxy_next_upstream error timeout;
    proxy_next_upstream_tries 3;

    # nginx's own upstream failures as JSON (upstream responses pass through unchanged).
    error_page 502 = @fleetplan_502;
    error_page 504 = @fleetplan_504;
    location @fleetplan_502 {{
        {_json_error(502, "no replica of the model answered (connection failed)", "bad_gateway")}
    }}
    location @fleetplan_504 {{
        {_json_error(504, "the replica did not answer in time", "gateway_timeout")}
    }}

    location = {ROUTING_STATUS_PATH} {{
        return 200 '{{"generation":"$fleetplan_generation"}}\\n';
    }}
    location = /-/healthy {{
        return 200 '{{"status":"ok"}}\\n';
    }}
    location = /v1/models {{
        if ($http_{MODEL_HEADER.lower().replace("-", "_")} = "") {{
            return 200 '$fleetplan_models_json\\n';
        }}
        if ($fleetplan_header_upstream = "") {{
            {_json_error(404, f"unknown model (the {MODEL_HEADER} header names no routed model)", "model_not_found")}
        }}
        if ($fleetplan_header_upstream = "{_NO_REPLICA}") {{
            add_header Retry-After 5 always;
            {_json_error(503, "no replica of model $http_x_model is serving", "unavailable")}
        }}
        proxy_pass http://$fleetplan_header_upstream;
    }}
    location {PATH_PREFIX} {{
        if ($fleetplan_path_upstream = "") {{
            {_json_error(404, f"unknown model (the {PATH_PREFIX}<model>/ path prefix names no routed model)", "model_not_found")}
        }}
        if ($fleetplan_path_upstream = "{_NO_REPLICA}") {{
            add_header Retry-After 5 always;
            {_json_error(503, "no replica of model $fleetplan_path_model is serving", "unavailable")}
        }}
        proxy_pass http://$fleetplan_path_upstream$fleetplan_rest;
    }}
    location / {{
        if ($http_{MODEL_HEADER.lower().replace("-", "_")} = "") {{
            {_json_error(400, f"name the model with a {PATH_PREFIX}<model>/ path prefix or an {MODEL_HEADER} header", "invalid_request_error")}
        }}
        if ($fleetplan_header_upstream = "") {{
            {_json_error(404, f"unknown model (the {MODEL_HEADER} header names no routed model)", "model_not_found")}
        }}
        if ($fleetplan_header_upstream = "{_NO_REPLICA}") {{
            add_header Retry-After 5 always;
            {_json_error(503, "no replica of model $http_x_model is serving", "unavailable")}
        }}
        proxy_pass http://$fleetplan_header_upstream;
    }}
}}
"""


class NginxRouter:
    """Writes the upstreams include atomically and reloads nginx; keeps the old file on failure.

    `reload` validates and reloads (e.g. `Lab.reload_nginx` or `nginx_reloader(...)`); it raises
    on failure. Blocking: from asyncio call `await asyncio.to_thread(router.apply, endpoints)`.
    """

    def __init__(self, upstreams_path: str | Path, reload: Callable[[], None], *,
                 affinity: Mapping[str, str] | None = None) -> None:
        self.upstreams_path = Path(upstreams_path)
        self._reload = reload
        self.affinity = dict(affinity or {})  # model -> session header (render_nginx_upstreams)
        self._lock = threading.Lock()  # one rewrite + reload at a time (callers use worker threads)

    def current_text(self) -> str | None:
        try:
            return self.upstreams_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def apply(self, endpoints: Mapping[str, Sequence[str]]) -> bool:
        """Route `endpoints` (model -> ["host:port"]). Returns False when nothing changed.

        On return nginx serves the new table (when `reload` waits for it, as the lab's does).
        On a reload failure the previous file is restored and NginxReloadError is raised.
        """
        text = render_nginx_upstreams(endpoints, affinity=self.affinity)
        with self._lock:
            return self._apply_locked(text)

    def _apply_locked(self, text: str) -> bool:
        old = self.current_text()
        if old == text:
            return False
        atomic_write_text(self.upstreams_path, text)
        try:
            self._reload()
        except Exception as exc:
            if old is None:
                self.upstreams_path.unlink(missing_ok=True)
            else:
                atomic_write_text(self.upstreams_path, old)
            log.error("nginx reload failed, kept the previous upstreams %s: %s", self.upstreams_path, exc)
            if isinstance(exc, NginxReloadError):
                raise
            raise NginxReloadError(f"nginx reload failed for {self.upstreams_path}: {exc}") from exc
        log.info("nginx upstreams %s now generation %s", self.upstreams_path, read_generation(text))
        return True

    update = apply

    def reload_now(self) -> None:
        """Reload the router on the file as it is (a router that came back serving another table)."""
        with self._lock:
            try:
                self._reload()
            except NginxReloadError:
                raise
            except Exception as exc:
                raise NginxReloadError(f"nginx reload failed for {self.upstreams_path}: {exc}") from exc


def probe_router(router_url: str, timeout_s: float = 2.0) -> str:
    """GET <router_url>/-/fleetplan/routing on a fresh connection: the generation the router serves.
    Raises (httpx.HTTPError, ValueError) when it does not answer like a fleetplan front."""
    import httpx

    resp = httpx.get(router_url.rstrip("/") + ROUTING_STATUS_PATH, timeout=timeout_s, headers={"Connection": "close"})
    if resp.status_code != 200:
        raise ValueError(f"HTTP {resp.status_code} from {router_url}{ROUTING_STATUS_PATH}")
    gen = resp.json().get("generation")
    if not isinstance(gen, str):
        raise ValueError(f"{router_url}{ROUTING_STATUS_PATH} names no routing generation")
    return gen


def nginx_reloader(
    *,
    nginx_bin: str = "nginx",
    conf: str | Path | None = None,
    prefix: str | Path | None = None,
    error_log: str | Path | None = None,
    timeout_s: float = 30.0,
) -> Callable[[], None]:
    """A reload callable for a system nginx: `nginx -t` then `nginx -s reload` (same -p/-c)."""

    def base() -> list[str]:
        argv = [nginx_bin]
        if prefix is not None:
            argv += ["-p", str(prefix)]
        if conf is not None:
            argv += ["-c", str(conf)]
        if error_log is not None:
            argv += ["-e", str(error_log)]
        return argv

    def reload() -> None:
        for extra, what in ((["-t", "-q"], "config test"), (["-s", "reload"], "reload")):
            proc = subprocess.run(
                base() + extra, capture_output=True, text=True, timeout=timeout_s, check=False
            )
            if proc.returncode != 0:
                raise NginxReloadError(
                    f"nginx {what} failed ({' '.join(base() + extra)}): {proc.stderr.strip()}"
                )

    return reload


@dataclass(frozen=True)
class ScrapeTarget:
    """One engine replica for Prometheus file_sd. `address` is host:port of its metrics server."""

    address: str
    model: str
    engine: str  # fleetplan.models.names.Engine value ("vllm" | "trtllm")
    host: str
    replica: str
    metrics_path: str | None = None  # None: /metrics for vllm, /prometheus/metrics for trtllm
    extra_labels: tuple[tuple[str, str], ...] = ()

    def labels(self) -> dict[str, str]:
        labels = {"model": self.model, "engine": str(self.engine), "host": self.host, "replica": self.replica}
        path = self.metrics_path
        if path is None and str(self.engine) == "trtllm":
            path = TRTLLM_METRICS_PATH
        if path is not None:
            labels["__metrics_path__"] = path
        labels.update(dict(self.extra_labels))
        return labels


def render_file_sd(targets: Iterable[ScrapeTarget]) -> str:
    groups = [
        {"targets": [validate_endpoint(t.address)], "labels": t.labels()}
        for t in sorted(targets, key=lambda t: (t.model, t.replica, t.address))
    ]
    return json.dumps(groups, indent=2, sort_keys=True) + "\n"


def write_file_sd(path: str | Path, targets: Iterable[ScrapeTarget]) -> None:
    """Prometheus file_sd JSON (one group per replica, labels model/engine/host/replica), atomically.

    Use a ``*.json`` name inside the lab's `prometheus_file_sd_dir`; Prometheus picks it up
    within ~1 s (inotify + 1 s refresh).
    """
    atomic_write_text(path, render_file_sd(targets))


def render_endpoints_json(endpoints: Mapping[str, Sequence[str]]) -> str:
    table = _normalise(endpoints)
    doc = {
        "version": 1,
        "generation": routing_generation(table),
        "models": {m: {"endpoints": s, "path_prefix": f"{PATH_PREFIX}{m}/"} for m, s in table.items()},
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def write_endpoints_json(path: str | Path, endpoints: Mapping[str, Sequence[str]]) -> None:
    """The routing table as JSON for other routers: {"version", "generation", "models": {m: {"endpoints"}}}."""
    atomic_write_text(path, render_endpoints_json(endpoints))
