"""plan_with_capacities(): cost-optimal counts, lead times, fail static, scale-down delay, actions."""

from __future__ import annotations

import json
from dataclasses import replace

from planner_helpers import A100, TRT, VLLM, caps, hosts, key, observe, policy

from fleetplan.planner.core import plan_to_dict, plan_with_capacities
from fleetplan.planner.types import ActionKind, Fleet, PlannerState, Replica, ReplicaState

NOW = 1_700_000_000.0
CAPS = caps({key("m8", VLLM, tp=1): 10.0, key("m8", TRT, tp=1): 14.0, key("m8", VLLM, tp=2): 18.0,
             key("m70", VLLM, tp=4): 4.0, key("m70", TRT, tp=4): 6.0, key("m70", VLLM, tp=8): 7.0})


def _counts(plan: object) -> dict[tuple[str, str, int], int]:
    return {(c.config.model, c.config.engine.value, c.config.tp): c.replicas for c in plan.counts}  # type: ignore[attr-defined]


def test_cheapest_fleet_meeting_demand_with_cached_engines() -> None:
    p = policy(tps={"m8": [1, 2], "m70": [4, 8]}, cached=[("m8", "h100", 1), ("m70", "h100", 4)])
    r = plan_with_capacities(observe({"m8": 40.0, "m70": 11.0}), Fleet(hosts(2)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 3, ("m70", "trtllm", 4): 2}
    assert r.plan == r.target
    assert [a.kind for a in r.actions] == [ActionKind.START] * 5
    e = r.explanation
    assert e.solver[0].status == "OPTIMAL" and e.solver[0].gap is not None and e.solver[0].gap <= 1e-6
    m8 = e.models[0]
    assert m8.capacity_rps == 42.0 and m8.unmet_rps == 0.0 and m8.usd_h == 9.0
    json.dumps(plan_to_dict(r))  # JSON-able


def test_uncached_trtllm_serves_on_vllm_now_and_builds() -> None:
    p = policy(tps={"m8": [1, 2], "m70": [4, 8]})
    r = plan_with_capacities(observe({"m8": 40.0, "m70": 11.0}), Fleet(hosts(4)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert all(c.config.engine == VLLM for c in r.plan.counts)
    assert _counts(r.target) == {("m8", "trtllm", 1): 3, ("m70", "trtllm", 4): 2}
    builds = [a for a in r.actions if a.kind == ActionKind.BUILD]
    assert {(a.replica.config.model, a.replica.config.tp) for a in builds} == {("m8", 1), ("m70", 4)}
    assert all(len(a.replica.gpu_indices) == a.replica.config.tp for a in builds)
    kinds = [a.kind for a in r.actions]
    assert kinds == sorted(kinds, key=[ActionKind.START, ActionKind.BUILD].index)  # starts first, then builds
    assert r.explanation.models[0].capacity_rps >= 40.0


def test_build_in_progress_is_not_restarted_and_ready_build_is_used() -> None:
    from fleetplan.planner.types import EngineBuild

    p = policy(tps={"m8": [1], "m70": [4]})
    running = EngineBuild("m8", TRT, key("m8").gpu, 1, key("m8").precision, "h00", False, NOW + 100)
    r = plan_with_capacities(observe({"m8": 20.0, "m70": 0.0}), Fleet(hosts(1), (), (running,)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert not [a for a in r.actions if a.kind == ActionKind.BUILD and a.replica.config.model == "m8"]
    done = EngineBuild("m8", TRT, key("m8").gpu, 1, key("m8").precision, "h00", True, None)
    r = plan_with_capacities(observe({"m8": 20.0, "m70": 0.0}), Fleet(hosts(1), (), (done,)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 2}


def test_infeasible_is_best_effort_by_priority() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1), ("m70", "h100", 4)],
               model_extra={"m70": {"priority": 50}, "m8": {"priority": 1}})
    r = plan_with_capacities(observe({"m8": 100.0, "m70": 10.0}), Fleet(hosts(1)), p, CAPS,
                             PlannerState.initial(), NOW)
    c = _counts(r.plan)
    assert c[("m70", "trtllm", 4)] == 2  # high priority fully served first
    assert r.plan.gpus == 8
    m8, m70 = r.explanation.models
    assert m70.unmet_rps == 0.0 and m8.unmet_rps > 50.0
    assert any("best effort" in n for n in m8.notes)
    assert any("inventory h100" in b for b in r.explanation.binding_constraints)


def test_budget_min_and_max_replicas() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], budget={"max_usd_h": 12.0},
               model_extra={"m70": {"min_replicas": 1, "allowed": {"tp": [4], "engines": ["vllm"]}},
                            "m8": {"max_replicas": 2}})
    r = plan_with_capacities(observe({"m8": 100.0, "m70": 0.0}), Fleet(hosts(2)), p, CAPS,
                             PlannerState.initial(), NOW)
    c = _counts(r.plan)
    assert c == {("m70", "vllm", 4): 1} or r.plan.usd_h <= 12.0
    assert r.plan.usd_h <= 12.0
    assert c.get(("m70", "vllm", 4)) == 1
    assert sum(v for k, v in c.items() if k[0] == "m8") <= 2


def _running(model: str, engine: object, tp: int, host: str, first: int, state: ReplicaState = ReplicaState.READY,
             rid: str | None = None) -> Replica:
    k = key(model, engine, tp=tp)  # type: ignore[arg-type]
    idx = tuple(range(first, first + tp))
    return Replica(rid or f"{model}-{host}-{first}", k, host, idx, state, 8000 + first, NOW - 3600)


def test_running_replicas_stay_in_place_and_fail_static_keeps_them() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1), ("m70", "h100", 4)])
    current = (_running("m8", TRT, 1, "h01", 5), _running("m8", TRT, 1, "h01", 6), _running("m8", TRT, 1, "h01", 7))
    fleet = Fleet(hosts(2), current)
    # demand for m8 unknown (stale): no scale-down even though the rate says 1 replica would do
    r = plan_with_capacities(observe({"m8": 5.0, "m70": 0.0}, stale=["m8"]), fleet, p, CAPS,
                             PlannerState.initial(), NOW)
    assert set(current) <= set(r.plan.replicas)
    assert not [a for a in r.actions if a.kind in (ActionKind.DRAIN, ActionKind.STOP)]
    assert any("fail static" in n for n in r.explanation.models[0].notes)
    # no observation at all: same
    r = plan_with_capacities(observe({"m70": 0.0}), fleet, p, CAPS, PlannerState.initial(), NOW)
    assert set(current) <= set(r.plan.replicas)


