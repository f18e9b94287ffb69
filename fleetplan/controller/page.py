"""The plan page: one self-contained HTML document (inline CSS, SVG and a few lines of JS; no CDN,
no external request) served by the report API at GET /plan.

It shows the current plan with its explanation (and the counterfactual alternatives when the plan
carries them), demand vs forecast vs capacity per model over the last 24 h (an inline SVG chart
drawn from the stored decision records: what each cycle saw and planned, never recomputed), the
held-back actions, the actions timeline and the alerts. `render_page` is a pure function of the
report dict and the series; `plan_page(ctrl)` gathers them from a running controller.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

DAY_S = 86400.0
SERIES = (  # key in the decision record, label, colour, dash
    ("observed_rps", "observed demand", "#1f77b4", ""),
    ("forecast_rps", "forecast", "#ff7f0e", "6 4"),
    ("required_rps", "required (with headroom)", "#7f7f7f", "2 3"),
    ("capacity_rps", "planned capacity", "#2ca02c", ""),
)


def series_from_decisions(decisions: Sequence[Mapping[str, Any]], now_s: float,
                          window_s: float = DAY_S) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """model -> series key -> [(now_s, value)] of the decisions in (now - window, now]."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for d in decisions:
        t = float(d.get("now_s") or 0.0)
        if not now_s - window_s < t <= now_s + 1e-6:
            continue
        for model, m in (d.get("models") or {}).items():
            per = out.setdefault(model, {k: [] for k, *_ in SERIES})
            for k, *_ in SERIES:
                v = m.get(k)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    per[k].append((t, float(v)))
    return out


def plan_page(ctrl: Any) -> str:
    data = ctrl.report()
    now_s = float(data.get("now_s") or ctrl.clock.now())
    since_wall = time.time() - DAY_S / max(float(ctrl.time_scale), 1e-9)
    decisions = ctrl.store.decisions(since_wall)
    return render_page(data, series_from_decisions(decisions, now_s), now_s)


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _n(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else _e(fmt.format(x))


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text)


