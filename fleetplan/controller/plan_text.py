"""The text of a plan document (fleetplan.planner.core.plan_to_dict, as a cycle stores it): the one
renderer of it and of its parts, never recomputing anything. `render_plan` is the full document
(`fleetplan plan`); `plan_summary_lines` its part of the controller's report (`fleetplan report`);
`render_alternatives`, `render_relaxations`, `config_lines`, `uncertainty_lines`, `held_lines` and
`missed_line` the parts both and `fleetplan explain` show (with `page.pairing_line`, a pooled
model's pairing).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from fleetplan.controller.page import attainment_lines, pairing_line
from fleetplan.models.mix import SLO_SHARE

SUMMARY_ALTERNATIVES = 3  # alternatives the report's plan part shows per model (the cheapest)

def dash(x: Any, fmt: str = "{:.2f}") -> str:
    """`x` formatted with `fmt` ("-" when unknown)."""
    return "-" if x is None else fmt.format(x)


def ago(t: float | None, now: float) -> str:
    """How long before `now` `t` was ("40s ago", "3m ago"; "-" when unknown)."""
    if t is None:
        return "-"
    d = max(0.0, now - t)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago"


def _key(c: Mapping[str, Any]) -> tuple[Any, ...]:
    return (c.get("model"), c.get("engine"), c.get("gpu"), c.get("tp"), c.get("precision"))


def _spec(v: Any, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def held_lines(plan: Mapping[str, Any] | None, model: str | None = None) -> list[str]:
    """The stored plan's held-back actions, one line each ("held back by <limit>: ...")."""
    brakes = (plan or {}).get("brakes") or {}
    out = []
    for h in brakes.get("held", []):
        if model is not None and h.get("model") != model:
            continue
        out.append(f"  {h['kind']:<6} {h['replica_id']:<10} {h['model']:<20} {h['host'] or '-':<10} "
                   f"held back by {h['limit']}: {h['detail']}")
    return out


def corrections_by_config(plan: Mapping[str, Any]) -> dict[tuple[Any, ...], Mapping[str, Any]]:
    """The corrections the planner carries (stored plan's next_state), by (model, engine, gpu, tp, precision)."""
    return {_key(c): c for c in ((plan.get("next_state") or {}).get("corrections") or [])}


def _when(t: float | None, now: float | None) -> str:
    if t is None:
        return "-"
    iso = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return iso if now is None else f"{iso}, {ago(t, now)}"


def config_lines(m: Mapping[str, Any], c: Mapping[str, Any], plan: Mapping[str, Any], *,
                 indent: str = "    ") -> list[str]:
    """Per config, from the stored plan: the profile's capacity and prediction, the observation, the
    correction in force and since when, and where the profile is extrapolated."""
    corr = corrections_by_config(plan).get(_key({**c, "model": m["model"]}))
    now = plan.get("now_s")
    factor = c.get("capacity_factor", 1.0)
    name = f"{c['engine']}/{c['gpu']}x{c['tp']}/{c['precision']}"
    lines = [
        f"{indent}{name}: {c['replicas']} replicas; capacity {c['capacity_per_replica_rps']:.2f} rps/replica = "
        f"profile {dash(c.get('profile_capacity_rps'))} x {factor:.2f}"
        + (" (profile trusted)" if abs(factor - 1.0) < 0.005 else " (corrected)"),
        f"{indent}  {'profile predicts' if abs(factor - 1.0) < 0.005 else 'corrected profile predicts'} at "
        f"{c['load_per_replica_rps']:.2f} rps/replica: TTFT p99 "
        f"{dash(c.get('predicted_ttft_p99_ms'), '{:.0f}')} ms, ITL p99 {dash(c.get('predicted_itl_p99_ms'), '{:.1f}')} ms",
    ]
    if c.get("observed_rps_per_replica") is not None or c.get("observed_ttft_p99_ms") is not None:
        lines.append(
            f"{indent}  observed at {dash(c.get('observed_rps_per_replica'))} rps/replica: TTFT p99 "
            f"{dash(c.get('observed_ttft_p99_ms'), '{:.0f}')} ms, ITL p99 {dash(c.get('observed_itl_p99_ms'), '{:.1f}')} ms")
    else:
        lines.append(f"{indent}  observed: no evidence from this config in the last window")
    text = c.get("correction") or ""
    if corr is not None and corr.get("since_s") is not None:
        lines.append(f"{indent}  correction: {text or 'in force'}; in force since {_when(corr['since_s'], now)}")
    elif text:
        lines.append(f"{indent}  correction: {text}")
    elif corr is not None and corr.get("observations"):
        lines.append(f"{indent}  correction: none in force ({corr['observations']} windows agree with the profile "
                     "within its fit error)")
    else:
        lines.append(f"{indent}  correction: none (no evidence yet)")
    if c.get("extrapolating"):
        lines.append(f"{indent}  extrapolating: {'; '.join(c['extrapolating'])}")
    lines.extend(attainment_lines(c, indent=indent))
    return lines



