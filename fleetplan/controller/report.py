"""The report API (aiohttp) and its text rendering for on-call.

Endpoints (loopback by default; a bearer token is required when bound elsewhere):
  GET /api/report          everything: stored plan + explanation, fleet, hosts, actions, history, alerts
  GET /api/explain/<model> the stored explanation of one model
  GET /api/state           the planner's inputs: loaded policy, fleet + planner state, last observation,
                           profiles (for `fleetplan what-if --controller` / `policy check --controller`)
  GET /metrics             the controller's own Prometheus metrics
  GET /healthz             200 while the MQTT task runs and cycles finish; else 503 + problems
  GET /plan                the plan page: self-contained HTML (controller/page.py)
  POST /api/pause          stop actuating from the next cycle on (JSON body {"reason": "..."} optional);
                           persisted in the state store, so a restart stays paused
  POST /api/resume         act again from the next cycle on

Without a token (loopback only) the API is this machine's, not every web page's: the Host header must
name it (a loopback name, or one of the `report_hosts` setting: no DNS rebinding), and a write
(POST) must carry the X-Fleetplan-Request header or a JSON body and, when the browser sends an
Origin, come from the API's own origin (a cross-site page cannot pause the fleet). `fleetplan
pause/resume` send both. With a token, the token is the check.

The plan and its explanation are rendered from the plan dict stored by the cycle that made it
(fleetplan.planner.core.plan_to_dict), never recomputed.

Under load: the reads (/api/report, /api/explain, /api/state, /plan, /metrics) are served from a
snapshot made once per cycle and rendered in a worker thread (controller/report_snapshot.py); at
most `report_max_concurrent` of them are in flight, answered at most `report_max_rps` a second in
the order they came (controller/report_gate.py); beyond that the answer is 503 with Retry-After.
/healthz and pause/resume are never refused nor paced.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any

from fleetplan.controller import reporting
from fleetplan.controller.page import budget_line, pairing_line
from fleetplan.controller.plan_text import (
    ago,
    config_lines,
    dash,
    explanation_for,
    missed_line,
    plan_summary_lines,
    render_alternatives,
    render_relaxations,
    uncertainty_lines,
)
from fleetplan.controller.report_gate import ReadGate
from fleetplan.controller.report_snapshot import Rendered, ReportSnapshot
from fleetplan.controller.settings import ControllerSettings

LOOPBACK = ("127.0.0.1", "::1", "localhost")
RETRY_AFTER_S = 1


async def start_report_server(ctrl: Any, listen: str, token: str | None) -> tuple[Any, str]:
    """Serve the report API on `listen` (HOST:PORT); a bearer token is required off loopback.
    Returns the aiohttp runner (cleanup() stops it) and the URL it listens on."""
    from aiohttp import web

    host, _, port_s = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if host not in LOOPBACK and not token:
        raise SystemExit(f"report API on {listen}: a bearer token is required when not bound to loopback")
    ctrl.reports.serve(ctrl)  # the first snapshot; then one per cycle (Controller.cycle)
    runner = web.AppRunner(_app(ctrl, token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, int(port_s))
    await site.start()
    actual = port_s
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        actual = str(server.sockets[0].getsockname()[1])
    return runner, f"http://{host}:{actual}"


def _app(ctrl: Any, token: str | None) -> Any:
    """The report API's routes over the controller (read-only but for pause/resume)."""
    from aiohttp import web

    settings = getattr(ctrl, "settings", None)
    names = frozenset(n.lower() for n in getattr(settings, "report_hosts", ()) or ())

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if token and request.path != "/healthz":
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "bearer token required"}, status=401)
        if not token and request.path != "/healthz" and _proxied(request.headers):
            # loopback without a token is for this machine: a reverse proxy in front would make it
            # the network's (docs/controller.md "TLS": give the controller a token)
            return web.json_response({"error": "request through a proxy: the controller needs a bearer token "
                                               "(--report-token-file) to be reached this way"}, status=403)
        if not token and request.path != "/healthz":
            refused = _refused_without_token(request.method, request.headers, names)
            if refused is not None:
                return web.json_response({"error": refused}, status=403)
        result: web.StreamResponse = await handler(request)
        return result

    snapshot: ReportSnapshot = ctrl.reports
    cfg = settings or ControllerSettings()
    gate = ReadGate(cfg.report_max_concurrent, cfg.report_max_rps)

    @web.middleware
    async def bounded(request: web.Request, handler: Any) -> web.StreamResponse:
        # the reads are bounded and paced (controller/report_gate.py); /healthz and pause/resume are
        # answered whatever the readers do
        if request.method not in SAFE_METHODS or request.path == "/healthz":
            result: web.StreamResponse = await handler(request)
            return result
        if not gate.admit():
            ctrl.metrics.report_refused.inc()
            return web.json_response(
                {"error": f"the report API is busy: {gate.inflight} reads in flight, the limit is {gate.limit} "
                          f"(controller setting report_max_concurrent); retry in {RETRY_AFTER_S} s"},
                status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        try:  # the slot is held while the read waits its turn and until its body is sent
            delay = gate.delay_s(asyncio.get_running_loop().time())
            if delay > 0:
                await asyncio.sleep(delay)
            resp: web.StreamResponse = await handler(request)
            if isinstance(resp, web.Response):
                await resp.prepare(request)
                await resp.write_eof()
            return resp
        finally:
            gate.release()

    def _json_bytes(body: bytes) -> web.Response:
        return web.Response(body=body, content_type="application/json", charset="utf-8")

    async def rendered() -> Rendered:
        r = await snapshot.latest()
        if r is None:
            raise web.HTTPServiceUnavailable(
                text=json.dumps({"error": "no report rendered yet (see the controller's log)"}),
                content_type="application/json", headers={"Retry-After": str(RETRY_AFTER_S)})
        return r

    async def report(_: web.Request) -> web.Response:
        return _json_bytes((await rendered()).report)

    async def explain(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        body = (await rendered()).explain.get(model)
        if body is None:
            return web.json_response({"error": f"model {model!r} is not in the current plan"}, status=404)
        return _json_bytes(body)

    async def state(_: web.Request) -> web.Response:
        def gather() -> Callable[[], dict[str, Any]]:  # the loop's part; state_doc runs in a worker thread
            return functools.partial(reporting.state_doc, reporting.state_inputs(ctrl))

        return _json_bytes(await snapshot.state(gather))

    async def metrics(_: web.Request) -> web.Response:
        from fleetplan.controller.metrics import CONTENT_TYPE_LATEST

        exposition = snapshot.exposition
        assert exposition is not None  # start_report_server serves the snapshot before it listens
        resp = web.Response(body=await exposition.get())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def pause(request: web.Request) -> web.Response:
        reason = ""
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "body: expected JSON like {\"reason\": \"...\"}"}, status=400)
            if not isinstance(body, dict) or not isinstance(body.get("reason", ""), str):
                return web.json_response({"error": f"body.reason = {body!r}: expected a string"}, status=400)
            reason = body.get("reason", "")[:500]
        try:
            done = ctrl.set_paused(request.path.endswith("/pause"), reason)
            snapshot.refresh(ctrl)  # the report shows it from now on
            return web.json_response(done)
        except sqlite3.OperationalError as exc:  # not recorded, so not done: a restart would forget it
            return web.json_response({"error": f"not {'paused' if request.path.endswith('/pause') else 'resumed'}: "
                                               f"the state store {ctrl.store.path} cannot be written: {exc}"},
                                     status=503)

    async def plan_page(_: web.Request) -> web.Response:
        return web.Response(body=(await rendered()).page, content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                     "script-src 'unsafe-inline'; img-src data:"})

    async def healthz(_: web.Request) -> web.Response:
        # 200 only while the controller's loops live (MQTT task running, cycles finishing); "degraded"
        # names what it cannot do although it lives (a store it cannot write, a router that is down):
        # a restart would not fix those, so they are not a 503
        from fleetplan.controller.failsafe import degraded

        problems = ctrl.health()
        slow = degraded(ctrl)
        status = "unhealthy" if problems else "degraded" if slow else "ok"
        return web.json_response({"ok": not problems, "status": status, "cycles": ctrl.cycle_count,
                                  "problems": problems, "degraded": slow}, status=503 if problems else 200)

    app = web.Application(middlewares=[auth, bounded])
    app.router.add_get("/api/report", report)
    app.router.add_get("/api/explain/{model:.+}", explain)
    app.router.add_get("/api/state", state)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/plan", plan_page)
    app.router.add_post("/api/pause", pause)
    app.router.add_post("/api/resume", pause)
    return app


PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Real-IP")
WRITE_HEADER = "X-Fleetplan-Request"  # a header no cross-site form or simple request can carry
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def host_allowed(host: str, names: frozenset[str] = frozenset()) -> bool:
    """Whether a Host header names this API: a loopback name (localhost, 127.0.0.1, [::1]; any port,
    so an SSH tunnel's local port works) or a configured name (`report_hosts`: "name" for any port,
    "name:port" for one). Any other name is DNS rebinding: a page of attacker.example that resolved
    its name to 127.0.0.1.

    >>> [host_allowed(h) for h in ("127.0.0.1:9470", "localhost:8080", "[::1]:9470", "LOCALHOST")]
    [True, True, True, True]
    >>> [host_allowed(h) for h in ("attacker.example:9470", "", "127.0.0.1.evil.example:9470", "[::1")]
    [False, False, False, False]
    >>> host_allowed("ctl.internal:9470", frozenset({"ctl.internal"})), host_allowed("c:1", frozenset({"c:2"}))
    (True, False)
    """
    h = host.strip().lower()
    if not h:
        return False
    if h in names:
        return True
    if h.startswith("["):
        name, sep, rest = h[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
        name = f"[{name}]"
    else:
        name, _, port = h.partition(":")
        if port and not port.isdigit():
            return False
    return name in ("localhost", "127.0.0.1", "[::1]") or name in names


def _refused_without_token(method: str, headers: Mapping[str, str], names: frozenset[str]) -> str | None:
    """Why a request to the token-less (loopback) API is refused, or None. Reads: the Host must name
    this API (no DNS rebinding). Writes (POST ...): also a request no other site's page can make -
    the X-Fleetplan-Request header or a JSON body (both need a CORS preflight this API never
    grants), and, when the browser names the page's origin, that origin is this API's own."""
    host = headers.get("Host", "")
    if not host_allowed(host, names):
        return (f"Host {host!r} does not name this controller (loopback names, or the controller setting "
                "report_hosts)")
    if method.upper() in SAFE_METHODS:
        return None
    ctype = headers.get("Content-Type", "").split(";")[0].strip().lower()
    if WRITE_HEADER not in headers and ctype != "application/json":
        return f"a write needs the {WRITE_HEADER} header or a JSON body (cross-site requests are refused)"
    if headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        return "cross-site request refused"
    origin = headers.get("Origin")
    if origin is not None:
        scheme, sep, netloc = origin.partition("://")
        if not sep or scheme.lower() not in ("http", "https") or netloc.lower() != host.strip().lower():
            return f"Origin {origin!r} is not this controller ({host}): cross-site request refused"
    return None


def _proxied(headers: Mapping[str, str]) -> bool:
    """Whether a request came through a reverse proxy (one of the headers proxies add)."""
    return any(h in headers for h in PROXY_HEADERS)


def _call(method: str, url: str, path: str, token: str | None, timeout_s: float,
          body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One request to the report API; errors name the URL and status (RuntimeError)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if method != "GET":
        headers[WRITE_HEADER] = "1"  # the token-less API takes writes only with it (or a JSON body)
    try:
        resp = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=timeout_s,
                             json=dict(body) if body is not None else None)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"controller report API at {url} unreachable: {exc}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:200]}")
    data: dict[str, Any] = resp.json()
    return data


