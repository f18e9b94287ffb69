"""The SLO's own verdicts bound a replica's capacity (planner/knee.py knee_load, planner/capacity.py
_siblings_knees): where the replicas missed the SLO within the period, whatever the corrected profile
says, and on the siblings nobody saw miss."""

from __future__ import annotations

from fleetplan.models.mix import capacity_mix, predict_mix
from fleetplan.planner.capacity import MixedWorkload, capacity_table
from fleetplan.planner.correction import applied_speeds, update_corrections
from fleetplan.planner.serde import state_from_dict, state_to_dict
from fleetplan.planner.types import ConfigKey, ConfigObservation, Correction, ModelObservation, PlannerState
from tests.unit.planner.planner_helpers import BF16, H100, VLLM, policy
from tests.unit.planner.test_correction import KEY, MIX, TRUE

SLO_MS = (1000.0, 80.0)
WORK = {"m8": MixedWorkload(500.0, 200.0)}
KEY2 = ConfigKey("m8", VLLM, H100, 2, BF16)
POLICY2 = policy(models=("m8",), tps={"m8": [1, 2]},
                 model_extra={"m8": {"allowed": {"tp": [1, 2], "engines": ["vllm"]}}})


def capacity() -> float:
    return capacity_mix(TRUE, MIX, ttft_p99_ms=SLO_MS[0], itl_p99_ms=SLO_MS[1]).max_rps


def window(key: ConfigKey, load_rps: float, *, missed: bool) -> ConfigObservation:
    """One replica's window at `load_rps`: latency as the profile says (the correction's speed stays
    at 1), or a TTFT p99 past the SLO with a sampling interval wholly above it (a clear miss)."""
    seen = predict_mix(TRUE, MIX, load_rps)
    if missed:
        return ConfigObservation(key, 1, load_rps, 1500.0, seen.itl_p99_ms, 400.0,
                                 ttft_p99_sampling_ms=(1300.0, 1700.0))
    return ConfigObservation(key, 1, load_rps, seen.ttft_p99_ms, seen.itl_p99_ms, 400.0)


def feed(loads: list[tuple[float, bool]], *, t0_s: float = 1000.0, key: ConfigKey = KEY,
         start: dict[ConfigKey, Correction] | None = None, period_s: float = 3600.0) -> dict[ConfigKey, Correction]:
    out = dict(start or {})
    for i, (load, missed) in enumerate(loads):
        obs = ModelObservation("m8", load, 500.0, 200.0, configs=(window(key, load, missed=missed),))
        out = update_corrections(out, {"m8": obs}, {key: TRUE}, WORK, {}, t0_s + 60.0 * i, {"m8": SLO_MS},
                                 {"m8": period_s})
    return out


def planned(corrections: dict[ConfigKey, Correction], keys: tuple[ConfigKey, ...] = (KEY,)) -> dict:
    profiles = {k: TRUE for k in keys}
    speeds = applied_speeds(corrections, profiles, {})
    table, _ = capacity_table(POLICY2, profiles, WORK, [H100], speeds=speeds)
    return table


def test_a_replica_is_counted_for_no_more_than_the_load_at_which_it_missed_the_slo() -> None:
    c = capacity()
    knee = 0.7 * c  # the engine's knee sits lower than the profile's: misses from 0.7 of its capacity
    held = [(f * c, False) for f in (0.3, 0.4, 0.5, 0.6)]
    corr = feed([*held, (knee, True), (0.8 * c, True), (0.5 * c, False)])
    info = planned(corr)[KEY]
    assert info.max_rps <= knee + 1e-9
    assert "missed the SLO at" in info.correction
    # the same windows, every one within the SLO: counted as the profile says
    assert planned(feed([*held, (0.65 * c, False), (0.5 * c, False)]))[KEY].max_rps > 0.95 * c


