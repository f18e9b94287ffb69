"""The length mix held over readings that show none. Pure.

Capacity at the SLO depends on the request-length mix (models/mix.py): a long-context model's
observed mix (prompt p99 ~80k tokens) gives a replica a third of the capacity the policy's
`workload` means do. A reading shows no mix when it is stale (a new replica's first window, a
scrape target down: planner/observation.py drops its partial numbers) or when the model was idle.
Falling back to the policy's `workload` then is a different model of the traffic every other cycle:
on the Mooncake long-context hour every scale-up made the next cycle stale, its plan sized configs
on the policy's mix and started replicas of another config, which the scale-down delay then kept
(12.5 -> 11.7 GPU-h when held). The last mix a reading showed is the better estimate of the same
traffic; it is held for HOLD_S, after which the policy's `workload` applies again.

>>> from fleetplan.planner.types import ModelObservation, Observation
>>> fresh = Observation({"m": ModelObservation("m", 3.0, isl=12000.0, osl=350.0)})
>>> obs, held = hold_lengths(fresh, (), lambda n: n, now_s=100.0)
>>> held[0].isl, held[0].t_s
(12000.0, 100.0)
>>> stale = Observation({"m": ModelObservation("m", 3.2, stale=True)})
>>> obs, held2 = hold_lengths(stale, held, lambda n: n, now_s=160.0)
>>> obs.models["m"].isl, obs.models["m"].rate_rps, held2 == held
(12000.0, 3.2, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from fleetplan.planner.types import HeldLengths, ModelObservation, Observation

HOLD_S = 3600.0  # a mix older than this is not held: the policy's `workload` applies


def _positive(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) and x > 0 else None


def _pairs(qs: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    return tuple((q, v) for q, v in qs if math.isfinite(q) and 0.0 <= q <= 1.0 and math.isfinite(v) and v >= 0)


def _shows_lengths(o: ModelObservation) -> bool:
    return not o.stale and (_positive(o.isl) is not None or bool(_pairs(o.isl_quantiles))
                            or bool(_pairs(o.osl_quantiles)))


def hold_lengths(observation: Observation, held: tuple[HeldLengths, ...], canonical: Callable[[str], str], *,
                 now_s: float) -> tuple[Observation, tuple[HeldLengths, ...]]:
    """(the observation with a held mix filled in where a model's reading shows none, the mixes to
    hold next cycle). `canonical`: a model name as the policy spells it (aliases). A reading that
    shows a mix replaces the held one whole (its means and quantiles belong together)."""
    last = {h.model: h for h in held if 0.0 <= now_s - h.t_s <= HOLD_S}
    models = dict(observation.models)
    for name, o in sorted(observation.models.items()):
        m = canonical(name)
        if _shows_lengths(o):
            # only what a stored state can hold again (a NaN or 0 mean is no mix; workloads_from
            # ignores it too)
            last[m] = HeldLengths(m, now_s, _positive(o.isl), _positive(o.osl), _pairs(o.isl_quantiles),
                                  _pairs(o.osl_quantiles), _positive(o.isl_p99_low))
            continue
        h = last.get(m)
        if h is not None:
            models[name] = replace(o, isl=h.isl, osl=h.osl, isl_quantiles=h.isl_quantiles,
                                   osl_quantiles=h.osl_quantiles, isl_p99_low=h.isl_p99_low)
    out = observation if models == dict(observation.models) else replace(observation, models=models)
    return out, tuple(last[m] for m in sorted(last))


def held_note(held: tuple[HeldLengths, ...], model: str, now_s: float) -> str | None:
    """The plan's note when `model` is sized on a held mix, e.g. 'length mix: held from the reading
    120 s ago (this one shows none: stale or idle)'; None: this cycle's reading showed its own (a mix
    read now is held from now) or none is held."""
    h = next((h for h in held if h.model == model), None)
    if h is None or h.t_s >= now_s:
        return None
    return (f"length mix: held from the reading {now_s - h.t_s:.0f} s ago (this cycle's reading shows "
            "none: stale or idle)")


__all__ = ["HOLD_S", "held_note", "hold_lengths"]
