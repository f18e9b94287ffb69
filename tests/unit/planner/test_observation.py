"""planner/observation.py: the fail-static rules of observation, from raw Prometheus answers, no server.

Partial windows are unknown, never 0 rps (issue 11 item 3); a stale model keeps its rate as a lower
bound (item 5); Prometheus down leaves everything unknown."""

from __future__ import annotations

import math

import pytest

from fleetplan.planner.observation import (
    ObserveRules,
    Query,
    Readings,
    Sample,
    Series,
    interpret,
    window_full,
)

WALL = 1_000_000.0
W = 60.0  # rate window, wall seconds
RULES = ObserveRules(window_s=W)
M = "llama"


def target(rid: str, *, since_s: float = WALL - 3600, up: bool = True, interval_s: float = 15.0,
           model: str = M) -> dict[Query, list[Sample]]:
    """One scrape target scraped every `interval_s` since `since_s`: the answers of the up queries."""
    labels = {"replica": rid, "model": model, "instance": f"{rid}:8000"}
    first_in_window = max(since_s, WALL - W + 0.5 * interval_s)  # the sample phase: half an interval in
    n = math.floor((WALL - first_in_window) / interval_s) + 1
    last = first_in_window + (n - 1) * interval_s
    return {Query.UP: [Sample(labels, 1.0 if up else 0.0)], Query.UP_FIRST_S: [Sample(labels, first_in_window)],
            Query.UP_LAST_S: [Sample(labels, last)], Query.UP_SAMPLES: [Sample(labels, float(n))]}


def readings(*targets: dict[Query, list[Sample]], rate: float | None = None, prompt: float | None = None,
             gen: float | None = None, history: tuple[Series, ...] = (), model: str = M) -> Readings:
    res: dict[Query, list[Sample]] = {}
    for t in targets:
        for q, samples in t.items():
            res.setdefault(q, []).extend(samples)
    for q, v in ((Query.RATE, rate), (Query.PROMPT, prompt), (Query.GEN, gen)):
        if v is not None:
            res[q] = [Sample({"model_name": model}, v)]
    return Readings(WALL, {q: tuple(s) for q, s in res.items()}, history)


def test_full_window_rate_is_known_and_scaled_to_the_simulated_clock() -> None:
    r = readings(target("r1"), target("r2"), rate=8.0, prompt=8.0 * 500, gen=8.0 * 100)
    out = interpret(r, [M], now_s=5000.0, rules=ObserveRules(window_s=W, time_scale=4.0))
    m = out.models[M]
    assert not m.stale and m.reasons == () and out.alerts == ()
    assert m.rate_rps == 2.0 and m.isl == 500.0 and m.osl == 100.0
    assert m.replicas_up == 2 and out.replicas["r1"].window_full


def test_prometheus_restarted_with_empty_data_is_unknown_not_idle() -> None:
    # scraped again for 10 s: one target has a single sample, rate() has nothing yet
    r = readings(target("r1", since_s=WALL - 10), target("r2", since_s=WALL - 0.5))
    m = interpret(r, [M], now_s=WALL, rules=RULES).models[M]
    assert m.stale and m.rate_rps is None
    assert any("not yet covered" in x and "r1, r2" in x for x in m.reasons)
    # the same targets after a whole window: up, no request finished -> idle, known 0 rps
    idle = interpret(readings(target("r1"), target("r2")), [M], now_s=WALL, rules=RULES).models[M]
    assert not idle.stale and idle.rate_rps == 0.0


def test_partial_window_rate_is_a_lower_bound_and_no_length_means() -> None:
    # 20 s of samples in a 60 s window: rate() reads about a third of the true 30 rps
    r = readings(target("r1", since_s=WALL - 20), rate=10.0, prompt=10.0 * 500, gen=10.0 * 100)
    out = interpret(r, [M], now_s=WALL, rules=RULES)
    m = out.models[M]
    assert m.stale and m.rate_rps == 10.0  # kept: it can raise capacity (planner/core.py), never lower it
    assert m.isl is None and m.osl is None
    assert out.alerts and "fail static for llama" in out.alerts[0]


