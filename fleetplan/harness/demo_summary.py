"""The demo's summary.json: what the live run measured, and what the replay says for the same day.

The demo (fleetplan/harness/demo.py) keeps in its directory the day of requests it sent
(`requests.jsonl`, a Mooncake-format trace that `fleetplan evaluate --trace` reads), the policy it ran
(`policy.yaml`, with the lab's hosts listed) and the profiles it fitted (`PROFILES.json`). This module

- measures the live run: `LiveGpuMeter` (GPU-hours per engine from the controller's own records,
  sampled on the simulated clock and clipped to the day's span, as the replay clips them) and
  `live_figures` (requests, failed, SLO attainment by the SLO's own definition, the same as the
  replay's: a request meets the SLO when it was served, its TTFT <= the policy's `ttft_p99_ms` and
  its per-request ITL, (last token - first token) / (output tokens - 1), <= `itl_p99_ms`);
- replays the same files with `fleetplan.sim.evaluate.evaluate`, read exactly as
  `fleetplan evaluate` reads them (`run_replay`), for fleetplan, static-peak, static-mean, hpa, the
  cheapest fixed fleet in hindsight (best-fixed) and the oracle, and records the command line that
  reproduces it (`evaluate_argv`);
- builds summary.json (`build_summary`) and renders the table the demo prints (`render_summary`).

No baseline is derived from the live run itself: every baseline is the replay's.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_FILE = "requests.jsonl"
POLICY_FILE = "policy.yaml"
PROFILES_FILE = "PROFILES.json"
CONTROLLER_FILE = "controller.yaml"  # the live daemon's controller config: the replay's windows and timeouts
SUMMARY_FILE = "summary.json"
REPLAY_POLICIES = ("fleetplan", "fleetplan-vllm-only", "static-peak", "static-mean", "hpa", "best-fixed", "oracle")
ENGINES = ("vllm", "trtllm")
# the key another part of the evaluation may carry per policy; used as is when present
BY_ENGINE_KEY = "gpu_hours_by_engine"
SLO_DEFINITION = (
    "a request meets the SLO when it was served (all its tokens), its TTFT <= the policy's ttft_p99_ms and "
    "its per-request ITL = (last token - first token) / (output tokens - 1) <= itl_p99_ms (a one-token "
    "output has ITL 0); attainment = requests meeting it / requests sent (failed ones are misses). The same "
    "rule as the replay's slo_attainment (sim/des.py) and the ground-truth capacity at the SLO"
)


# ---------------------------------------------------------------------------------------------
# the day as a trace file


def write_trace(path: Path, requests: Sequence[Sequence[Any]]) -> Path:
    """The day's requests, (t_s, prompt_tokens, output_tokens[, model]), as Mooncake JSONL
    (`timestamp` in ms, `input_length`, `output_length`): the format `fleetplan evaluate --trace`
    detects. Times are kept to the microsecond; `read_trace` puts the first arrival at t = 0."""
    lines = [json.dumps({"timestamp": round(float(r[0]) * 1000.0, 3), "input_length": int(r[1]),
                         "output_length": int(r[2])}) for r in requests]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# live figures


@dataclass
class LiveGpuMeter:
    """GPU-seconds the live fleet holds per engine, on the simulated clock, clipped to the day's span
    [t_from_s, t_to_s] (the replay counts GPU-hours from launch to stop clipped to the trace's span).
    `sample(t, held, builds)` at short intervals: the GPUs held at one sample count until the next."""

    t_from_s: float
    t_to_s: float
    gpu_s: dict[str, float] = field(default_factory=dict)
    build_gpu_s: float = 0.0
    samples: int = 0
    # the graduation as the controller's records show it (simulated s, None: not seen): the first
    # engine build, the first TensorRT-LLM replica, the first moment after it with no vLLM replica
    build_started_s: float | None = None
    trtllm_serving_s: float | None = None
    vllm_gone_s: float | None = None
    _last_t: float | None = None
    _last_held: dict[str, int] = field(default_factory=dict)
    _last_builds: int = 0

    def sample(self, t_s: float, held: Mapping[str, int], build_gpus: int = 0) -> None:
        if build_gpus > 0 and self.build_started_s is None:
            self.build_started_s = t_s
        if held.get("trtllm", 0) > 0 and self.trtllm_serving_s is None:
            self.trtllm_serving_s = t_s
        if self.trtllm_serving_s is not None and self.vllm_gone_s is None and held.get("vllm", 0) == 0:
            self.vllm_gone_s = t_s
        if self._last_t is not None:
            lo, hi = max(self._last_t, self.t_from_s), min(t_s, self.t_to_s)
            if hi > lo:
                for engine, n in self._last_held.items():
                    self.gpu_s[engine] = self.gpu_s.get(engine, 0.0) + n * (hi - lo)
                self.build_gpu_s += self._last_builds * (hi - lo)
        self._last_t, self._last_held, self._last_builds = t_s, dict(held), build_gpus
        self.samples += 1

    def gpu_hours_by_engine(self) -> dict[str, float]:
        """Replicas' GPU-hours per engine; engine builds' GPUs are counted under the engine they build."""
        out = {e: self.gpu_s.get(e, 0.0) / 3600.0 for e in sorted(set(ENGINES) | set(self.gpu_s))}
        out["trtllm"] = out.get("trtllm", 0.0) + self.build_gpu_s / 3600.0
        return out

    def gpu_hours(self) -> float:
        return sum(self.gpu_hours_by_engine().values())


def _q(values: Sequence[float], q: float) -> float | None:
    """The q-quantile, linear interpolation (numpy's default), None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def request_meets_slo(r: Any, ttft_slo_ms: float, itl_slo_ms: float) -> bool:
    """The SLO's own per-request rule (SLO_DEFINITION) on a `fleetplan.sim.replay.RequestResult`."""
    if r.outcome != "ok" or r.ttft_s is None or r.ttft_s * 1000.0 > ttft_slo_ms:
        return False
    itl_s = r.itl_mean_s if r.itl_mean_s is not None else 0.0  # None only for a one-token output
    return bool(itl_s * 1000.0 <= itl_slo_ms)


def live_figures(results: Sequence[Any], *, ttft_slo_ms: float, itl_slo_ms: float, meter: LiveGpuMeter,
                 price_usd_h: float | None = None) -> dict[str, Any]:
    """The live run's figures from the clients' results and the GPU meter."""
    ok = [r for r in results if r.outcome == "ok"]
    met = sum(1 for r in results if request_meets_slo(r, ttft_slo_ms, itl_slo_ms))
    ttft = [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]
    itl = [r.itl_mean_s * 1000.0 for r in ok if r.itl_mean_s is not None]
    by_engine = meter.gpu_hours_by_engine()
    gpu_h = sum(by_engine.values())
    ttft_p99, itl_p99 = _q(ttft, 0.99), _q(itl, 0.99)
    out: dict[str, Any] = {
        "requests": len(results),
        "served": len(ok),
        "failed": len(results) - len(ok),
        "slo_met": met,
        "slo_attainment": round(met / len(results), 5) if results else None,
        "ttft_p50_ms": _r(_q(ttft, 0.5), 1), "ttft_p99_ms": _r(ttft_p99, 1),
        "itl_p50_ms": _r(_q(itl, 0.5), 2), "itl_p99_ms": _r(itl_p99, 2),
        # the SLO read as its name says: p99 over the served requests of TTFT and of per-request ITL
        "slo_p99_met": bool(ttft_p99 is not None and ttft_p99 <= ttft_slo_ms
                            and (itl_p99 is None or itl_p99 <= itl_slo_ms)),
        "gpu_hours": round(gpu_h, 4),
        "gpu_hours_by_engine": {e: round(v, 4) for e, v in by_engine.items()},
        "build_gpu_hours": round(meter.build_gpu_s / 3600.0, 4),
        "gpu_hours_window_s": [round(meter.t_from_s, 1), round(meter.t_to_s, 1)],
        "gpu_samples": meter.samples,
        "graduation": {"build_started_s": _r(meter.build_started_s, 1),
                       "trtllm_serving_s": _r(meter.trtllm_serving_s, 1),
                       "vllm_gone_s": _r(meter.vllm_gone_s, 1)},
    }
    if price_usd_h is not None:
        out["cost_usd"] = round(gpu_h * price_usd_h, 2)
    return out


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


# ---------------------------------------------------------------------------------------------
# the replay


def evaluate_argv(work: Path, model: str, *, policies: Sequence[str] = REPLAY_POLICIES,
                  time_scale: float | None = None, trace_file: str = TRACE_FILE) -> list[str]:
    """`fleetplan evaluate` on the demo's own files: the command that reproduces the replay.
    `time_scale`: the live daemon ran with work/CONTROLLER_FILE at this speed-up; the replay reads its
    windows and waits its timeouts (None: the daemon's defaults)."""
    argv = ["fleetplan", "evaluate", "--trace", str(work / trace_file), "--policy", str(work / POLICY_FILE),
            "--profiles", str(work / PROFILES_FILE), "--model", model, "--policies", ",".join(policies),
            "--shared-engine-cache"]
    if time_scale is not None:
        argv += ["--controller-config", str(work / CONTROLLER_FILE), "--time-scale", f"{time_scale:g}"]
    return [*argv, "--json"]


@dataclass(frozen=True)
class Replay:
    evaluation: Any  # fleetplan.sim.evaluate.Evaluation
    doc: dict[str, Any]  # evaluation.to_json(), with the trace info `fleetplan evaluate` adds
    baseline_engine: str | None  # the engine of the baseline config static-*/hpa run (None: unknown)
    baseline_config: str | None


def run_replay(work: Path, model: str, *, policies: Sequence[str] = REPLAY_POLICIES, workers: int = 2,
               time_scale: float | None = None, trace_file: str = TRACE_FILE) -> Replay:
    """`fleetplan.sim.evaluate.evaluate` on work/requests.jsonl, work/policy.yaml, work/PROFILES.json,
    each read as `fleetplan evaluate` reads it (fleetplan/harness/cli/evaluate.py), with the options of
    `evaluate_argv`: a shared engine cache, as the demo's agents share one; the live daemon's windows
    and timeouts from work/controller.yaml at `time_scale` (None: the daemon's defaults); rate scale
    1, no day shaping."""
    from fleetplan.controller.settings import ControllerSettings, load_settings
    from fleetplan.harness.replay_settings import replay_settings
    from fleetplan.planner.policy import load_policy_text
    from fleetplan.shared.benchfiles import load_profiles
    from fleetplan.sim.evaluate import EvaluateOptions, evaluate
    from fleetplan.sim.traces import read_trace

    trace_path, policy_path = work / trace_file, work / POLICY_FILE
    policy = load_policy_text(policy_path.read_text(encoding="utf-8"), str(policy_path))
    profiles = load_profiles(work / PROFILES_FILE)
    trace = read_trace(trace_path)
    info: dict[str, Any] = {"file": str(trace_path), "requests_in_file": len(trace.requests),
                            "skipped_rows": trace.skipped, "rate_scale": 1.0, "day_s": None}
    live_config = ControllerSettings() if time_scale is None else load_settings(work / CONTROLLER_FILE)
    rs = replay_settings(live_config, time_scale=time_scale or 1.0, shared_engine_cache=True)
    ev = evaluate(trace, policy, profiles,
                  EvaluateOptions(policies=tuple(policies), model=model, workers=max(1, workers),
                                  settings=rs.sim, control=rs.control),
                  trace_info=info)
    engine, label = _baseline(trace, policy, profiles, model)
    return Replay(ev, ev.to_json(), engine, label)


def _baseline(trace: Any, policy: Any, profiles: Any, model: str) -> tuple[str | None, str | None]:
    """The one config static-peak, static-mean and hpa run (fleetplan.sim.baselines.baseline_config on
    the trace's mean lengths, as the replay sizes them); (None, None) when it cannot be told."""
    try:
        from fleetplan.sim.baselines import baseline_config, trace_mix

        isl, osl = trace_mix(trace.as_single_model(model))
        sizing = baseline_config(policy, profiles, model, isl, osl)
        return sizing.config.engine.value, sizing.config.label()
    except Exception:  # another version of the baselines: per-engine figures then come from the evaluation only
        return None, None


def replay_by_engine(name: str, figures: Mapping[str, Any], replay: Replay) -> tuple[dict[str, float] | None, str]:
    """GPU-hours per engine of one replayed policy, and where the figure comes from.

    1. `Evaluation.to_json()["policies"][name]["gpu_hours_by_engine"]` when the evaluation carries it;
    2. static-peak, static-mean, hpa: they run one config (the baseline config), so all their GPU-hours
       are on its engine;
    3. otherwise (fleetplan, the oracle on an evaluation without the field) None: not derivable from
       the totals the evaluation returns."""
    given = figures.get(BY_ENGINE_KEY)
    if isinstance(given, Mapping):
        return {str(k): round(float(v), 4) for k, v in given.items()}, "evaluation"
    if name in ("static-peak", "static-mean", "hpa") and replay.baseline_engine is not None:
        out = {e: 0.0 for e in ENGINES}
        out[replay.baseline_engine] = round(float(figures.get("gpu_hours", 0.0)), 4)
        return out, f"baseline config {replay.baseline_config} (the only config {name} runs)"
    return None, (f"not in this evaluation's output: read from Evaluation.to_json()['policies'][{name!r}]"
                  f"['{BY_ENGINE_KEY}'] when present")


# ---------------------------------------------------------------------------------------------
# summary.json and the table


def build_summary(*, work: Path, model: str, day: Mapping[str, Any], slo: Mapping[str, float],
                  live: Mapping[str, Any], replay: Replay | None, replay_wall_s: float | None = None,
                  replay_error: str | None = None,
                  policies: Sequence[str] = REPLAY_POLICIES, time_scale: float | None = None) -> dict[str, Any]:
    """summary.json: the live figures, the replay's per policy (same day, policy, profiles, and the
    live daemon's windows at `time_scale`), the command that reproduces the replay, and live vs
    replay fleetplan GPU-hours."""
    argv = evaluate_argv(work, model, policies=policies, time_scale=time_scale)
    rep: dict[str, Any] = {"command": shlex.join(argv), "argv": argv,
                           "files": {"trace": str(work / TRACE_FILE), "policy": str(work / POLICY_FILE),
                                     "profiles": str(work / PROFILES_FILE)}}
    if replay_wall_s is not None:
        rep["wall_s"] = round(replay_wall_s, 1)
    if replay_error is not None:
        rep["error"] = replay_error
    comparison: dict[str, Any] = {}
    graduation: dict[str, Any] = {}
    if replay is not None:
        pol_out: dict[str, Any] = {}
        for name in policies:
            fig = replay.doc["policies"].get(name)
            if fig is None:
                continue
            by_engine, source = replay_by_engine(name, fig, replay)
            row = {k: fig.get(k) for k in ("gpu_hours", "cost_usd", "slo_attainment", "ttft_p50_ms", "ttft_p99_ms",
                                          "itl_p50_ms", "itl_p99_ms", "replica_starts", "builds",
                                          "unmet_requests", "mean_gpus", "peak_gpus") if k in fig}
            row[BY_ENGINE_KEY] = by_engine
            row[BY_ENGINE_KEY + "_source"] = source
            if name == "oracle":
                row["config"] = fig.get("config")
            if name == "best-fixed":
                row["fleet"] = fig.get("fleet")
            pol_out[name] = row
        rep["policies"] = pol_out
        rep["trace"] = replay.doc.get("trace", {})
        fp = pol_out.get("fleetplan", {}).get("gpu_hours")
        lv = live.get("gpu_hours")
        if isinstance(fp, (int, float)) and fp > 0 and isinstance(lv, (int, float)):
            ratio = lv / fp
            comparison = {"live_gpu_hours": lv, "replay_fleetplan_gpu_hours": fp,
                          "live_over_replay": round(ratio, 4), "within_10_percent": abs(ratio - 1.0) <= 0.10}
        graduation = graduation_figures(live, pol_out)
    return {
        "version": 1,
        "model": model,
        "day": dict(day),
        "slo": {**dict(slo), "definition": SLO_DEFINITION},
        "live": dict(live),
        "replay": rep,
        "live_vs_replay": comparison,
        "graduation": graduation,
    }


def graduation_figures(live: Mapping[str, Any], replay_policies: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What TensorRT-LLM did on the day: when the live run built its engine, first served on it and had no
    vLLM replica left (simulated s; None: it did not), TensorRT-LLM's share of the live GPU-hours (its
    builds included), and the GPU-hours it saved: the replay of fleetplan restricted to vLLM
    (`fleetplan-vllm-only`, same day, policy and profiles) minus the live run and minus the replay's
    fleetplan. Negative: the build cost more than it saved on this day.

    >>> g = graduation_figures({"gpu_hours": 8.0, "gpu_hours_by_engine": {"vllm": 2.0, "trtllm": 6.0}},
    ...                        {"fleetplan": {"gpu_hours": 8.2}, "fleetplan-vllm-only": {"gpu_hours": 9.0}})
    >>> g["live_trtllm_share"], g["live_saved_gpu_hours"], g["replay_saved_gpu_hours"]
    (0.75, 1.0, 0.8)
    """
    out: dict[str, Any] = dict(live.get("graduation") or {})
    by = live.get(BY_ENGINE_KEY) or {}
    total = live.get("gpu_hours")
    if isinstance(total, (int, float)) and total > 0:
        out["live_trtllm_share"] = round(float(by.get("trtllm", 0.0)) / total, 4)
    only = (replay_policies.get("fleetplan-vllm-only") or {}).get("gpu_hours")
    fp = (replay_policies.get("fleetplan") or {}).get("gpu_hours")
    if isinstance(only, (int, float)):
        out["replay_vllm_only_gpu_hours"] = only
        if isinstance(total, (int, float)):
            out["live_saved_gpu_hours"] = round(only - total, 4)
        if isinstance(fp, (int, float)):
            out["replay_saved_gpu_hours"] = round(only - fp, 4)
    return out


def write_summary(work: Path, summary: Mapping[str, Any]) -> Path:
    from fleetplan.shared.atomic import atomic_write_text

    path = work / SUMMARY_FILE
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")
    return path


def render_summary(summary: Mapping[str, Any]) -> str:
    """The table the demo prints at its end (the same figures as summary.json)."""

    def f(x: Any, fmt: str, suffix: str = "") -> str:
        return "-" if not isinstance(x, (int, float)) else format(x, fmt) + suffix

    def pct(x: Any) -> str:
        return "-" if not isinstance(x, (int, float)) else f"{100 * x:.2f}%"

    def engines(by: Any) -> list[str]:
        if not isinstance(by, Mapping):
            return ["n/a"] * len(ENGINES)
        return [f(by.get(e, 0.0), ".2f") for e in ENGINES]

    head = (f"{'':<28} {'GPU-h':>7} {'vLLM':>7} {'TRT-LLM':>7} {'SLO att.':>8} {'TTFT p99':>9} {'ITL p99':>8} "
            f"{'requests':>8} {'failed':>7}")
    lines = [head, "-" * len(head)]
    live = summary.get("live", {})
    lines.append(f"{'live (the daemon)':<28} {f(live.get('gpu_hours'), '.2f'):>7} "
                 + " ".join(f"{x:>7}" for x in engines(live.get(BY_ENGINE_KEY)))
                 + f" {pct(live.get('slo_attainment')):>8} {f(live.get('ttft_p99_ms'), '.0f'):>9} "
                 f"{f(live.get('itl_p99_ms'), '.1f'):>8} {live.get('requests', '-')!s:>8} {live.get('failed', '-')!s:>7}")
    rep = summary.get("replay", {})
    for name, p in rep.get("policies", {}).items():
        label = f"replay {name}" + {"oracle": " (bound)", "best-fixed": " (hindsight)"}.get(name, "")
        lines.append(f"{label:<28} {f(p.get('gpu_hours'), '.2f'):>7} "
                     + " ".join(f"{x:>7}" for x in engines(p.get(BY_ENGINE_KEY)))
                     + f" {pct(p.get('slo_attainment')):>8} {f(p.get('ttft_p99_ms'), '.0f'):>9} "
                     f"{f(p.get('itl_p99_ms'), '.1f'):>8} {'':>8} {p.get('unmet_requests', '-')!s:>7}")
    slo = summary.get("slo", {})
    lines.append("")
    lines.append(f"SLO: TTFT <= {f(slo.get('ttft_p99_ms'), '.0f')} ms and per-request ITL <= "
                 f"{f(slo.get('itl_p99_ms'), '.0f')} ms per request (failed = miss); 'failed' for the replay = "
                 f"unmet (rejected or unfinished)")
    cmp_ = summary.get("live_vs_replay") or {}
    if cmp_:
        lines.append(f"live / replay fleetplan GPU-hours: {cmp_['live_over_replay']:.3f} "
                     f"({'within' if cmp_['within_10_percent'] else 'NOT within'} 10%)")
    grad = summary.get("graduation") or {}
    if grad:
        lines.append(_graduation_line(grad))
    missing = [n for n, p in rep.get("policies", {}).items() if p.get(BY_ENGINE_KEY) is None]
    if missing:
        lines.append(f"n/a: GPU-hours per engine not reported by this evaluation for {', '.join(missing)}")
    if rep.get("error"):
        lines.append(f"replay failed: {rep['error']}")
    lines.append(f"reproduce the replay: {rep.get('command', '')}")
    return "\n".join(lines)


def _graduation_line(g: Mapping[str, Any]) -> str:
    """One line on the graduation (graduation_figures): when, TensorRT-LLM's share, what it saved."""

    def t(key: str) -> str | None:
        v = g.get(key)
        return None if not isinstance(v, (int, float)) else f"t = {v:.0f} s"

    steps = [f"{what} {t(key)}" for key, what in (("build_started_s", "engine build started"),
                                                  ("trtllm_serving_s", "first replica serving"),
                                                  ("vllm_gone_s", "no vLLM replica left"))
             if t(key) is not None]
    head = "graduation to TensorRT-LLM (live): " + (", ".join(steps) if steps else "not on this day")
    share = g.get("live_trtllm_share")
    if isinstance(share, (int, float)) and steps:
        head += f"; TensorRT-LLM carried {100 * share:.0f}% of the GPU-hours (its builds included)"
    only = g.get("replay_vllm_only_gpu_hours")
    if isinstance(only, (int, float)) and steps:
        saved = [f"{g[k]:+.2f} {what}" for k, what in (("live_saved_gpu_hours", "live"),
                                                      ("replay_saved_gpu_hours", "replayed"))
                 if isinstance(g.get(k), (int, float))]
        head += (f"; saved against fleetplan restricted to vLLM ({only:.2f} GPU-h replayed): "
                 + ", ".join(saved) + " GPU-h")
    return head


def held_gpus(store: Any) -> tuple[dict[str, int], int]:
    """GPUs the controller's records hold now: per engine for its replicas (desired or draining:
    starting, ready or draining engines) and for its running engine builds."""
    held: dict[str, int] = {}
    for r in store.active_replicas():
        held[r.engine] = held.get(r.engine, 0) + (len(r.gpu_indices) or r.tp)
    builds = sum(len(b.gpu_indices) or b.tp for b in store.builds(("desired",)) if b.result is None)
    return held, builds


def progress_printer(what: str, log: Callable[[str], None] = print) -> Callable[[float], None]:
    """A callback that prints one progress line for the elapsed wall seconds."""

    def tick(elapsed_s: float) -> None:
        log(f"  replay running: {elapsed_s:4.0f} s ({what})")

    return tick