def test_scale_down_waits_for_the_delay_and_drains_before_stopping() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], scaling={"scale_down_delay_s": 300})
    current = tuple(_running("m8", TRT, 1, "h00", i) for i in range(4))
    fleet = Fleet(hosts(1), current)
    obs = observe({"m8": 12.0, "m70": 0.0})
    r1 = plan_with_capacities(obs, fleet, p, CAPS, PlannerState.initial(), NOW)
    assert len(r1.plan.replicas) == 4 and not r1.actions
    assert any("scale-down delayed" in n for n in r1.explanation.notes)
    r2 = plan_with_capacities(obs, fleet, p, CAPS, r1.next_state, NOW + 200)
    assert len(r2.plan.replicas) == 4
    r3 = plan_with_capacities(obs, fleet, p, CAPS, r2.next_state, NOW + 301)
    assert len(r3.plan.replicas) == 1
    kinds = [a.kind for a in r3.actions]
    assert kinds == [ActionKind.DRAIN] * 3 + [ActionKind.STOP] * 3
    kept = r3.plan.replicas[0]
    assert kept in current  # kept in place, same id
    # demand rises again: the surplus clock resets
    r4 = plan_with_capacities(observe({"m8": 50.0, "m70": 0.0}), fleet, p, CAPS, r2.next_state, NOW + 301)
    assert r4.next_state.surplus_since_s == ()