def test_a_new_replica_in_its_first_window_makes_the_model_stale_until_it_is_covered() -> None:
    old = [target("r1"), target("r2")]
    r = readings(*old, target("r3", since_s=WALL - 30), rate=12.0)
    m = interpret(r, [M], now_s=WALL, rules=RULES).models[M]
    assert m.stale and m.rate_rps == 12.0 and any("r3" in x for x in m.reasons)
    later = interpret(readings(*old, target("r3", since_s=WALL - 65), rate=12.0), [M], now_s=WALL,
                      rules=RULES).models[M]
    assert not later.stale


def per_replica(rid: str, *, rate: float | None = None, done: float | None = None, running: float = 0.0,
                waiting: float = 0.0, started_s: float | None = None) -> dict[Query, list[Sample]]:
    """A target's per-replica answers: its arrival rate, its completions counter, its queue gauges,
    when its counters started (the engine's `_created`; None: the engine exports none)."""
    labels = {"replica": rid, "model": M}
    out = {Query.REPLICA_RUNNING: [Sample(labels, running)], Query.REPLICA_WAITING: [Sample(labels, waiting)]}
    if rate is not None:
        out[Query.REPLICA_RATE] = [Sample(labels, rate)]
    if done is not None:
        out[Query.REPLICA_DONE] = [Sample(labels, done)]
    if started_s is not None:
        out[Query.REPLICA_STARTED_S] = [Sample(labels, started_s)]
    return out


def test_a_replica_ready_inside_the_window_is_counted_from_its_start_not_stale() -> None:
    """A new replica's first window: two old replicas served 4 rps each for the whole window; r3,
    ready 30 s ago, received 2 rps since: 55 completed, 5 in it now. rate() reads r3 only from its
    first scrape (0.5 rps here); counted from its start the model's rate is 8 + 60 / 60 = 9 rps, known:
    no fail-static cycle for every start (a third of the cycles of a scaling fleet)."""
    old = [target("r1"), target("r2"), per_replica("r1", rate=4.0), per_replica("r2", rate=4.0)]
    new = [target("r3", since_s=WALL - 30), per_replica("r3", rate=0.5, done=55.0, running=4.0, waiting=1.0)]
    r = readings(*old, *new, rate=4.0 + 4.0 + 0.5, prompt=8.5 * 500, gen=8.5 * 100)  # rate() of all three
    out = interpret(r, [M], now_s=WALL, rules=RULES, ready_wall_s={"r3": WALL - 30, "r1": WALL - 900})
    m = out.models[M]
    assert not m.stale and m.reasons == ()
    assert m.rate_rps == pytest.approx(8.5 - 0.5 + 60.0 / 60.0)
    assert m.isl == pytest.approx(500.0) and m.osl == pytest.approx(100.0)  # tokens / the rate() they share
    # not known when it became ready, or ready before the window (Prometheus restarted): a lower bound
    for ready in ({}, {"r3": WALL - 120}):
        m = interpret(r, [M], now_s=WALL, rules=RULES, ready_wall_s=ready).models[M]
        assert m.stale and any("not yet covered" in x and "r3" in x for x in m.reasons)
    # without its completions counter it cannot be counted: stale, as before
    blind = readings(*old, target("r3", since_s=WALL - 30), per_replica("r3", rate=1.0), rate=8.0)
    assert interpret(blind, [M], now_s=WALL, rules=RULES, ready_wall_s={"r3": WALL - 30}).models[M].stale


def test_a_replica_ready_after_every_other_targets_last_scrape_adds_nothing_and_is_not_stale() -> None:
    """The two old replicas were last scraped 7.5 s ago; r3 became READY then and was scraped at 0.
    The spans the old replicas' samples cover hold none of r3's serving time: every request of
    those spans reached them, and rate() extrapolates them to now as any target: known, 8 rps.
    Before, r3's single sample left the model stale for the cycle after every start. Ready 2.5 s
    earlier, the old replicas' last samples hold some of its serving time: a lower bound, stale."""
    old = [target("r1"), target("r2"), per_replica("r1", rate=4.0), per_replica("r2", rate=4.0)]
    last = WALL - 7.5  # the old targets' last sample (target(): half an interval in, every 15 s)
    new = [target("r3", since_s=last), per_replica("r3", done=0.0)]
    r = readings(*old, *new, rate=8.0)
    m = interpret(r, [M], now_s=WALL, rules=RULES, ready_wall_s={"r3": last, "r1": WALL - 900}).models[M]
    assert not m.stale and m.reasons == () and m.rate_rps == pytest.approx(8.0)
    early = [target("r3", since_s=last - 2.5), per_replica("r3", done=0.0)]
    m = interpret(readings(*old, *early, rate=8.0), [M], now_s=WALL, rules=RULES,
                  ready_wall_s={"r3": last - 2.5, "r1": WALL - 900}).models[M]
    assert m.stale and any("not yet covered" in x and "r3" in x for x in m.reasons)


