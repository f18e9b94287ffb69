"""The replay runs the daemon's own decision path (fleetplan.sim.control, planner/cycle.py): the raw
readings of the replay's Prometheus interpreted by planner/observation.py, the plan, the brakes, the
act core, drains ended by act.drain_step. Only I/O is simulated."""

from __future__ import annotations

import math

from sim_policies import ONE_HOST_8B as POLICY

from fleetplan.planner import act
from fleetplan.planner.policy import load_policy_text
from fleetplan.sim.control import FleetplanController
from fleetplan.sim.des import FleetSim, SimSettings
from fleetplan.sim.evaluate import make_environment, profiles_from_ground_truth
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest


def _trace(segments: list[tuple[float, float]]) -> Trace:
    """Evenly spaced arrivals: (duration_s, rps) per segment; 500 tokens in, 50 out."""
    out, start = [], 0.0
    for dur, rps in segments:
        k = 0
        while k / rps < dur:
            out.append(TraceRequest(start + k / rps, 500, 50, "llama-3-8b"))
            k += 1
        start += dur
    return Trace("t", TraceFormat.AZURE, tuple(out))


def _world(cap_rps: float) -> tuple[object, object]:
    policy = load_policy_text(POLICY, "p")
    from fleetplan.sim.evaluate import candidates_for

    configs = candidates_for(policy, "llama-3-8b")
    profiles = profiles_from_ground_truth(configs, [(500, 50)] * 50, 500.0, 50.0, n=300,
                                          capacities={c: cap_rps for c in configs})
    return policy, profiles


def test_the_replay_reads_prometheus_answers_and_drains_through_drain_step() -> None:
    policy, profiles = _world(4.0)
    trace = _trace([(900.0, 90.0), (900.0, 15.0)])  # a step down: the fleet drains replicas
    ctl = FleetplanController("fleetplan", policy, profiles)  # type: ignore[arg-type]
    sim = FleetSim(trace, ctl, make_environment(policy), SimSettings())  # type: ignore[arg-type]
    res = sim.run()
    control = sim.control
    assert control is not None
    planned = [(t, d) for t, d in control.decisions if d.result is not None]
    assert len(planned) >= 1800 // 60 - 1  # one decision per cycle through planner.cycle.decide
    # the observed rate is what the engines' counters say over the window (interpreted, not given)
    seen = {round(t): d.result.explanation.models[0].observed_rps for t, d in planned if t > 0}
    assert seen[840] is not None and math.isclose(seen[840], 90.0, rel_tol=0.1)
    assert seen[1740] is not None and math.isclose(seen[1740], 15.0, rel_tol=0.1)
    # replicas were drained by the act core and stopped once drain_step saw 0 in flight twice
    drained = [r for r in sim.replicas if r.t_stop is not None and r.t_ready is not None]
    assert drained, "the step down drained nobody"
    s = control.s
    for r in drained:  # drained by a cycle (every 60 s), stopped after the settle and two polls
        assert r.t_stop % 60.0 >= s.drain_settle_s + s.drain_poll_s - 1e-9, r.t_stop
    assert res.drain_timeouts == 0
    assert res.rejected == 0 and res.unfinished == 0
    assert res.served == res.arrived == len(trace.requests)
    # the records hold exactly the engines still running
    live = {r.rid for r in sim.replicas if r.t_stop is None}
    assert set(control.rows) == live
    assert all(row.phase == act.Phase.DESIRED for row in control.rows.values())


def test_a_new_replicas_first_window_is_read_exactly_not_as_a_lower_bound() -> None:
    """A step up starts replicas: the cycles after each start read the window's true rate (the new
    replica counted from its start, planner/observation.py) instead of a fail-static lower bound;
    fail static is left only where a replica serves before Prometheus' first scrape of it."""
    policy, profiles = _world(4.0)
    trace = _trace([(600.0, 15.0), (900.0, 90.0)])
    ctl = FleetplanController("fleetplan", policy, profiles)  # type: ignore[arg-type]
    sim = FleetSim(trace, ctl, make_environment(policy), SimSettings())  # type: ignore[arg-type]
    control = sim.control
    assert control is not None
    control.keep_observations = True
    sim.run()
    starts = sorted(r.t_ready for r in sim.replicas if r.t_ready is not None and r.t_ready > 600.0)
    assert len(starts) >= 4, starts  # the step up started replicas
    after = [(t, obs) for t, obs in control.observations if 720.0 <= t <= 1500.0]
    assert after
    stale = [(t, obs.alerts) for t, obs in after if obs.models["llama-3-8b"].stale]
    assert all(any("serving but not scraped yet" in a for a in alerts) for _, alerts in stale), stale
    assert len(stale) <= len(after) // 3, stale
    for t, obs in after:  # the rate read over the 60 s window: the true 90 rps once the step is a window old
        m = obs.models["llama-3-8b"]
        if not m.stale and t >= 660.0:
            assert m.rate_rps is not None and math.isclose(m.rate_rps, 90.0, rel_tol=0.1), (t, m.rate_rps)


