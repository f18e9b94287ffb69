"""The replay's meter: the timeline of demand and capacity, GPU-hours and cost, and the SLO
accounting of every request, returned as a SimResult."""

from __future__ import annotations

import numpy as np

from fleetplan.models.config_key import Role
from fleetplan.models.mix import SLO_SHARE
from fleetplan.planner.types import ConfigKey, ReplicaState
from fleetplan.sim.des_base import FleetSimBase
from fleetplan.sim.des_types import PENDING, REJECTED, SERVED, SimResult, TimelinePoint
from fleetplan.sim.slo_periods import judge, miss_minutes


def hours_by_role(by_config: dict[ConfigKey, float]) -> tuple[tuple[Role, float], ...]:
    """GPU-hours per role, in the order of `Role` (a role no replica had is left out)."""
    out: dict[Role, float] = {}
    for c, h in by_config.items():
        out[c.role] = out.get(c.role, 0.0) + h
    return tuple((r, out[r]) for r in Role if r in out)


class FleetMeter(FleetSimBase):
    """What the replay measures (a mixin of `FleetSim`)."""

    # -- timeline
    def _record_timeline(self, t: float, demand: float) -> None:
        per: dict[ConfigKey, int] = {}
        ready = 0
        gpus = 0
        for r in self.replicas:
            if r.state == ReplicaState.STOPPED:
                continue
            gpus += len(r.gpus)
            if r.state == ReplicaState.READY:
                per[r.config] = per.get(r.config, 0) + 1
                ready += len(r.gpus)
        for b in self.sim_builds.values():
            if not b.done:
                gpus += len(b.row.gpu_indices) or b.config.tp
        self.timeline.append(TimelinePoint(t, demand, tuple(sorted(per.items())), ready, gpus))

    def _result(self, end_s: float) -> SimResult:
        gpu_s: dict[str, float] = {}
        by_config: dict[ConfigKey, float] = {}
        for r in self.replicas:
            if r.t_gpu is None:
                continue
            stop = end_s if r.t_stop is None else min(r.t_stop, end_s)
            dur = max(0.0, stop - max(0.0, r.t_gpu))
            gpu_s[r.config.gpu.value] = gpu_s.get(r.config.gpu.value, 0.0) + dur * len(r.gpus)
            by_config[r.config] = by_config.get(r.config, 0.0) + dur * len(r.gpus) / 3600.0
        build_s = sum(self.build_gpu_s.values())
        gpu_hours = (sum(gpu_s.values()) + build_s) / 3600.0
        cost = 0.0
        for g, sec in list(gpu_s.items()) + list(self.build_gpu_s.items()):
            cost += sec / 3600.0 * self.env.price_usd_h.get(g, 0.0)
        served = self.status == SERVED
        ttft_s = np.zeros(self.n)
        itl_s = np.zeros(self.n)
        oh = np.zeros(self.n)
        for j in np.nonzero(served)[0]:
            rep = self.owner[j]
            assert rep is not None
            oh[j] = rep.core.params.factors.ttft_overhead_s
        ttft_s[served] = self.first_t[served] - self.arr_t[served] + oh[served]
        outs = np.array(self.output, dtype=float)
        multi = served & (outs > 1)
        itl_s[multi] = (self.finish_t[multi] - self.first_t[multi]) / (outs[multi] - 1)
        ttft_slo = np.array([self.env.ttft_slo_ms[self.model_names[m]] for m in self.req_model]) / 1000.0
        itl_slo = np.array([self.env.itl_slo_ms[self.model_names[m]] for m in self.req_model]) / 1000.0
        ok = served & (ttft_s <= ttft_slo) & (itl_s <= itl_slo)
        names = self.model_names
        judged = judge(self.arr_t, np.asarray(self.req_model, dtype=np.int64), ok, names,
                       {m: self.env.slo_objective.get(m, SLO_SHARE) for m in names},
                       {m: self.env.slo_period_s.get(m, 3600.0) for m in names}, self.duration_s)
        c = self.control
        queried = sum(r.core.prefix_queries_tokens for r in self.replicas)
        hits = sum(r.core.prefix_hit_tokens for r in self.replicas)
        return SimResult(
            policy=self.ctl.name,
            duration_s=end_s,
            arrived=self.n,
            served=int(served.sum()),
            rejected=int((self.status == REJECTED).sum()),
            unfinished=int((self.status == PENDING).sum()),
            slo_met=int(ok.sum()),
            met=ok,
            judged=judged,
            misses=miss_minutes(self.arr_t, ok),
            gpu_hours=gpu_hours,
            build_gpu_hours=build_s / 3600.0,
            cost_usd=cost,
            ttft_ms=ttft_s[served] * 1000.0,
            itl_ms=itl_s[multi] * 1000.0,
            replica_starts=self.replica_starts,
            builds=self.n_builds,
            timeline=tuple(self.timeline),
            decisions=self.decisions,
            notes=tuple(self.notes + (c.notes if c is not None else [])),
            placement_conflicts=self.conflicts,
            swap_cycles=c.swap_cycles if c is not None else 0,
            deferred_actions=c.deferred if c is not None else 0,
            drain_timeouts=c.drain_timeouts if c is not None else 0,
            gpu_hours_by_config=tuple(sorted(by_config.items())),
            gpu_hours_by_role=hours_by_role(by_config),
            prefix_hit_rate=hits / queried if queried > 0 else None,
            build_windows=tuple(sorted((b.done_t - (self.env.build_s(b.config) or 0.0), b.done_t, b.config)
                                       for b in self.sim_builds.values())),
        )