def test_a_model_whose_only_replica_is_new_and_has_one_sample_is_counted_from_its_start() -> None:
    """One sample: rate() answers nothing for it (no RATE series at all), its counter still counts:
    15 requests in the 4 s from its READY to its scrape, at that rate to now (6 s), over the window."""
    r = readings(target("r1", since_s=WALL - 2), per_replica("r1", done=12.0, running=3.0))
    m = interpret(r, [M], now_s=WALL, rules=ObserveRules(window_s=W, time_scale=2.0),
                  ready_wall_s={"r1": WALL - 6}).models[M]
    assert not m.stale and m.rate_rps == pytest.approx(15.0 * 6.0 / 4.0 / 60.0 / 2.0)
    assert m.isl is None  # no token rates read yet: the policy's mix
    # scraped 1 s after its READY, 5 s ago: most of the count would be extrapolated: a lower bound
    r = readings(target("r1", since_s=WALL - 5), per_replica("r1", done=2.0))
    assert interpret(r, [M], now_s=WALL, rules=RULES, ready_wall_s={"r1": WALL - 6}).models[M].stale


def test_a_new_vllm_replica_has_a_rate_from_its_first_scrape_by_its_counters_created_time() -> None:
    """What a real vLLM exports: its counters at 0 from `vllm:request_success_created` (set as the
    engine finished loading). Scraped once, 4 requests done, the controller's record of its READY
    not given (`fleetplan observe`, or a record not yet written): its 4 arrivals happened inside the
    window, so the model's rate is known, 4 requests over the window extrapolated to now at the
    replica's own rate (10 s since the start, scraped at 9 s), not stale."""
    r = readings(target("r1", since_s=WALL - 1), per_replica("r1", done=4.0, started_s=WALL - 10))
    out = interpret(r, [M], now_s=WALL, rules=RULES)
    m = out.models[M]
    assert not out.replicas["r1"].window_full
    assert not m.stale and m.reasons == () and m.rate_rps == pytest.approx(4.0 * 10.0 / 9.0 / W)
    # the same engine without its `_created` and without a record: unknown, and the reading says why
    r = readings(target("r1", since_s=WALL - 1), per_replica("r1", done=4.0))
    m = interpret(r, [M], now_s=WALL, rules=RULES).models[M]
    assert m.stale and m.rate_rps is None
    assert any("not yet covered" in x and "r1" in x for x in m.reasons)
    # ... until its samples cover the window: rate() then reads it, known
    r = readings(target("r1", since_s=WALL - 70), per_replica("r1", done=4.0), rate=4.0 / W)
    m = interpret(r, [M], now_s=WALL, rules=RULES).models[M]
    assert not m.stale and m.rate_rps == pytest.approx(4.0 / W)


