"""When a replayed fleet moved between engines: its builds, and when each engine served.

The seeds' headline is a graduation: start a model on vLLM (ready in ~90 s), build its
TensorRT-LLM engine (15-45 min) once the steady base pays it back, serve the base on TensorRT-LLM
and let vLLM go. `graduation` reads it off a replay's result: the builds' windows and, per engine,
when it first served, when it stopped serving for good (None: it serves at the end) and the share of
the run it served in.

>>> from fleetplan.models.names import Engine, GpuType, Precision
>>> from fleetplan.sim.des_types import TimelinePoint
>>> v = ConfigKey("m", Engine.VLLM, GpuType("h100"), 1, Precision.BF16)
>>> t = ConfigKey("m", Engine.TRTLLM, GpuType("h100"), 1, Precision.BF16)
>>> tl = [TimelinePoint(0.0, 1.0, ((v, 1),), 1, 1), TimelinePoint(60.0, 1.0, ((v, 1), (t, 1)), 2, 2),
...       TimelinePoint(120.0, 1.0, ((t, 1),), 1, 1), TimelinePoint(180.0, 1.0, ((t, 1),), 1, 1)]
>>> g = graduation(tl, [(-840.0, 60.0, t)])
>>> g.to_json()["serving"]["vllm"], g.to_json()["serving"]["trtllm"]["first_ready_s"]
({'first_ready_s': 0.0, 'gone_s': 120.0, 'serving_share': 0.5}, 60.0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fleetplan.planner.types import ConfigKey
from fleetplan.sim.des_types import TimelinePoint

__all__ = ["EngineServing", "Graduation", "graduation"]


@dataclass(frozen=True)
class EngineServing:
    engine: str
    first_ready_s: float  # the first timeline point with a READY replica of the engine
    gone_s: float | None  # from here on no replica of the engine is READY (None: it serves at the end)
    serving_share: float  # share of the timeline's points with one READY or more


@dataclass(frozen=True)
class Graduation:
    builds: tuple[tuple[float, float, str], ...]  # (start_s, done_s, config label)
    serving: tuple[EngineServing, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "builds": [{"config": c, "start_s": round(a, 1), "done_s": round(b, 1)} for a, b, c in self.builds],
            "serving": {e.engine: {"first_ready_s": round(e.first_ready_s, 1),
                                   "gone_s": None if e.gone_s is None else round(e.gone_s, 1),
                                   "serving_share": round(e.serving_share, 4)} for e in self.serving},
        }


def graduation(timeline: Sequence[TimelinePoint],
               build_windows: Iterable[tuple[float, float, ConfigKey]]) -> Graduation:
    """The builds and each engine's serving span of one replay (see the module docstring)."""
    engines = sorted({c.engine.value for p in timeline for c, n in p.ready if n > 0})
    serving: list[EngineServing] = []
    for engine in engines:
        up = [any(c.engine.value == engine and n > 0 for c, n in p.ready) for p in timeline]
        first = next(i for i, u in enumerate(up) if u)
        last = max(i for i, u in enumerate(up) if u)
        gone = timeline[last + 1].t_s if last + 1 < len(timeline) else None
        serving.append(EngineServing(engine, timeline[first].t_s, gone, sum(up) / len(up)))
    return Graduation(tuple((a, b, c.label()) for a, b, c in sorted(build_windows, key=lambda w: w[:2])),
                      tuple(serving))