def test_switch_engine_starts_before_stops_and_caps_actions_per_cycle() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], scaling={"max_actions_per_cycle": 3})
    current = tuple(_running("m8", VLLM, 1, "h00", i) for i in range(4))
    # 38 rps: 3 TRT-LLM replicas (42) keep the scale-down band's margin (38 + 3.8)
    r = plan_with_capacities(observe({"m8": 38.0, "m70": 0.0}), Fleet(hosts(1), current), p, CAPS,
                             PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 3}
    # make-before-break: the vLLM replicas keep serving while their replacements start
    order = [a.kind for a in (*r.actions, *r.deferred_actions)]
    assert order == [ActionKind.START] * 3
    assert len(r.actions) == 3 and not r.deferred_actions
    assert any("make-before-break" in n for n in r.explanation.notes)
    # new replicas never land on GPUs still held by the replicas being replaced
    held = {i for x in current for i in x.gpu_indices}
    assert all(not (set(a.replica.gpu_indices) & held) for a in r.actions)
    # once the replacements are READY the old replicas are drained (start before stop, capped)
    new = tuple(replace(a.replica, state=ReplicaState.READY, since_s=NOW + 60) for a in r.actions)
    r2 = plan_with_capacities(observe({"m8": 38.0, "m70": 0.0}), Fleet(hosts(1), current + new), p, CAPS,
                              r.next_state, NOW + 120)
    order = [a.kind for a in (*r2.actions, *r2.deferred_actions)]
    assert order == [ActionKind.DRAIN] * 4 + [ActionKind.STOP] * 4
    assert len(r2.actions) == 3 and len(r2.deferred_actions) == 5


def test_a_swap_on_a_full_host_rolls_one_replica_at_a_time() -> None:
    # 4 GPUs, all held by vLLM TP1 (4 x 10 rps); 3 TRT-LLM TP1 (42 rps) serve 38 rps on fewer GPUs, but
    # they can only start on the GPUs the vLLM replicas leave: all four drained at once left nothing
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)])
    current = tuple(_running("m8", VLLM, 1, "h00", i) for i in range(4))
    fleet = Fleet(hosts(1, count=4), current)
    r = plan_with_capacities(observe({"m8": 38.0, "m70": 0.0}), fleet, p, CAPS, PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 3}
    acts = [*r.actions, *r.deferred_actions]
    drains = [a for a in acts if a.kind is ActionKind.DRAIN]
    assert len(drains) == 1  # one out of service; 30 rps keep serving
    starts = [a for a in acts if a.kind is ActionKind.START]
    assert starts and all(set(a.replica.gpu_indices) <= set(drains[0].replica.gpu_indices) for a in starts)
    # next cycle: that one is draining, its replacement not READY: no second drain yet
    draining = replace(drains[0].replica, state=ReplicaState.DRAINING)
    rest = tuple(x for x in current if x.replica_id != draining.replica_id)
    r2 = plan_with_capacities(observe({"m8": 38.0, "m70": 0.0}), Fleet(hosts(1, count=4), (*rest, draining)), p,
                              CAPS, r.next_state, NOW + 60)
    assert not [a for a in (*r2.actions, *r2.deferred_actions) if a.kind is ActionKind.DRAIN]