def test_the_engines_counter_start_wins_over_the_controllers_record() -> None:
    """The record says READY 30 s ago, but the engine's counters started two hours ago (an engine
    adopted by a restarted agent, or a record rewritten): its counter holds two hours of requests,
    not the window's, so it is not counted whole; its partial rate() stays a lower bound. A
    record is used only where the engine says nothing (trtllm-serve: no `_created`)."""
    old = [target("r1"), per_replica("r1", rate=4.0)]
    new = target("r3", since_s=WALL - 30)
    adopted = readings(*old, new, per_replica("r3", rate=1.0, done=50_000.0, started_s=WALL - 7200), rate=5.0)
    m = interpret(adopted, [M], now_s=WALL, rules=RULES, ready_wall_s={"r3": WALL - 30}).models[M]
    assert m.stale and m.rate_rps == 5.0 and any("not yet covered" in x and "r3" in x for x in m.reasons)
    # the engine's start inside the window: counted from it, the record's later READY is not needed
    fresh = readings(*old, new, per_replica("r3", rate=1.0, done=58.0, running=2.0, started_s=WALL - 30),
                     rate=5.0)
    m = interpret(fresh, [M], now_s=WALL, rules=RULES, ready_wall_s={"r3": WALL - 1}).models[M]
    assert not m.stale and m.rate_rps == pytest.approx(4.0 + 60.0 / W)
    # no `_created` (NaN or absent): the record stands in, as for trtllm-serve
    nan = readings(*old, new, per_replica("r3", rate=1.0, done=58.0, running=2.0, started_s=math.nan), rate=5.0)
    m = interpret(nan, [M], now_s=WALL, rules=RULES, ready_wall_s={"r3": WALL - 30}).models[M]
    assert not m.stale and m.rate_rps == pytest.approx(4.0 + 60.0 / W)


def test_a_down_target_makes_the_model_stale_unless_it_is_being_removed() -> None:
    r = readings(target("r1"), target("r2", up=False), rate=6.0)
    m = interpret(r, [M], now_s=WALL, rules=RULES).models[M]
    assert m.stale and m.rate_rps == 6.0 and m.replicas_down == 1
    assert any("1 scrape target(s) down: r2" in x for x in m.reasons)
    removing = interpret(r, [M], now_s=WALL, rules=RULES, expected_replicas={"r1"}).models[M]
    assert not removing.stale and removing.replicas_down == 0
    assert not interpret(r, [M], now_s=WALL, rules=ObserveRules(window_s=W, require_all_targets_up=False)
                         ).models[M].stale


def test_prometheus_error_leaves_every_model_unknown() -> None:
    out = interpret(Readings(WALL, error="prometheus at x unreachable"), [M, "other"], now_s=WALL, rules=RULES)
    assert not out.prometheus_ok and out.replicas == {}
    assert all(m.stale and m.rate_rps is None for m in out.models.values()) and set(out.models) == {M, "other"}
    assert out.alerts == ("fail static: prometheus at x unreachable",)


def test_nan_rate_and_no_series_are_unknown() -> None:
    nan = interpret(readings(target("r1"), rate=math.nan), [M], now_s=WALL, rules=RULES).models[M]
    assert nan.stale and nan.rate_rps is None and "request rate is NaN" in nan.reasons
    absent = interpret(readings(), ["absent"], now_s=WALL, rules=RULES).models["absent"]
    assert absent.stale and absent.rate_rps is None and absent.replicas_up == 0


def test_history_is_summed_per_model_and_mapped_onto_the_controller_clock() -> None:
    h = (Series({"model_name": M, "finished_reason": "stop"}, ((WALL - 60, 4.0), (WALL, 8.0))),
         Series({"model_name": M, "finished_reason": "length"}, ((WALL, 2.0), (WALL - 30, math.nan))))
    r = readings(target("r1"), rate=10.0, history=h)
    m = interpret(r, [M], now_s=500.0, rules=ObserveRules(window_s=W, time_scale=2.0)).models[M]
    assert m.history == ((500.0 - 120.0, 2.0), (500.0, 5.0))


def test_a_history_series_that_begins_inside_the_span_drops_its_under_read_first_points() -> None:
    """A series starting inside the queried hour (a new model, Prometheus' data starting): its first
    point's window reaches back before the first sample and rate() divides by the whole window (13
    rps read for 30 rps); the forecast took that for a climb and bought a replica (the replay's
    constant-load test)."""
    rules = ObserveRules(window_s=W, history_s=3600.0, history_window_s=60.0)
    start = WALL - 600.0
    pts = tuple((start + 30.0 * i, 13.0 if i == 0 else 30.0) for i in range(21))
    r = readings(target("r1"), rate=30.0, history=(Series({"model_name": M}, pts),))
    kept = interpret(r, [M], now_s=WALL, rules=rules).models[M].history
    assert kept[0] == (start + 60.0, 30.0) and all(v == 30.0 for _, v in kept)
    # a series that covers the whole span keeps every point
    full = tuple((WALL - 3600.0 + 30.0 * i, 30.0) for i in range(121))
    r = readings(target("r1"), rate=30.0, history=(Series({"model_name": M}, full),))
    assert len(interpret(r, [M], now_s=WALL, rules=rules).models[M].history) == 121


