"""The clairvoyant's schedule (CP-SAT over windows, lead times paid) and the yardsticks' search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.policy import load_policy_text
from fleetplan.planner.types import ConfigKey
from fleetplan.sim.des import SimResult
from fleetplan.sim.evaluate import make_environment, max_replicas
from fleetplan.sim.yardsticks import Schedule, _ladder_search, clairvoyant_schedule

REPO = Path(__file__).resolve().parents[3]
POLICY = load_policy_text((REPO / "config" / "example-policy.yaml").read_text(), "example-policy.yaml")
VLLM = ConfigKey("llama-3-8b", Engine.VLLM, GpuType.H100, 1, Precision.BF16)
TRT1 = ConfigKey("llama-3-8b", Engine.TRTLLM, GpuType.H100, 1, Precision.BF16)  # cached in the policy
TRT2 = ConfigKey("llama-3-8b", Engine.TRTLLM, GpuType.H100, 2, Precision.BF16)  # needs a 900 s build
ENV = make_environment(POLICY)
GPUS = {"h100": 32}


def _schedule(rates: list[float], caps: dict[ConfigKey, float], window_s: float = 60.0,
              margin: float = 1.0) -> Schedule:
    s = clairvoyant_schedule(rates, window_s, list(caps), caps, ENV.price_usd_h, ENV,
                             lambda c: max_replicas(POLICY, c), GPUS, margin)
    assert s is not None
    return s


def test_each_window_gets_the_fewest_replicas_that_carry_it() -> None:
    s = _schedule([5.0, 5.0, 25.0, 25.0, 5.0] + [0.0] * 10, {VLLM: 10.0})
    assert s.counts[VLLM][:5] == (1, 1, 3, 3, 1)
    assert s.lead_s[VLLM] == 60.0  # vLLM's startup in the policy


def test_a_gap_shorter_than_a_start_is_kept_a_longer_one_is_not() -> None:
    # vLLM starts in 60 s: stopping for one 30 s window and starting again costs more than holding
    short = _schedule([10.0, 0.0, 10.0], {VLLM: 10.0}, window_s=30.0)
    assert short.counts[VLLM] == (1, 1, 1)
    long = _schedule([10.0, 0.0, 0.0, 0.0, 10.0], {VLLM: 10.0}, window_s=30.0)
    assert long.counts[VLLM] == (1, 0, 0, 0, 1)


def test_the_cheaper_engine_per_capacity_carries_the_load_once_its_build_can_have_finished() -> None:
    # TRT TP2 carries 4x vLLM's rate per replica for 2 GPUs, but needs a 900 s build + 45 s startup
    caps = {VLLM: 10.0, TRT2: 40.0}
    s = _schedule([40.0] * 60, caps)  # an hour of 60 s windows
    trt = s.counts[TRT2]
    first = next(k for k, n in enumerate(trt) if n > 0)
    assert (first + 1) * 60.0 > 900.0 + 45.0  # not serving before it can have been built
    assert all(n == 1 for n in trt[first:])
    assert all(n == 4 for n in s.counts[VLLM][:first])  # vLLM carries it meanwhile
    assert s.first_lead_s[TRT2] == 945.0
    # asked for one build + start ahead of its first window
    assert s.targets_at(first * 60.0 - 945.0)[TRT2] == 1
    assert s.targets_at(first * 60.0 - 946.0)[TRT2] == 0


def test_a_cached_engine_needs_no_build() -> None:
    s = _schedule([40.0] * 10, {VLLM: 10.0, TRT1: 20.0})
    assert s.counts[TRT1] == (2,) * 10
    assert VLLM not in s.counts


def _result(gpu_hours: float, attainment: float) -> SimResult:
    n = 1000
    return SimResult("x", 3600.0, n, n, 0, 0, round(attainment * n), gpu_hours, 0.0, 0.0, np.zeros(0),
                     np.zeros(0), 0, 0, (), 0)


@pytest.mark.parametrize(("needs", "found"), [(1.1, 1.1), (0.6, 0.6), (3.0, 3.0), (9.0, None)])
def test_the_search_finds_the_cheapest_setting_that_serves_the_objective(needs: float, found: float | None) -> None:
    ladder = (0.6, 0.8, 1.0, 1.1, 1.5, 2.0, 3.0)
    runs: list[float] = []

    def run(m: float) -> SimResult:
        runs.append(m)
        return _result(m, 0.995 if m >= needs else 0.95)

    y = _ladder_search(ladder, run, 0.99)
    if found is None:
        assert y is None
        return
    assert y is not None and y.setting == found and y.result.gpu_hours == found
    assert len(runs) == len(set(runs))  # never a setting replayed twice


def test_a_schedule_that_changes_engine_keeps_the_old_replica_until_the_new_one_serves() -> None:
    """The yardstick's switch from vLLM to a TensorRT-LLM engine that needs a build: the vLLM replica
    is drained only once its replacement is READY (a rolling update with none unavailable), so the
    switch rejects no request even when the schedule's ask comes a tick late."""
    from fleetplan.sim.des import FleetSim
    from fleetplan.sim.evaluate import EvaluateOptions
    from fleetplan.sim.traces import Trace, TraceRequest
    from fleetplan.sim.yardsticks import ScheduleController

    # 1 rps for 40 min; vLLM for the first 20 min, TRT TP2 (a 900 s build) from then on. The ask is
    # made 30 s late (first_lead shorter than the build + startup): the old schedule executor drained
    # vLLM at the window's start, before TRT served, and rejected what came meanwhile
    reqs = tuple(TraceRequest(float(t), 256, 32, "llama-3-8b") for t in range(0, 2400))
    trace = Trace("switch", "synthetic", reqs)
    late = Schedule(1200.0, {VLLM: (1, 0), TRT2: (0, 1)}, {VLLM: 60.0, TRT2: 45.0}, {VLLM: 60.0, TRT2: 915.0})
    res = FleetSim(trace, ScheduleController("clairvoyant", late), ENV, EvaluateOptions().settings).run()
    assert res.rejected == 0
    by = dict(res.gpu_hours_by_config)
    assert by[TRT2] > 0 and by[VLLM] > 1200.0 / 3600.0  # vLLM held past its window until TRT served
