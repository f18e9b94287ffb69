"""The evaluation's yardsticks a policy can reach (sim/yardsticks.py), run on the trace being evaluated:
`clairvoyant` (per model the clairvoyant's schedule, then the models' schedules replayed together)
and `hpa-tuned` (hpa at its best target utilisation). Called by `evaluate()`; each returns its replay
and a label saying what it was found at."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey
from fleetplan.sim.des import Environment, FleetSim, SimResult, SimSettings
from fleetplan.sim.traces import Trace
from fleetplan.sim.yardsticks import Schedule, ScheduleController, clairvoyant, tuned_hpa

YARDSTICK_NAMES: tuple[str, ...] = ("clairvoyant", "hpa-tuned")


@dataclass(frozen=True)
class YardstickRun:
    result: SimResult  # its replay, named after the yardstick
    label: str  # what it was found at, for the table and the JSON
    wall_s: float  # the search's and the replays' wall time


def clairvoyant_window_s(cycle_s: float, duration_s: float) -> float:
    """The clairvoyant's window: the control cycle, stretched so that the trace has at most 288 windows
    (a day's 5-minute windows: a solve of seconds), never beyond 5 minutes (a week: 2,016 windows).

    >>> clairvoyant_window_s(60.0, 3600.0), clairvoyant_window_s(60.0, 86400.0), clairvoyant_window_s(5.0, 3600.0)
    (60.0, 300.0, 12.5)
    """
    return min(300.0, max(cycle_s, duration_s / 288.0))


def run_clairvoyant(trace: Trace, subs: Mapping[str, Trace], cands: Mapping[str, Sequence[ConfigKey]],
                    caps: Mapping[ConfigKey, float], policy: Policy, env: Environment, settings: SimSettings,
                    max_count: Callable[[ConfigKey], int], objective: float) -> YardstickRun | None:
    """Per model the clairvoyant (the smallest margin whose schedule, replayed on the model's requests,
    serves `objective`), then every model's schedule replayed together on the whole trace. None: some
    model has no schedule that serves it within the inventory."""
    window_s = clairvoyant_window_s(policy.scaling.cycle_s, trace.duration_s)
    have: dict[str, int] = {}
    for h in policy.hosts:
        have[h.gpu.value] = have.get(h.gpu.value, 0) + h.gpu_count
    counts: dict[ConfigKey, tuple[int, ...]] = {}
    lead: dict[ConfigKey, float] = {}
    first_lead: dict[ConfigKey, float] = {}
    labels = []
    for m, sub in sorted(subs.items()):
        mp = policy.model(m)
        found = clairvoyant(sub, cands[m], caps, env, settings, max_count, have, objective, window_s,
                            mp.slo.period_s if mp is not None else None)
        if found is None or found.schedule is None:
            return None
        counts.update(found.schedule.counts)
        lead.update(found.schedule.lead_s)
        first_lead.update(found.schedule.first_lead_s)
        if found.low_setting is None:
            labels.append(f"{m} at {found.setting:g}x the window's rate")
        else:
            labels.append(f"{m} at {found.low_setting:g}x the window's rate, {found.setting:g}x in the "
                          f"{found.high_windows} windows where {found.low_setting:g}x missed")
    schedule = Schedule(window_s, counts, lead, first_lead)
    res = FleetSim(trace, ScheduleController("clairvoyant", schedule), env, settings).run()
    return YardstickRun(res, f"{window_s:g} s windows; " + "; ".join(labels), 0.0)


def run_hpa_tuned(replay_hpa: Callable[[float], SimResult], objective: float) -> YardstickRun | None:
    """hpa at the target utilisation with the fewest GPU-hours whose replay serves `objective`."""
    found = tuned_hpa(replay_hpa, objective)
    if found is None:
        return None
    tried = ", ".join(f"{t:g}: {h:.2f} GPU-h / {100 * a:.2f}%" for t, h, a in found.tried)
    return YardstickRun(replace(found.result, policy="hpa-tuned"),
                        f"target utilisation {found.setting:g} (tried {tried})", 0.0)


def run_yardsticks(names: Sequence[str], trace: Trace, subs: Mapping[str, Trace],
                   cands: Mapping[str, Sequence[ConfigKey]], caps: Mapping[ConfigKey, float], policy: Policy,
                   env: Environment, settings: SimSettings, replay_hpa: Callable[[float], SimResult],
                   max_count: Callable[[ConfigKey], int], objective: float,
                   progress: Callable[[str], None]) -> tuple[dict[str, YardstickRun], list[str]]:
    """The yardsticks of `names` (YARDSTICK_NAMES) on the trace: their runs, and a note for each that
    no setting makes serve `objective`."""
    runs: dict[str, YardstickRun] = {}
    notes: list[str] = []
    for name in (n for n in YARDSTICK_NAMES if n in names):
        t0 = time.perf_counter()
        run = (run_clairvoyant(trace, subs, cands, caps, policy, env, settings, max_count, objective)
               if name == "clairvoyant" else run_hpa_tuned(replay_hpa, objective))
        if run is None:
            notes.append(f"{name} left out: no setting it searches serves {100.0 * objective:g}% of the requests")
            continue
        runs[name] = replace(run, wall_s=time.perf_counter() - t0)
        progress(f"{name} found ({runs[name].wall_s:.0f} s)")
    return runs, notes
