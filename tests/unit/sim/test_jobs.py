"""Where an evaluation's jobs run (fleetplan.sim.jobs): the place changes the wall time, never a figure."""

from __future__ import annotations

import os
import sys

import pytest

from fleetplan.planner.policy import Policy
from fleetplan.planner.types import ConfigKey
from fleetplan.sim.evaluate import EvaluateOptions, evaluate
from fleetplan.sim.jobs import InlineJobs, JobsError, RayJobs, open_jobs
from tests.unit.sim.test_evaluate_policies import synthetic, world

World = tuple[Policy, object, dict[ConfigKey, float]]
__all__ = ["world"]  # the fixture, shared with the evaluation's invariants


def _fail(x: int) -> int:
    raise ValueError(f"job {x} failed")


def test_inline_jobs_run_at_submit_and_keep_the_error_for_result() -> None:
    jobs = InlineJobs()
    assert jobs.submit(divmod, 7, 2).result() == (3, 1)
    fut = jobs.submit(_fail, 3)
    assert fut.done()
    with pytest.raises(ValueError, match="job 3 failed"):
        fut.result()


def test_several_workers_run_in_other_processes() -> None:
    with open_jobs(workers=1) as one:
        assert one.submit(os.getpid).result() == os.getpid()
    with open_jobs(workers=2) as two:
        assert two.submit(os.getpid).result() != os.getpid()


def test_ray_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(JobsError, match=r"--ray auto: Ray is not installed \(pip install 'fleetplan\[ray\]'\)"):
        RayJobs("auto")


def _figures(world: World, workers: int, ray_address: str | None = None) -> dict[str, object]:
    # the replays and the best-fixed searches go through the place (the capacities are the fixture's)
    policy, profiles, caps = world
    trace = synthetic([(120.0, 6.0), (120.0, 12.0)], seed=5)
    ev = evaluate(trace, policy, profiles,  # type: ignore[arg-type]
                  EvaluateOptions(policies=("fleetplan", "best-fixed", "oracle"), workers=workers,
                                  ray_address=ray_address), capacities=caps)
    doc = ev.to_json()
    doc["trace"].pop("evaluation_wall_s")
    for pol in doc["policies"].values():
        pol.pop("sim_wall_s", None)
    return doc


def test_one_worker_and_two_give_the_same_figures(world: World) -> None:
    one = _figures(world, 1)
    assert one["policies"]["best-fixed"]["gpu_hours"] > 0  # type: ignore[index]
    assert one == _figures(world, 2)


def test_a_local_ray_cluster_gives_the_same_figures(world: World) -> None:
    pytest.importorskip("ray")  # the optional extra: pip install 'fleetplan[ray]'
    assert _figures(world, 1) == _figures(world, 1, ray_address="local")
