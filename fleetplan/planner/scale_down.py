"""When a running replica may go: the scale-down rules of a plan. Pure.

A scale-down is a bet that the demand stays low: a replica drained and needed again costs its whole
startup, and a rate read near a replica boundary swings with the window's Poisson noise from one
cycle to the next. Four rules keep the fleet from drain/start flip-flops:

1. **A replica proves itself first** (`unproven_floors`): a READY replica is not drained, for a
   scale-down or a swap, while it has been READY for less than its minimum age (policy
   `scaling.min_replica_age_s`; by default the largest of 60 s, its config's startup time and the
   model's rate window: the GPU time a restart costs, and a whole window of its own evidence), nor
   while its config's latency correction is still settling (`settling`), for at most
   SETTLE_AGES minimum ages. A replica still STARTING has served nothing: whether it is kept is
   rule 2's. A replica on a host that failed or is drained is no live replica of the plan
   (planner/core.py drops it from the usable fleet): it is replaced at once.
2. **Young replicas are not swapped away** (`young_floors`): for YOUNG_CYCLES cycles a replica goes
   only where its model's demand fell (a swap a few cycles later costs less than a start thrown away).
3. **The band** (`apply_band`): a model whose running replicas cover its required rate is sized for
   up to the rate estimate's own noise more: the width of the Poisson interval of the count its rate
   window or the scale-down delay holds, the longer (2 x BAND_Z / sqrt(rate x span), `noise_band`),
   at least the policy's
   `scale_down_band`, at most half a replica.
4. **The delay** (`hold_surplus`): a surplus must persist for `scaling.scale_down_delay_s`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from fleetplan.planner.capacity import CapacityInfo
from fleetplan.planner.correction import CONFIRMED_SD
from fleetplan.planner.counts import CountProblem, CountSolution
from fleetplan.planner.demand import Demand
from fleetplan.planner.placement import LIVE_STATES, Placement, _keep_order
from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey, Correction, Fleet, Replica, ReplicaState

__all__ = ["BAND_Z", "MIN_AGE_S", "SCALE_DOWN_BAND_REPLICAS", "SETTLE_AGES", "YOUNG_CYCLES", "Unproven", "apply_band",
           "hold_surplus", "min_age_s", "noise_band", "running_capacity", "settling", "unproven_floors",
           "young_floors"]

# The scale-down band is at most this fraction of the model's smallest running replica's capacity:
# a large fleet keeps at most one replica for it.
SCALE_DOWN_BAND_REPLICAS = 0.5
YOUNG_CYCLES = 3  # a replica started or ready for less than this many cycles is not swapped away
MIN_AGE_S = 60.0  # the least minimum age of a replica (policy scaling.min_replica_age_s unset)
# a settling correction protects a replica for at most this many minimum ages (a config whose
# windows never hold enough requests for evidence settles never)
SETTLE_AGES = 3.0
# the z of the rate's Poisson interval the scale-down band spans (`noise_band`): 2, a 95% interval
BAND_Z = 2.0


def running_capacity(current: Mapping[ConfigKey, int], capacities: Mapping[ConfigKey, CapacityInfo]) -> dict[str, float]:
    """Per model, the capacity (rps) of the replicas running now, at the configs' planned capacities."""
    out: dict[str, float] = {}
    for c, k in current.items():
        info = capacities.get(c)
        if info is not None and math.isfinite(info.max_rps):
            out[c.model] = out.get(c.model, 0.0) + info.max_rps * k
    return out


def min_age_s(policy: Policy, config: ConfigKey, rate_window_s: float | None) -> float:
    """How long a replica of `config` serves (READY) before it may be drained: the policy's
    `scaling.min_replica_age_s`, else the largest of MIN_AGE_S, the config's startup time (a drain
    that has to be undone costs that much GPU time: holding the replica as long costs no more) and
    the model's rate window (its load and latency are then a whole window of evidence).

    >>> from fleetplan.planner.policy import load_policy_dict
    >>> doc = {"gpu_types": {"h100": {"price_usd_h": 3}}, "engines": {"vllm": {"launch": {"command": "vllm"},
    ...        "startup": {"default_s": 90}}}, "models": [{"name": "m", "slo": {"ttft_p99_ms": 500,
    ...        "itl_p99_ms": 50}, "workload": {"isl": 500, "osl": 100}, "allowed": {"engines": ["vllm"]}}]}
    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
    >>> p = load_policy_dict(doc, "p")
    >>> min_age_s(p, k, 160.0), min_age_s(p, k, None)  # the rate window, then the startup
    (160.0, 90.0)
    """
    if policy.scaling.min_replica_age_s is not None:
        return policy.scaling.min_replica_age_s
    return max(MIN_AGE_S, policy.startup_s(config), rate_window_s or 0.0)


