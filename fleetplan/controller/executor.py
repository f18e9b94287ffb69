"""The controller's hands: it carries out what the act core (planner/act.py) decides.

`Executor` is the daemon's act-loop port (planner/act_port.py `Port`): the daemon runs the loop's
steps (`act_port.reconcile` inside `reconcile`, `act_port.execute`, `act_port.drain`) with it, as
the replay runs them with sim/control.py `ReplayControl`.

Inputs to the core: `view()` (the hosts' last reports + this controller's records). Effects of
its decisions: rows committed in one transaction (`apply`), then desired states published
(`publish_hosts`: staged version+1 committed before the MQTT publish; acks are never awaited
here: the next reconcile republishes what stays unacked and acts on refusals), routing files
written (`update_routing`: nginx, Prometheus' targets, the pool proxy's upstreams file), drains
run (`drain`: out of the upstream, wait for in-flight requests to reach 0 or the drain deadline,
then out of the desired state).

Each reconcile also keeps the records: the hosts' inventory records in step with the store
(`HostBook.sync_inventory`) and one bounded step of the store's retention
(controller/state_retention.py). A deferral the act core repeats is one action-log row with a
count (`deferrals`), logged once when it begins.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import sqlite3
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetplan.controller.hosts import HostBook, retained_replica
from fleetplan.controller.link import MqttLink
from fleetplan.controller.metrics import ControllerMetrics
from fleetplan.controller.observe import _RUNNING, _WAITING, PromClient, PrometheusError
from fleetplan.controller.policy_source import PolicySource
from fleetplan.controller.pool_table import (
    ModelPools,
    TableError,
    parse_table,
    render_table,
    table_before_router,
    table_generation,
)
from fleetplan.controller.protocol import desired_topic
from fleetplan.controller.settings import ControllerSettings
from fleetplan.controller.state import Phase, ReplicaRow, StateStore
from fleetplan.controller.state_retention import DAY_S, RetentionRules, prune_step
from fleetplan.models.config_key import Role
from fleetplan.planner import act, act_port, records
from fleetplan.planner.act import ActDecision, ActSettings, ActView
from fleetplan.planner.act_types import AlertKey, AlertKind, DeferKey, Deferral, Repeat
from fleetplan.planner.policy import ModelPolicy
from fleetplan.planner.queries import ROLE_LABEL
from fleetplan.shared.atomic import atomic_write_text

log = logging.getLogger(__name__)


# Back-pressure: at most this many QoS 1 publishes wait for the broker at once (a rollout to 1,000
# hosts must not queue 1,000 messages in the client: paho warns and the broker may drop them).
MAX_PUBLISHES_IN_FLIGHT = 32
# act-core alerts also logged when raised (or when their text changes): a replica or host the
# controller does not act on as asked
_LOGGED_ALERTS = frozenset({AlertKind.ORPHAN, AlertKind.REJECTED, AlertKind.UNREACHABLE})


def _engine_metrics_path(engine: str) -> str:
    return "/prometheus/metrics" if engine == "trtllm" else "/metrics"


# A sample of the in-flight gauges (text exposition format): the name (a longer name is another
# metric: vllm:num_requests_waiting_by_reason), labels whose quoted values may hold "}" or \",
# the value, an optional timestamp. A line with the name that does not parse has no `value`.
_INFLIGHT_RE = re.compile(
    rf"[ \t]*(?:{_RUNNING}|{_WAITING})(?=[{{ \t]|$)"
    r'(?:(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+'
    r"(?:(?P<value>[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)|\S+)(?:[ \t]+-?[0-9]+)?[ \t]*$)?"
)


def inflight_from_metrics(text: str) -> float | None:
    r"""running + waiting requests from an engine's /metrics exposition; None if not exported or
    unknown: a sample that is not a finite, non-negative number (NaN, +Inf, -1, 1e999, a missing or
    unparsable value) makes the count unknown, not 0 (a drain must not finish on it).

    >>> inflight_from_metrics('vllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting 2\n')
    5.0
    >>> inflight_from_metrics('trtllm_num_requests_running 0 1712345678000\n')  # with a timestamp
    0.0
    >>> inflight_from_metrics('vllm:num_requests_waiting_by_reason{reason="x"} 9\n') is None  # not exported
    True
    >>> [inflight_from_metrics(f"vllm:num_requests_running 1\nvllm:num_requests_waiting {v}\n")
    ...  for v in ("NaN", "+Inf", "-1", "1e999", "", "two")]
    [None, None, None, None, None, None]
    """
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _INFLIGHT_RE.match(line)
        if m is None:
            continue  # another metric
        raw = m.group("value")  # None: NaN, +Inf, a missing or unparsable value
        value = float(raw) if raw is not None else math.nan
        if not (math.isfinite(value) and value >= 0):
            return None
        seen = True
        total += value
    return total if seen and math.isfinite(total) else None


def inflight_from_prometheus(values: Sequence[float]) -> float | None:
    """running + waiting requests from the values of Prometheus' `sum(<in-flight gauges>)`; None
    ("unknown") unless it answered one finite, non-negative number: no series (not exported), NaN
    (a gauge exported as NaN, an unparsable value), +Inf, -Inf, -1 or more than one sample are
    unknown, never 0 (planner/act.py drain_step counts `inflight <= 0` as idle: a drain must not
    finish on it).

    >>> inflight_from_prometheus([5.0]), inflight_from_prometheus([0.0]), inflight_from_prometheus([-0.0])
    (5.0, 0.0, 0.0)
    >>> [inflight_from_prometheus(v) for v in ([], [math.nan], [math.inf], [-math.inf], [-1.0], [1.0, 2.0])]
    [None, None, None, None, None, None]
    """
    if len(values) != 1:
        return None
    value = values[0]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value) + 0.0  # -0.0 -> 0.0


@dataclass
class Executor:
    settings: ControllerSettings
    store: StateStore
    link: MqttLink
    hosts: HostBook
    alerts: MutableMapping[AlertKey, str]
    metrics: ControllerMetrics
    prom: PromClient
    lock: asyncio.Lock  # the cycle's lock: a finished drain changes the records between cycles
    policy: PolicySource  # model names, advisory mode (publishes and routes nothing), agent templates
    wall: Callable[[], float] = time.time
    time_scale: float = 1.0  # simulated seconds per wall second (lab); the policy's times are simulated
    router: Any = None
    routed: set[str] = field(default_factory=set)  # replica ids in the nginx upstreams or the proxy's table right now
    # models whose nginx upstream holds the pool proxy (None: not known yet in this process)
    proxied: frozenset[str] | None = None
    pool_table: dict[str, ModelPools] | None = None  # the pool proxy's table as last written
    proxy_missed: str | None = None  # the table generation the pool proxy did not take in time
    desired_ids: set[str] = field(default_factory=set)  # replica ids in phase desired at the last routing update
    republish_all: bool = False
    connected_wall: float = 0.0  # set on each (re)connect
    noted: set[tuple[str, str]] = field(default_factory=set)
    pending_publish: set[str] = field(default_factory=set)
    drains: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    deferrals: dict[DeferKey, Deferral] = field(default_factory=dict)  # open since an earlier cycle
    _routing_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    RETENTION_ALERT = AlertKey(AlertKind.RETENTION)
    POOL_PROXY_ALERT = AlertKey(AlertKind.ROUTING, "pool-proxy")  # the pool proxy does not take its table

    def __post_init__(self) -> None:
        if self.hosts is not None and self.store is not None:  # (tests build an Executor of parts)
            self.hosts.sync_inventory(self.store)  # the recorded inventories, before any report is judged
        r = self.settings.retention
        self.retention = RetentionRules(keep_s=r.keep_days * DAY_S, keep_documents_s=r.keep_plans_days * DAY_S,
                                        max_bytes=int(r.max_mb * 1024 * 1024), rows_per_cycle=r.rows_per_cycle)

    def address(self, host: str) -> str:
        return self.settings.host_addresses.get(host) or self.settings.default_host_address or host

    def endpoint(self, row: ReplicaRow) -> str:
        return f"{self.address(row.host)}:{row.port}"

    # ---- routing -----------------------------------------------------------------------------
    async def update_routing(self) -> None:
        """nginx upstreams + endpoints JSON: ready, non-draining aggregated replicas, and the pool
        proxy for a model whose prefill and decode pools both have a ready replica; the proxy's
        upstreams file: the pools (written before the proxy joins an upstream, emptied only after it
        left); file_sd: ready or draining."""
        if self.policy.advisory():
            return
        async with self._routing_lock:
            await self._update_routing()

    async def _update_routing(self) -> None:
        from fleetplan.controller.routing import ScrapeTarget, write_endpoints_json, write_file_sd
        from fleetplan.planner.act import routes

        rows = self.store.active_replicas()
        self.desired_ids = {row.replica_id for row in rows if row.phase == Phase.DESIRED}
        connected = self.connected_wall if self.link.connected.is_set() else None
        decided = routes(rows, self.hosts.reports(), self.policy.model_names(), now_s=self.wall(),
                         connected_since_s=connected, grace_s=self.settings.host_offline_grace_s)
        if decided is None:
            return  # statuses still arriving (or MQTT down): the files written before stay
        by_id = {row.replica_id: row for row in rows}
        proxy = self.settings.routing.pool_proxy
        proxied = frozenset(decided.proxied) if proxy is not None else frozenset()
        # a model's aggregated replicas, and the pool proxy while both its pools have a ready replica
        endpoints = {m: [self.endpoint(by_id[rid]) for rid in ids] for m, ids in decided.serving.items()}
        if proxy is not None:
            for m in proxied:
                endpoints.setdefault(m, []).append(proxy.address)
        # a pool replica's target carries its role, so the per-model queries count each request once
        # (controller/observe.py ROLE_LABEL); an aggregated one's labels are as before roles
        targets = [ScrapeTarget(self.endpoint(row), row.model, row.engine, row.host, row.replica_id,
                                extra_labels=() if row.role == Role.AGGREGATED.value else ((ROLE_LABEL, row.role),))
                   for row in (by_id[rid] for rid in decided.scraped)]
        r = self.settings.routing
        try:
            if proxy is not None:
                # each URL with its host: the proxy hands a prefill's KV to a decode replica beside it
                table = {m: ModelPools(m, tuple(self._url(by_id[i]) for i in p.prefill),
                                       tuple(self._url(by_id[i]) for i in p.decode),
                                       tuple(sorted({(self._url(by_id[i]), by_id[i].host)
                                                     for i in (*p.prefill, *p.decode)})))
                         for m, p in decided.upstreams().items()}
                current = self._pool_table_now(proxy.upstreams_path)
                # the proxy's file before the router: its pools are there before the proxy joins a
                # model's upstream; a model the proxy leaves keeps them until the router is reloaded
                leaving = (self.proxied if self.proxied is not None else frozenset(current)) - proxied
                first = await asyncio.to_thread(self._write_pool_table, proxy.upstreams_path,
                                                table_before_router(current, table, leaving))
                joining = proxied - (self.proxied or frozenset())
                if joining and not await self._proxy_serves(first):
                    proxied -= joining  # the proxy has not the pools: not in those upstreams (alert)
                    for m in joining:
                        endpoints[m] = [e for e in endpoints[m] if e != proxy.address]
            if r.file_sd_path is not None:
                await asyncio.to_thread(write_file_sd, r.file_sd_path, targets)
            if r.endpoints_path is not None:
                await asyncio.to_thread(write_endpoints_json, r.endpoints_path, endpoints)
            if self.router is not None:
                await asyncio.to_thread(self.router.apply, endpoints)
            self.proxied = proxied
            if proxy is not None:
                await asyncio.to_thread(self._write_pool_table, proxy.upstreams_path, table)
            self.routed = set(decided.routed())
            if proxied == frozenset(decided.proxied):  # every model whose pools serve is routed to them
                self.alerts.pop(self.POOL_PROXY_ALERT, None)
            self.alerts.pop(AlertKey(AlertKind.ROUTING), None)
            if AlertKey(AlertKind.ROUTER) not in self.alerts:
                self.metrics.router_up.set(1.0)
        except Exception as exc:
            self.alerts[AlertKey(AlertKind.ROUTING)] = f"routing update failed: {exc}"
            log.error("routing update failed: %s", exc)
            self.metrics.router_reload_failures.inc()
            self.metrics.router_up.set(0.0)  # controller/failsafe.py watches it come back

    def _url(self, row: ReplicaRow) -> str:
        return f"http://{self.endpoint(row)}"

    def _pool_table_now(self, path: Path) -> dict[str, ModelPools]:
        """The proxy's table as last written; at the first routing update of this process, the
        file's (a previous controller's), unreadable or malformed: none."""
        if self.pool_table is None:
            try:
                self.pool_table = {p.name: p for p in parse_table(path, path.read_text(encoding="utf-8")).values()}
            except (OSError, UnicodeDecodeError, TableError):
                self.pool_table = {}
        return self.pool_table

    async def _proxy_serves(self, text: str) -> bool:
        """Whether the pool proxy serves the table `text` (its /health generation), waiting for it
        at most the proxy's load_timeout_s: a model's upstream gets the proxy only once the proxy
        knows the model's pools (it re-reads its file every --poll-s). An alert names the proxy
        while it does not."""
        import httpx

        proxy = self.settings.routing.pool_proxy
        assert proxy is not None
        want, url = table_generation(text), f"http://{proxy.address}/health"
        # a table the proxy did not take before is asked once more, not waited for again (a proxy
        # that is down must not hold every routing update for its timeout)
        deadline = time.monotonic() + (0.0 if want == self.proxy_missed else proxy.load_timeout_s)
        key = self.POOL_PROXY_ALERT
        seen = "no answer"
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                try:
                    resp = await client.get(url)
                    got = resp.json().get("generation") if resp.status_code == 200 else None
                    if got == want:
                        self.alerts.pop(key, None)
                        self.proxy_missed = None
                        return True
                    seen = f"HTTP {resp.status_code}, table generation {got}"
                except (httpx.HTTPError, ValueError, AttributeError) as exc:
                    seen = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.05)
        text = (f"pool proxy {url} does not serve the table written to {proxy.upstreams_path} (generation "
                f"{want}) after {proxy.load_timeout_s:g} s ({seen}): models whose pools are ready are not "
                "routed to it")
        if self.alerts.get(key) is None:
            log.error("%s", text)
        self.alerts[key] = text
        self.proxy_missed = want
        return False

    def _write_pool_table(self, path: Path, table: Mapping[str, ModelPools]) -> str:
        """The proxy's upstreams file, atomically; not rewritten when its text would not change
        (the proxy re-reads the file on every change). Returns the text."""
        text = render_table(table.values())
        try:
            same = path.read_text(encoding="utf-8") == text
        except (OSError, UnicodeDecodeError):
            same = False
        if not same:
            atomic_write_text(path, text)
            log.info("pool proxy table %s: %s", path, ", ".join(
                f"{m} {len(p.prefill)} prefill + {len(p.decode)} decode" for m, p in sorted(table.items())) or "empty")
        self.pool_table = dict(table)
        return text

    # ---- desired state publishing ------------------------------------------------------------
    async def publish_hosts(self, hosts: set[str]) -> None:
        """Stage (version+1, committed) and publish each host's desired state; acks arrive later."""
        if not hosts or self.policy.advisory():
            return  # advisory mode publishes nothing (a staged state is published once active)
        with self.store.tx() as c:
            payloads = {h: self.store.stage_desired(c, h) for h in sorted(hosts)}
        gate = asyncio.Semaphore(MAX_PUBLISHES_IN_FLIGHT)

        async def publish(host: str, payload: dict[str, Any]) -> bool:
            async with gate:
                return await self.link.publish(desired_topic(host), json.dumps(payload).encode())

        published = await asyncio.gather(*(publish(h, p) for h, p in payloads.items()))
        done = {}
        for (host, payload), ok in zip(payloads.items(), published, strict=True):
            key = AlertKey(AlertKind.PUBLISH, host)
            if ok:
                done[host] = int(payload["version"])
                self.alerts.pop(key, None)
            else:
                self.alerts[key] = f"desired v{payload['version']} for {host} not published (MQTT down)"
        self.store.mark_published(done)

    # ---- acting: inputs to the act core and its effects ------------------------------------------
    def view(self) -> ActView:
        """What the act core decides on: the hosts' last reports and this controller's records."""
        s, pol = self.settings, self.policy.policy
        return ActView(
            now_s=self.wall(), hosts=self.hosts.reports(),
            replicas=tuple(self.store.active_replicas()), builds=tuple(self.store.builds((Phase.DESIRED,))),
            desired=self.store.desired_rows(), known_ids=frozenset(self.store.known_ids()),
            settings=ActSettings(s.ready_timeout_s, s.ack_timeout_s, s.host_offline_grace_s, s.default_port_range,
                                 pol.agent_templates(), pol.agent_templates(build=True),
                                 frozenset(h.name for h in pol.hosts)),
            retained={h: tuple(retained_replica(r) for r in d.replicas)
                      for h, d in self.hosts.retained_desired.items()},
            connected_since_s=self.connected_wall if self.link.connected.is_set() else None,
            republish_all=self.republish_all, noted=frozenset(self.noted), deferrals=dict(self.deferrals),
        )

    def apply(self, d: ActDecision, cycle_id: int | None) -> None:
        """Persist the decision's effects (one transaction), count its actions, raise/clear alerts;
        a decision about deferrals replaces the open ones (a repeated one counts on its first row)."""
        opened: dict[DeferKey, Deferral] = {}
        for note in self._record(d.effects, cycle_id):
            opens = note.defer_key()
            if opens is not None and note.action_id is not None:
                opened[opens] = Deferral(note.action_id, 1, self.wall())
                log.info("%s %s on %s deferred: %s", note.kind, note.subject.split("#")[0], note.host or "-",
                         note.detail)
        for e in d.effects:
            if isinstance(e, Repeat):
                self.metrics.actions.labels(e.note.kind, e.note.status).inc()
        if d.deferrals is not None:
            self.deferrals = {**d.deferrals, **opened}
        for key, text in d.alerts.items():
            if key.kind in _LOGGED_ALERTS and self.alerts.get(key) != text:
                log.warning("%s", text)
            self.alerts[key] = text
        for key in d.cleared:
            self.alerts.pop(key, None)
        self.noted |= set(d.noted)

    def _record(self, effects: Sequence[records.RecordEffect], cycle_id: int | None) -> list[act.Note]:
        """Persist effects through the records reducer (StateStore.apply); count the actions logged."""
        notes = self.store.apply(effects, cycle_id)
        for note in notes:
            self.metrics.actions.labels(note.kind, note.status).inc()
        return notes

    async def reconcile(self) -> None:
        """Bring the records in line with what the agents report (before planning), then keep the
        store within its retention (one bounded step)."""
        self.hosts.sync_inventory(self.store)
        self.store.note_version_floors({h: st.desired_version for h, st in self.hosts.statuses.items() if st.online})
        d = act_port.reconcile(self)
        changed = set(d.publish) | self.pending_publish
        self.pending_publish.clear()
        self.republish_all = False
        if changed and self.link.connected.is_set():
            await self.publish_hosts(changed)
        self.prune_store()

    def prune_store(self) -> None:
        """One bounded retention step (controller/state_retention.py); a store above its size bound
        with nothing left that may go is an alert, a failed step a log line (the next cycle tries
        again)."""
        try:
            p = prune_step(self.store, self.retention, self.store._clock())
        except sqlite3.OperationalError as exc:
            log.warning("state store retention step failed: %s", exc)
            return
        if p.rows:
            log.debug("state store retention: %d row(s) pruned in %d step(s) (longest %.3f s), %.1f MiB live",
                      p.rows, p.steps, p.longest_step_s, p.live_bytes / 2**20)
        if p.over:
            text = (f"state store {self.store.path} holds {p.live_bytes / 2**20:.0f} MiB, above its bound "
                    f"retention.max_mb {self.retention.max_bytes / 2**20:.0f}, and only what the reports, audit "
                    "and brakes need is left: raise retention.max_mb")
            if self.alerts.get(self.RETENTION_ALERT) is None:
                log.warning("%s", text)
            self.alerts[self.RETENTION_ALERT] = text
        else:
            self.alerts.pop(self.RETENTION_ALERT, None)

    def adopt_orphans(self) -> set[str]:
        """Adopt engines the agents run that this database never allocated (act.adopt); returns the
        hosts whose desired state changed (published by the next reconcile)."""
        d = act.adopt(self.view())
        self.apply(d, None)
        self.pending_publish.update(d.publish)
        return set(d.publish)

    # ---- draining ------------------------------------------------------------------------------
    def start_drain(self, rid: str) -> None:
        if rid in self.drains and not self.drains[rid].done():
            return
        self.drains[rid] = asyncio.create_task(self.drain(rid), name=f"drain-{rid}")

    async def inflight(self, row: ReplicaRow) -> float | None:
        """The replica's running + waiting requests: its own /metrics, else Prometheus, else unknown."""
        import httpx

        url = f"http://{self.endpoint(row)}{_engine_metrics_path(row.engine)}"
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                resp = await client.get(url)
            if resp.status_code == 200:
                return inflight_from_metrics(resp.text)
        except httpx.HTTPError:
            pass
        try:
            sel = f'{{__name__=~"{_RUNNING}|{_WAITING}",replica="{row.replica_id}"}}'
            res = await self.prom.query(f"sum({sel})")
            return inflight_from_prometheus([r.value for r in res])
        except PrometheusError:
            return None

    def _model_policy(self, model: str) -> ModelPolicy | None:
        pol = self.policy.policy
        return pol.model(model) if pol is not None else None

    def drain_deadline_s(self, model: str) -> float:
        """The drain deadline for `model` in wall seconds, from the policy (act.drain_deadline_s); the
        controller's drain_timeout_s setting (wall) is the floor and the default."""
        return act.model_drain_deadline_s(self._model_policy(model), floor_s=self.settings.drain_timeout_s,
                                          time_scale=self.time_scale)

    async def drain(self, rid: str) -> None:
        """The replica's drain (planner/act_port.py `drain`, through this executor as its port)."""
        row = self.store.get_replica(rid)
        if row is None or row.phase != Phase.DRAINING:
            return
        done = await act_port.drain(self, rid, deadline_s=self.drain_deadline_s(row.model),
                                    settle_s=self.settings.drain_settle_s, poll_s=self.settings.drain_poll_s,
                                    hold_s=act.kv_hold_s(self._model_policy(row.model), row.role,
                                                         time_scale=self.time_scale))
        if done is None:
            return
        if done.timed_out:
            self.alerts[AlertKey(AlertKind.DRAIN_TIMEOUT, rid)] = f"replica {rid} ({row.model}): {done.reason}"
        log.info("replica %s drained (%s) and removed", rid, done.reason)

    # ---- the port (planner/act_port.py Port) over SQLite, MQTT, nginx and httpx ------------------
    def now_s(self) -> float:
        return self.wall()

    def reports(self) -> Mapping[str, act.HostReport]:
        return self.hosts.reports()

    def replica(self, replica_id: str) -> ReplicaRow | None:
        return self.store.get_replica(replica_id)

    def active_replicas(self) -> Sequence[ReplicaRow]:
        return self.store.active_replicas()

    async def sleep(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)

    async def record(self, effects: Sequence[records.RecordEffect], cycle_id: int | None) -> list[act.Note]:
        return self._record(effects, cycle_id)

    async def route(self) -> None:
        await self.update_routing()

    async def publish(self, hosts: frozenset[str]) -> None:
        await self.publish_hosts(set(hosts))

    def exclusive(self) -> asyncio.Lock:
        return self.lock
