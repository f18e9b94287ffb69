"""The act core's routing and draining: which replicas nginx routes to, which the pool proxy sends
legs to, and which Prometheus scrapes (`routes`), since when each serves (`ready_since`), one poll
of a draining replica (`drain_step`), whose requests also hold a drain (`drain_holders`), how
long a drain may wait (`drain_deadline_s`) and how long a prefill replica's KV holds it (`kv_hold_s`). Pure; see `fleetplan.planner.act`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from fleetplan.models.config_key import Role
from fleetplan.planner.act_execute import unreported
from fleetplan.planner.act_types import HostReport, Phase, ReplicaRow, reported_by_id
from fleetplan.planner.types import ReplicaState

if TYPE_CHECKING:
    from fleetplan.planner.policy import ModelPolicy


@dataclass(frozen=True)
class Pools:
    """A disaggregated model's pool replicas by role (replica ids)."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    @property
    def serves(self) -> bool:
        """Whether a request can be served: it needs a prefill AND a decode replica."""
        return bool(self.prefill) and bool(self.decode)

    def ids(self) -> tuple[str, ...]:
        return (*self.prefill, *self.decode)

    def joined(self, other: Pools) -> Pools:
        """Both sides of `self` and `other` (in this order, each id once)."""
        return Pools(tuple(dict.fromkeys((*self.prefill, *other.prefill))),
                     tuple(dict.fromkeys((*self.decode, *other.decode))))


@dataclass(frozen=True)
class Routes:
    """Where requests go and what Prometheus scrapes, by replica id.

    A model's aggregated replicas are in its nginx upstream (`serving`). Its prefill and decode
    pools are reached through the pool proxy (controller/pool_proxy.py), which sends each request's
    prefill leg then its decode leg: the proxy joins the model's upstream only while the model has
    a ready prefill AND a ready decode replica (`proxied`), so a pool half-started (or half-drained)
    never takes a request it cannot finish; the aggregated replicas stay in the upstream until the
    planner drains them (it does once the pools serve: planner/actions.py make_before_break).
    """

    serving: Mapping[str, tuple[str, ...]]  # model -> aggregated replicas nginx sends requests to
    scraped: tuple[str, ...]  # replicas Prometheus scrapes: ready, or draining (its last requests)
    pools: Mapping[str, Pools] = field(default_factory=dict)  # model -> its ready pool replicas (desired)
    leaving: Mapping[str, Pools] = field(default_factory=dict)  # model -> its draining pool replicas

    @property
    def proxied(self) -> tuple[str, ...]:
        """The models whose pools serve: the proxy is in their nginx upstream."""
        return tuple(m for m, p in self.pools.items() if p.serves)

    def upstreams(self) -> dict[str, Pools]:
        """The proxy's table (its upstreams file): per model with pool replicas, the ready ones; a
        model not proxied also keeps its draining ones, so the requests the proxy took before it
        left the model's upstream finish both legs (a proxied model's draining replicas take no new
        leg: the ready ones do)."""
        out: dict[str, Pools] = {}
        for m in sorted({*self.pools, *self.leaving}):
            ready = self.pools.get(m, Pools())
            out[m] = ready if ready.serves else ready.joined(self.leaving.get(m, Pools()))
        return out

    def routed(self) -> frozenset[str]:
        """The replicas routing names: in an nginx upstream or in the proxy's table as ready."""
        return frozenset({rid for ids in self.serving.values() for rid in ids}
                         | {rid for p in self.pools.values() for rid in p.ids()})