def test_misses_at_every_load_are_no_knee_and_a_period_later_the_bound_is_gone() -> None:
    c = capacity()
    scattered = [(0.3 * c, True), (0.4 * c, False), (0.5 * c, True), (0.6 * c, False), (0.7 * c, True),
                 (0.8 * c, False)]
    corr = feed(scattered)
    assert all(w[2] in (True, False) for w in corr[KEY].slo_windows) and len(corr[KEY].slo_windows) == 6
    # each window's TTFT p99 is kept with its load for the period, as read, with the low end of its
    # sampling interval (the p99 itself where the window has none; planner/knee.py queue_knee)
    assert [round(x, 9) for _, x, _, _ in corr[KEY].ttft_windows] == [round(x, 9) for x, _ in scattered]
    assert [(ms, lo) for _, _, ms, lo in corr[KEY].ttft_windows][0::2] == [(1500.0, 1300.0)] * 3  # the misses'
    assert all(ms == lo for _, _, ms, lo in corr[KEY].ttft_windows[1::2])
    assert "missed the SLO at" not in planned(corr).get(KEY).correction
    # a knee, then an hour of windows within the SLO at low load: the period forgets the misses
    knee = feed([(0.3 * c, False), (0.4 * c, False), (0.7 * c, True), (0.8 * c, True)])
    assert planned(knee)[KEY].max_rps <= 0.7 * c + 1e-9
    later = feed([(0.4 * c, False)] * 5, t0_s=1000.0 + 3700.0, start=knee)
    assert [w for w in later[KEY].slo_windows if w[2]] == []
    assert [t for t, *_ in later[KEY].ttft_windows] == [t for t, _, _ in later[KEY].slo_windows]  # the period's
    assert "missed the SLO at" not in planned(later)[KEY].correction


def test_a_sibling_nobody_saw_miss_is_counted_at_the_ratio_the_knee_showed_above_what_it_held() -> None:
    c = capacity()
    knee = feed([(0.3 * c, False), (0.4 * c, False), (0.6 * c, True), (0.7 * c, True)])
    table = planned(knee, (KEY, KEY2))
    assert table[KEY].max_rps <= 0.6 * c + 1e-9
    # TP2 runs the same profile here, unobserved: counted at the knee's ratio of what its speeds (its
    # sibling's, shared) say, and says why
    assert table[KEY2].max_rps <= table[KEY].max_rps + 1e-6
    assert "a sibling's replicas missed the SLO" in table[KEY2].correction
    assert "TTFT queue" not in table[KEY2].correction
    # its own windows held the SLO at 0.8 of the profile's capacity: no lower than that
    both = feed([(0.8 * c, False)] * 3, key=KEY2, start=knee, t0_s=1300.0)
    assert planned(both, (KEY, KEY2))[KEY2].max_rps >= 0.8 * c - 1e-6


def test_the_verdicts_survive_the_state_round_trip() -> None:
    c = Correction(KEY, -0.1, 0.01, 0.0, 0.02, 3, None, 1240.0, slo_windows=((1000.0, 2.0, False),
                                                                             (1060.0, 3.1, True)),
                   ttft_windows=((1000.0, 2.0, 335.0, 320.5), (1060.0, 3.1, 1500.5, 1300.0)))
    state = PlannerState((), 7, (c,))
    assert state_from_dict(state_to_dict(state)) == state
    # a state written before the low end was kept reads each window's p99 as its own low end
    doc = state_to_dict(state)
    doc["corrections"][0]["ttft_windows"] = [w[:3] for w in doc["corrections"][0]["ttft_windows"]]
    old = state_from_dict(doc).corrections[0].ttft_windows
    assert old == ((1000.0, 2.0, 335.0, 335.0), (1060.0, 3.1, 1500.5, 1500.5))


def test_the_plan_counts_a_config_at_its_knee_and_says_so_in_a_field() -> None:
    from dataclasses import replace

    from fleetplan.models import profile as mp
    from fleetplan.planner.core import plan, plan_to_dict
    from fleetplan.planner.types import Fleet, Observation
    from tests.unit.planner.planner_helpers import hosts
    from tests.unit.planner.test_correction import POLICY

    c = capacity()
    windows = ((900.0, 0.3 * c, False), (960.0, 0.4 * c, False), (1020.0, 0.7 * c, True), (1080.0, 0.8 * c, True))
    state = replace(PlannerState.initial(),
                    corrections=(Correction(KEY, observations=4, updated_s=1080.0, slo_windows=windows),))
    obs = Observation({"m8": ModelObservation("m8", 3.0 * c, 500.0, 200.0)})

    def counted(s: PlannerState) -> tuple[int, float | None, dict]:
        r = plan(obs, Fleet(hosts(2)), POLICY, mp.ProfileSet((TRUE,)), s, 1100.0)
        cfg = next(x for x in r.explanation.models[0].configs if x.config == KEY)
        doc = next(x for x in plan_to_dict(r)["explanation"]["models"][0]["configs"] if x["tp"] == 1)
        return cfg.replicas, cfg.knee_rps, doc

    n, knee, doc = counted(state)
    assert knee is not None and abs(knee - 0.7 * c) < 1e-9 and doc["knee_rps"] == knee
    assert doc["capacity_per_replica_rps"] <= knee + 1e-9
    n_free, none, doc_free = counted(PlannerState.initial())
    assert none is None and doc_free["knee_rps"] is None
    assert n > n_free  # 3x the profile's capacity at 1.2 headroom: 4 replicas as profiled, 6 at the knee


