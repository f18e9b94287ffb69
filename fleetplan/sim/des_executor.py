"""The baseline executor: how a baseline's view is built and its target counts become starts and drains
(baselines model other controllers; fleetplan runs the daemon's decision path, fleetplan.sim.control)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from fleetplan.models.config_key import Role
from fleetplan.planner.types import ConfigKey, Fleet, Replica, ReplicaState
from fleetplan.sim.des_base import _SimReplica
from fleetplan.sim.des_types import Baseline, ControllerView, ReplicaLoad
from fleetplan.sim.des_world import FleetWorld


class BaselineExecutor(FleetWorld):
    """A baseline's targets carried out directly (a mixin of `FleetSim`)."""

    # -- baselines' view
    def _fleet(self, t: float) -> Fleet:
        e0 = self.env.epoch0_s
        reps = tuple(
            Replica(r.rid, r.config, r.host, r.gpus, r.state, None, e0 + r.since)
            for r in self.replicas if r.state != ReplicaState.STOPPED
        )
        return Fleet(hosts=self.env.hosts, replicas=reps, builds=tuple(self.cached()))

    def _replica_loads(self, t: float) -> Mapping[str, ReplicaLoad]:
        cut = t - self.s.scrape_delay_s
        best: Mapping[str, ReplicaLoad] = {}
        for ts, loads in self.replica_scrape_hist:
            if ts <= cut:
                best = loads
            else:
                break
        return best

    def _reconcile(self, t: float, targets: Mapping[ConfigKey, int]) -> None:
        """A baseline's targets, carried out directly (they model other controllers)."""
        live: dict[ConfigKey, list[_SimReplica]] = {}
        for r in self.replicas:
            if r.state in (ReplicaState.STARTING, ReplicaState.READY):
                live.setdefault(r.config, []).append(r)
        # the pools' replicas this decision starts count as incoming for every other config of their
        # model (a move to pools keeps the aggregated replicas until the pools serve, whatever the
        # order of the keys; aggregated keys count only the replicas already starting, as before)
        pool_starts: dict[str, int] = {}
        for c, want in targets.items():
            if c.role is not Role.AGGREGATED:
                pool_starts[c.model] = pool_starts.get(c.model, 0) + max(0, want - len(live.get(c, [])))
        for c in sorted(set(live) | set(targets)):
            have = live.get(c, [])
            want = max(0, targets.get(c, 0))
            if len(have) < want:
                for _ in range(want - len(have)):
                    slot = self._free_slot(c)
                    if slot is None:
                        self.notes.append(f"t={t:.0f}s: no free GPUs for {c.label()}")
                        break
                    self._start_replica(t, None, c, slot[0], slot[1])
            elif len(have) > want:
                # cancel starting replicas first (newest first), then the least-loaded ready ones; a
                # ready one stays while a replica of another config of its model is still starting
                # to take its place (make-before-break, as a rolling update with none unavailable)
                order = sorted(have, key=lambda r: (r.state == ReplicaState.READY, r.load, -r.seq))
                incoming = sum(1 for r in self.replicas if r.config.model == c.model and r.config != c
                               and r.state == ReplicaState.STARTING) + pool_starts.get(c.model, 0)
                cut = order[: len(have) - want]
                ready_cut = [r for r in cut if r.state == ReplicaState.READY]
                keep = set(map(id, ready_cut[: min(incoming, len(ready_cut))]))
                for r in cut:
                    if id(r) not in keep:
                        self._drain(r, t)

    def _warm_baseline(self) -> None:
        """The baseline's fleet for the first window, READY at t = 0 (not counted as starts)."""
        ctl = cast(Baseline, self.ctl)
        d = ctl.decide(ControllerView(0.0, self.env.epoch0_s, self._fleet(0.0), {}))
        if d.targets is not None:
            for c, want in sorted(d.targets.items()):
                for _ in range(max(0, want)):
                    slot = self._free_slot(c)
                    if slot is None:
                        break
                    self._start_replica(0.0, None, c, slot[0], slot[1], instant=True)
        self.replica_starts = 0  # warm replicas are not counted as starts

    def _decide_baseline(self, t: float) -> None:
        """One decision of the baseline on its view; its targets carried out."""
        ctl = cast(Baseline, self.ctl)
        d = ctl.decide(ControllerView(t, self.env.epoch0_s + t, self._fleet(t), self._replica_loads(t)))
        if d.note and len(self.notes) < 50:
            self.notes.append(f"t={t:.0f}s: {d.note}")
        if d.targets is not None:
            self._reconcile(t, d.targets)