def chart_svg(model: str, series: Mapping[str, Sequence[tuple[float, float]]], now_s: float,
              window_s: float = DAY_S, width: int = 760, height: int = 220) -> str:
    """An SVG line chart of one model's series; one <path class="series"> per series with points."""
    left, right, top, bottom = 52, 28, 12, 28
    pw, ph = width - left - right, height - top - bottom
    pts = [p for s in series.values() for p in s]
    t1 = now_s
    t0 = min([p[0] for p in pts] + [now_s - window_s]) if pts else now_s - window_s
    t0 = max(t0, now_s - window_s)
    ymax = max([p[1] for p in pts] + [0.0])
    ymax = 1.0 if ymax <= 0 else ymax * 1.1

    def x(t: float) -> float:
        return left + (t - t0) / max(t1 - t0, 1e-9) * pw

    def y(v: float) -> float:
        return top + ph - v / ymax * ph

    out = [f'<svg class="chart" id="chart-{_e(_slug(model))}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_e(model)}: demand, forecast and capacity, last 24 h">']
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    for i in range(5):
        v = ymax * i / 4
        yy = y(v)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e3e3e3"/>')
        out.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end" class="tick">{v:.2f}</text>')
    for i in range(5):
        t = t0 + (t1 - t0) * i / 4
        out.append(f'<text x="{x(t):.1f}" y="{height - 8}" text-anchor="middle" class="tick">{_clock(t)}</text>')
    out.append(f'<text x="12" y="{top + ph / 2:.0f}" class="tick" transform="rotate(-90 12 {top + ph / 2:.0f})" '
               'text-anchor="middle">rps</text>')
    for key, label, colour, dash in SERIES:
        s = sorted(series.get(key, ()))
        if not s:
            continue
        d = " ".join(f"{'M' if i == 0 else 'L'}{x(t):.1f},{y(v):.1f}" for i, (t, v) in enumerate(s))
        if len(s) == 1:  # one point: a short tick so it is visible
            d += f" L{x(s[0][0]) - 4:.1f},{y(s[0][1]):.1f}"
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<path class="series" data-series="{key}" data-points="{len(s)}" d="{d}" fill="none" '
                   f'stroke="{colour}" stroke-width="2"{dash_attr}><title>{_e(label)}: last '
                   f'{s[-1][1]:.2f} rps</title></path>')
    out.append("</svg>")
    return "".join(out)


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:20px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:4px 0}td,th{padding:3px 8px;border-bottom:1px solid #eee;text-align:left}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.banner{padding:8px 12px;margin:8px 0;border-radius:4px;font-weight:600}
.advisory{background:#fff4ce;border:1px solid #e0b400}.paused{background:#fde2e1;border:1px solid #d33}
.alert{color:#a40000}.muted{color:#777}.tick{font-size:11px;fill:#555}
.legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:18px;height:3px;
vertical-align:middle;margin-right:4px}.held{color:#8a5a00}
"""

_JS = """
(function(){var b=document.getElementById('refresh');if(!b)return;var t=null;
b.addEventListener('change',function(){if(b.checked){t=setInterval(function(){location.reload()},30000)}
else if(t){clearInterval(t)}});})();
"""


def _legend() -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{c}"></i>{_e(label)}</span>' for _, label, c, _ in SERIES) + "</div>"


def attainment_lines(c: Mapping[str, Any], *, indent: str = "    ") -> list[str]:
    """The SLO attainment the plan expects of a config, its floor, and what its last replica buys."""
    share = c.get("predicted_attainment")
    if share is None:
        return []
    text = f"{indent}  SLO attainment predicted {100.0 * share:.2f}% of requests"
    floor = c.get("floor_share")
    if floor is not None:
        text += (f"; out of reach: an idle replica meets the SLO for {100.0 * floor:.2f}% (more replicas do "
                 "not help; a higher TP or another engine might)")
    last = c.get("last_replica_attainment")
    if last is not None and c.get("replicas", 0) > 1:
        per = c.get("usd_h", 0.0) / max(c["replicas"], 1)
        text += f"; the last replica adds {100.0 * last:+.2f} points for ${per:.2f}/h"
    return [text]


def pairing_line(m: Mapping[str, Any], *, indent: str = "  ") -> str | None:
    """Where the plan placed a pooled model's prefill replicas (the plan's `pools`,
    `paired_prefill_replicas`: planner/placement.py): how many share a host with a decode replica of
    their pool, and that the others' KV moves over the network. None: no pools (or a plan stored
    before the count was kept).

    >>> pairing_line({"pools": {"prefill_replicas": 9, "paired_prefill_replicas": 7}})
    '  placed: 7 of 9 prefill replicas share a host with a decode replica of their pool; 2 have none on their host (their KV moves over the network)'
    """
    pools = m.get("pools")
    if not pools or pools.get("paired_prefill_replicas") is None:
        return None
    n, paired = pools["prefill_replicas"], pools["paired_prefill_replicas"]
    text = f"{indent}placed: {paired} of {n} prefill replicas share a host with a decode replica of their pool"
    if n > paired:
        text += f"; {n - paired} have none on their host (their KV moves over the network)"
    return text


def budget_line(m: Mapping[str, Any], *, indent: str = "  ") -> str | None:
    """A model's SLO over its period and the error budget left (planner/slo.py, the plan's
    `error_budget`); each figure a range where the engines' histogram buckets bound it. None: no
    request counted yet.

    >>> budget_line({"error_budget": {"kind": "period", "objective": 0.99, "period_s": 3600.0,
    ...     "window_floor": 0.95, "requests": 1200.0, "covered_s": 3600.0, "good_share": [0.9962, 0.997],
    ...     "budget_left": [0.62, 0.7], "worst_slice_good_share": 0.98}})
    '  SLO over the last 1 h (99% of requests): 99.62-99.70% good, 62-70% of the error budget left; worst slice 98.00% (window floor 95%)'
    """
    b = m.get("error_budget")
    if not b:
        return None

    def rng(pair: Sequence[float], digits: int) -> str:
        lo, hi = (100.0 * x for x in pair)
        return f"{lo:.{digits}f}%" if abs(hi - lo) < 0.5 * 10 ** -digits else f"{lo:.{digits}f}-{hi:.{digits}f}%"

    period = b["period_s"]
    span = f"{period / 3600.0:g} h" if period >= 3600.0 else f"{period / 60.0:g} min"
    covered = "" if b["covered_s"] >= period - 1e-6 else f", {b['covered_s'] / 60.0:.0f} min of it counted so far"
    return (f"{indent}SLO over the last {span} ({100.0 * b['objective']:g}% of requests{covered}): "
            f"{rng(b['good_share'], 2)} good, {rng(b['budget_left'], 0)} of the error budget left; worst slice "
            f"{100.0 * b['worst_slice_good_share']:.2f}% (window floor {100.0 * b['window_floor']:g}%)")


def _plan_html(plan: Mapping[str, Any]) -> list[str]:
    """The current plan: per model table, why (binding constraints, notes, alternatives), held actions."""
    e = plan.get("explanation") or {}
    p = plan.get("plan") or {}
    h = ["<h2>Current plan</h2>"]
    if not plan:
        return [*h, '<p class="muted">no plan yet (no cycle finished)</p>']
    h.append(f'<p id="plan-summary"><b>{len(p.get("replicas", []))}</b> replicas, <b>{_e(p.get("gpus"))}</b> GPUs, '
             f'<b>${_n(p.get("usd_h"))}/h</b> (target ${_n(e.get("target_usd_h"))}/h); solve '
             f'{_n(e.get("solve_s"))} s</p>')
    h.append("<table id=\"models\"><tr><th>model</th><th>observed rps</th><th>forecast rps</th>"
             "<th>required rps</th><th>capacity rps</th><th>unmet rps</th><th>replicas</th><th>configs</th>"
             "<th>$/h</th></tr>")
    for m in e.get("models", []):
        n = sum(c["replicas"] for c in m.get("configs", []))
        cfgs = "<br>".join(
            f"{c['replicas']} × {_e(c['engine'])} {_e(c['gpu'])} tp{c['tp']} "
            f"({c['capacity_per_replica_rps']:.2f} rps each, bound by {_e(c.get('binding') or '?')})"
            for c in m.get("configs", []))
        h.append(f"<tr><td>{_e(m['model'])}</td><td class=num>{_n(m.get('observed_rps'))}</td>"
                 f"<td class=num>{_n(m.get('forecast_rps'))}</td><td class=num>{_n(m.get('required_rps'))}</td>"
                 f"<td class=num>{_n(m.get('capacity_rps'))}</td><td class=num>{_n(m.get('unmet_rps'))}</td>"
                 f"<td class=num>{n}</td><td>{cfgs}</td><td class=num>{_n(m.get('usd_h'))}</td></tr>")
    h.append("</table>")
    h.append("<h2>Why</h2><ul>")
    for b in e.get("binding_constraints", []):
        h.append(f"<li>binding: {_e(b)}</li>")
    for m in e.get("models", []):
        for note in m.get("notes", []):
            h.append(f"<li>{_e(m['model'])}: {_e(note)}</li>")
        paired = pairing_line(m, indent="")
        if paired:
            h.append(f"<li>{_e(m['model'])}: {_e(paired)}</li>")
        for c in m.get("configs", []):
            for line in attainment_lines(c, indent=""):
                h.append(f"<li>{_e(m['model'])} {_e(c['engine'])} {_e(c['gpu'])} tp{_e(c['tp'])}: "
                         f"{_e(line.strip())}</li>")
        for alt in m.get("alternatives", []) or []:
            h.append(f"<li>{_e(m['model'])}: alternative {_e(alt.get('engine'))} {_e(alt.get('gpu'))} "
                     f"tp{_e(alt.get('tp'))} ${_n(alt.get('usd_h'))}/h — {_e(alt.get('reason'))}</li>")
    for note in e.get("notes", []):
        h.append(f"<li>{_e(note)}</li>")
    h.append("</ul>")
    held = (plan.get("brakes") or {}).get("held") or []
    if held:
        h.append(f"<h2>Held back this cycle ({len(held)})</h2><ul>")
        for x in held:
            h.append(f'<li class="held">{_e(x["kind"])} {_e(x["replica_id"])} ({_e(x["model"])}): held back by '
                     f'<b>{_e(x["limit"])}</b>: {_e(x["detail"])}</li>')
        h.append("</ul>")

    return h


def render_page(data: Mapping[str, Any], series: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
                now_s: float) -> str:
    plan = data.get("plan") or {}
    act = data.get("actuation") or {}
    h: list[str] = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
                    '<meta name="viewport" content="width=device-width, initial-scale=1">',
                    f"<title>fleetplan plan — cycle {_e(data.get('cycle_id'))}</title>",
                    f"<style>{_CSS}</style></head><body>"]
    h.append(f"<h1>fleetplan plan — cycle {_e(data.get('cycle_id'))}</h1>")
    pol = data.get("policy") or {}
    h.append(f'<div class="muted">policy {_e(pol.get("path"))} · now '
             f'{_e(datetime.fromtimestamp(now_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))} · MQTT '
             f'{"connected" if data.get("mqtt_connected") else "DISCONNECTED"} · '
             '<label><input type="checkbox" id="refresh"> refresh every 30 s</label></div>')
    if act.get("mode") == "advisory":
        h.append('<div class="banner advisory">ADVISORY MODE: plans and reports only, no action is issued</div>')
    if act.get("paused"):
        h.append(f'<div class="banner paused">ACTUATION PAUSED{": " + _e(act["reason"]) if act.get("reason") else ""}'
                 " — <code>fleetplan resume</code> to act again</div>")
    if pol.get("error"):
        h.append(f'<div class="banner paused">policy reload rejected (old policy kept): {_e(pol["error"])}</div>')

    alerts = data.get("alerts") or []
    h.append(f"<h2>Alerts ({len(alerts)})</h2>")
    h.append("<ul>" + "".join(f'<li class="alert">{_e(a)}</li>' for a in alerts) + "</ul>" if alerts
             else '<p class="muted">none</p>')

    budgets = [(m["model"], budget_line(m, indent="")) for m in (plan.get("explanation") or {}).get("models", [])]
    h.append("<h2>SLO and error budget</h2>")
    h.append("<ul>" + "".join(f"<li><b>{_e(name)}</b>: {_e(line)}</li>" for name, line in budgets if line) + "</ul>"
             if any(line for _, line in budgets) else '<p class="muted">no request counted yet</p>')

    h.extend(_plan_html(plan))

    h.append("<h2>Demand vs forecast vs capacity, last 24 h</h2>")
    if not series:
        h.append('<p class="muted">no stored decisions in the last 24 h</p>')
    else:
        h.append(_legend())
        for model in sorted(series):
            h.append(f"<h3>{_e(model)}</h3>")
            h.append(chart_svg(model, series[model], now_s))

    acts = data.get("actions") or []
    h.append(f"<h2>Actions timeline ({len(acts)} most recent)</h2>")
    if not acts:
        h.append('<p class="muted">no actions yet</p>')
    else:
        h.append('<table id="actions"><tr><th>when (UTC)</th><th>decision</th><th>kind</th><th>status</th>'
                 "<th>replica</th><th>model</th><th>host</th><th>why</th></tr>")
        for a in acts:
            when = datetime.fromtimestamp(float(a["created_s"]), UTC).strftime("%m-%d %H:%M:%S")
            detail = f" <span class=muted>[{_e(a['detail'])}]</span>" if a.get("detail") else ""
            h.append(f"<tr><td>{when}</td><td>{_e(a.get('decision_id') or '-')}</td><td>{_e(a['kind'])}</td>"
                     f"<td>{_e(a['status'])}</td><td>{_e(a.get('replica_id'))}</td><td>{_e(a.get('model'))}</td>"
                     f"<td>{_e(a.get('host'))}</td><td>{_e(a.get('reason'))}{detail}</td></tr>")
        h.append("</table>")
    h.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(h)