def test_maintenance_window_drains_host_and_offline_host_is_replaced() -> None:
    sched = [{"name": "m", "cron": "0 * * * *", "duration_s": 3600, "override": {"drain_hosts": ["h00"]}}]
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], schedules=sched)
    current = (_running("m8", TRT, 1, "h00", 0),)
    r = plan_with_capacities(observe({"m8": 10.0, "m70": 0.0}), Fleet(hosts(2), current), p, CAPS,
                             PlannerState.initial(), NOW)
    assert all(x.host == "h01" for x in r.plan.replicas)
    # make-before-break: the replica on h00 serves until its replacement on h01 is READY
    assert [a.kind for a in r.actions] == [ActionKind.START]
    moved = replace(r.actions[0].replica, state=ReplicaState.READY, since_s=NOW + 60)
    r2 = plan_with_capacities(observe({"m8": 10.0, "m70": 0.0}), Fleet(hosts(2), (*current, moved)), p, CAPS,
                              r.next_state, NOW + 120)
    assert [a.kind for a in r2.actions] == [ActionKind.DRAIN, ActionKind.STOP]
    assert "maintenance" in r2.actions[0].reason


def test_failed_replicas_are_stopped_and_replaced() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)])
    bad = _running("m8", TRT, 1, "h00", 0, ReplicaState.FAILED)
    r = plan_with_capacities(observe({"m8": 10.0, "m70": 0.0}), Fleet(hosts(1), (bad,)), p, CAPS,
                             PlannerState.initial(), NOW)
    # the failed replica's GPUs are free once it is stopped: stop first, then start there
    assert [a.kind for a in r.actions] == [ActionKind.STOP, ActionKind.START]
    assert r.actions[0].replica == bad and "failed" in r.actions[0].reason


def test_mixed_gpus_pick_the_cheaper_type_when_it_meets_the_slo() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, prices={"h100": 3.0, "a100": 1.8},
               cached=[("m8", "h100", 1), ("m8", "a100", 1)])
    table = {**CAPS, **caps({key("m8", VLLM, A100, 1): 7.0})}
    inv = (*hosts(1), *hosts(1, A100, prefix="a"))
    r = plan_with_capacities(observe({"m8": 20.0, "m70": 0.0}), Fleet(inv), p, table, PlannerState.initial(), NOW)
    # h100 trt 14 rps for $3, a100 vllm 7 rps for $1.8: 20 rps = 1 + 1 ($4.8) beats 2x h100 ($6), 3x a100 ($5.4)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 1, ("m8", "vllm", 1): 1}
    assert {x.config.gpu for x in r.plan.replicas} == {A100, key("m8").gpu}
    assert r.plan.usd_h == 4.8


def test_deterministic() -> None:
    p = policy(tps={"m8": [1, 2], "m70": [4, 8]}, cached=[("m8", "h100", 1)])
    args = (observe({"m8": 63.0, "m70": 13.0}), Fleet(hosts(3)), p, CAPS, PlannerState.initial(), NOW)
    a, b = plan_with_capacities(*args), plan_with_capacities(*args)
    da, db = plan_to_dict(a), plan_to_dict(b)
    for d in (da, db):
        for s in d["explanation"]["solver"]:
            s["wall_s"] = 0
        d["explanation"]["solve_s"] = 0
    assert da == db


def test_fragmented_hosts_are_repaired_with_few_moves_when_new_tp_groups_do_not_fit() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1), ("m70", "h100", 4)])
    islands = ((0, 1, 2, 3), (4, 5, 6, 7))
    inv = hosts(2, groups=islands)
    current = (_running("m8", TRT, 1, "h00", 1), _running("m8", TRT, 1, "h00", 5),
               _running("m8", TRT, 1, "h01", 2), _running("m8", TRT, 1, "h01", 6))
    r = plan_with_capacities(observe({"m8": 20.0, "m70": 17.0}), Fleet(inv, current), p, CAPS,
                             PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 2, ("m70", "trtllm", 4): 3}
    assert all(m.unmet_rps == 0 for m in r.explanation.models)
    for x in r.plan.replicas:
        assert any(set(x.gpu_indices) <= set(g) for g in islands)
    starts = [a for a in r.actions if a.kind == ActionKind.START]
    stops = [a for a in r.actions if a.kind == ActionKind.STOP]
    # 2 surplus TP1 replicas go; one kept TP1 moves out of the way of a TP4 group (its replacement
    # starts now; it stops once that is READY: make-before-break, and the TP4 group that needs its
    # GPUs waits for that); one stays put
    assert len(stops) == 2 and len(starts) == 3
    assert any("make-before-break: kept serving until their replacements are READY: m8 x1" in n
               for n in r.explanation.notes)
    assert len(set(current) & set(r.plan.replicas)) == 1
    # starts that need GPUs of a replica being stopped come after that stop
    pos = {id(a): i for i, a in enumerate(r.actions)}
    for s in starts:
        for t in stops:
            if t.replica.host == s.replica.host and set(t.replica.gpu_indices) & set(s.replica.gpu_indices):
                assert pos[id(t)] < pos[id(s)]


