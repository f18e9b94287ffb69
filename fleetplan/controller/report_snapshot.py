"""What the report API serves, made ready before anyone asks.

The report (GET /api/report), the explanations (/api/explain/<model>) and the plan page (/plan)
are gathered on the event loop once per cycle and after a change made through the API (pause,
resume), then rendered to bytes in a worker thread; the handlers send those bytes. A reader never
builds or renders them: one that arrives while a render is in flight waits for that render (so a
request made after a cycle sees that cycle), the others are served the last one. The cost of the
report on the loop is one gather per cycle, whatever the number of readers.

The planner's inputs (/api/state, for `fleetplan what-if --controller`: the fleet, the policy, the
last observation with its rate history, the profiles; megabytes at 1,000 hosts) are gathered at
most once per snapshot and only when asked for: the first request after a cycle gathers them (the
fleet is read on the loop), the serialization runs in a worker thread, later requests share it.

/metrics is rendered in a worker thread too, at most once per `METRICS_MAX_AGE_S`; scrapes that
arrive meanwhile share that render.

The plan page's 24 h of decision records are kept in memory and read incrementally: each gather
reads only the records stored since the last one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fleetplan.controller.page import DAY_S, render_page, series_from_decisions

log = logging.getLogger(__name__)

METRICS_MAX_AGE_S = 1.0  # /metrics: an exposition younger than this is served as it is
DECISIONS_KEPT = 5000  # the plan page's decision records, at most (StateStore.decisions' limit)


class ReportSource(Protocol):
    """What a gather reads from the controller (controller/daemon.py Controller)."""

    time_scale: float
    store: Any
    metrics: Any  # controller/metrics.py ControllerMetrics

    def report(self) -> dict[str, Any]: ...

    def wall(self) -> float: ...


@dataclass(frozen=True)
class Gathered:
    """One gather: plain data, handed over whole to the render thread (nothing else holds it)."""

    seq: int
    report: dict[str, Any]
    decisions: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Rendered:
    """The bytes the report API serves, from gather number `seq`."""

    seq: int
    cycle_id: int | None
    generated_s: float | None
    report: bytes
    page: bytes
    explain: Mapping[str, bytes]  # model -> the explanation's JSON


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, default=str).encode()


def render(g: Gathered) -> Rendered:
    """The bytes of one gather (pure; runs in a worker thread)."""
    from fleetplan.controller.plan_text import explanation_for

    data = g.report
    now_s = float(data.get("now_s") or 0.0)
    page = render_page(data, series_from_decisions(g.decisions, now_s), now_s)
    models = [m.get("model") for m in ((data.get("plan") or {}).get("explanation") or {}).get("models", [])]
    explain = {str(m): dumps(explanation_for(data, str(m))) for m in models}
    return Rendered(seq=g.seq, cycle_id=data.get("cycle_id"), generated_s=data.get("generated_s"),
                    report=dumps(data), page=page.encode(), explain=explain)


class DecisionWindow:
    """The decision records of the plan page's window (24 h of simulated time), oldest first; each
    update reads from the store only those created since the newest one it holds."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.read = 0  # records read from the store so far

    def update(self, store: Any, since_wall_s: float) -> tuple[dict[str, Any], ...]:
        start = since_wall_s if not self.rows else max(since_wall_s, float(self.rows[-1]["created_s"]))
        last = int(self.rows[-1].get("cycle_id") or 0) if self.rows else None
        new = store.decisions(start)
        self.read += len(new)
        self.rows.extend(r for r in new if last is None or int(r.get("cycle_id") or 0) > last)
        first = next((i for i, r in enumerate(self.rows) if float(r["created_s"]) >= since_wall_s), len(self.rows))
        del self.rows[:max(first, len(self.rows) - DECISIONS_KEPT)]
        return tuple(self.rows)