def _conversations(n_conv: int, turns: int, gap_s: float, rps: float) -> Trace:
    """Conversations whose turns resend the conversation so far (4 blocks of 512 tokens, one more per
    turn): a prefix cache serves most of every later turn's prompt."""
    out = []
    k = 0
    for turn in range(turns):
        for c in range(n_conv):
            blocks = tuple(1_000 * c + b for b in range(4 + turn))
            out.append(TraceRequest(turn * gap_s + k / rps, 512 * len(blocks), 50, "llama-3-8b", blocks))
            k += 1
        k = 0
    return Trace("t", TraceFormat.MOONCAKE, tuple(sorted(out, key=lambda r: r.t_s)))


def test_the_prefix_cache_is_observed_planned_with_and_routed_for() -> None:
    from fleetplan.sim.router import RouteMode

    policy, profiles = _world(4.0)
    trace = _conversations(n_conv=120, turns=6, gap_s=240.0, rps=2.0)
    runs = {}
    for routing in (RouteMode.LEAST_LOADED, RouteMode.AFFINITY):
        ctl = FleetplanController("fleetplan", policy, profiles)  # type: ignore[arg-type]
        sim = FleetSim(trace, ctl, make_environment(policy), SimSettings(routing=routing))  # type: ignore[arg-type]
        res = sim.run()
        assert sim.control is not None
        runs[routing] = (res, sim.control)
    res, control = runs[RouteMode.AFFINITY]
    assert res.prefix_hit_rate is not None and res.prefix_hit_rate > 0.3
    # the controller reads the hit rate from the engines' counters and plans with the prompt's cached share
    seen = [d.result.explanation.models[0].length_mix for _, d in control.decisions if d.result is not None]
    assert any("of prompt tokens cached" in text for text in seen), seen[-3:]
    # affinity keeps a conversation on the replica that holds its prefix
    plain, _ = runs[RouteMode.LEAST_LOADED]
    assert plain.prefix_hit_rate is not None and res.prefix_hit_rate >= plain.prefix_hit_rate
    # without the cache nothing is found
    ctl = FleetplanController("fleetplan", policy, profiles)  # type: ignore[arg-type]
    off = FleetSim(trace, ctl, make_environment(policy), SimSettings(prefix_cache=False)).run()  # type: ignore[arg-type]
    assert not off.prefix_hit_rate


BUILD_POLICY = """
version: 1
gpu_types: {h100: {price_usd_h: 2.0}}
hosts: [{name: h1, gpu: h100, gpu_count: 8}, {name: h2, gpu: h100, gpu_count: 8},
        {name: h3, gpu: h100, gpu_count: 8}]
engines:
  vllm: {launch: {command: vllm}, startup: {default_s: 30}}
  trtllm: {launch: {command: trtllm-serve}, startup: {default_s: 30}, build: {default_s: 300}}
scaling: {cycle_s: 60, scale_down_delay_s: 120, max_actions_per_cycle: 30, churn_cost_usd_h: 0}
models:
  - {name: llama-3-8b, slo: {ttft_p99_ms: 500, itl_p99_ms: 50}, allowed: {engines: [vllm, trtllm], tp: [1]},
     workload: {isl: 4000, osl: 100}, headroom: 0.1}
"""


def test_a_built_engine_serves_from_the_host_that_built_it() -> None:
    """The replay's agents hold the engines they built, as real ones do: after the TensorRT-LLM build
    on one host, its replicas start there only (none refused elsewhere), vLLM serves the rest."""
    from fleetplan.planner.types import Engine
    from fleetplan.sim.evaluate import candidates_for

    policy = load_policy_text(BUILD_POLICY, "p")
    configs = candidates_for(policy, "llama-3-8b")
    profiles = profiles_from_ground_truth(configs, [(4000, 100)] * 50, 500.0, 50.0, n=300)
    # 28 rps of 4000/100 tokens: 12 vLLM replicas (2.6 rps each at the SLO) or 9 TRT-LLM (3.6), one
    # more than the 8 GPUs of the host that builds the engine hold
    trace = Trace("t", TraceFormat.AZURE, tuple(TraceRequest(k / 28.0, 4000, 100, "llama-3-8b")
                                                 for k in range(1800 * 28)))
    sim = FleetSim(trace, FleetplanController("fleetplan", policy, profiles), make_environment(policy),
                   SimSettings())
    res = sim.run()
    assert res.builds == 1 and res.placement_conflicts == 0, res.notes
    built_on = {b.row.host for b in sim.sim_builds.values()}
    trt = {r.host for r in sim.replicas if r.config.engine == Engine.TRTLLM}
    assert trt == built_on, (trt, built_on)
    assert res.slo_attainment >= 0.98