def fetch(url: str, path: str, token: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    return _call("GET", url, path, token, timeout_s)


def post(url: str, path: str, body: Mapping[str, Any], token: str | None = None,
         timeout_s: float = 10.0) -> dict[str, Any]:
    return _call("POST", url, path, token, timeout_s, body)


def actuation_line(data: Mapping[str, Any]) -> str | None:
    a = data.get("actuation") or {}
    if a.get("mode") == "advisory":
        return "ADVISORY MODE: plans and reports only; no action is issued (policy mode: advisory)"
    if a.get("paused"):
        why = f" ({a['reason']})" if a.get("reason") else ""
        return f"ACTUATION PAUSED since {ago(a.get('since_s'), float(data.get('generated_s') or time.time()))}" \
               f"{why}: `fleetplan resume` to act again"
    return None


def render_report(data: Mapping[str, Any], *, actions: int = 12) -> str:
    now = float(data.get("generated_s") or time.time())
    lines: list[str] = []
    pol = data.get("policy") or {}
    head = f"fleetplan controller — cycle {data.get('cycle_id')}"
    if data.get("time_scale", 1.0) != 1.0:
        head += f" (time scale {data['time_scale']:g}x)"
    lines.append(head)
    lines.append(f"policy {pol.get('path')} loaded {ago(pol.get('loaded_s'), now)}"
                 + ("" if data.get("mqtt_connected") else "   MQTT: DISCONNECTED"))
    if pol.get("error"):
        lines.append(f"POLICY RELOAD REJECTED (old policy kept): {pol['error']}")
    act = actuation_line(data)
    if act:
        lines.append(act)
    alerts = data.get("alerts") or []
    lines.append("")
    lines.append(f"ALERTS ({len(alerts)})" if alerts else "alerts: none")
    for a in alerts:
        lines.append(f"  ! {a}")
    lines.extend(plan_summary_lines(data))
    fleet = data.get("fleet") or []
    lines.append("")
    lines.append(f"fleet ({len(fleet)} replicas in desired state):")
    for r in fleet:
        lines.append(
            f"  {r['replica_id']:<8} {r['model']:<22} {r['engine']:<7} {r['gpu']}x{r['tp']} {r['host']:<10} "
            f"GPUs {r['gpu_indices']!s:<10} :{r['port']:<6} {r['phase']:<9} agent={r.get('reported_state') or '-'}"
        )
    hosts = data.get("hosts") or {}
    if hosts:
        lines.append("hosts: " + ", ".join(
            f"{h}({'up' if v['online'] else 'OFFLINE'} v{v.get('desired_version') or '-'})" for h, v in hosts.items()
        ))
    acts = (data.get("actions") or [])[:actions]
    lines.append("")
    lines.append("last actions:")
    for a in acts:
        lines.append(
            f"  #{a['action_id']:<5} {ago(a['created_s'], now):>9} {a['kind']:<6} {a['status']:<9} "
            f"{a.get('replica_id') or '':<8} {a.get('model') or '':<20} {a.get('reason', '')}"
            + (f" [{a['detail']}]" if a.get("detail") else "")
        )
    if not acts:
        lines.append("  (none)")
    return "\n".join(lines)


def render_explain(data: Mapping[str, Any], model: str) -> str | None:
    m = explanation_for(data, model)
    if m is None:
        return None
    o = m.get("observation") or {}
    lines = [f"{model}: {sum(c['replicas'] for c in m['configs'])} replicas (cycle {m.get('cycle_id')})"]
    lines.append(
        f"  observed {dash(m['observed_rps'])} rps (ISL {dash(o.get('isl'), '{:.0f}')}, OSL {dash(o.get('osl'), '{:.0f}')}, "
        f"TTFT p99 {dash(o.get('ttft_p99_ms'), '{:.0f}')} ms, ITL p99 {dash(o.get('itl_p99_ms'), '{:.1f}')} ms"
        + (", STALE" if o.get("stale") else "") + ")"
    )
    lines.append(
        f"  forecast {dash(m['forecast_rps'])} rps -> demand {m['demand_rps']:.2f} rps x (1 + headroom "
        f"{m['headroom']:.2f}) = required {m['required_rps']:.2f} rps"
    )
    lines.append(
        f"  capacity now {m['capacity_rps']:.2f} rps, after builds {m['target_capacity_rps']:.2f} rps; "
        f"unmet {m['unmet_rps']:.2f} rps; SLO TTFT p99 {m['slo_ttft_p99_ms']:.0f} ms, ITL p99 "
        f"{m['slo_itl_p99_ms']:.0f} ms; ${m['usd_h']:.2f}/h"
    )
    if m.get("length_mix"):
        lines.append(f"  length mix used for capacity: {m['length_mix']}")
    missed = missed_line(m)
    if missed:
        lines.append(missed)
    budget = budget_line(m)
    if budget:
        lines.append(budget)
    lines.extend(uncertainty_lines(m))
    plan = data.get("plan") or {}
    for c in m["configs"]:
        lines.append(
            f"  - {c['replicas']} x {c['engine']} {c['gpu']} tp{c['tp']} {c['precision']}: "
            f"{c['capacity_per_replica_rps']:.2f} rps each (bound by {c['binding'] or '?'}), load "
            f"{c['load_per_replica_rps']:.2f} rps each, predicted TTFT p99 {dash(c['predicted_ttft_p99_ms'], '{:.0f}')} ms "
            f"ITL p99 {dash(c['predicted_itl_p99_ms'], '{:.1f}')} ms, ${c['usd_h']:.2f}/h"
        )
        lines.extend(config_lines(m, c, plan))
    for n in m.get("notes", []):
        lines.append(f"  note: {n}")
    paired = pairing_line(m)
    if paired:
        lines.append(paired)
    lines.append("  why not the others (each allowed config alone, from the plan's solve):")
    lines.extend(render_alternatives(m, indent="    "))
    relax = render_relaxations(m.get("relaxations") or [], model, indent="    ")
    if relax:
        lines.append("  relaxing a binding constraint one step (re-solved):")
        lines.extend(relax)
    for h in m.get("held", []):
        lines.append(f"  held: {h['kind']} {h['replica_id']} held back by {h['limit']}: {h['detail']}")
    for r in m.get("replicas", []):
        lines.append(f"  replica {r['replica_id']} on {r['host']} GPUs {r['gpu_indices']} ({r['state']})")
    return "\n".join(lines)