class ReportSnapshot:
    """The report API's current `Rendered` and the render in flight. `refresh` (event loop) gathers
    and starts a render; `latest` (a handler) waits for the newest render started, never starts one.
    Nothing is gathered until `serve()` (the report server started)."""

    def __init__(self, render_fn: Callable[[Gathered], Rendered] = render) -> None:
        self.current: Rendered | None = None
        self.gathers = 0  # gathers on the event loop (one per cycle and per change)
        self.renders = 0  # renders finished in the worker thread
        self.serving = False
        self.waiting = 0  # readers waiting for the render in flight
        self._render = render_fn
        self._next: asyncio.Future[Rendered] | None = None
        self._window = DecisionWindow()
        self.exposition: Exposition | None = None  # /metrics
        self._state: tuple[int, asyncio.Future[bytes]] | None = None  # (gather seq, its /api/state body)
        self.state_gathers = 0

    def serve(self, ctrl: ReportSource) -> None:
        """The report server is up: gather the first snapshot now, and at every refresh from now on."""
        self.serving = True
        self.exposition = Exposition(ctrl.metrics.render)
        self.refresh(ctrl)

    def refresh(self, ctrl: ReportSource) -> None:
        """Gather the report on the event loop and render it in a worker thread (end of a cycle, a
        pause or resume). A gather that fails keeps the last snapshot (logged, never raised: the
        cycle that calls this has finished its work)."""
        if not self.serving:
            return
        try:
            since = ctrl.wall() - DAY_S / max(float(ctrl.time_scale), 1e-9)
            g = Gathered(self.gathers + 1, ctrl.report(), self._window.update(ctrl.store, since))
        except Exception:
            log.exception("report snapshot: gather failed; the API serves the last one")
            return
        self.gathers = g.seq
        fut = asyncio.get_running_loop().run_in_executor(None, self._render, g)
        fut.add_done_callback(self._rendered)
        self._next = fut

    def _rendered(self, fut: asyncio.Future[Rendered]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            exc = fut.exception()
            log.error("report snapshot: render failed (%s: %s); the API serves the last one",
                      type(exc).__name__, exc)
        self._take(fut)

    def _take(self, fut: asyncio.Future[Rendered]) -> None:
        """A finished render becomes the current one unless a newer one already is."""
        if fut.cancelled() or fut.exception() is not None:
            return
        r = fut.result()
        if self.current is None or r.seq > self.current.seq:
            self.current = r
            self.renders += 1

    async def state(self, gather: Callable[[], Callable[[], dict[str, Any]]]) -> bytes:
        """/api/state's body for the current snapshot: `gather()` (event loop) returns the function
        that builds the document (worker thread); once per snapshot, shared by concurrent requests."""
        seq = self.gathers
        if self._state is None or self._state[0] != seq or (self._state[1].done() and (
                self._state[1].cancelled() or self._state[1].exception() is not None)):
            build = gather()
            self.state_gathers += 1
            fut = asyncio.get_running_loop().run_in_executor(None, lambda: dumps(build()))
            self._state = (seq, fut)
        fut = self._state[1]
        await asyncio.wait([fut])
        return fut.result()

    async def latest(self) -> Rendered | None:
        """The newest snapshot: the render in flight once it finishes, else the current one."""
        nxt = self._next
        if nxt is not None:
            if not nxt.done():
                self.waiting += 1
                try:  # asyncio.wait: a reader cancelled by its client does not cancel the render
                    await asyncio.wait([nxt])
                finally:
                    self.waiting -= 1
            self._take(nxt)  # its done callback may not have run yet
        return self.current


class Exposition:
    """GET /metrics: `render_fn` (the registry's exposition) in a worker thread, at most once per
    `max_age_s`; scrapes that arrive while it renders wait for that render."""

    def __init__(self, render_fn: Callable[[], bytes], max_age_s: float = METRICS_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._render = render_fn
        self.max_age_s = max_age_s
        self._clock = clock
        self._body: bytes | None = None
        self._at = 0.0
        self._task: asyncio.Future[bytes] | None = None
        self.renders = 0

    async def get(self) -> bytes:
        if self._body is not None and self._clock() - self._at < self.max_age_s:
            return self._body
        if self._task is None or self._task.done():
            started = self._clock()
            self._task = asyncio.get_running_loop().run_in_executor(None, self._render)
            self._task.add_done_callback(lambda f: self._done(f, started))
        task = self._task
        await asyncio.wait([task])
        return task.result()

    def _done(self, fut: asyncio.Future[bytes], started: float) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.renders += 1
            self._body, self._at = fut.result(), started
