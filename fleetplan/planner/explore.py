"""Exploration: one canary replica of a config nobody has measured, when its profile promises a
cheaper fleet than anything known by more than the trial costs. Pure.

A config used outside its profile's data and never observed is planned at a conservative x0.5
speed (planner/correction.py), so the solver never picks it, it never runs, and it is never
learned: the fleet stays on the first config that ran (issue 18: in two of three demo runs
TensorRT-LLM was never tried; on long context the TP4 configs, 1.6x cheaper per request than the
TP1 the fleet ran, were never measured). A canary breaks the loop: the plan keeps one replica of the
config (a floor) until EXPLORE_WINDOWS windows of its latency are observed; the correction then
knows its speed, the floor goes, and the solver keeps it or not on what it learned.

The canary is safe: it is counted at its conservative capacity, so the rest of the fleet is sized
as if it were slow; it serves its share of the traffic through the same router. It is bounded by
the policy (`scaling.explore_max_gpus`: the largest canary; 0 = never explore), it only runs when
its promise pays for the trial within PAYBACK_S, and advisory mode, pause and the blast-radius
limits apply to its start as to any other (planner/brakes.py).

Worked example: a model needs 5 rps; TP1 (one $3/h GPU) is measured at 0.56 rps ($5.36/h per rps);
TP4 (4 GPUs, $12/h) is planned at x0.5 (2.86 rps: $4.20 per rps, the best the plan can buy without
learning), its profile as fitted says 5.71 rps ($2.10 per rps): the promise is 5 x (4.20 - 2.10) =
$10.5/h; the trial (5 windows of 60 s of one $12/h replica, and a 900 s TP4 build: 4 GPUs for
0.25 h) costs $1 + $3 = $4, paid back in 23 minutes: the plan carries one TP4 canary until measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey, Correction

__all__ = ["EXPLORE_WINDOWS", "Canary", "canaries"]

EXPLORE_WINDOWS = 5  # windows of evidence that end a trial (the correction's estimate has settled)
PAYBACK_S = 3600.0  # the promised saving must pay for the trial within this long
MIN_GAIN = 0.15  # explore only a config whose profile promises capacity >= 15% cheaper per rps
MIN_REQUESTS_PER_WINDOW = 20.0  # a canary that would see fewer requests per window learns nothing


@dataclass(frozen=True)
class Canary:
    """One canary replica the plan keeps until its config is measured."""

    config: ConfigKey
    windows: int  # windows of evidence so far
    promised_usd_h: float  # $/h saved if the profile as fitted holds
    trial_usd: float  # what the trial costs: the canary for EXPLORE_WINDOWS cycles, and its build

    def note(self) -> str:
        return (f"exploring {self.config.label()}: one canary replica until {EXPLORE_WINDOWS} windows of its "
                f"latency are observed ({self.windows} so far); its profile promises "
                f"${self.promised_usd_h:.2f}/h less than the best config known, the trial costs "
                f"~${self.trial_usd:.2f}")


def canaries(policy: Policy, capacities: Mapping[ConfigKey, CapacityInfo],
             corrections: Mapping[ConfigKey, Correction], required_rps: Mapping[str, float],
             ready: frozenset[ConfigKey]) -> dict[str, Canary]:
    """Per model, the canary to run this cycle (at most one), or none.

    `required_rps`: what each model's plan must serve (models with an unknown demand absent);
    `ready`: configs whose engines are built (a canary of another config costs its build too).

    >>> from fleetplan.planner.policy import load_policy_dict
    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> pol = load_policy_dict({"version": 1, "gpu_types": {"h100": {"price_usd_h": 3.0}},
    ...     "hosts": [{"name": "h", "gpu": "h100", "gpu_count": 8}],
    ...     "models": [{"name": "m", "slo": {"ttft_p99_ms": 1000, "itl_p99_ms": 50},
    ...                 "allowed": {"engines": ["vllm"], "tp": [1, 4]}, "workload": {"isl": 100, "osl": 100}}],
    ...     "engines": {"vllm": {"launch": {"command": "vllm"}, "startup": {"default_s": 60}}},
    ...     "scaling": {"explore_max_gpus": 8}}, "doc")
    >>> tp1 = ConfigKey("m", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
    >>> tp4 = ConfigKey("m", Engine.VLLM, GpuType("h100"), 4, Precision.BF16)
    >>> caps = {tp1: CapacityInfo(0.56, "itl", profile_rps=1.35),   # observed: 0.56 is what it does
    ...         tp4: CapacityInfo(2.86, "itl", profile_rps=5.71)}   # x0.5 until observed
    >>> seen = {tp1: Correction(tp1, 0.0, 0.01, -0.9, 0.01, observations=12)}
    >>> c = canaries(pol, caps, seen, {"m": 5.0}, frozenset({tp1, tp4}))["m"]
    >>> c.config.tp, round(c.promised_usd_h, 1), round(c.trial_usd, 2)
    (4, 10.5, 1.0)
    >>> canaries(pol, caps, seen, {"m": 0.05}, frozenset({tp1, tp4}))  # too few requests to learn from
    {}
    """
    limit = policy.scaling.explore_max_gpus
    if limit <= 0:
        return {}
    cycle_s = policy.scaling.cycle_s
    by_model: dict[str, list[tuple[ConfigKey, CapacityInfo]]] = {}
    for c, info in capacities.items():
        by_model.setdefault(c.model, []).append((c, info))
    out: dict[str, Canary] = {}
    for model, rows in sorted(by_model.items()):
        req = required_rps.get(model)
        if req is None or not req > 0:
            continue
        best_known: float | None = None  # $/h per rps the plan can buy without learning anything
        for c, info in rows:
            usd = policy.replica_usd_h(c)
            if usd is not None and info.max_rps > 0 and math.isfinite(info.max_rps):
                best_known = min(best_known, usd / info.max_rps) if best_known is not None else usd / info.max_rps
        if best_known is None:
            continue
        pick: Canary | None = None
        for c, info in sorted(rows):
            usd = policy.replica_usd_h(c)
            corr = corrections.get(c)
            windows = corr.observations if corr is not None else 0
            if (usd is None or c.tp > limit or windows >= EXPLORE_WINDOWS or info.profile_rps is None
                    or not info.profile_rps > info.max_rps * (1.0 + MIN_GAIN) or not info.max_rps > 0):
                continue  # nothing to learn (measured, or planned as fitted), or not allowed
            promise = usd / info.profile_rps
            if promise > best_known * (1.0 - MIN_GAIN):
                continue
            # the canary's share of the requests: its capacity's share of the fleet's
            share = min(1.0, info.max_rps / max(req, info.max_rps))
            if req * share * cycle_s < MIN_REQUESTS_PER_WINDOW:
                continue
            gain_usd_h = req * (best_known - promise)
            build_s = policy.build_s(c) if c not in ready and policy.needs_build(c) else None
            trial = usd * EXPLORE_WINDOWS * cycle_s / 3600.0 + (usd * build_s / 3600.0 if build_s else 0.0)
            if gain_usd_h * PAYBACK_S / 3600.0 < trial:
                continue
            cand = Canary(c, windows, gain_usd_h, trial)
            if pick is None or cand.promised_usd_h - cand.trial_usd > pick.promised_usd_h - pick.trial_usd:
                pick = cand
        if pick is not None:
            out[model] = pick
    return out