def test_a_replica_is_counted_for_no_less_than_the_load_its_windows_held_below_every_miss() -> None:
    # the knee's mirror (planner/knee.py held_floor): windows clearly within the targets at loads the
    # profile's shape says miss (a roofline prior's queue for prompts beyond its data); the speeds
    # they read move by capped steps, what they held is counted at once (the second highest load)
    from dataclasses import replace

    c = capacity()

    def within(load: float) -> ModelObservation:
        return ModelObservation("m8", load, 500.0, 200.0,
                                configs=(ConfigObservation(KEY, 1, load, 600.0, 60.0, 400.0),))

    corr: dict[ConfigKey, Correction] = {}
    for i, f in enumerate((1.6, 1.5, 1.4)):
        corr = update_corrections(corr, {"m8": within(f * c)}, {KEY: TRUE}, WORK, {}, 1000.0 + 60.0 * i,
                                  {"m8": SLO_MS}, {"m8": 3600.0})
    speeds = applied_speeds(corr, {KEY: TRUE}, {})
    floored = capacity_table(POLICY2, {KEY: TRUE}, WORK, [H100], speeds=speeds)[0][KEY]
    alone = capacity_table(POLICY2, {KEY: TRUE}, WORK, [H100],
                           speeds={KEY: replace(speeds[KEY], floor_rps=None)})[0][KEY]
    assert alone.max_rps < 1.5 * c - 1e-6  # the speeds alone: less than the replicas carried
    assert abs(floored.max_rps - 1.5 * c) < 1e-6
    assert "held the SLO at" in floored.correction
    # one miss at a lower load (a heavier mix since): nothing held below it, the floor is gone
    missed = feed([(1.0 * c, True)], t0_s=1200.0, start=corr)
    assert "held the SLO at" not in planned(missed)[KEY].correction
    assert planned(missed)[KEY].max_rps < 1.5 * c - 1e-6


def test_a_profile_outside_its_data_is_held_to_its_replicas_ttft_queue() -> None:
    """A roofline prior read at the right speed at the loads seen can put the knee too far out; the
    replicas' TTFT p99 rising toward the target says where the queue reaches it (knee.queue_knee)."""
    c = capacity()
    # 335 ms without a queue, then 420, 715 and 675 ms at 0.35, 0.48 and 0.5 of the profile's capacity
    rising = ((900.0, 0.2 * c, 330.0, 330.0), (960.0, 0.22 * c, 340.0, 340.0), (1020.0, 0.25 * c, 335.0, 335.0),
              (1080.0, 0.35 * c, 420.0, 420.0), (1140.0, 0.48 * c, 715.0, 715.0), (1200.0, 0.5 * c, 675.0, 675.0))
    corr = {KEY: Correction(KEY, observations=6, updated_s=1200.0, ttft_windows=rising)}
    outside = {KEY: ("roofline prior only (no benchmark data)",)}

    def counted(extrapolating: dict, slo: dict | None) -> tuple[float, str]:
        speeds = applied_speeds(corr, {KEY: TRUE}, extrapolating, slo)
        table, _ = capacity_table(POLICY2, {KEY: TRUE}, WORK, [H100], speeds=speeds)
        return table[KEY].max_rps, table[KEY].correction

    held, note = counted(outside, {"m8": SLO_MS[0]})
    assert abs(held - 0.5 * c * (1 - 335.0 / 1000.0) / (1 - 335.0 / 675.0)) < 1e-6  # the median reading, 0.66 c
    assert "TTFT queue reaches the target at" in note
    # an unobserved sibling is counted at the same ratio, and its note says the bound came from a queue
    speeds = applied_speeds(corr, {KEY: TRUE, KEY2: TRUE}, outside, {"m8": SLO_MS[0]})
    table, _ = capacity_table(POLICY2, {KEY: TRUE, KEY2: TRUE}, WORK, [H100], speeds=speeds)
    assert abs(table[KEY2].max_rps - held) < 0.01 * c  # the same profile: the same ratio of it
    assert "a sibling's replicas showed a TTFT queue reaching the target" in table[KEY2].correction
    assert "missed" not in table[KEY2].correction
    # a profile inside its data keeps its own shape, and without the target nothing is held
    assert counted({}, {"m8": SLO_MS[0]})[0] > 0.95 * c
    assert counted(outside, None)[0] > 0.95 * c
    # what the replicas held below every miss stands above the queue's reading
    floor = {KEY: Correction(KEY, observations=6, updated_s=1200.0, ttft_windows=rising,
                             slo_windows=tuple((t, 0.8 * c, False) for t in (900.0, 960.0, 1020.0)))}
    speeds = applied_speeds(floor, {KEY: TRUE}, outside, {"m8": SLO_MS[0]})
    assert speeds[KEY].knee_rps is not None and abs(speeds[KEY].knee_rps - 0.8 * c) < 1e-9