def test_long_names_give_valid_protocol_ids() -> None:
    from fleetplan.planner.placement import new_replica_id

    long = key("x" * 80)
    a = new_replica_id(long, "host.example.com", (0, 1))
    b = new_replica_id(long, "host.example.com", (2, 3))
    assert a != b and len(a) <= 64 and "." not in a


def test_gpus_of_a_running_build_stay_free_and_max_replicas_is_reported_binding() -> None:
    from fleetplan.planner.types import EngineBuild

    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)],
               model_extra={"m8": {"max_replicas": 4}})
    build = EngineBuild("m70", TRT, key("m70").gpu, 4, key("m70").precision, "h00", False, NOW + 600,
                        (0, 1, 2, 3))
    r = plan_with_capacities(observe({"m8": 200.0, "m70": 0.0}), Fleet(hosts(1), (), (build,)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert len(r.plan.replicas) == 4
    assert all(set(x.gpu_indices) <= {4, 5, 6, 7} for x in r.plan.replicas)
    assert any(b.startswith("max_replicas m8") for b in r.explanation.binding_constraints)


def test_scale_down_delay_holds_configs_that_were_never_surplus_too() -> None:
    p = policy(tps={"m8": [1, 2], "m70": [4]}, cached=[("m8", "h100", 1)], scaling={"scale_down_delay_s": 300})
    current = (_running("m8", VLLM, 2, "h00", 0), _running("m8", VLLM, 2, "h00", 2),
               _running("m8", TRT, 1, "h00", 4), _running("m8", TRT, 1, "h00", 5))
    # 40 rps: one vLLM TP2 and two TRT-LLM TP1 (46) keep the scale-down band's margin (40 + 4)
    r = plan_with_capacities(observe({"m8": 40.0, "m70": 0.0}), Fleet(hosts(1), current), p, CAPS,
                             PlannerState.initial(), NOW)
    assert not [a for a in r.actions if a.kind in (ActionKind.DRAIN, ActionKind.STOP)]
    assert set(current) <= set(r.plan.replicas)
    later = plan_with_capacities(observe({"m8": 40.0, "m70": 0.0}), Fleet(hosts(1), current), p, CAPS,
                                 r.next_state, NOW + 400)
    assert [a.kind for a in later.actions] == [ActionKind.DRAIN, ActionKind.STOP]


def test_a_rate_at_a_replica_boundary_does_not_drain_one_cycle_and_start_the_next() -> None:
    # 4 TRT-LLM TP1 replicas of 14 rps; the rate wanders 40.5 <-> 41.5 rps around 3 replicas' 42
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], scaling={"scale_down_delay_s": 0})
    current = tuple(_running("m8", TRT, 1, "h00", i) for i in range(4))
    state = PlannerState.initial()
    for i, rate in enumerate((41.5, 40.5, 41.5, 40.5)):
        r = plan_with_capacities(observe({"m8": rate, "m70": 0.0}), Fleet(hosts(1), current), p, CAPS, state,
                                 NOW + 30 * i)
        state = r.next_state
        assert _counts(r.plan) == {("m8", "trtllm", 1): 4}, rate  # within the band: no drain
    r = plan_with_capacities(observe({"m8": 30.0, "m70": 0.0}), Fleet(hosts(1), current), p, CAPS, state, NOW + 150)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 3}  # clear of the band: one replica goes
    # the band never adds a replica: 3 running, 41.5 rps -> 3 (42 covers it)
    three = current[:3]
    r = plan_with_capacities(observe({"m8": 41.5, "m70": 0.0}), Fleet(hosts(1), three), p, CAPS,
                             PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 3}
    # scaling.scale_down_band: 0 turns it off: 40.5 rps then drains one at once
    off = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)],
                 scaling={"scale_down_delay_s": 0, "scale_down_band": 0})
    r = plan_with_capacities(observe({"m8": 40.5, "m70": 0.0}), Fleet(hosts(1), current), off, CAPS,
                             PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 3}


