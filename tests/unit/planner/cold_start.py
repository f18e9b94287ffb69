"""A cold start replayed through `plan`, cycle after cycle: Poisson arrivals at a seeded rate, the
rate read over the observation's window as Prometheus' rate() reads it, a request-rate history, the
fleet's latency from a "true" profile as evidence, and a fleet that carries out the plan's actions
(a START is READY after the startup time, a DRAIN leaves the fleet). What a lab's cold start does,
without the lab: every number is deterministic for a seed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from planner_helpers import H100, VLLM, hosts, policy_dict

from fleetplan.models import profile as mp
from fleetplan.models.mix import LengthMix, predict_mix, scaled
from fleetplan.planner.core import plan
from fleetplan.planner.policy import Policy, load_policy_dict
from fleetplan.planner.types import (
    ActionKind,
    ConfigKey,
    ConfigObservation,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    PlannerState,
    Replica,
    ReplicaState,
)

T0 = 1_700_000_000.0
MODEL = "m8"
KEY = ConfigKey(MODEL, VLLM, H100, 1, mp.Precision.BF16)
ISL, OSL = 2000.0, 300.0
BASE = mp.PerfProfile(KEY, mp.PerfParams(s0_ms=9.0, s1_ms=0.05, s2_ms=0.0002, p0_ms=5.0, p1_ms=0.06,
                                         p2_ms=2e-7, q=1.0),
                      kv_tokens=400_000.0,
                      data_range=mp.DataRange((128.0, 4096.0), (64.0, 1024.0), (0.1, 20.0), None, 8))
# the engine as it runs: ~1.07 rps per replica at the SLO below, so that 0.89 rps x 1.2 headroom sits
# on the one/two-replica boundary (the lab's 0.8 rps with its profiles)
TRUTH = scaled(BASE, 0.5)
# the lab's windows (controller settings at a 20x time scale): an 8 s rate window is 160 s, the
# history every 2 s is every 40 s; its policy: 30 s cycles, 120 s scale-down delay, 40 s startup
WINDOW_S, HISTORY_STEP_S, CYCLE_S, STARTUP_S, DELAY_S = 160.0, 40.0, 30.0, 40.0, 120.0


def lab_policy(**scaling: float) -> Policy:
    d = policy_dict(models=(MODEL,), model_extra={MODEL: {
        "allowed": {"tp": [1], "engines": ["vllm"]}, "headroom": 0.2, "min_replicas": 1,
        "slo": {"ttft_p99_ms": 2000, "itl_p99_ms": 100}, "workload": {"isl": ISL, "osl": OSL}}},
        scaling={"cycle_s": CYCLE_S, "scale_down_delay_s": DELAY_S, **scaling})
    d["engines"]["vllm"]["startup"]["default_s"] = STARTUP_S
    return load_policy_dict(d, "cold-start-policy")


@dataclass
class Run:
    """What happened: (t, replica id, rate read) per start; (t, replica id, rate read, age since its
    start) per drain; the rate read and the live replicas per cycle."""

    starts: list[tuple[float, str, float]] = field(default_factory=list)
    drains: list[tuple[float, str, float, float]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def flip_flops(self, within_s: float) -> list[tuple[float, float]]:
        """(drain t, start t): a start that followed a drain within `within_s`, the fleet going back
        on a scale-down."""
        return [(td, ts) for td, *_ in self.drains for ts, *_ in self.starts if 0 < ts - td <= within_s]


def capacity_rps(policy: Policy | None = None) -> float:
    """One replica's capacity at the SLO as the planner sizes it (TRUTH as the profile)."""
    obs = Observation({MODEL: ModelObservation(MODEL, 1.0, ISL, OSL)})
    r = plan(obs, Fleet(hosts(1)), policy or lab_policy(), mp.ProfileSet((TRUTH,)), PlannerState.initial(), T0,
             counterfactuals=False)
    return r.explanation.models[0].configs[0].capacity_per_replica_rps


