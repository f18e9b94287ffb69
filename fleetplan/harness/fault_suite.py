"""The fault suite: each fault on the lab with load flowing, measured the same way.

One Rig, one controller (one state database) and one steady Load for the whole run: the faults run
one after the other, each starting from a settled fleet (every replica ready and routed, every
desired state acked, engines == desired replicas, the fleet unchanged for 3 s). The load never
stops between faults (a gap would read as a demand drop). Per fault:

- requests sent / ok / failed: those SENT inside the fault's window (settle + fault + recovery +
  the rest of `seconds`); `unexplained` = failed requests that were not in flight on a process the
  fault killed (only the engine and host-lost faults kill serving processes; a failure of a
  request sent before the kill counts as in flight on it);
- duplicates: replica ids that had two live engines at once (sampled every 0.5 s all along);
- orphans: engines that no desired state names, 15 s after recovery (stops take a moment);
- scale-downs: how far the desired fleet (replicas in the desired state and not draining; those the
  fault killed count as kept) fell below what it had before the fault, sampled every 0.5 s from
  the fault to the end of the window. A replacement (make-before-break: the new replica first)
  does not dip; a drain the planner decided before a controller kill (mid drain) lowers the floor.
  The drains and stops in the window are listed from the controller's database for diagnosis;
- recover_s: from the fault to the first moment the fleet is settled again (a cycle completed
  after the fault, every replica ready and routed, at least as many replicas as before, desired
  states acked, engines == desired replicas, hosts reporting, an observation that is not stale and
  reads at least half the offered load), None if not within `recover_timeout_s`.

The harness plays systemd: a killed controller, agent, Mosquitto or Prometheus is restarted at
once (an agent after 1 s); a lost host is not.
"""


from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from fleetplan.harness.fault_controlplane import ControlPlaneFaults
from fleetplan.harness.fault_core import (
    ALL_FAULTS,
    CONTROL_PLANE_FAULTS,
    CONTROLLER_FAULTS,
    HEADER,
    INVENTORY_FAULTS,
    LAB_FAULTS,
    MACHINE_FAULTS,
    OWN_ROWS,
    BadPayloads,
    FaultResult,
    Injection,
)
from fleetplan.harness.fault_injections import MachineFaults, ProcessFaults
from fleetplan.harness.fault_inventory import InventoryFaults

__all__ = ["ALL_FAULTS", "CONTROLLER_FAULTS", "CONTROL_PLANE_FAULTS", "HEADER", "INVENTORY_FAULTS", "LAB_FAULTS",
           "MACHINE_FAULTS", "OWN_ROWS", "BadPayloads", "FaultResult", "FaultSuite", "Injection", "summary"]