def test_scale_down_delay_with_history_holds_the_recent_demand_and_steps_down() -> None:
    from fleetplan.planner.types import ModelObservation, Observation

    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], scaling={"scale_down_delay_s": 300})
    current = tuple(_running("m8", TRT, 1, "h00", i) for i in range(4))  # 4 x 14 rps
    fleet = Fleet(hosts(1), current)

    def rate(t: float) -> float:  # 45 rps, then 30 rps from now - 360, then 8 rps from now - 100
        return 45.0 if t < NOW - 360 else 30.0 if t < NOW - 100 else 8.0

    hist = tuple((NOW - 1800 + 30 * i, rate(NOW - 1800 + 30 * i)) for i in range(61))
    obs = Observation({"m8": ModelObservation("m8", 8.0, 500.0, 200.0, history=hist),
                       "m70": ModelObservation("m70", 0.0, 500.0, 200.0)})
    r = plan_with_capacities(obs, fleet, p, CAPS, PlannerState.initial(), NOW)
    # the ideal plan wants 1 replica; the hold serves the highest level of the last 300 s (30 rps x
    # 1.2 = 36 rps -> 3 replicas) instead of all 4: the fleet steps down
    assert len(r.plan.replicas) == 3
    assert any("highest rate level of the last 300 s" in n for n in r.explanation.notes)
    assert [a.kind for a in r.actions] == [ActionKind.DRAIN, ActionKind.STOP]
    # without a history covering the delay the replica counts are held (4)
    r0 = plan_with_capacities(observe({"m8": 8.0, "m70": 0.0}), fleet, p, CAPS, PlannerState.initial(), NOW)
    assert len(r0.plan.replicas) == 4


def test_make_before_break_drains_only_what_ready_capacity_can_spare() -> None:
    p = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)], scaling={"scale_down_delay_s": 0})
    current = tuple(_running("m8", VLLM, 1, "h00", i) for i in range(3))  # 3 x 10 rps READY
    obs = observe({"m8": 12.0, "m70": 0.0})
    r = plan_with_capacities(obs, Fleet(hosts(1), current), p, CAPS, PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 1}  # one TRT-LLM replica (14 rps, 1 GPU) replaces them
    # required 12 rps (headroom 0): one vLLM replica can go now (20 rps stay READY), the other two
    # serve until the TRT-LLM replica is READY
    assert [a.kind for a in r.actions] == [ActionKind.START, ActionKind.DRAIN, ActionKind.STOP]
    drained = r.actions[1].replica
    # the act core gets the planner's verdict typed: this drain need not wait for the replacement
    assert r.actions[1].covered and not r.actions[0].after_stop
    kept = tuple(x for x in current if x != drained)
    assert len(kept) == 2 and not any(a.replica in kept for a in r.actions)
    assert any("make-before-break: kept serving until their replacements are READY: m8 x2" in n
               for n in r.explanation.notes)
    # the replacement READY: the other two are drained now
    new = replace(r.actions[0].replica, state=ReplicaState.READY, since_s=NOW + 60)
    r2 = plan_with_capacities(obs, Fleet(hosts(1), (*kept, new)), p, CAPS, r.next_state, NOW + 120)
    assert sorted((a.kind.value, a.replica.replica_id) for a in r2.actions) == sorted(
        [("drain", x.replica_id) for x in kept] + [("stop", x.replica_id) for x in kept])


