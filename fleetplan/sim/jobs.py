"""Where an evaluation's independent replays run: in this process, in worker processes of this
machine, or on a Ray cluster.

An evaluation is a set of independent jobs (one replay per policy, one ground-truth capacity per
config, one best-fixed search per config); each is a function of its arguments (the replay is a
function), so where it runs changes the wall time, never a figure. `open_jobs` chooses the place
and every place answers the same way: `submit(fn, *args)` returns a `concurrent.futures.Future`,
so the evaluation has one scheduling loop (fleetplan/sim/evaluate.py) for all three.

Ray is an optional extra (`pip install 'fleetplan[ray]'`, on every node of the cluster with
fleetplan's own dependencies): it is imported only when an address is given, and the fleetplan
package is shipped to the workers with the job (`runtime_env` `py_modules`).

>>> with open_jobs(workers=1) as jobs:
...     jobs.submit(pow, 2, 10).result()
1024
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Protocol

__all__ = ["InlineJobs", "Jobs", "JobsError", "RayJobs", "open_jobs"]


class JobsError(RuntimeError):
    """The place asked for cannot run jobs (Ray not installed, the cluster unreachable)."""


class Jobs(Protocol):
    """Runs independent jobs; `submit` returns at once with the job's future."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]: ...


class InlineJobs:
    """Runs each job when submitted, in this process (one worker: no fork, plain tracebacks)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:  # the job's error is the future's, raised by .result() as a pool's is
            fut.set_exception(e)
        return fut


class RayJobs:
    """Runs jobs as Ray tasks on the cluster at `address` ("auto": the cluster this machine is part
    of; "local": a cluster started for this process). An argument passed to several jobs (the trace,
    the policy, the profiles) is stored in the cluster's object store once."""

    def __init__(self, address: str) -> None:
        try:
            import ray
        except ImportError as e:
            raise JobsError(f"--ray {address}: Ray is not installed (pip install 'fleetplan[ray]')") from e
        import fleetplan

        self._ray = ray
        try:
            ray.init(address=None if address == "local" else address, ignore_reinit_error=True,
                     runtime_env={"py_modules": [fleetplan]}, log_to_driver=False)
        except ConnectionError as e:
            raise JobsError(f"--ray {address}: no Ray cluster answers there ({e})") from e
        self._remote: dict[Callable[..., Any], Any] = {}
        self._stored: dict[int, tuple[Any, Any]] = {}  # id(arg) -> (arg, its object ref); arg kept alive

    def _ref(self, arg: Any) -> Any:
        if isinstance(arg, (int, float, str, bool, type(None))):
            return arg
        hit = self._stored.get(id(arg))
        if hit is None:
            hit = self._stored[id(arg)] = (arg, self._ray.put(arg))
        return hit[1]

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        task = self._remote.get(fn)
        if task is None:
            task = self._remote[fn] = self._ray.remote(fn)
        fut: Future[Any] = task.remote(*(self._ref(a) for a in args)).future()
        return fut

    def close(self) -> None:
        self._stored.clear()
        self._ray.shutdown()


@contextlib.contextmanager
def open_jobs(*, workers: int, ray_address: str | None = None) -> Iterator[Jobs]:
    """The place the jobs run: Ray at `ray_address` when given, else `workers` forked processes of
    this machine (1: this process)."""
    if ray_address is not None:
        ray_jobs = RayJobs(ray_address)
        try:
            yield ray_jobs
        finally:
            ray_jobs.close()
    elif workers > 1:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            yield pool
    else:
        yield InlineJobs()
