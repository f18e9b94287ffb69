"""The report API (aiohttp) and its text rendering for on-call.

Endpoints (loopback by default; a bearer token is required when bound elsewhere):
  GET /api/report          everything: stored plan + explanation, fleet, hosts, actions, history, alerts
  GET /api/explain/<model> the stored explanation of one model
  GET /metrics             the controller's own Prometheus metrics
  GET /healthz             200 while the MQTT task runs and cycles finish; else 503 + problems

The plan and its explanation are rendered from the plan dict stored by the cycle that made it
(planner.core.plan_to_dict), never recomputed.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

LOOPBACK = ("127.0.0.1", "::1", "localhost")


async def start_report_server(ctrl: Any, listen: str, token: str | None) -> tuple[Any, str]:
    from aiohttp import web

    host, _, port_s = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if host not in LOOPBACK and not token:
        raise SystemExit(f"report API on {listen}: a bearer token is required when not bound to loopback")

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if token and request.path != "/healthz":
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "bearer token required"}, status=401)
        result: web.StreamResponse = await handler(request)
        return result

    async def report(_: web.Request) -> web.Response:
        return web.json_response(ctrl.report(), dumps=lambda d: json.dumps(d, default=str))

    async def explain(request: web.Request) -> web.Response:
        data = ctrl.report()
        model = request.match_info["model"]
        m = explanation_for(data, model)
        if m is None:
            return web.json_response({"error": f"model {model!r} is not in the current plan"}, status=404)
        return web.json_response(m, dumps=lambda d: json.dumps(d, default=str))

    async def metrics(_: web.Request) -> web.Response:
        from controller.metrics import CONTENT_TYPE_LATEST

        resp = web.Response(body=ctrl.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def healthz(_: web.Request) -> web.Response:
        # 200 only while the controller's loops live (MQTT task running, cycles finishing)
        problems = ctrl.health()
        return web.json_response({"ok": not problems, "cycles": ctrl.cycle_count, "problems": problems},
                                 status=503 if problems else 200)

    app = web.Application(middlewares=[auth])
    app.router.add_get("/api/report", report)
    app.router.add_get("/api/explain/{model:.+}", explain)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, int(port_s))
    await site.start()
    actual = port_s
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        actual = str(server.sockets[0].getsockname()[1])
    return runner, f"http://{host}:{actual}"


def fetch(url: str, path: str, token: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url.rstrip("/") + path, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"controller report API at {url} unreachable: {exc}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:200]}")
    data: dict[str, Any] = resp.json()
    return data


def explanation_for(data: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    plan = data.get("plan") or {}
    for m in plan.get("explanation", {}).get("models", []):
        if m.get("model") == model:
            out = dict(m)
            out["observation"] = (plan.get("observation") or {}).get(model)
            out["replicas"] = [r for r in plan.get("plan", {}).get("replicas", []) if r.get("model") == model]
            out["cycle_id"] = plan.get("cycle_id")
            return out
    return None


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    d = max(0.0, now - t)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago"


def render_report(data: Mapping[str, Any], *, actions: int = 12) -> str:
    now = float(data.get("generated_s") or time.time())
    lines: list[str] = []
    pol = data.get("policy") or {}
    head = f"fleetplan controller — cycle {data.get('cycle_id')}"
    if data.get("time_scale", 1.0) != 1.0:
        head += f" (time scale {data['time_scale']:g}x)"
    lines.append(head)
    lines.append(f"policy {pol.get('path')} loaded {_ago(pol.get('loaded_s'), now)}"
                 + ("" if data.get("mqtt_connected") else "   MQTT: DISCONNECTED"))
    if pol.get("error"):
        lines.append(f"POLICY RELOAD REJECTED (old policy kept): {pol['error']}")
    alerts = data.get("alerts") or []
    lines.append("")
    lines.append(f"ALERTS ({len(alerts)})" if alerts else "alerts: none")
    for a in alerts:
        lines.append(f"  ! {a}")
    plan = data.get("plan")
    if plan:
        e = plan["explanation"]
        lines.append("")
        lines.append(
            f"plan: {len(plan['plan']['replicas'])} replicas, {plan['plan']['gpus']} GPUs, "
            f"${plan['plan']['usd_h']:.2f}/h (target ${e['target_usd_h']:.2f}/h); solve {e['solve_s']:.2f} s"
        )
        lines.append(f"{'model':<22} {'obs rps':>8} {'fcst':>7} {'need':>7} {'cap':>7} {'unmet':>6} "
                     f"{'TTFT p99 obs/pred/slo ms':>26} {'replicas':>9}")
        obs = plan.get("observation") or {}
        for m in e["models"]:
            o = obs.get(m["model"]) or {}
            pred = [c["predicted_ttft_p99_ms"] for c in m["configs"] if c["predicted_ttft_p99_ms"] is not None]
            ttft = f"{_f(o.get('ttft_p99_ms'), '{:.0f}')}/{_f(max(pred) if pred else None, '{:.0f}')}/" \
                   f"{m['slo_ttft_p99_ms']:.0f}"
            n = sum(c["replicas"] for c in m["configs"])
            stale = " STALE" if o.get("stale") else ""
            lines.append(
                f"{m['model']:<22} {_f(m['observed_rps']):>8} {_f(m['forecast_rps']):>7} "
                f"{m['required_rps']:>7.2f} {m['capacity_rps']:>7.2f} {m['unmet_rps']:>6.2f} {ttft:>26} "
                f"{n:>9}{stale}"
            )
        for b in e.get("binding_constraints", []):
            lines.append(f"  binding: {b}")
        for n in e.get("notes", []):
            lines.append(f"  note: {n}")
    else:
        lines.append("")
        lines.append("plan: none yet (no cycle finished)")
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
            f"  #{a['action_id']:<5} {_ago(a['created_s'], now):>9} {a['kind']:<6} {a['status']:<9} "
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
        f"  observed {_f(m['observed_rps'])} rps (ISL {_f(o.get('isl'), '{:.0f}')}, OSL {_f(o.get('osl'), '{:.0f}')}, "
        f"TTFT p99 {_f(o.get('ttft_p99_ms'), '{:.0f}')} ms, ITL p99 {_f(o.get('itl_p99_ms'), '{:.1f}')} ms"
        + (", STALE" if o.get("stale") else "") + ")"
    )
    lines.append(
        f"  forecast {_f(m['forecast_rps'])} rps -> demand {m['demand_rps']:.2f} rps x (1 + headroom "
        f"{m['headroom']:.2f}) = required {m['required_rps']:.2f} rps"
    )
    lines.append(
        f"  capacity now {m['capacity_rps']:.2f} rps, after builds {m['target_capacity_rps']:.2f} rps; "
        f"unmet {m['unmet_rps']:.2f} rps; SLO TTFT p99 {m['slo_ttft_p99_ms']:.0f} ms, ITL p99 "
        f"{m['slo_itl_p99_ms']:.0f} ms; ${m['usd_h']:.2f}/h"
    )
    for c in m["configs"]:
        lines.append(
            f"  - {c['replicas']} x {c['engine']} {c['gpu']} tp{c['tp']} {c['precision']}: "
            f"{c['capacity_per_replica_rps']:.2f} rps each (bound by {c['binding'] or '?'}), load "
            f"{c['load_per_replica_rps']:.2f} rps each, predicted TTFT p99 {_f(c['predicted_ttft_p99_ms'], '{:.0f}')} ms "
            f"ITL p99 {_f(c['predicted_itl_p99_ms'], '{:.1f}')} ms, ${c['usd_h']:.2f}/h"
        )
    for n in m.get("notes", []):
        lines.append(f"  note: {n}")
    for r in m.get("replicas", []):
        lines.append(f"  replica {r['replica_id']} on {r['host']} GPUs {r['gpu_indices']} ({r['state']})")
    return "\n".join(lines)