@pytest.mark.parametrize(("first", "last", "n", "full"), [
    (WALL - W + 1, WALL, 60, True),  # every second, the whole window
    (WALL - W + 15, WALL - 15, 3, True),  # every 15 s, the first sample 15 s in: rate() extrapolates
    (WALL - W + 2.5, WALL, 23, True),  # within one subquery step (3 s) of the start: counted as covered
    (WALL - W + 20, WALL, 41, False),  # started 40 s ago, scraped every second
    (WALL - 1, WALL - 1, 1, False),  # one sample: no rate
    (None, WALL, 5, False),  # unknown: not evidence
    (WALL - 30, WALL - 40, 3, False),  # inconsistent answers: not evidence
])
def test_window_full(first: float | None, last: float, n: float, full: bool) -> None:
    assert window_full(first, last, n, eval_s=WALL, window_s=W, step_s=RULES.window_step_s) is full


def test_a_replica_the_router_serves_but_prometheus_does_not_scrape_makes_the_rate_a_lower_bound() -> None:
    """Found by replaying the lab (tests/e2e/test_e2e_parity.py): nginx routed a new replica some
    seconds before Prometheus' file_sd scraped it; its completions were not counted, the rate read
    0.26 rps for 0.5 rps of load and a replica the load still needed was drained."""
    r = readings(target("r1"), rate=0.26)
    out = interpret(r, [M], now_s=5000.0, rules=RULES, serving={"r1": M, "r2": M})
    m = out.models[M]
    assert m.stale and m.rate_rps == 0.26  # a lower bound: it can raise capacity, never lower it
    assert any("serving but not scraped yet" in x and "r2" in x for x in m.reasons)
    # once scraped (or not serving), the reading is whole again
    assert not interpret(readings(target("r1"), target("r2"), rate=0.5), [M], now_s=5000.0, rules=RULES,
                         serving={"r1": M, "r2": M}).models[M].stale
    assert not interpret(r, [M], now_s=5000.0, rules=RULES, serving={"r1": M}).models[M].stale


def test_the_prefix_cache_hit_rate_is_read_from_the_engines_token_counters() -> None:
    r = readings(target("r1"), rate=4.0)
    res = dict(r.results)
    res[Query.PREFIX_QUERIES] = (Sample({"model_name": M}, 4000.0),)  # prompt tokens looked up per s
    res[Query.PREFIX_HITS] = (Sample({"model_name": M}, 1464.0),)
    m = interpret(Readings(r.wall_s, res), [M], now_s=5000.0, rules=RULES).models[M]
    assert m.prefix_hit_rate == pytest.approx(0.366)
    # too few tokens in the window to tell (a handful of requests): unknown, the plan assumes none
    res[Query.PREFIX_QUERIES] = (Sample({"model_name": M}, 100.0),)
    res[Query.PREFIX_HITS] = (Sample({"model_name": M}, 50.0),)
    assert interpret(Readings(r.wall_s, res), [M], now_s=5000.0, rules=RULES).models[M].prefix_hit_rate is None


def test_a_router_down_within_the_window_makes_every_rate_a_lower_bound() -> None:
    """The fault suite's killed nginx: requests never reached the engines, the rate fell, and the
    planner drained a replica the load needed once nginx was back."""
    r = readings(target("r1"), rate=0.2)
    m = interpret(r, [M], now_s=5000.0, rules=RULES, router_down=True).models[M]
    assert m.stale and m.rate_rps == 0.2 and any("router is down" in x for x in m.reasons)
    assert not interpret(r, [M], now_s=5000.0, rules=RULES).models[M].stale


def test_the_cycle_path_takes_router_down_to_the_planner_input() -> None:
    from fleetplan.planner.cycle import observe

    r = readings(target("r1"), rate=0.2)
    down = observe(r, None, [M], now_s=5000.0, rules=RULES, router_down=True)
    obs, _ = down.for_fleet(None)
    assert obs.models[M].stale and obs.models[M].rate_rps == 0.2
    assert not observe(r, None, [M], now_s=5000.0, rules=RULES).for_fleet(None)[0].models[M].stale