def arrivals(rng: np.random.Generator, rate_rps: Callable[[float], float], end_s: float) -> np.ndarray:
    """Poisson arrival times on (-WINDOW_S, end_s] at a rate that may change with time (thinning)."""
    top = max(rate_rps(t) for t in np.arange(-WINDOW_S, end_s, 10.0))
    n = rng.poisson(top * (end_s + WINDOW_S))
    t = np.sort(rng.uniform(-WINDOW_S, end_s, n))
    keep = rng.uniform(size=n) * top < np.array([rate_rps(x) for x in t])
    return np.asarray(t[keep])


def replay(seed: int, rate_rps: float | Callable[[float], float], *, minutes: float, policy: Policy | None = None,
           profile: mp.PerfProfile = TRUTH, fleet_hosts: Sequence[HostInventory] | None = None,
           p99_noise_ln: float = 0.1,
           events: Callable[[float, tuple[HostInventory, ...]], tuple[HostInventory, ...]] | None = None) -> Run:
    """A cold start: no replica at t = 0, traffic at `rate_rps` (a constant or a function of time) from
    one window before it; `plan` every CYCLE_S for `minutes`. The planner sizes with `profile`, the
    fleet's latency (its evidence) comes from TRUTH with lognormal noise `p99_noise_ln` on each p99.
    `events(t, hosts)`: the hosts at t (a host failing)."""
    rng = np.random.default_rng(seed)
    rate = rate_rps if callable(rate_rps) else (lambda _t, r=float(rate_rps): r)
    end = minutes * 60.0
    arr = arrivals(rng, rate, end)
    pol = policy or lab_policy()
    profiles = mp.ProfileSet((profile,))
    mix = LengthMix.single(ISL, OSL)
    fleet: dict[str, Replica] = {}
    started: dict[str, float] = {}
    state = PlannerState.initial()
    run = Run()
    inventory = tuple(fleet_hosts or hosts(1))

    def read(te: float) -> float:
        return float(np.count_nonzero((arr > te - WINDOW_S) & (arr <= te))) / WINDOW_S

    for k in range(int(end / CYCLE_S)):
        t = k * CYCLE_S
        now = T0 + t
        if events is not None:
            inventory = events(t, inventory)
        online = {h.name for h in inventory if h.online}
        for rid, r in list(fleet.items()):
            if r.state == ReplicaState.DRAINING or r.host not in online:
                del fleet[rid]  # drained, or gone with its host
            elif r.state == ReplicaState.STARTING and t >= started[rid] + STARTUP_S:
                fleet[rid] = replace(r, state=ReplicaState.READY, since_s=T0 + started[rid] + STARTUP_S)
        cur = read(t)
        history = tuple((T0 + tk, read(tk)) for tk in np.arange(0.0, t, HISTORY_STEP_S))
        full = [r for r in fleet.values() if r.state == ReplicaState.READY and r.since_s is not None
                and r.since_s <= now - WINDOW_S]
        evidence: tuple[ConfigObservation, ...] = ()
        if full and cur > 0:
            p = predict_mix(TRUTH, mix, cur / len(full))
            ttft, itl = (float(v * np.exp(rng.normal(0.0, p99_noise_ln))) for v in (p.ttft_p99_ms, p.itl_p99_ms))
            evidence = (ConfigObservation(KEY, len(full), cur, ttft, itl, cur * WINDOW_S),)
        obs = Observation({MODEL: ModelObservation(MODEL, cur, ISL, OSL, history=history,
                                                   history_window_s=WINDOW_S, rate_window_s=WINDOW_S,
                                                   configs=evidence)})
        res = plan(obs, Fleet(inventory, tuple(fleet.values())), pol, profiles, state, now, counterfactuals=False)
        state = res.next_state
        run.rates.append(cur)
        run.notes.extend(n for m in res.explanation.models for n in m.notes if "not yet proven" in n)
        for a in res.actions:
            if a.kind == ActionKind.START:
                rid = f"r{len(started) + 1}"
                fleet[rid] = replace(a.replica, replica_id=rid, state=ReplicaState.STARTING, since_s=now)
                started[rid] = t
                run.starts.append((t, rid, cur))
            elif a.kind == ActionKind.DRAIN:
                rid = a.replica.replica_id
                run.drains.append((t, rid, cur, t - started[rid]))
                fleet[rid] = replace(fleet[rid], state=ReplicaState.DRAINING)
        run.live.append(sum(1 for r in fleet.values() if r.state != ReplicaState.DRAINING))
    return run