def settling(corrections: Mapping[ConfigKey, Correction], configs: Collection[ConfigKey]) -> frozenset[ConfigKey]:
    """The configs among `configs` whose latency correction (planner/correction.py) is still settling:
    no window of their own evidence yet, or an estimate whose sd is above CONFIRMED_SD (the filter's
    own "not yet confirmed": a capped step still walking toward the evidence, or a surprise it is
    following). A capacity that is still moving is no reason to drain a replica just started."""
    out = set()
    for c in configs:
        corr = corrections.get(c)
        if corr is None or corr.observations == 0 or max(corr.ttft_var, corr.itl_var) > CONFIRMED_SD ** 2:
            out.add(c)
    return frozenset(out)


@dataclass(frozen=True)
class Unproven:
    """The replicas of one config that have not proved themselves, and the floor they set."""

    floor: int  # the config keeps at least this many replicas (placement drains its youngest first)
    replicas: tuple[str, ...]  # their ids
    until_s: float | None  # when the last of them has proved itself (None: unknown)


def unproven_floors(fleet: Fleet, usable: Collection[str], now_s: float, min_age: Callable[[ConfigKey], float],
                    settling_configs: Collection[ConfigKey]) -> dict[ConfigKey, Unproven]:
    """Per config, the replicas that have not proved themselves (rule 1 of the module docstring) and
    the count it keeps for them: placement keeps READY replicas oldest first and drains the youngest
    (planner/placement.py), so a config keeps every replica up to its last unproven one. A READY
    replica of unknown age (since_s None, a restart's first reading) counts as proven.

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
    >>> old = Replica("a", k, "h1", (0,), ReplicaState.READY, 8000, 0.0)
    >>> new = Replica("b", k, "h1", (1,), ReplicaState.READY, 8001, 970.0)
    >>> unproven_floors(Fleet((), (old, new)), {"h1"}, 1000.0, lambda c: 60.0, ())[k]
    Unproven(floor=2, replicas=('b',), until_s=1030.0)
    >>> unproven_floors(Fleet((), (old, new)), {"h2"}, 1000.0, lambda c: 60.0, ())  # its host failed
    {}
    """
    by_config: dict[ConfigKey, list[Replica]] = {}
    for r in fleet.replicas:
        if r.state in LIVE_STATES and r.host in usable:
            by_config.setdefault(r.config, []).append(r)
    out: dict[ConfigKey, Unproven] = {}
    for c, reps in sorted(by_config.items()):
        age = min_age(c)
        protect = age * SETTLE_AGES if c in settling_configs else age
        floor = 0
        ids: list[str] = []
        until: float | None = -math.inf
        for i, r in enumerate(sorted(reps, key=_keep_order)):
            if r.state != ReplicaState.READY:
                # still starting: it has served nothing, so stopping it drains nothing (whether it
                # is kept is the young-replica rule's, young_floors). Flooring it kept the READY
                # replicas ahead of it too: azure x4 98.30% / 30.83 GPU-h against 99.54% / 30.24
                continue
            if r.since_s is not None and now_s - r.since_s < protect:
                floor = i + 1
                ids.append(r.replica_id)
                if until is not None:
                    until = max(until, r.since_s + protect)
        if floor:
            out[c] = Unproven(floor, tuple(ids), until)
    return out