def routes(replicas: Sequence[ReplicaRow], hosts: Mapping[str, HostReport], models: Sequence[str], *,
           now_s: float, connected_since_s: float | None, grace_s: float) -> Routes | None:
    """The routing for `replicas` (the active rows): a replica serves when it is desired, its host
    reports it ready and the host is not lost (offline past `grace_s`: an agent restart keeps its
    engines routed). None while the hosts' reports are incomplete (MQTT down, or statuses still
    arriving after a restart): the routing written before stays as it is, because a view without
    the hosts that have not reported yet would take their serving replicas out of nginx (the fault
    suite's controller kill -9 mid drain: 4 requests answered 503 in the 0.2 s before the statuses).
    An aggregated replica serves in its model's nginx upstream (`serving`), a prefill or decode
    replica in its model's pool (`pools`, by the row's role; `Routes.proxied` says which models'
    pools take requests).

    >>> from fleetplan.planner.act_types import ReportedReplica
    >>> def row(rid, role="aggregated"):
    ...     return ReplicaRow(rid, "h1", "m", "vllm", "h100", 1, "bf16", (0,), 8000, "vllm", Phase.DESIRED,
    ...                       "planned", 0.0, 0.0, None, None, role)
    >>> def ready(*rids):
    ...     return {"h1": HostReport("h1", True, replicas=tuple(ReportedReplica(r, ReplicaState.READY, "m", "vllm",
    ...             "h100", 1, "bf16", (0,), 8000) for r in rids))}
    >>> routes([row("r1")], ready("r1"), ["m"], now_s=100.0, connected_since_s=0.0, grace_s=60.0).serving
    {'m': ('r1',)}
    >>> routes([row("r1")], {}, ["m"], now_s=10.0, connected_since_s=0.0, grace_s=60.0) is None  # h1 not heard yet
    True

    Make-before-break between aggregated replicas and pools: a ready prefill replica alone is no
    route (its decode replica still starts); once both pools have a ready replica the proxy joins,
    beside the aggregated replica the planner has not drained yet.

    >>> rows = [row("a1"), row("p1", "prefill"), row("d1", "decode")]
    >>> r = routes(rows, ready("a1", "p1"), ["m"], now_s=100.0, connected_since_s=0.0, grace_s=60.0)
    >>> r.serving, r.pools, r.proxied
    ({'m': ('a1',)}, {'m': Pools(prefill=('p1',), decode=())}, ())
    >>> r = routes(rows, ready("a1", "p1", "d1"), ["m"], now_s=100.0, connected_since_s=0.0, grace_s=60.0)
    >>> r.serving, r.proxied, r.upstreams()
    ({'m': ('a1',)}, ('m',), {'m': Pools(prefill=('p1',), decode=('d1',))})

    On the way back the pools drain once aggregated replicas serve: the proxy leaves the upstream,
    and its table keeps the draining replicas for the requests it already took.

    >>> back = [row("a2"), replace(row("p1", "prefill"), phase=Phase.DRAINING),
    ...         replace(row("d1", "decode"), phase=Phase.DRAINING)]
    >>> r = routes(back, ready("a2", "p1", "d1"), ["m"], now_s=100.0, connected_since_s=0.0, grace_s=60.0)
    >>> r.serving, r.proxied, r.upstreams()
    ({'m': ('a2',)}, (), {'m': Pools(prefill=('p1',), decode=('d1',))})
    """
    if unreported({r.host for r in replicas}, hosts, now_s, connected_since_s, grace_s) is not None:
        return None
    reported = reported_by_id(hosts)
    serving: dict[str, list[str]] = {m: [] for m in models}
    pools: dict[str, dict[Role, list[str]]] = {}
    leaving: dict[str, dict[Role, list[str]]] = {}
    scraped: list[str] = []
    for row in replicas:
        rep = reported.get(row.replica_id)
        ready = rep is not None and rep[1].state == ReplicaState.READY
        host = hosts.get(row.host)
        role = Role(row.role)
        if row.phase == Phase.DESIRED and ready and host is not None and not host.lost(now_s, grace_s):
            if role is Role.AGGREGATED:
                serving.setdefault(row.model, []).append(row.replica_id)
            else:
                pools.setdefault(row.model, {}).setdefault(role, []).append(row.replica_id)
        elif row.phase == Phase.DRAINING and role is not Role.AGGREGATED:
            leaving.setdefault(row.model, {}).setdefault(role, []).append(row.replica_id)
        if ready or row.phase == Phase.DRAINING:
            scraped.append(row.replica_id)

    def by_model(found: Mapping[str, Mapping[Role, list[str]]]) -> dict[str, Pools]:
        return {m: Pools(tuple(s.get(Role.PREFILL, ())), tuple(s.get(Role.DECODE, ()))) for m, s in found.items()}

    return Routes({m: tuple(ids) for m, ids in serving.items()}, tuple(scraped), by_model(pools), by_model(leaving))


