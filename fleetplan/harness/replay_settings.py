"""The replay's settings from the daemon's own config: one source for both.

`fleetplan evaluate` replays a trace through the daemon's decisions; what the daemon reads and how
long it waits come from its controller config (controller/settings.py, wall seconds). This maps
that config onto the replay's observation windows (fleetplan.sim.des.SimSettings) and control
timeouts (fleetplan.sim.control.ControlSettings), in simulated seconds: wall seconds x
`time_scale` (a lab whose engines run K x faster than real time; 1 on a real fleet). The defaults
of the two sides agree (tests/unit/harness/test_replay_settings.py), so a replay without a config
is the daemon with its defaults.

Worked example: the demo's controller reads 12 s rate windows with its engines at 20x, so its
replay reads 240 s windows (`replay_settings(settings, time_scale=20).sim.window_s == 240`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fleetplan.controller.settings import ControllerSettings
from fleetplan.sim.control import ControlSettings
from fleetplan.sim.des import SimSettings

__all__ = ["ReplaySettings", "replay_settings"]


@dataclass(frozen=True)
class ReplaySettings:
    sim: SimSettings = field(default_factory=SimSettings)
    control: ControlSettings = field(default_factory=ControlSettings)


def replay_settings(cs: ControllerSettings, *, time_scale: float = 1.0, scrape_interval_s: float | None = None,
                    **sim_over: Any) -> ReplaySettings:
    """The replay's windows and timeouts for a daemon run with `cs` at `time_scale`;
    `scrape_interval_s`: the Prometheus' scrape interval for the engines, wall seconds (None: the
    replay's default); `sim_over`: further SimSettings fields (routing, prefix cache, the shared
    engine cache). A burst window shorter than two scrape intervals is refused: the daemon's burst
    query needs two samples in it (controller/settings.py `peak_window_s`), so the config is wrong
    for the live daemon as well."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
    k = time_scale
    if scrape_interval_s is not None:
        if not scrape_interval_s > 0:
            raise ValueError(f"the scrape interval must be > 0 s, got {scrape_interval_s!r}")
        if cs.peak_window_s < 2 * scrape_interval_s:
            raise ValueError(f"peak_window_s {cs.peak_window_s:g} of the controller config is shorter than two "
                             f"scrape intervals (2 x {scrape_interval_s:g} s): the burst query sees one sample or "
                             f"none; set peak_window_s >= {2 * scrape_interval_s:g}")
        sim_over = {"scrape_s": scrape_interval_s * k,
                    "scrape_delay_s": min(SimSettings().scrape_delay_s, scrape_interval_s * k / 2), **sim_over}
    sim = replace(SimSettings(), window_s=cs.observe_window_s * k, peak_window_s=cs.peak_window_s * k,
                  length_window_s=cs.length_window_s * k, history_s=cs.history_s * k,
                  history_step_s=cs.history_step_s * k, **sim_over)
    control = ControlSettings(ready_timeout_s=cs.ready_timeout_s * k, ack_timeout_s=cs.ack_timeout_s * k,
                              host_offline_grace_s=cs.host_offline_grace_s * k,
                              drain_timeout_s=cs.drain_timeout_s * k, drain_settle_s=cs.drain_settle_s * k,
                              drain_poll_s=cs.drain_poll_s * k, cycle_s=cs.cycle_s)  # already simulated s
    return ReplaySettings(sim, control)