def test_a_model_whose_slo_is_out_of_reach_keeps_its_min_replicas() -> None:
    """Every allowed config has capacity 0 at the SLO for this length mix: best effort, never an
    outage: the serving replica stays for min_replicas, and the explanation says why."""
    p = policy(tps={"m70": [4]}, cached=[("m70", "h100", 4)],
               model_extra={"m70": {"min_replicas": 1, "allowed": {"tp": [4], "engines": ["vllm"]}}})
    zero = caps({key("m70", VLLM, tp=4): 0.0})
    serving = Replica("r1", key("m70", VLLM, tp=4), "h00", (0, 1, 2, 3), ReplicaState.READY, 8000, NOW - 600)
    r = plan_with_capacities(observe({"m70": 0.5}), Fleet(hosts(1), (serving,)), p, zero,
                             PlannerState.initial(), NOW)
    assert [x.replica_id for x in r.plan.replicas] == ["r1"]
    assert not [a for a in r.actions if a.kind in (ActionKind.DRAIN, ActionKind.STOP)]
    (m,) = [m for m in r.explanation.models if m.model == "m70"]
    assert any("meets the SLO at this length mix" in n for n in m.notes)


def test_the_scale_down_hold_never_puts_an_engine_still_building_in_the_plan_for_now() -> None:
    """The target needs no build (the ready vLLM serves this cycle's demand alone), so the plan for
    now is solved on the target's candidates; the scale-down hold then re-solves for the recent
    level, where the TensorRT-LLM config still building is cheaper. The plan for now must not start
    a replica of an engine that does not exist yet (a replay of a generated day did, every swap)."""
    from fleetplan.planner.types import EngineBuild, ModelObservation, Observation

    p = policy(tps={"m8": [1], "m70": [4]}, scaling={"scale_down_delay_s": 300})
    building = EngineBuild("m8", TRT, key("m8").gpu, 1, key("m8").precision, "h01", False, NOW + 300)
    current = tuple(_running("m8", VLLM, 1, "h00", i) for i in range(5))  # 5 x 10 rps

    def rate(t: float) -> float:  # 45 rps, 38 rps from now - 360, 8 rps from now - 100
        return 45.0 if t < NOW - 360 else 38.0 if t < NOW - 100 else 8.0

    hist = tuple((NOW - 1800 + 30 * i, rate(NOW - 1800 + 30 * i)) for i in range(61))
    obs = Observation({"m8": ModelObservation("m8", 8.0, 500.0, 200.0, history=hist),
                       "m70": ModelObservation("m70", 0.0, 500.0, 200.0)})
    r = plan_with_capacities(obs, Fleet(hosts(2), current, (building,)), p, CAPS, PlannerState.initial(), NOW)
    assert any("highest rate level of the last 300 s" in n for n in r.explanation.notes)
    # 38 rps held: 4 of the 5 vLLM replicas (3 TRT-LLM TP1 would do it on 3 GPUs, once built)
    assert _counts(r.plan) == {("m8", "vllm", 1): 4}
    assert not [a for a in r.actions if a.kind == ActionKind.START]


