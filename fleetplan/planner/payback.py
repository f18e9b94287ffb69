"""Engine builds that pay back: a TensorRT-LLM build is a one-off cost, started only for savings that last. Pure.

A build holds its replica's GPUs for the build time (15-45 min on real GPUs). The count solver prices
configs in $/h at the required rate of this cycle, so a build whose config is cheaper only at this
moment's rate (a required rate just above one vLLM replica's capacity, falling again) is started,
paid for, and its replica replaces the vLLM one one for one (the demo's day: 0.67 of 6.89 GPU-h).

Rule: a config that needs a build stays a candidate for the target only if, at the required rates
of the model's last `HISTORY_S` (its observed rate history x (1 + headroom), and this cycle's
required rate), a fleet allowed to use it would have been cheaper by enough on average to pay the
build back within `PAYBACK_S`: mean saving ($/h) x PAYBACK_S >= the build's GPU cost ($). The
savings come after the build, so a past rate above this cycle's required rate (which already holds
the forecast's rise and margin over the lead time) counts at this cycle's rate: on the way down
from a peak the peak's savings are not expected again. A model that nothing ready can serve builds
anyway (the build is the only way to serve it).

Worked example: vLLM 1.75 rps / $12/h per replica, TRT-LLM 1.92 rps / $12/h, a 15-min build on its
4 GPUs costs $3. Over the last hour the required rate sat in 1.75-1.92 rps (one TRT-LLM replica
where vLLM needs two) for 6 of 60 minutes: the mean saving is $1.20/h, the build would pay back in
2.5 h: not started. At a steady 1.8 rps it saves $12/h and pays back in 15 min: started. An hour
at 1.8 rps that has fallen to 1.5 rps (one replica of either engine): the past hour's rates count
at 1.5 rps, nothing is saved: not started.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from fleetplan.planner.counts import Candidate
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey

PAYBACK_S = 3600.0  # a build must pay for itself within this long of the savings the recent traffic shows
HISTORY_S = 3600.0  # the recent traffic: the model's rate history over this long


def _fleet_usd_h(rate_rps: float, cands: Iterable[Candidate]) -> float:
    """$/h of the cheapest single-config fleet of `cands` serving `rate_rps` (at least one replica).
    A config capped at `max_count` replicas (its engine on some hosts only) serves what its replicas
    hold and the cheapest uncapped config the rest."""
    pool = [c for c in cands if c.capacity_rps > 0 and math.isfinite(c.capacity_rps)]
    free = [c for c in pool if c.max_count is None]
    best = math.inf
    for c in pool:
        n = max(1, math.ceil(rate_rps / c.capacity_rps - 1e-9))
        if c.max_count is None or n <= c.max_count:
            best = min(best, n * c.usd_h)
        elif c.max_count > 0 and free:
            rest = rate_rps - c.max_count * c.capacity_rps
            best = min(best, c.max_count * c.usd_h + min(
                math.ceil(rest / o.capacity_rps - 1e-9) * o.usd_h for o in free))
    return best


def unpaid_builds(policy: Policy, cands: Sequence[Candidate], required_rps: Mapping[str, float],
                  histories: Mapping[str, Sequence[tuple[float, float]]], now_s: float,
                  keep: Iterable[ConfigKey] = ()) -> dict[ConfigKey, str]:
    """The build candidates that would not pay back, each with a readable note ("" where it would save
    nothing at all). `histories`: per model its rate history, (time, rps) samples already checked to
    be valid rates (planner/core.py `_demands`); `keep`: configs never dropped (a canary, a floor)."""
    kept = set(keep)
    out: dict[ConfigKey, str] = {}
    models = sorted({c.config.model for c in cands if c.build_s > 0})
    for model in models:
        builds = [c for c in cands if c.config.model == model and c.build_s > 0 and c.config not in kept]
        ready = [c for c in cands if c.config.model == model and c.build_s <= 0]
        m = policy.model(model)
        if not builds or m is None or math.isinf(_fleet_usd_h(1e-9, ready)):
            continue  # nothing ready serves it: the build is the only way
        rates = [r * (1.0 + m.headroom) for t, r in histories.get(model, ()) if t >= now_s - HISTORY_S]
        req = required_rps.get(model)
        if req is not None and math.isfinite(req) and req > 0:
            # the savings come after the build: a past rate above what this cycle requires (its forecast
            # over the lead time, margin included) is not expected again soon, so it counts at this
            # cycle's rate (the evening after a peak would otherwise start a build the peak paid for)
            rates = [min(r, req) for r in rates]
            rates.append(req)
        if not rates:
            continue
        without = [_fleet_usd_h(r, ready) for r in rates]
        for b in builds:
            saving = sum(w - min(w, _fleet_usd_h(r, (b,))) for w, r in zip(without, rates, strict=True)) / len(rates)
            cost = b.usd_h * b.build_s / 3600.0
            if saving * PAYBACK_S / 3600.0 < cost:
                # a build that would save nothing at any recent rate is not news: no note (the
                # counterfactuals say why the config is not chosen)
                out[b.config] = "" if saving <= 0 else (
                    f"{b.config.label()}: engine build not started: at the required rates of the last "
                    f"{HISTORY_S / 3600.0:g} h it would save ${saving:.2f}/h on average, the build costs "
                    f"${cost:.2f} (pays back in {cost / saving:.1f} h; the limit {PAYBACK_S / 3600.0:g} h)")
    return out


__all__ = ["HISTORY_S", "PAYBACK_S", "unpaid_builds"]
