"""How an evaluation is presented: the table `fleetplan evaluate` prints, the charts (PNG and a
self-contained HTML page) and the goals a benchmark checks. `fleetplan.sim.evaluate` computes the
`Evaluation`; see docs/evaluate.md for every figure."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fleetplan.sim.evaluate import Evaluation, PolicyFigures


def _period(p: PolicyFigures) -> str:
    """The worst rolling period's good share, '*' where it is below the objective; '-' not judged."""
    j = p.slo_periods
    if j is None:
        return "-"
    return f"{100 * j.worst_share:.2f}%" + ("" if j.met else "*")


def render_table(ev: Evaluation) -> str:
    head = (f"{'policy':<22} {'GPU-h':>8} {'cost $':>8} {'SLO att.':>8} {'worst per.':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'starts':>6} {'lag s':>6} {'unmet':>7} {'unmet d':>7}")
    lines = [head, "-" * len(head)]

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for name, p in ev.policies.items():
        lines.append(
            f"{name:<22} {p.gpu_hours:>8.2f} {p.cost_usd:>8.2f} "
            f"{f(None if p.slo_attainment is None else 100 * p.slo_attainment, '7.2f') + ('%' if p.slo_attainment is not None else ''):>8} "
            f"{_period(p):>10} "
            f"{f(p.ttft_p50_ms, '9.0f'):>9} {f(p.ttft_p99_ms, '9.0f'):>9} {f(p.itl_p50_ms, '8.1f'):>8} "
            f"{f(p.itl_p99_ms, '8.1f'):>8} {p.replica_starts:>6} {f(p.scale_up_lag_mean_s, '6.0f'):>6} "
            f"{(p.unmet_requests if p.slo_attainment is not None else '-')!s:>7} {100 * p.unmet_demand_share:>6.2f}%"
        )
    tr = ev.trace
    lines.append("")
    lines.append(f"trace: {tr.get('source')} ({tr.get('format')}), {tr.get('requests')} requests over "
                 f"{tr.get('duration_s')} s, mean {tr.get('mean_rps')} rps, peak(60 s) {tr.get('peak_rps_60s')} rps")
    if ev.oracle_config:
        lines.append(f"oracle config: {ev.oracle_config}")
    if ev.best_fixed_fleet:
        lines.append(f"best-fixed fleet: {ev.best_fixed_fleet}")
    lines.extend(f"{name} found at: {label}" for name, label in ev.found_at.items())
    fp = ev.policies.get("fleetplan")
    for name in ("best-fixed", "hpa-tuned", "clairvoyant"):  # the yardsticks a policy can reach
        y = ev.policies.get(name)
        if y is not None and fp is not None and y.gpu_hours > 0:
            lines.append(f"fleetplan / {name} GPU-hours: {fp.gpu_hours / y.gpu_hours:.2f} (SLO attainment "
                         f"{100 * (fp.slo_attainment or 0.0):.2f}% vs {100 * (y.slo_attainment or 0.0):.2f}%; "
                         f"worst period {_period(fp).strip()} vs {_period(y).strip()})")
    missed = [(name, p.miss_minutes) for name, p in ev.policies.items() if p.miss_minutes is not None
              and p.miss_minutes.misses]
    if missed:  # a burst the standing fleet did not serve, or a fleet short all along (docs/evaluate.md)
        lines.append("where the misses fell (minutes from the trace's start):")
        lines.extend(f"  {name}: {mm.describe()}" for name, mm in missed)
    judged = fp.slo_periods if fp is not None else None
    if judged is not None and judged.windows > 1:
        lines.append(f"SLO judged over every rolling {judged.period_s / 3600:g} h period (the policy's): "
                     "a policy serves it when each period has its objective; 'worst per.' is the worst one's share")
    lines.extend(f"note: {n}" for n in ev.notes)
    lines.extend(f"note: {name}: {p.refused_starts} starts an agent would refuse (GPUs in use, or no engine on "
                 "that host): a defect of the act path, see the replay's notes"
                 for name, p in ev.policies.items() if p.refused_starts)
    gaps = ev.capacity_gaps()
    if gaps:
        lines.append("capacity per replica at the SLO for the trace's mix, profile vs ground truth:")
        lines.extend(f"  {g}" for g in gaps)
    if ev.attainment_floors:
        lines.append("SLO attainment an idle replica reaches for the trace's mix (no count of the config does better):")
        lines.extend(f"  {label}: {100.0 * (1.0 - v):.2f}%" for label, v in sorted(ev.attainment_floors.items()))
    hits = [(name, f.prefix_hit_rate) for name, f in ev.policies.items() if f.prefix_hit_rate is not None]
    if hits:
        lines.append("prefix-cache hit rate (prompt tokens): "
                     + ", ".join(f"{name} {100.0 * h:.1f}%" for name, h in hits))
    lines.append("GPU-hours per engine:")
    for name, figs in ev.policies.items():
        per = figs.gpu_hours_by_engine()
        if per:
            lines.append(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
    lines.append(f"evaluation wall time: {ev.wall_s:.1f} s")
    return "\n".join(lines)


def write_charts(ev: Evaluation, out_dir: Path) -> tuple[Path, Path]:
    """demand vs capacity over time per policy: evaluation.png and a self-contained evaluation.html."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fleetplan.shared.atomic import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(ev.policies)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.1 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        p = ev.policies[name]
        if not p.timeline:
            continue
        t = np.array([x[0] for x in p.timeline]) / 60.0
        ax.plot(t, [x[1] for x in p.timeline], color="#444444", lw=0.9, label="demand (rps, 60 s)")
        ax.step(t, [x[2] for x in p.timeline], where="post", color="#1f77b4", lw=1.3,
                label="ready capacity at SLO (rps)")
        ax2 = ax.twinx()
        ax2.step(t, [x[3] for x in p.timeline], where="post", color="#d62728", lw=0.8, alpha=0.6)
        ax2.set_ylabel("GPUs", color="#d62728", fontsize=8)
        att = "" if p.slo_attainment is None else f", SLO {100 * p.slo_attainment:.2f}%"
        ax.set_title(f"{name}: {p.gpu_hours:.2f} GPU-h{att}", fontsize=9, loc="left")
        ax.set_ylabel("rps", fontsize=8)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("simulated minutes")
    fig.tight_layout()
    png = out_dir / "evaluation.png"
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    data = buf.getvalue()
    tmp = png.with_suffix(".png.tmp")
    tmp.write_bytes(data)
    tmp.replace(png)
    b64 = base64.b64encode(data).decode("ascii")
    table = html.escape(render_table(ev))
    doc = (
        "<!doctype html><html><head><meta charset='utf-8'><title>fleetplan evaluate</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}pre{font-size:12px}</style></head><body>"
        f"<h1>fleetplan evaluate</h1><pre>{table}</pre>"
        f"<img alt='demand vs capacity per policy' src='data:image/png;base64,{b64}'/>"
        "</body></html>\n"
    )
    html_path = out_dir / "evaluation.html"
    atomic_write_text(html_path, doc)
    return png, html_path


def goals(ev: Evaluation) -> list[tuple[str, bool | None, str]]:
    """The issue's goals: (goal, met (None: not computable), figures)."""
    pol = ev.policies
    out: list[tuple[str, bool | None, str]] = []
    fp = pol.get("fleetplan")
    orc = pol.get("oracle")
    sp = pol.get("static-peak")
    hpa = pol.get("hpa")
    if fp is None:
        return out
    att = fp.slo_attainment or 0.0
    if orc is not None and orc.gpu_hours > 0:
        ratio = fp.gpu_hours / orc.gpu_hours
        out.append(("fleetplan GPU-h <= 1.10 x oracle with SLO attainment >= 99.5%",
                    bool(ratio <= 1.10 and att >= 0.995), f"ratio {ratio:.3f}, attainment {100 * att:.2f}%"))
    if sp is not None and sp.gpu_hours > 0:
        saving = 1.0 - fp.gpu_hours / sp.gpu_hours
        out.append((">= 30% fewer GPU-h than static-peak", bool(saving >= 0.30), f"saving {100 * saving:.1f}%"))
    if hpa is not None and hpa.gpu_hours > 0:
        saving = 1.0 - fp.gpu_hours / hpa.gpu_hours
        ok = bool(saving >= 0.15 and att >= (hpa.slo_attainment or 0.0))
        out.append((">= 15% fewer GPU-h than hpa at equal or better SLO attainment", ok,
                    f"saving {100 * saving:.1f}%, attainment {100 * att:.2f}% vs hpa "
                    f"{100 * (hpa.slo_attainment or 0.0):.2f}%"))
    return out
