"""The act core's routing and draining: which replicas nginx routes to and Prometheus scrapes
(`routes`), since when each serves (`ready_since`), one poll of a draining replica (`drain_step`)
and how long a drain may wait (`drain_deadline_s`). Pure; see `fleetplan.planner.act`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from fleetplan.planner.act_execute import unreported
from fleetplan.planner.act_types import HostReport, Phase, ReplicaRow, reported_by_id
from fleetplan.planner.types import ReplicaState

if TYPE_CHECKING:
    from fleetplan.planner.policy import ModelPolicy


@dataclass(frozen=True)
class Routes:
    """Where requests go and what Prometheus scrapes, by replica id."""

    serving: Mapping[str, tuple[str, ...]]  # model -> replicas nginx sends requests to
    scraped: tuple[str, ...]  # replicas Prometheus scrapes: ready, or draining (its last requests)


def routes(replicas: Sequence[ReplicaRow], hosts: Mapping[str, HostReport], models: Sequence[str], *,
           now_s: float, connected_since_s: float | None, grace_s: float) -> Routes | None:
    """The routing for `replicas` (the active rows): a replica serves when it is desired, its host
    reports it ready and the host is not lost (offline past `grace_s`: an agent restart keeps its
    engines routed). None while the hosts' reports are incomplete (MQTT down, or statuses still
    arriving after a restart): the routing written before stays as it is, because a view without
    the hosts that have not reported yet would take their serving replicas out of nginx (the fault
    suite's controller kill -9 mid drain: 4 requests answered 503 in the 0.2 s before the statuses).

    >>> from fleetplan.planner.act_types import ReportedReplica
    >>> row = ReplicaRow("r1", "h1", "m", "vllm", "h100", 4, "bf16", (0, 1, 2, 3), 8000, "vllm",
    ...                  Phase.DESIRED, "planned", 0.0, 0.0, None, None)
    >>> ready = HostReport("h1", True, replicas=(ReportedReplica("r1", ReplicaState.READY, "m", "vllm",
    ...                    "h100", 4, "bf16", (0, 1, 2, 3), 8000),))
    >>> routes([row], {"h1": ready}, ["m"], now_s=100.0, connected_since_s=0.0, grace_s=60.0).serving
    {'m': ('r1',)}
    >>> routes([row], {}, ["m"], now_s=10.0, connected_since_s=0.0, grace_s=60.0) is None  # h1 not heard yet
    True
    """
    if unreported({r.host for r in replicas}, hosts, now_s, connected_since_s, grace_s) is not None:
        return None
    reported = reported_by_id(hosts)
    serving: dict[str, list[str]] = {m: [] for m in models}
    scraped: list[str] = []
    for row in replicas:
        rep = reported.get(row.replica_id)
        ready = rep is not None and rep[1].state == ReplicaState.READY
        host = hosts.get(row.host)
        if row.phase == Phase.DESIRED and ready and host is not None and not host.lost(now_s, grace_s):
            serving.setdefault(row.model, []).append(row.replica_id)
        if ready or row.phase == Phase.DRAINING:
            scraped.append(row.replica_id)
    return Routes({m: tuple(ids) for m, ids in serving.items()}, tuple(scraped))


def ready_since(replicas: Sequence[ReplicaRow], hosts: Mapping[str, HostReport]) -> dict[str, float]:
    """Per replica its hosts report READY, when it became ready (unix seconds): the earlier of the
    agent's `since_s` and this controller's record (`ready_s`). The router sends a replica requests
    from the agent's READY on (routed at once, before the next cycle records it), so the agent's
    time is the start; an agent restarted since reports a later one, which the record caps; a
    record made late (a replica adopted after a lost state database) is capped by the agent's.

    >>> from fleetplan.planner.act_types import ReportedReplica
    >>> row = ReplicaRow("r1", "h1", "m", "vllm", "h100", 1, "bf16", (0,), 8000, "vllm", Phase.DESIRED,
    ...                  "planned", 0.0, 0.0, None, 130.0)
    >>> rep = ReportedReplica("r1", ReplicaState.READY, "m", "vllm", "h100", 1, "bf16", (0,), 8000, since_s=100.0)
    >>> ready_since([row], {"h1": HostReport("h1", True, replicas=(rep,))})
    {'r1': 100.0}
    """
    reported = reported_by_id(hosts)
    out: dict[str, float] = {}
    for row in replicas:
        rep = reported.get(row.replica_id)
        if rep is None or rep[1].state != ReplicaState.READY:
            continue
        times = [t for t in (rep[1].since_s, row.ready_s) if t is not None and math.isfinite(t)]
        if times:
            out[row.replica_id] = min(times)
    return out


# ---- draining -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainProgress:
    """A drain's state between polls of the replica's in-flight requests."""

    started_s: float
    zeros: int = 0  # consecutive polls that saw no request in flight
    last_inflight: float | None = None  # what the last poll saw (None: unknown)


class DrainStep(StrEnum):
    WAIT = "wait"
    DONE = "done"  # in-flight requests reached 0 (twice in a row: one poll may race a new request)
    TIMEOUT = "timeout"  # stopped anyway; alert


def drain_step(progress: DrainProgress, inflight: float | None, now_s: float,
               timeout_s: float) -> tuple[DrainStep, DrainProgress]:
    """One poll of a draining replica: `inflight` requests (None: unknown, e.g. metrics unreachable).

    >>> p = DrainProgress(started_s=0.0)
    >>> drain_step(p, 0.0, 5.0, 120.0)
    (<DrainStep.WAIT: 'wait'>, DrainProgress(started_s=0.0, zeros=1, last_inflight=0.0))
    >>> drain_step(DrainProgress(0.0, 1), 0.0, 10.0, 120.0)[0]
    <DrainStep.DONE: 'done'>
    >>> drain_step(DrainProgress(0.0, 1), None, 130.0, 120.0)[0]
    <DrainStep.TIMEOUT: 'timeout'>
    """
    if now_s - progress.started_s >= timeout_s:
        return DrainStep.TIMEOUT, progress
    zeros = progress.zeros + 1 if inflight is not None and inflight <= 0 else 0
    nxt = replace(progress, zeros=zeros, last_inflight=inflight)
    return (DrainStep.DONE if zeros >= 2 else DrainStep.WAIT), nxt


# A draining replica may serve its last requests slower than the SLO's pace (it may be the one
# that was overloaded): its longest request gets twice the SLO's time per token.
DRAIN_PACE_ALLOWANCE = 2.0


def drain_deadline_s(*, slo_ttft_s: float, slo_itl_s: float, max_output_tokens: float | None,
                     explicit_s: float | None, floor_s: float) -> float:
    """How long a drain waits for in-flight requests before the replica is stopped anyway: the
    policy's explicit `drain_timeout_s`, else the longest request at the SLO's pace (prefill plus
    `max_output_tokens` x p99 ITL, x DRAIN_PACE_ALLOWANCE), never below `floor_s`.

    >>> drain_deadline_s(slo_ttft_s=2.0, slo_itl_s=0.05, max_output_tokens=2000, explicit_s=None, floor_s=120.0)
    204.0
    >>> drain_deadline_s(slo_ttft_s=2.0, slo_itl_s=0.05, max_output_tokens=100, explicit_s=None, floor_s=120.0)
    120.0
    >>> drain_deadline_s(slo_ttft_s=2.0, slo_itl_s=0.05, max_output_tokens=2000, explicit_s=30.0, floor_s=120.0)
    30.0
    """
    if explicit_s is not None:
        return explicit_s
    if max_output_tokens is None:
        return floor_s
    return max(floor_s, DRAIN_PACE_ALLOWANCE * (slo_ttft_s + max_output_tokens * slo_itl_s))


def model_drain_deadline_s(m: ModelPolicy | None, *, floor_s: float, time_scale: float = 1.0) -> float:
    """`drain_deadline_s` of a policy model (None: the floor), on a clock `time_scale` times faster than
    the policy's (the lab's wall clock); the daemon's executor and the replay both ask it."""
    if m is None:
        return floor_s
    k = time_scale
    explicit = m.drain_timeout_s / k if m.drain_timeout_s is not None else None
    return drain_deadline_s(slo_ttft_s=m.slo.ttft_p99_ms / 1000 / k, slo_itl_s=m.slo.itl_p99_ms / 1000 / k,
                            max_output_tokens=m.max_output_tokens, explicit_s=explicit, floor_s=floor_s)