def test_with_a_shared_engine_cache_one_build_serves_every_host() -> None:
    """Hosts that share one engine cache directory (`--shared-engine-cache`): the engine one host
    built is held by every host of its GPU type, as their agents find its manifest; TRT-LLM replicas
    then run beyond the builder's GPUs, from one build, and no start is refused."""
    from fleetplan.planner.types import Engine
    from fleetplan.sim.evaluate import candidates_for

    policy = load_policy_text(BUILD_POLICY, "p")
    profiles = profiles_from_ground_truth(candidates_for(policy, "llama-3-8b"), [(4000, 100)] * 50, 500.0, 50.0,
                                          n=300)
    trace = Trace("t", TraceFormat.AZURE, tuple(TraceRequest(k / 28.0, 4000, 100, "llama-3-8b")
                                                 for k in range(1800 * 28)))
    sim = FleetSim(trace, FleetplanController("fleetplan", policy, profiles), make_environment(policy),
                   SimSettings(shared_engine_cache=True))
    res = sim.run()
    assert res.builds == 1 and res.placement_conflicts == 0, res.notes
    built_on = {b.row.host for b in sim.sim_builds.values()}
    trt = {r.host for r in sim.replicas if r.config.engine == Engine.TRTLLM}
    assert trt > built_on, (trt, built_on)  # beyond the host that built it
    assert {(b.host, b.ready) for b in sim.cached()} == {(h.name, True) for h in make_environment(policy).hosts}
    assert res.slo_attainment >= 0.98


def test_the_warm_start_sizes_the_first_fleet_from_readings() -> None:
    """The replay's first fleet comes from what Prometheus would hold had the first window's traffic
    come one window earlier (a pre-roll target read through planner/cycle.py `observe`), not from
    the trace: its rate and lengths are the counters' and sized the fleet READY at t = 0."""
    policy, profiles = _world(4.0)
    trace = _trace([(900.0, 90.0)])
    ctl = FleetplanController("fleetplan", policy, profiles)  # type: ignore[arg-type]
    sim = FleetSim(trace, ctl, make_environment(policy), SimSettings())  # type: ignore[arg-type]
    obs = sim._preroll_observation()
    o = obs.models["llama-3-8b"]
    assert o.rate_rps is not None and math.isclose(o.rate_rps, 90.0, rel_tol=0.05), o.rate_rps
    assert o.isl is not None and math.isclose(o.isl, 500.0, rel_tol=0.01)
    assert o.osl is not None and math.isclose(o.osl, 50.0, rel_tol=0.01)
    res = sim.run()
    warm = [r for r in sim.replicas if r.t_start == 0.0 and r.t_ready == 0.0]
    assert len(warm) >= 2  # more than one replica's worth of traffic
    assert sim.replica_starts == 0  # steady traffic: the fleet read at t = 0 was the right one
    assert res.rejected == 0 and res.served == res.arrived


def _offsets(settings: SimSettings) -> dict[str, set[float]]:
    """Per target still scraped at the end of a step up, the offsets of its samples in the interval."""
    policy, profiles = _world(4.0)
    ctl = FleetplanController("fleetplan", policy, profiles)  # type: ignore[arg-type]
    sim = FleetSim(_trace([(600.0, 15.0), (600.0, 90.0)]), ctl, make_environment(policy), settings)  # type: ignore[arg-type]
    sim.run()
    return {rid: {x.t_s % settings.scrape_s for x in dq} for rid, dq in sim.prom.samples.items() if dq}


def test_each_target_is_scraped_at_its_own_offset_in_the_interval() -> None:
    """As Prometheus offsets each target by a hash of its labels: a target keeps one offset, and the
    fleet's targets do not all fall on one instant (a new replica's first scrape lands anywhere in
    the interval after its READY, not on the cycle's grid). One offset (the default): every target
    at once."""
    spread = _offsets(SimSettings(scrape_offsets=15))
    assert len(spread) >= 4
    assert all(len(o) == 1 for o in spread.values()), spread
    assert len({next(iter(o)) for o in spread.values()}) >= 2, spread
    lockstep = _offsets(SimSettings())
    assert {next(iter(o)) for o in lockstep.values()} == {0.0}, lockstep