def test_an_engine_built_on_one_host_runs_there_only() -> None:
    """A TensorRT-LLM engine built on h01's GPUs is held by h01's agent alone, which refuses a
    replica of an engine it does not hold: the plan puts that config's replicas on h01 only, as many
    as h01 holds, and serves the rest with vLLM. An engine the policy lists as cached is on every
    host."""
    from fleetplan.planner.types import EngineBuild

    p = policy(tps={"m8": [1], "m70": [4]})
    built = EngineBuild("m8", TRT, key("m8").gpu, 1, key("m8").precision, "h01", True, None)
    r = plan_with_capacities(observe({"m8": 150.0, "m70": 0.0}), Fleet(hosts(3), (), (built,)), p, CAPS,
                             PlannerState.initial(), NOW)
    trt = [x for x in r.plan.replicas if x.config.engine == TRT]
    assert len(trt) == 8 and {x.host for x in trt} == {"h01"}  # 8 x 14 = 112 rps
    assert _counts(r.plan) == {("m8", "trtllm", 1): 8, ("m8", "vllm", 1): 4}  # + 4 x 10 = 152
    assert r.explanation.models[0].unmet_rps == 0.0
    # the counts stay within h01's GPUs: placed at the first try, no re-solve
    assert [x.status for x in r.explanation.solver if x.stage == "placement"] == ["OK"]
    # and the target fills h01: the engine is built on one more host (11 TRT-LLM replicas would
    # serve for $33/h against $36/h, the 15-min build on one GPU costs $0.75)
    builds = [a for a in r.actions if a.kind == ActionKind.BUILD]
    assert [(a.replica.config.engine, a.replica.host != "h01") for a in builds] == [(TRT, True)]
    assert any("building it on one more host" in n for n in r.explanation.notes)
    # a build of it already running: not ordered twice
    more = EngineBuild("m8", TRT, key("m8").gpu, 1, key("m8").precision, "h02", False, NOW + 600)
    r2 = plan_with_capacities(observe({"m8": 150.0, "m70": 0.0}), Fleet(hosts(3), (), (built, more)), p, CAPS,
                              PlannerState.initial(), NOW)
    assert not [a for a in r2.actions if a.kind == ActionKind.BUILD]
    # a demand h01 holds alone: no second build
    r3 = plan_with_capacities(observe({"m8": 60.0, "m70": 0.0}), Fleet(hosts(3), (), (built,)), p, CAPS,
                              PlannerState.initial(), NOW)
    assert _counts(r3.plan) == {("m8", "trtllm", 1): 5} and not [a for a in r3.actions if a.kind == ActionKind.BUILD]
    # h01 goes offline: no usable host holds the engine, so the target builds it again elsewhere
    down = (*hosts(3)[:1], replace(hosts(3)[1], online=False), *hosts(3)[2:])
    r = plan_with_capacities(observe({"m8": 150.0, "m70": 0.0}), Fleet(down, (), (built,)), p, CAPS,
                             PlannerState.initial(), NOW)
    assert all(c.config.engine == VLLM for c in r.plan.counts)
    assert [(a.replica.config.engine, a.replica.host != "h01") for a in r.actions
            if a.kind == ActionKind.BUILD] == [(TRT, True)]
    # the same engine in the policy's cached_builds: TRT-LLM everywhere
    everywhere = policy(tps={"m8": [1], "m70": [4]}, cached=[("m8", "h100", 1)])
    r = plan_with_capacities(observe({"m8": 150.0, "m70": 0.0}), Fleet(hosts(3), (), (built,)), everywhere,
                             CAPS, PlannerState.initial(), NOW)
    assert _counts(r.plan) == {("m8", "trtllm", 1): 11}


def test_placement_keeps_a_config_to_the_hosts_that_hold_its_engine() -> None:
    from fleetplan.planner.placement import place

    c = key("m8", TRT, tp=2)
    p = place({c: 3}, hosts(3), (), frozenset(), {c: frozenset({"h02"})})
    assert {r.host for r in p.replicas} == {"h02"} and not p.unplaced
    p = place({c: 5}, hosts(3), (), frozenset(), {c: frozenset({"h02"})})
    assert len(p.replicas) == 4 and p.unplaced == {c: 1}  # h02's 8 GPUs hold 4 TP2 groups
    # a replica already running elsewhere stays (its agent holds the engine: it runs)
    running = _running("m8", TRT, 2, "h00", 0)
    p = place({c: 2}, hosts(3), (running,), frozenset(), {c: frozenset({"h02"})})
    assert running in p.kept and {r.host for r in p.new} == {"h02"}