def drain_holders(replicas: Sequence[ReplicaRow], hosts: Mapping[str, HostReport], row: ReplicaRow) -> tuple[str, ...]:
    """The replicas whose requests in flight also hold `row`'s drain: a decode replica that is its
    model's last (no other desired decode replica is ready) stays up while the model's prefill
    replicas still hold requests, since each of those takes a decode leg once its prefill ends
    (the replay's proxy keeps such a replica up the same way: sim/disagg_proxy.py `_holds_decode`).

    >>> from fleetplan.planner.act_types import ReportedReplica
    >>> def row(rid, role, phase=Phase.DRAINING):
    ...     return ReplicaRow(rid, "h1", "m", "vllm", "h100", 1, "bf16", (0,), 8000, "vllm", phase,
    ...                       "planned", 0.0, 0.0, None, None, role)
    >>> d1, p1 = row("d1", "decode"), row("p1", "prefill")
    >>> drain_holders([d1, p1], {}, d1)
    ('p1',)
    >>> d2 = row("d2", "decode", Phase.DESIRED)
    >>> up = {"h1": HostReport("h1", True, replicas=(ReportedReplica("d2", ReplicaState.READY, "m", "vllm", "h100",
    ...       1, "bf16", (0,), 8000),))}
    >>> drain_holders([d1, d2, p1], up, d1)  # another decode replica takes the legs
    ()
    >>> drain_holders([d1, p1], {}, p1)
    ()
    """
    if row.role != Role.DECODE.value:
        return ()
    reported = reported_by_id(hosts)
    for r in replicas:
        if (r.model == row.model and r.role == Role.DECODE.value and r.replica_id != row.replica_id
                and r.phase == Phase.DESIRED):
            rep = reported.get(r.replica_id)
            if rep is not None and rep[1].state == ReplicaState.READY:
                return ()
    return tuple(r.replica_id for r in replicas if r.model == row.model and r.role == Role.PREFILL.value
                 and r.phase in (Phase.DESIRED, Phase.DRAINING))


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
    zero_since_s: float | None = None  # when the polls first saw none in flight (None: some now)


class DrainStep(StrEnum):
    WAIT = "wait"
    DONE = "done"  # in-flight requests reached 0 (twice in a row: one poll may race a new request)
    TIMEOUT = "timeout"  # stopped anyway; alert


def drain_step(progress: DrainProgress, inflight: float | None, now_s: float,
               timeout_s: float, hold_s: float = 0.0) -> tuple[DrainStep, DrainProgress]:
    """One poll of a draining replica: `inflight` requests (None: unknown, e.g. metrics unreachable).
    Done once two polls in a row saw none in flight, `hold_s` or more after the first of them (a
    prefill replica's last KV caches wait for the decode side to pull them: `kv_hold_s`).

    >>> p = DrainProgress(started_s=0.0)
    >>> drain_step(p, 0.0, 5.0, 120.0)
    (<DrainStep.WAIT: 'wait'>, DrainProgress(started_s=0.0, zeros=1, last_inflight=0.0, zero_since_s=5.0))
    >>> drain_step(DrainProgress(0.0, 1, 0.0, 5.0), 0.0, 10.0, 120.0)[0]
    <DrainStep.DONE: 'done'>
    >>> drain_step(DrainProgress(0.0, 1, 0.0, 5.0), 0.0, 10.0, 120.0, hold_s=15.0)[0]  # a prefill's KV held
    <DrainStep.WAIT: 'wait'>
    >>> drain_step(DrainProgress(0.0, 1), None, 130.0, 120.0)[0]
    <DrainStep.TIMEOUT: 'timeout'>
    """
    if now_s - progress.started_s >= timeout_s:
        return DrainStep.TIMEOUT, progress
    idle = inflight is not None and inflight <= 0
    zeros = progress.zeros + 1 if idle else 0
    since = (progress.zero_since_s if progress.zero_since_s is not None else now_s) if idle else None
    nxt = replace(progress, zeros=zeros, last_inflight=inflight, zero_since_s=since)
    done = zeros >= 2 and since is not None and now_s - since >= hold_s
    return (DrainStep.DONE if done else DrainStep.WAIT), nxt


def kv_hold_s(m: ModelPolicy | None, role: str, *, time_scale: float = 1.0) -> float:
    """How long a draining replica of `role` waits after its last request before it stops: a prefill
    replica's engine holds each finished request's KV cache until the decode replica pulls it
    (vLLM's NixlConnector: the decode engine reads the blocks when it schedules the request), which
    a request within its SLO does before its TTFT target; stopping sooner loses the KV of the
    last requests it handed over. Other roles: 0. On a clock `time_scale` times faster than the
    policy's (the lab's wall clock).

    >>> kv_hold_s(None, "prefill")
    0.0
    """
    if m is None or role != Role.PREFILL.value:
        return 0.0
    return m.slo.ttft_p99_ms / 1000.0 / time_scale


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