def test_a_p99_within_its_sampling_noise_of_the_light_latency_is_no_queue() -> None:
    """At 1-2 rps a window's p99 is its one or two slowest requests: a long prompt among them reads
    as a queue that the 1 / (1 - utilisation) curve carries down to the load the window held. Read at
    the low end of its sampling interval, a window shows a queue only beyond its noise."""
    c = capacity()
    p99s = ((0.2, 330.0), (0.22, 340.0), (0.25, 335.0), (0.35, 420.0), (0.48, 715.0), (0.5, 675.0))
    outside = {KEY: ("roofline prior only (no benchmark data)",)}

    def knee(low_of: float) -> float | None:
        """The queue's reading when each window's p99 could have read `low_of` x the light latency."""
        ws = tuple((900.0 + 60.0 * i, f * c, ms, min(ms, low_of * 335.0)) for i, (f, ms) in enumerate(p99s))
        corr = {KEY: Correction(KEY, observations=6, updated_s=1200.0, ttft_windows=ws)}
        speeds = applied_speeds(corr, {KEY: TRUE}, outside, {"m8": SLO_MS[0]}).get(KEY)
        return None if speeds is None else speeds.knee_rps

    assert knee(1.05) is None  # every window could have read within 5% of the light latency: no queue
    shown = knee(1.6)  # the loaded windows' luckiest reading still 1.6x it: a queue, read at that low end
    assert shown is not None and abs(shown - 0.5 * c * (1 - 335.0 / 1000.0) / (1 - 1.0 / 1.6)) < 1e-6
    # through the correction: windows fed with wide intervals keep their low ends
    wide = ConfigObservation(KEY, 1, 0.5 * c, 900.0, 40.0, 400.0, ttft_p99_sampling_ms=(350.0, 1400.0))
    out = update_corrections({}, {"m8": ModelObservation("m8", 0.5 * c, 500.0, 200.0, configs=(wide,))},
                             {KEY: TRUE}, WORK, {}, 1000.0, {"m8": SLO_MS}, {"m8": 3600.0})
    assert out[KEY].ttft_windows == ((1000.0, 0.5 * c, 900.0, 350.0),)


def test_a_window_of_fewer_requests_than_a_p99_needs_shows_no_queue() -> None:
    """The p99 of n < 100 requests is their slowest one, on average their n / (n + 1) quantile: on a
    light day the lightest windows (8 requests, no long prompt among them) read a lower quantile of
    the same prompts' prefill than the windows at three times their load (24-30 requests), which
    reads as a queue that is not there. Such windows stay out of the queue's curve; the same
    readings from windows of a p99's size still show one."""
    c = capacity()
    outside = {KEY: ("roofline prior only (no benchmark data)",)}
    readings = [(0.04, 98.0), (0.045, 97.0), (0.05, 99.0), (0.14, 240.0), (0.15, 238.0), (0.16, 242.0)]

    def fed(requests: float) -> dict[ConfigKey, Correction]:
        out: dict[ConfigKey, Correction] = {}
        for i, (f, ms) in enumerate(readings):
            w = ConfigObservation(KEY, 1, f * c, ms, 20.0, requests, ttft_p99_sampling_ms=(0.95 * ms, ms))
            obs = ModelObservation("m8", f * c, 500.0, 200.0, configs=(w,))
            out = update_corrections(out, {"m8": obs}, {KEY: TRUE}, WORK, {}, 1000.0 + 60.0 * i, {"m8": SLO_MS},
                                     {"m8": 3600.0})
        return out

    def knee(corr: dict[ConfigKey, Correction]) -> float | None:
        speeds = applied_speeds(corr, {KEY: TRUE}, outside, {"m8": SLO_MS[0]}).get(KEY)
        return None if speeds is None else speeds.knee_rps

    few = fed(24.0)
    assert few[KEY].ttft_windows == () and knee(few) is None
    many = fed(400.0)
    assert len(many[KEY].ttft_windows) == len(readings)
    shown = knee(many)
    assert shown is not None and shown < 0.5 * c  # what the rule keeps out: a queue at a quarter of the capacity (0.24)