def uncertainty_lines(m: Mapping[str, Any]) -> list[str]:
    """What the model's plan spends because its estimates are not certain yet (planner/uncertainty.py)."""
    usd = m.get("uncertainty_usd_h")
    if not usd:
        return []
    return [f"    cost of uncertainty: ${usd:.2f}/h above the fleet its corrected profiles would need "
            "with nothing left to learn: " + "; ".join(m.get("uncertainty_why") or ["-"])]


def explanation_for(data: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """One model's explanation with its observation, replicas, relaxations, corrections and held
    actions, from a report's stored plan (None: the plan has no such model)."""
    plan = data.get("plan") or {}
    for m in plan.get("explanation", {}).get("models", []):
        if m.get("model") == model:
            out = dict(m)
            out["observation"] = (plan.get("observation") or {}).get(model)
            out["replicas"] = [r for r in plan.get("plan", {}).get("replicas", []) if r.get("model") == model]
            out["cycle_id"] = plan.get("cycle_id")
            out["relaxations"] = [r for r in plan.get("explanation", {}).get("relaxations", [])
                                  if r.get("model") in (None, model)]
            out["corrections"] = [c for c in ((plan.get("next_state") or {}).get("corrections") or [])
                                  if c.get("model") == model]
            out["held"] = [h for h in (plan.get("brakes") or {}).get("held", []) if h.get("model") == model]
            return out
    return None


def plan_summary_lines(data: Mapping[str, Any]) -> list[str]:
    """The plan part of the report: per model demand, capacity and latency, alternatives not chosen,
    per-config evidence, binding constraints and actions the brakes held."""
    plan = data.get("plan")
    if not plan:
        return ["", "plan: none yet (no cycle finished)"]
    lines: list[str] = []
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
        ttft = f"{dash(o.get('ttft_p99_ms'), '{:.0f}')}/{dash(max(pred) if pred else None, '{:.0f}')}/" \
               f"{m['slo_ttft_p99_ms']:.0f}"
        n = sum(c["replicas"] for c in m["configs"])
        stale = " STALE" if o.get("stale") else ""
        lines.append(
            f"{m['model']:<22} {dash(m['observed_rps']):>8} {dash(m['forecast_rps']):>7} "
            f"{m['required_rps']:>7.2f} {m['capacity_rps']:>7.2f} {m['unmet_rps']:>6.2f} {ttft:>26} "
            f"{n:>9}{stale}"
        )
    for m in e["models"]:
        if m.get("alternatives"):
            more = len(m["alternatives"]) - SUMMARY_ALTERNATIVES
            lines.append(f"  {m['model']}: not chosen" + (f" (the {SUMMARY_ALTERNATIVES} cheapest; "
                                                         f"{more} more: fleetplan explain {m['model']})"
                                                         if more > 0 else ""))
            lines.extend(render_alternatives(m, indent="    ", limit=SUMMARY_ALTERNATIVES))
    lines.append("per config: profile vs the fleet's latency")
    for m in e["models"]:
        if m.get("length_mix"):
            lines.append(f"  {m['model']}: length mix {m['length_mix']}")
        else:
            lines.append(f"  {m['model']}:")
        lines.extend(uncertainty_lines(m))
        paired = pairing_line(m, indent="    ")
        if paired:
            lines.append(paired)
        for c in m["configs"]:
            lines.extend(config_lines(m, c, plan))
    for b in e.get("binding_constraints", []):
        lines.append(f"  binding: {b}")
    for n in e.get("notes", []):
        lines.append(f"  note: {n}")
    held = held_lines(plan)
    if held:
        lines.append(f"held back this cycle ({len(held)}):")
        lines.extend(held)
    return lines


def _flip_text(a: Mapping[str, Any]) -> str:
    if a.get("flip_rps") is not None:
        built = " once built" if a.get("reason") == "build_pending" else ""
        if a.get("flip_side") == "below":
            return f"cheaper below {a['flip_rps']:.1f} rps{built}"
        to = a.get("cheaper_to_rps")
        return f"cheaper above {a['flip_rps']:.1f} rps{built}" + (f", up to {to:.1f}" if to is not None else "")
    if a.get("cheaper_from_rps") is not None:
        return f"cheaper now ({a['cheaper_from_rps']:.1f}..{a['cheaper_to_rps']:.1f} rps)"
    return "-"


def render_alternatives(m: Mapping[str, Any], indent: str = "  ", limit: int | None = None) -> list[str]:
    """The stored `alternatives` of one model of a plan_to_dict() explanation (never recomputed);
    with `limit`: the cheapest `limit` of them (those without a price last)."""
    alts = list(m.get("alternatives") or [])
    if not alts:
        return [f"{indent}alternatives: none (every allowed config is in the plan)"]
    if limit is not None:
        alts = sorted(alts, key=lambda a: (a.get("usd_h") is None, a.get("usd_h") or 0.0, a["engine"],
                                           a["tp"]))[:limit]
    lines = [f"{indent}{'alternative':<24} {'n':>3} {'$/h':>8} {'reason':<14} flip load"]
    for a in alts:
        cfg = f"{a['engine']} {a['gpu']} tp{a['tp']}"
        n = "-" if a.get("replicas") is None else str(a["replicas"])
        usd = "-" if a.get("usd_h") is None else f"{a['usd_h']:.2f}"
        lines.append(f"{indent}{cfg:<24} {n:>3} {usd:>8} {a['reason']:<14} {_flip_text(a)}")
        lines.append(f"{indent}    {a.get('detail', '')}")
    return lines


def render_relaxations(relaxations: list[Mapping[str, Any]], model: str | None = None,
                       indent: str = "  ") -> list[str]:
    """The stored relaxation re-solves; with `model`: those of that model and the fleet-wide ones."""
    rows = [r for r in relaxations if model is None or r.get("model") in (None, model)]
    return [f"{indent}{r['detail']} (${r['usd_h_before']:.2f}/h -> ${r['usd_h_after']:.2f}/h, unmet "
            f"{r['unmet_rps_before']:.2f} -> {r['unmet_rps_after']:.2f} rps)" for r in rows]


def missed_line(m: Mapping[str, Any], indent: str = "  ") -> str | None:
    """The share of the last window's requests that missed the SLO, as the engines' histograms bound
    it (one figure where a target is a bucket edge), against the 1% a p99 target allows."""
    share = m.get("observed_missed_share")
    if not share:
        return None
    lo, hi = (100.0 * x for x in share)
    what = f"{lo:.2f}%" if hi - lo < 0.005 else f"{lo:.2f}-{hi:.2f}%"
    verdict = "within" if hi <= 100.0 * (1.0 - SLO_SHARE) + 1e-9 else (
        "above" if lo > 100.0 * (1.0 - SLO_SHARE) + 1e-9 else "perhaps above")
    return (f"{indent}missed the SLO (TTFT or ITL), last window: {what} of requests ({verdict} the "
            f"{100.0 * (1.0 - SLO_SHARE):g}% the p99 targets allow; the engines' histogram buckets bound it)")


def render_plan(doc: dict[str, Any]) -> str:
    """Readable tables from a plan_to_dict() document (never recomputes anything)."""
    e = doc["explanation"]
    out: list[str] = []
    out.append("DEMAND AND CAPACITY")
    out.append(f"{'model':<22} {'obs rps':>8} {'fcst':>8} {'demand':>8} {'head':>5} {'required':>9} "
               f"{'capacity':>9} {'target':>9} {'unmet':>7} {'$/h':>8}")
    for m in e["models"]:
        out.append(f"{m['model']:<22} {_spec(m['observed_rps']):>8} {_spec(m['forecast_rps']):>8} "
                   f"{m['demand_rps']:>8.1f} {m['headroom']:>5.2f} {m['required_rps']:>9.1f} "
                   f"{m['capacity_rps']:>9.1f} {m['target_capacity_rps']:>9.1f} {m['unmet_rps']:>7.1f} "
                   f"{m['usd_h']:>8.2f}")
    out.append("")
    out.append("CONFIGS (plan for now)")
    out.append(f"{'model':<22} {'engine':<7} {'gpu':<6} {'tp':>2} {'n':>3} {'cap/rep':>8} {'load/rep':>8} "
               f"{'bind':<6} {'ttft p99':>9} {'itl p99':>8} {'SLO ttft/itl':>13} {'$/h':>8}")
    for m in e["models"]:
        for c in m["configs"]:
            out.append(f"{c['model']:<22} {c['engine']:<7} {c['gpu']:<6} {c['tp']:>2} {c['replicas']:>3} "
                       f"{c['capacity_per_replica_rps']:>8.2f} {c['load_per_replica_rps']:>8.2f} "
                       f"{c['binding']:<6} {_spec(c['predicted_ttft_p99_ms'], '.0f'):>9} "
                       f"{_spec(c['predicted_itl_p99_ms'], '.1f'):>8} "
                       f"{m['slo_ttft_p99_ms']:>6.0f}/{m['slo_itl_p99_ms']:<6.0f} {c['usd_h']:>8.2f}")
            out.extend(config_lines(m, c, doc))  # the evidence behind the row (controller/report.py)
        if m.get("length_mix"):
            out.append(f"  {m['model']}: length mix: {m['length_mix']}")
        for note in m["notes"]:
            out.append(f"  {m['model']}: {note}")
        paired = pairing_line(m, indent="")
        if paired:
            out.append(f"  {m['model']}: {paired}")
    out.append("")
    out.append("ALTERNATIVES (each allowed config not chosen, alone; why it lost; the load where it would win)")
    for m in e["models"]:
        chosen = ", ".join(f"{c['replicas']} x {c['engine']} {c['gpu']} tp{c['tp']}" for c in m["configs"])
        out.append(f"{m['model']}: chosen {chosen or 'nothing'} ${m['usd_h']:.2f}/h at {m['demand_rps']:.1f} rps")
        out.extend(render_alternatives(m))
    relax = render_relaxations(e.get("relaxations") or [])
    if relax:
        out.append("RELAXATIONS (a binding constraint one step looser, re-solved)")
        out.extend(relax)
    for title, key in (("PLAN (now)", "plan"), ("TARGET (after builds)", "target")):
        p = doc[key]
        out.append("")
        out.append(f"{title}: {len(p['replicas'])} replicas, {p['gpus']} GPUs, ${p['usd_h']:.2f}/h")
        if key == "target" and p["replicas"] == doc["plan"]["replicas"]:
            out.append("  (same as the plan for now)")
            continue
        for r in p["replicas"]:
            out.append(f"  {r['host']:<14} gpus {','.join(str(i) for i in r['gpu_indices']):<16} "
                       f"{r['model']:<22} {r['engine']:<7} tp{r['tp']} {r['state']:<9} {r['replica_id']}")
    out.append("")
    out.append(f"ACTIONS ({len(doc['actions'])} this cycle, {len(doc['deferred_actions'])} deferred)")
    for i, a in enumerate(doc["actions"], 1):
        r = a["replica"]
        out.append(f"  {i:>2}. {a['kind'].upper():<5} {r['replica_id']}  ({a['reason']})")
    for a in doc["deferred_actions"]:
        out.append(f"   -  {a['kind'].upper():<5} {a['replica']['replica_id']}  (deferred: {a['reason']})")
    out.append("")
    out.append("SOLVER")
    for s in e["solver"]:
        out.append(f"  {s['stage']:<9} {s['backend']:<20} {s['status']:<9} objective={_spec(s['objective'], '.3f')} "
                   f"bound={_spec(s['best_bound'], '.3f')} gap={_spec(s['gap'], '.4f')} wall={s['wall_s']:.3f}s")
    out.append(f"  total solve {e['solve_s']:.3f} s; $/h now {e['usd_h']:.2f}, target {e['target_usd_h']:.2f}")
    if e["binding_constraints"]:
        out.append("BINDING")
        out.extend(f"  {b}" for b in e["binding_constraints"])
    for n in e["notes"]:
        out.append("NOTE: " + n)
    return "\n".join(out) + "\n"
