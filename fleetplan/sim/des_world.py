"""The replay's world: replicas on hosts' GPUs and engine builds, starting, ready, draining and
stopping, as the simulated agents carry them out (the engine port fleetplan.sim.control drives)."""

from __future__ import annotations

from collections.abc import Callable

from fleetplan.planner import act
from fleetplan.planner.agent_rules import AgentLimits, WantedBuild, WantedReplica, conflicts, refusals
from fleetplan.planner.placement import first_free
from fleetplan.planner.types import ConfigKey, EngineBuild, ReplicaState
from fleetplan.sim.des_base import _SimBuild, _SimReplica
from fleetplan.sim.des_types import PENDING, REJECTED, ReplicaLoad
from fleetplan.sim.disagg_proxy import DisaggProxy, core_for

SIM_PORT_RANGE = (8000, 8999)  # the simulated agents' port range (each reports it)


class FleetWorld(DisaggProxy):
    """The replicas and builds of the replay (a mixin of `FleetSim`)."""

    # -- the engines (fleetplan.sim.control.EnginePort)
    def launch(self, row: act.ReplicaRow, t_s: float) -> None:
        self._start_replica(t_s, row.replica_id, row.config, row.host, row.gpu_indices, port=row.port,
                            template=row.template)

    def stop(self, replica_id: str, t_s: float) -> None:
        rep = self.by_id.get(replica_id)
        if rep is not None and rep.state != ReplicaState.STOPPED:
            rep.version += 1  # cancels a pending "ready" and its next step
            self._stop(rep, t_s)

    def build(self, row: act.BuildRow, t_s: float) -> None:
        c = row.config
        bs = self.env.build_s(c) or 0.0
        self.sim_builds[row.build_id] = _SimBuild(row, c, t_s + bs)
        self.n_builds += 1
        self.build_gpu_s[c.gpu.value] = self.build_gpu_s.get(c.gpu.value, 0.0) + bs * max(
            1, len(row.gpu_indices) or c.tp)
        self._push(t_s + bs, self._P_LIFE, "built", row.build_id)

    def reports(self, t_s: float) -> dict[str, act.HostReport]:
        per_host: dict[str, list[act.ReportedReplica]] = {}
        for r in self.replicas:
            if r.state == ReplicaState.STOPPED:
                continue
            c = r.config
            state = ReplicaState.READY if r.state in (ReplicaState.READY, ReplicaState.DRAINING) else r.state
            per_host.setdefault(r.host, []).append(act.ReportedReplica(
                r.rid, state, c.model, c.engine.value, c.gpu.value, c.tp, c.precision.value, r.gpus,
                r.port, template=r.template, since_s=self.env.epoch0_s + (r.t_ready if r.t_ready is not None else r.t_start),
                role=c.role.value))
        builds: dict[str, list[act.ReportedBuild]] = {}
        for bid, b in self.sim_builds.items():
            bstate = act.BuildState.DONE if b.done else act.BuildState.RUNNING
            builds.setdefault(b.row.host, []).append(act.ReportedBuild(bid, bstate, b.row.gpu_indices))
        return {h.name: act.HostReport(h.name, h.online, h.gpu.value, h.gpu_count, h.nvlink_groups, SIM_PORT_RANGE,
                                       (), (),
                                       tuple(per_host.get(h.name, ())), tuple(builds.get(h.name, ())))
                for h in self.env.hosts}

    def cached(self) -> list[EngineBuild]:
        out = [EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, None, True, None)
               for c in sorted(self.env.cached)]
        # an engine per host that holds it, as each agent reports its own: the host that built it; with a
        # shared cache, every host of its GPU type
        done = sorted({(b.config, host) for b in self.sim_builds.values()
                       if b.done and b.config not in self.env.cached for host in self._holders(b)})
        out += [EngineBuild(c.model, c.engine, c.gpu, c.tp, c.precision, host, True, None) for c, host in done]
        return out

    def _holders(self, b: _SimBuild) -> list[str]:
        if not self.s.shared_engine_cache:
            return [b.row.host]
        return [h.name for h in self.env.hosts if h.gpu == b.config.gpu]

    def inflight(self, replica_id: str) -> float | None:
        rep = self.by_id.get(replica_id)
        if rep is None or rep.state == ReplicaState.STOPPED:
            return None
        return float(rep.core.num_running + rep.core.num_waiting)

    def route(self, routes: act.Routes, t_s: float) -> None:
        for mi, m in enumerate(self.model_names):
            reps = [self.by_id[rid] for rid in routes.serving.get(m, ()) if rid in self.by_id]
            pools = [self.by_id[rid] for rid in routes.pools.get(m, act.Pools()).ids() if rid in self.by_id]
            for r in self.serving[mi]:
                if r.state == ReplicaState.READY and r not in reps and not r.pooled:
                    r.state = ReplicaState.DRAINING  # out of the upstream: its last requests finish
                    r.since = t_s
            self.serving[mi] = sorted((r for r in reps if r.state == ReplicaState.READY), key=lambda r: r.seq)
            if pools or self.prefillers[mi] or self.decoders[mi]:
                self._pool_route(mi, pools, t_s)
        self.prom.set_targets((rid, self.by_id[rid].config.model, self.by_id[rid].config.role.value)
                              for rid in routes.scraped if rid in self.by_id)

    def later(self, t_s: float, fn: Callable[[float], None]) -> None:
        self._push(t_s, self._P_LIFE, "call", fn)

    # -- replicas
    def _start_replica(self, t: float, rid: str | None, config: ConfigKey, host: str, gpus: tuple[int, ...],
                       *, instant: bool = False, port: int | None = None,
                       template: str | None = None) -> _SimReplica | None:
        if config.model not in self.model_names:
            self.notes.append(f"start of {config.label()} ignored: model not in the trace")
            return None
        rid = rid or f"r{self._rid_seq + 1}-{config.engine.value}-{config.gpu.value}x{config.tp}"
        wanted = WantedReplica(rid, template or config.engine.value, config, gpus,
                               port if port is not None else SIM_PORT_RANGE[0] + min(gpus, default=0))
        refused = self._refusals(host, wanted)
        if refused:
            # the host's agent refuses the desired state (planner/agent_rules.py, as a real agent
            # does); the act core never asks for it, so this is a bug to see, not a case to schedule
            # around
            self.conflicts += 1
            self.notes.append(f"t={t:.0f}s: start of {rid} refused by {host}: {'; '.join(refused)}")
            return None
        params = self.env.params_for(config.profile_key())
        self._rid_seq += 1
        core = core_for(config, params, self.s.seed * 100003 + self._rid_seq, self.s.macro_steps)
        rep = _SimReplica(rid, config, host, gpus, core, t, self._rid_seq, self.model_names.index(config.model),
                          wanted.port, wanted.template)
        self.replicas.append(rep)
        self.by_id[rid] = rep
        self.replica_starts += 1
        if instant:
            self._ready(rep, t)
            return rep
        self._launch(rep, t)
        return rep

    def _refusals(self, host: str, new: WantedReplica) -> list[str]:
        """What `host`'s agent says to its desired state with `new` added: its replicas and the
        builds still running there (planner/agent_rules.py). The simulated agent offers the templates
        the controller names; a replica of an engine that needs a build needs it cached on the host
        or building there (a baseline's agent builds at launch: it needs none)."""
        h = self.host_by_name.get(host)
        if h is None:
            return [f"host {host} is not in the inventory"]
        replicas = [WantedReplica(r.rid, r.template, r.config, r.gpus, r.port) for r in self.replicas
                    if r.host == host and r.state != ReplicaState.STOPPED] + [new]
        builds = [WantedBuild(bid, b.row.template, b.config, b.row.gpu_indices)
                  for bid, b in self.sim_builds.items() if b.row.host == host and not b.done]
        need_cache = frozenset(r.template for r in replicas
                               if self.control is not None and self.env.build_s(r.config) is not None)
        cached = self.env.cached | {b.config for b in self.sim_builds.values() if b.done and host in self._holders(b)}
        limits = AgentLimits(host, h.gpu, h.gpu_count, SIM_PORT_RANGE,
                             {r.template: r.config.engine for r in replicas},
                             frozenset(b.template for b in builds), None, need_cache, frozenset(cached))
        return conflicts(replicas, builds) + refusals(replicas, builds, limits)

    def _launch(self, rep: _SimReplica, t: float) -> None:
        config = rep.config.profile_key()  # a pool's replica runs the aggregated config's engine
        rep.t_gpu = t
        delay = self.env.startup_s(config)
        if self.env.build_s(config) is not None and not self._built(config):
            b = self._build_of(config)
            if b is not None:  # the agent waits for the engine the build is making
                delay += max(0.0, b.done_t - t)
            else:
                delay += self.env.build_s(config) or 0.0
        self._push(t + delay, self._P_LIFE, "ready", (rep, rep.version))

    def _build_of(self, config: ConfigKey) -> _SimBuild | None:
        """The config's engine build: a finished one, else the one finishing first (None: none)."""
        return min((b for b in self.sim_builds.values() if b.config == config),
                   key=lambda b: (not b.done, b.done_t), default=None)

    def _built(self, config: ConfigKey) -> bool:
        if config in self.env.cached:
            return True
        b = self._build_of(config)
        return b is not None and b.done

    def _ready(self, rep: _SimReplica, t: float) -> None:
        if rep.state != ReplicaState.STARTING:
            return
        rep.state = ReplicaState.READY
        rep.t_ready = t
        rep.since = t
        if self.control is not None:
            self.control.update_routing(t)  # the agent's status: routed at once (daemon._on_status)
        elif rep.pooled:
            self._pool_ready(rep, t)
        else:
            self.serving[rep.mi].append(rep)

    def _drain(self, rep: _SimReplica, t: float) -> None:
        """Baselines: out of the router; stops once idle."""
        if rep.state == ReplicaState.STARTING:
            rep.version += 1  # cancels its pending "ready"
            self._stop(rep, t)
            return
        if rep.state != ReplicaState.READY:
            return
        rep.state = ReplicaState.DRAINING
        rep.since = t
        if rep.pooled:
            self._pool_leave(rep)
            if rep.load == 0 and not self._holds_decode(rep):
                self._stop(rep, t)
            return
        self.serving[rep.mi].remove(rep)
        if rep.load == 0:
            self._stop(rep, t)

    def _stop(self, rep: _SimReplica, t: float) -> None:
        if rep.pooled:
            self._pool_leave(rep)
        if rep in self.serving[rep.mi]:
            self.serving[rep.mi].remove(rep)
        rep.state = ReplicaState.STOPPED
        rep.t_stop = t
        rep.since = t
        for idx in rep.inflight:  # cut: the engine stopped with them in flight
            if self.status[idx] == PENDING:
                self.status[idx] = REJECTED
                self._cut += 1
        rep.inflight.clear()
        rep.load = 0

    def _free_slot(self, config: ConfigKey) -> tuple[str, tuple[int, ...]] | None:
        used: dict[str, set[int]] = {}
        for r in self.replicas:
            if r.state != ReplicaState.STOPPED:
                used.setdefault(r.host, set()).update(r.gpus)
        for h in self.env.hosts:
            if h.gpu != config.gpu or not h.online:
                continue
            spot = first_free(h.groups(), used.get(h.name, set()), config.tp)
            if spot is not None:
                return h.name, spot
        return None

    def _scrape(self, t: float, slot: int = 0) -> None:
        """The scrapes at offset `slot` of the interval (SimSettings.scrape_offsets): the targets
        whose offset it is (`PromSim.slot`); the baselines' load snapshot once an interval (slot 0)."""
        if self.control is not None:
            prom = self.prom
            live = [r for r in self.replicas if r.state in (ReplicaState.READY, ReplicaState.DRAINING)
                    and prom.slot(r.rid) == slot]
            for r in live:
                r.counters.prefix_queries = float(r.core.prefix_queries_tokens)
                r.counters.prefix_hits = float(r.core.prefix_hit_tokens)
            prom.scrape(t, {r.rid: (r.counters, float(r.core.num_running), float(r.core.num_waiting), r.core.kv_usage)
                            for r in live}, sweep=slot == 0)
        elif slot == 0:
            loads = {r.rid: ReplicaLoad(float(r.core.num_running), float(r.core.num_waiting), r.core.kv_usage)
                     for r in self.replicas if r.state == ReplicaState.READY}
            self.replica_scrape_hist.append((t, loads))
            if len(self.replica_scrape_hist) > 16:
                del self.replica_scrape_hist[:-16]
