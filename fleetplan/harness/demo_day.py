"""The demo's day at its real length: the same shape over 24 h, replayed in the simulator.

The live demo squeezes a day into one simulated hour, so an engine build takes a third of it and
graduation to TensorRT-LLM rarely pays. This replays the same day's shape (night trough, afternoon
peak, the same lengths, policy and profiles) over 24 h with the daemon's default windows, and puts
in summary.json what the users' horizon shows: fleetplan's GPU-hours over best-fixed, tuned hpa
and the clairvoyant (found with hindsight), GPU-hours per engine, and the graduation (its engine
build, TensorRT-LLM serving, vLLM gone).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fleetplan.harness.demo_summary import BY_ENGINE_KEY, evaluate_argv, run_replay, write_trace

__all__ = ["REAL_DAY_FILE", "REAL_DAY_POLICIES", "REAL_DAY_S", "YARDSTICKS", "real_day_section", "render_real_day",
           "run_real_day", "write_real_day"]

REAL_DAY_S = 86_400.0
REAL_DAY_FILE = "day-24h.jsonl"
REAL_DAY_POLICIES = ("fleetplan", "fleetplan-vllm-only", "best-fixed", "hpa-tuned", "clairvoyant", "oracle")
YARDSTICKS = ("best-fixed", "hpa-tuned", "clairvoyant")


def write_real_day(work: Path, day_requests: Callable[..., list[Any]], *, base_rps: float, peak_rps: float,
                   isl: int, osl: int, model: str) -> tuple[Path, int]:
    """The demo's generated day (`day_requests`, the same rates and lengths) over REAL_DAY_S."""
    reqs = day_requests(REAL_DAY_S, base_rps=base_rps, peak_rps=peak_rps, isl=isl, osl=osl, model=model)
    return write_trace(work / REAL_DAY_FILE, reqs), len(reqs)


def run_real_day(work: Path, model: str, *, workers: int = 2) -> dict[str, Any]:
    """`fleetplan evaluate` of work/REAL_DAY_FILE with the demo's policy and profiles and the daemon's
    default windows: the evaluation's JSON document."""
    return run_replay(work, model, policies=REAL_DAY_POLICIES, workers=workers, trace_file=REAL_DAY_FILE).doc


def real_day_section(work: Path, model: str, doc: Mapping[str, Any] | None, *, requests: int,
                     wall_s: float | None = None, error: str | None = None) -> dict[str, Any]:
    """summary.json's `real_length_day`: per policy GPU-hours, attainment and GPU-hours per engine;
    fleetplan over each yardstick; fleetplan's graduation (builds, when each engine served).

    >>> doc = {"policies": {"fleetplan": {"gpu_hours": 60.0, "slo_attainment": 0.995,
    ...        "gpu_hours_by_engine": {"vllm": 10.0, "trtllm": 48.0, "build": 2.0},
    ...        "graduation": {"builds": [], "serving": {}}}, "best-fixed": {"gpu_hours": 96.0, "slo_attainment": 0.99}}}
    >>> s = real_day_section(Path("/w"), "m", doc, requests=50)
    >>> s["fleetplan_over"], s["trtllm_serving_share"]
    ({'best-fixed': 0.625}, 0.8276)
    """
    argv = evaluate_argv(work, model, policies=REAL_DAY_POLICIES, trace_file=REAL_DAY_FILE)
    out: dict[str, Any] = {"span_s": REAL_DAY_S, "requests": requests, "command": shlex.join(argv)}
    if wall_s is not None:
        out["wall_s"] = round(wall_s, 1)
    if error is not None:
        out["error"] = error
    if doc is None:
        return out
    pols = doc.get("policies", {})
    out["policies"] = {n: {k: p.get(k) for k in ("gpu_hours", "slo_attainment", BY_ENGINE_KEY, "found_at") if k in p}
                       for n, p in pols.items()}
    fp = pols.get("fleetplan") or {}
    fp_h = fp.get("gpu_hours")
    if isinstance(fp_h, (int, float)):
        out["fleetplan_over"] = {n: round(fp_h / pols[n]["gpu_hours"], 4) for n in YARDSTICKS
                                 if isinstance((pols.get(n) or {}).get("gpu_hours"), (int, float))
                                 and pols[n]["gpu_hours"] > 0}
    by = fp.get(BY_ENGINE_KEY) or {}
    serving = sum(float(v) for k, v in by.items() if k != "build")
    if serving > 0:
        out["trtllm_serving_share"] = round(float(by.get("trtllm", 0.0)) / serving, 4)
    out["graduation"] = fp.get("graduation")
    return out


def _clock(t_s: Any) -> str:
    return "-" if not isinstance(t_s, (int, float)) else f"{int(t_s // 3600):02d}:{int(t_s % 3600 // 60):02d}"


def render_real_day(s: Mapping[str, Any]) -> list[str]:
    """The real-length day's lines of the demo's table (summary.json `real_length_day`)."""
    lines = ["", f"the same day at its real length (24 h, {s.get('requests', '-')} requests), replayed:"]
    if s.get("error"):
        return [*lines, f"  failed: {s['error']}", f"  reproduce: {s.get('command', '')}"]
    for name, p in (s.get("policies") or {}).items():
        att = p.get("slo_attainment")
        by = p.get(BY_ENGINE_KEY) or {}
        engines = ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items()) if v)
        found = f" (found at {p['found_at']})" if p.get("found_at") else ""
        lines.append(f"  {name:<22} {p.get('gpu_hours', 0.0):8.2f} GPU-h  "
                     f"{'-' if att is None else f'{100 * att:.2f}%':>7}  {engines}{found}")
    over = s.get("fleetplan_over") or {}
    if over:
        lines.append("  fleetplan over " + ", ".join(f"{n} {r:.2f}x" for n, r in over.items()))
    share = s.get("trtllm_serving_share")
    grad = s.get("graduation") or {}
    steps = [f"engine build {b['config']} {_clock(b['start_s'])}-{_clock(b['done_s'])}" for b in grad.get("builds", [])]
    serving = grad.get("serving") or {}
    if "trtllm" in serving:
        steps.append(f"TensorRT-LLM serving from {_clock(serving['trtllm']['first_ready_s'])}")
    if "vllm" in serving:
        gone = serving["vllm"].get("gone_s")
        steps.append("vLLM serving to the end" if gone is None else f"vLLM gone from {_clock(gone)}")
    if steps:
        lines.append("  graduation: " + ", ".join(steps)
                     + ("" if share is None else f"; TensorRT-LLM {100 * share:.0f}% of the serving GPU-hours"))
    lines.append(f"  reproduce: {s.get('command', '')}")
    return lines