class FaultSuite(ProcessFaults, MachineFaults, ControlPlaneFaults, InventoryFaults):
    """Runs faults one after the other on the lab, each from a settled fleet, and measures each the
    same way (the module's docstring)."""

    async def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler

    async def run(self, names: Sequence[str]) -> list[FaultResult]:
        results = []
        for name in names:
            try:
                res = await self.run_one(name)
            except Exception as exc:  # the harness failed (e.g. a controller that will not restart): say so, go on
                res = FaultResult(name, notes=[f"harness error: {type(exc).__name__}: {str(exc)[:2000]}"])
                self._window_start = time.monotonic()
                with contextlib.suppress(Exception):
                    if self.ctrl.proc is None or self.ctrl.proc.poll() is not None:
                        await asyncio.to_thread(self.ctrl.start)
            self.log(res.line() + ("  " + "; ".join(res.notes) if res.notes else "")
                     + ("  MISSED: " + "; ".join(res.missed) if res.missed else ""))
            results.append(res)
        return results

    async def run_one(self, name: str) -> FaultResult:
        res = FaultResult(name)
        t_window = self._window_start
        why = await self.settle()
        if why is not None:
            res.notes.append(f"not settled before the fault: {why}")
        self.target = await asyncio.to_thread(self.fleet_size)  # what the settled fleet has
        cycle0 = await asyncio.to_thread(self.cycle_id)
        mark = await asyncio.to_thread(self._action_mark)
        engines_before = {rid: pid for pid, rid in await asyncio.to_thread(self.rig.engine_processes)}
        log_from = self._log_size()
        self._dups.clear()
        self._killed = set()
        n_before = self.target
        self._min_present = n_before
        inject: Callable[[], Awaitable[Injection]] = getattr(self, f"_fault_{name}")
        inj = await inject()
        res.notes += inj.notes
        res.missed += inj.missed
        if inj.kills_serving:
            self._killed = set(inj.excused)
        floor = n_before if inj.floor is None else inj.floor
        if inj.floor is not None:  # an intended change during the injection: count from here on
            self._min_present = floor
        t_rec = time.monotonic()
        # within recover_timeout_s of the fault, or of the injection's end when it watched longer
        # (a busy machine stretches a fault that waits for cycles)
        deadline = max(inj.t_s, t_rec) + self.recover_timeout_s
        last_why: str | None = "not checked"
        while time.monotonic() < deadline:
            last_why = await asyncio.to_thread(self.health, cycle0 + 2)  # a whole cycle after the fault
            if last_why is None:
                res.recover_s = time.monotonic() - inj.t_s
                break
            await asyncio.sleep(0.2)
        if res.recover_s is None:
            res.notes.append(f"not recovered after {time.monotonic() - t_rec:.0f} s: {last_why}")
        if inj.engines_kept:
            now = {rid: pid for pid, rid in await asyncio.to_thread(self.rig.engine_processes)}
            changed = sorted(rid for rid, pid in engines_before.items() if rid in now and now[rid] != pid)
            if changed:
                res.notes.append(f"engines restarted: {changed}")
        await asyncio.sleep(max(0.0, inj.t_s + self.seconds - time.monotonic()))
        # orphans: engines no desired state names, once stops had time to finish
        orphans: set[str] = set()
        for _ in range(30):
            ids = await asyncio.to_thread(self.fleet_ids)
            engines = await asyncio.to_thread(self._engines)
            orphans = set(engines) - ids if ids is not None else set()
            if ids is not None and not orphans:
                break
            await asyncio.sleep(0.5)
        res.orphans = len(orphans)
        if orphans:
            res.notes.append(f"orphan engines {sorted(orphans)}")
        res.duplicates = len(self._dups)
        if self._dups:
            res.notes.append(f"duplicate engines for {sorted(self._dups)}")
        kept = await asyncio.to_thread(self._kept)
        low = min(x for x in (self._min_present, kept, floor) if x is not None)
        res.scale_downs = max(0, floor - low)
        removals = [r for r in await asyncio.to_thread(self._removals_since, mark) if r[0] not in inj.excused]
        if removals:  # replacements (make-before-break) and the planner's own changes show here too
            res.notes.append("removed: " + ", ".join(f"{k} {rid} ({st}: {reason})" for rid, k, st, reason in removals))
        if res.scale_downs:
            res.notes.append(f"the desired fleet fell to {low} replicas (floor {floor})")
        # requests: those sent in this window, once they all finished
        t_end = time.monotonic()
        await self.wait_for(lambda: self.load.unfinished_before(t_end) == 0, 30)
        sent = self.load.sent_between(t_window, t_end)
        res.sent = len(sent)
        res.ok = sum(1 for _, r in sent if r.outcome == "ok")
        res.failed = res.sent - res.ok
        bad = [(t, r) for t, r in sent if r.outcome != "ok" and not (inj.kills_serving and t < inj.t_s)
               and not (inj.outage is not None and inj.outage[0] <= t <= inj.outage[1])]
        res.unexplained = len(bad)
        if inj.no_failures and res.failed:
            res.missed.append(f"{res.failed} requests failed (goal: none)")
        if bad:
            kinds = Counter(f"{r.outcome}{'' if r.status is None else ' ' + str(r.status)}" for _, r in bad)
            res.notes.append("unexplained failures: " + ", ".join(f"{n}x {k}" for k, n in kinds.most_common()))
        self._window_start = t_end
        res.log_lines = self._log_since(log_from)
        return res


def summary(results: Sequence[FaultResult]) -> str:
    lines = [HEADER, *(r.line() for r in results)]
    tot = FaultResult("TOTAL", sum(r.sent for r in results), sum(r.ok for r in results),
                      sum(r.failed for r in results), sum(r.unexplained for r in results),
                      sum(r.duplicates for r in results), sum(r.orphans for r in results),
                      sum(r.scale_downs for r in results))
    missed = [r.name for r in results if not r.goals_met]
    lines.append(f"{tot.name:24s} {tot.sent:6d} {tot.ok:6d} {tot.failed:6d} {tot.unexplained:6d} "
                 f"{tot.duplicates:4d} {tot.orphans:4d} {tot.scale_downs:5d}")
    lines.append(f"goals missed by: {', '.join(missed)}" if missed else "all goals met")
    return "\n".join(lines)