def young_floors(fleet: Fleet, usable: Collection[str], demands: Mapping[str, Demand],
                 capacities: Mapping[ConfigKey, CapacityInfo], current: Mapping[ConfigKey, int],
                 now_s: float, young_s: float) -> dict[ConfigKey, int]:
    """Per config, how many of its replicas started (or READY) less than `young_s` ago are kept (as
    CountProblem.young: no saving takes them away, demand that needs their GPUs does): a
    replica started in one cycle is not drained in the next few unless its model's demand fell,
    i.e. unless the model's running capacity covers its required rate without it (a scale-down,
    which the scale-down rules govern); a drain that would need a replacement (a swap) waits.
    Why: at a cold start the first plan sizes the fleet for the policy's default length mix, the
    next one for the observed mix, and the first TensorRT-LLM replica was replaced within ~15 s of
    starting; a swap a few cycles later costs less than a start thrown away.

    >>> from fleetplan.models.names import Engine, GpuType, Precision
    >>> k = ConfigKey("m", Engine.TRTLLM, GpuType("h100"), 4, Precision.BF16)
    >>> r1, r2 = (Replica(f"r{i}", k, "h1", (i,), ReplicaState.STARTING, 8000 + i, 990.0) for i in (1, 2))
    >>> d = Demand("m", 3.0, 3.0, 3.0, 3.6, True, ())
    >>> floors = young_floors(Fleet((), (r1,)), {"h1"}, {"m": d}, {k: CapacityInfo(8.0, "itl")}, {k: 1}, 1000.0, 90.0)
    >>> list(floors.values())  # without it nothing serves the 3.6 rps: a drain would be a swap
    [1]
    >>> floors = young_floors(Fleet((), (r1, r2)), {"h1"}, {"m": d}, {k: CapacityInfo(8.0, "itl")}, {k: 2}, 1000.0, 90.0)
    >>> list(floors.values())  # demand fell below one replica: one of the two may go
    [1]
    """
    surplus = running_capacity(current, capacities)
    for m, dm in demands.items():
        surplus[m] = surplus.get(m, 0.0) - dm.required_rps

    def cap_of(r: Replica) -> float:
        info = capacities.get(r.config)
        return info.max_rps if info is not None else 0.0

    young = [r for r in fleet.replicas if r.state in LIVE_STATES and r.host in usable
             and (r.state != ReplicaState.READY or (r.since_s is not None and now_s - r.since_s < young_s))]
    out: dict[ConfigKey, int] = {}
    for r in sorted(young, key=lambda r: (-cap_of(r), r.replica_id)):
        known = demands.get(r.config.model)
        if known is None or not known.known:
            continue  # fail static has its own floor
        cap = cap_of(r)
        if math.isfinite(cap) and cap <= surplus.get(r.config.model, 0.0):
            surplus[r.config.model] -= cap  # surplus: demand fell, this one may go
            continue
        out[r.config] = out.get(r.config, 0) + 1
    return out


def noise_band(rate_rps: float | None, window_s: float | None) -> float | None:
    """The width of the rate's Poisson interval, relative to the rate: a rate read over a window of
    W seconds at λ rps counts n = λW requests, whose sd is sqrt(n), so the true rate lies within
    BAND_Z / sqrt(n) of the reading (the interval's half-width), and the readings after a
    scale-down scatter as much around the true rate. A smaller fleet that covers the reading plus
    both (2 x BAND_Z / sqrt(n)) is not called back by the next high reading: with the half-width
    alone, a noisy cold start replayed 30 minutes at 8 seeds still drained and restarted once
    (tests/unit/planner/test_cold_start.py). None: the rate or its window is unknown, or nothing
    arrived.

    >>> round(noise_band(0.8, 160.0), 3)  # the lab's cold start: 128 requests in the window
    0.354
    >>> round(noise_band(30.0, 60.0), 3)  # 1,800 requests: under the policy's 10%
    0.094
    """
    if rate_rps is None or window_s is None or not (rate_rps > 0 and window_s > 0):
        return None
    return 2.0 * BAND_Z / math.sqrt(rate_rps * window_s)


def apply_band(demands: dict[str, Demand], current: Mapping[ConfigKey, int],
               capacities: Mapping[ConfigKey, CapacityInfo], floor: float, unknown_rps: float,
               delay_s: float = 0.0) -> None:
    """Hysteresis: a model whose running replicas cover its required rate is sized for up to `band`
    more, never more than what runs, so it scales down only when the smaller fleet keeps that margin.
    The band is the rate's own noise (`noise_band` of its observed rate over its rate window or the
    scale-down delay `delay_s`, the longer: every reading over the delay must show the surplus), at
    least `floor` (policy scaling.scale_down_band, default 0.1: the rate also wanders beyond Poisson
    counting; the fault suite saw 1.37 -> 1.47 rps against 1.44 rps of two replicas), and the margin
    is at most half the smallest running replica (a large fleet keeps no more than one replica for
    it). Scale-up is unchanged: the band never asks for more than runs now. Without it a rate
    hovering at a replica boundary drains a replica one cycle and starts one the next: at 0.8 rps a
    160 s window holds ~128 requests and swings +/-20% between cycles, twice a 10% band (the band
    there: 35%).

    Example: required 1.37 rps, 3 replicas of 0.72 rps run (2.16), band 10%: sized for
    min(1.37 x 1.1, 2.16) = 1.51 rps, which 2 replicas (1.44) do not cover, so 3 stay until the
    rate falls below 1.31. `unknown_rps`: the capacity of a config nothing is known about."""
    cap_now: dict[str, float] = {}
    replica_min: dict[str, float] = {}
    for c, k in current.items():
        info = capacities.get(c)
        if info is not None and math.isfinite(info.max_rps) and info.max_rps > unknown_rps:
            cap_now[c.model] = cap_now.get(c.model, 0.0) + info.max_rps * k
            replica_min[c.model] = min(replica_min.get(c.model, math.inf), info.max_rps)
    for name, d in demands.items():
        cap = cap_now.get(name, 0.0)
        if d.known and 0.0 < d.required_rps <= cap:
            # the readings a scale-down rests on span the delay (its surplus must persist that long),
            # at least one rate window
            span = max(d.rate_window_s, delay_s) if d.rate_window_s is not None else None
            noise = noise_band(d.observed_rps, span)
            band = max(floor, noise or 0.0)
            margin = min(d.required_rps * band, SCALE_DOWN_BAND_REPLICAS * replica_min[name])
            notes = d.notes
            if noise is not None and noise > floor:
                notes = (*notes, f"scale-down band {100.0 * band:.0f}%: the rate's Poisson interval "
                                 f"({d.observed_rps or 0.0:.2f} rps x {span or 0.0:.0f} s = "
                                 f"{(d.observed_rps or 0.0) * (span or 0.0):.0f} requests; "
                                 f"floor {100.0 * floor:.0f}%)")
            demands[name] = replace(d, plan_rps=min(d.required_rps + margin, cap), notes=notes)


Solve = Callable[[CountProblem], tuple[CountSolution, Placement]]


@dataclass(frozen=True)
class Held:
    """The plan for now after the scale-down delay, and the surplus clocks for the next state."""

    problem: CountProblem
    solution: CountSolution
    placement: Placement
    surplus_since_s: dict[ConfigKey, float]
    note: str | None


def hold_surplus(policy: Policy, demands: Mapping[str, Demand], current: Mapping[ConfigKey, int],
                 capacities: Mapping[ConfigKey, CapacityInfo], surplus_prev: Mapping[ConfigKey, float],
                 below_reach: Collection[ConfigKey], now_s: float, problem: CountProblem,
                 solution: CountSolution, placement: Placement, solve: Solve) -> Held:
    """The scale-down delay: surplus replicas are held until the surplus has persisted for
    `scaling.scale_down_delay_s`. When the rate history covers the delay the DEMAND is held (the
    plan serves the highest rate level of the last delay x (1 + headroom), at most what runs now),
    so the fleet steps down as that window slides instead of all at once when a surplus clock runs
    out; else the replica counts are held. A config short of the best reach is no capacity the
    demand may need again: not held (it still serves until its replacements are READY)."""
    surplus_next: dict[ConfigKey, float] = {}
    held: dict[ConfigKey, int] = {}
    delay = policy.scaling.scale_down_delay_s
    for c, k in sorted(current.items()):
        if solution.counts.get(c, 0) < k and c not in below_reach:
            since = surplus_prev.get(c, now_s)
            surplus_next[c] = since
            if now_s - since < delay:
                held[c] = k
    held_models = {c.model for c in held}
    if not held:
        return Held(problem, solution, placement, surplus_next, None)
    if all(demands[m].hold_rps is not None for m in held_models):
        cap_now = running_capacity(current, capacities)
        md = []
        for x in problem.demands:
            d = demands[x.model]
            if x.model in held_models and d.hold_rps is not None:
                mp_ = policy.model(x.model)
                hr = mp_.headroom if mp_ is not None else 0.0
                hold_req = min(d.hold_rps * (1 + hr), cap_now.get(x.model, 0.0))
                x = replace(x, required_rps=max(x.required_rps, hold_req))
            md.append(x)
        problem = replace(problem, demands=tuple(md))
        note = (f"scale-down delayed ({delay:.0f} s): sized for the highest rate level of the last "
                f"{delay:.0f} s for " + ", ".join(sorted(held_models)))
    else:
        # hold every running config whose surplus clock has not run out (not only the ones the ideal
        # plan cut: with those held, the solver might otherwise cut a config that was never surplus)
        floors = dict(problem.floors)
        for c, k in current.items():
            started = surplus_prev.get(c)
            if (started is None or now_s - started < delay) and c not in below_reach:
                floors[c] = max(floors.get(c, 0), k)
        problem = replace(problem, floors=floors)
        note = f"scale-down delayed ({delay:.0f} s) for " + ", ".join(
            f"{c.label()} (surplus for {now_s - surplus_next[c]:.0f} s)" for c in sorted(held))
    solution, placement = solve(problem)
    return Held(problem, solution, placement, surplus_next, note)
