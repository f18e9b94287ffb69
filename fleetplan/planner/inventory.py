"""Whether to believe what a host says it has: the inventory rule. Pure.

A host's GPUs are planned on only when someone vouches for them: the policy's `hosts:` entry, the
host's own first report (recorded by the controller), or an operator's confirmation
(`fleetplan hosts confirm HOST`). `judge` compares a host's report with its record and its policy
entry and says what to plan on:

- the first report is recorded. A host the policy lists is planned on as far as the policy agrees
  (more GPUs or another type than the policy says: cut to the policy, alerted); a host the policy
  does not list, while the policy lists others, is held entirely (alerted) until it is confirmed or
  listed; with no `hosts:` in the policy at all the agents' first reports are the inventory;
- a later report whose GPUs differ from the record (count, type or NVLink groups) is an alert and is
  held: only what the record and the report share (the same type, the GPUs both name, in groups both
  agree on) is planned on until the change is confirmed (the operator, or a policy entry that says
  exactly what the host now reports);
- a report equal to its policy entry is believed and recorded (a policy edit confirms a change);
- a hold refuses new placements; it does not take GPUs from the replicas already running on the
  host (`keep_in_use`): a policy that stops listing a serving host, or a changed report, must not
  drain what serves (fail static), only stop the host from getting more.

Worked example: gpu-09 (not in a policy that lists gpu-01..04) first reports 24 h100: recorded,
HOLD, planned on none, alert "not in the policy's hosts". Confirmed: BELIEVE 24. It then reports
16: HOLD, planned on 16 (what both name), alert "changed from 24 to 16" until confirmed again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Inventory", "InventoryRecord", "Judgement", "Verdict", "Voucher", "common", "judge", "keep_in_use"]


@dataclass(frozen=True)
class Inventory:
    """A host's GPUs: one type, `gpu_count` of them (indices 0..n-1) and their NVLink groups (empty:
    one group of all)."""

    gpu: str
    gpu_count: int
    nvlink_groups: tuple[tuple[int, ...], ...] = ()

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The NVLink groups, normalised (sorted; empty -> one group of every GPU)."""
        raw = self.nvlink_groups or ((tuple(range(self.gpu_count)),) if self.gpu_count else ())
        return tuple(sorted(tuple(sorted(g)) for g in raw if g))

    def same(self, other: Inventory) -> bool:
        """The same GPUs: type (any spelling case), count and NVLink groups."""
        return (self.gpu.lower() == other.gpu.lower() and self.gpu_count == other.gpu_count
                and self.groups() == other.groups())

    def within(self, other: Inventory) -> bool:
        """No more than `other`: the same type and at most its count (a failed GPU is not a lie)."""
        return self.gpu.lower() == other.gpu.lower() and self.gpu_count <= other.gpu_count

    def describe(self) -> str:
        return f"{self.gpu_count} {self.gpu} GPU(s)"


NONE_OF_THEM = 0


def common(a: Inventory, b: Inventory) -> Inventory:
    """What two inventories share: `a`'s type if both name it, the GPUs both count, in the groups
    both agree on (the common refinement of the two NVLink partitions), so a TP group placed on it
    is one NVLink group for both.

    >>> common(Inventory("h100", 24, (tuple(range(24)),)), Inventory("h100", 8)).groups()
    ((0, 1, 2, 3, 4, 5, 6, 7),)
    >>> common(Inventory("h100", 8), Inventory("h100", 8, ((0, 1, 2, 3), (4, 5, 6, 7)))).groups()
    ((0, 1, 2, 3), (4, 5, 6, 7))
    >>> common(Inventory("a100", 8), Inventory("h100", 8)).gpu_count
    0
    """
    if a.gpu.lower() != b.gpu.lower():
        return Inventory(a.gpu, NONE_OF_THEM, ())
    n = min(a.gpu_count, b.gpu_count)
    groups = tuple(g for g in (tuple(i for i in ga if i in set(gb) and i < n)
                               for ga in a.groups() for gb in b.groups()) if g)
    return Inventory(a.gpu, n, tuple(sorted(groups)))


class Verdict(StrEnum):
    BELIEVE = "believe"  # plan on the report
    HOLD = "hold"  # plan only on what is vouched for (`Judgement.plan_on`); alerted


class Voucher(StrEnum):
    """Who vouched for a host's recorded inventory."""

    FIRST_REPORT = "first-report"  # the host's own first report
    POLICY = "policy"  # the policy's `hosts:` entry says exactly this
    OPERATOR = "operator"  # `fleetplan hosts confirm HOST`


@dataclass(frozen=True)
class InventoryRecord:
    """What the controller recorded of a host's GPUs, since when (wall seconds) and on whose word."""

    inventory: Inventory
    since_s: float
    voucher: Voucher


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    plan_on: Inventory | None  # None: the report as it is
    record: InventoryRecord | None  # a new record to store (None: keep the one there is)
    alert: str | None  # what on-call must know (None: nothing)


def judge(host: str, reported: Inventory | None, record: InventoryRecord | None, listed: Inventory | None, *,
          policy_lists_hosts: bool, now_s: float) -> Judgement:
    """What to plan on for `host` (see the module docstring). `reported`: its status' GPUs (None:
    it reported none); `record`: what the controller recorded; `listed`: its policy entry (None:
    not listed); `policy_lists_hosts`: the policy has a `hosts:` list at all."""
    if reported is None:
        return Judgement(Verdict.BELIEVE, None, None, None)
    said = f"host {host} reports {reported.describe()}"
    confirm = f"`fleetplan hosts confirm {host}`"
    if listed is not None and reported.same(listed):
        fresh = record is None or not record.inventory.same(reported) or record.voucher == Voucher.FIRST_REPORT
        return Judgement(Verdict.BELIEVE, None, InventoryRecord(reported, now_s, Voucher.POLICY) if fresh else None,
                         None)
    new = InventoryRecord(reported, now_s, Voucher.FIRST_REPORT) if record is None else None
    if record is not None and not reported.same(record.inventory):
        was = record.inventory
        trusted = common(was, listed) if listed is not None else was
        if listed is None and policy_lists_hosts and record.voucher == Voucher.FIRST_REPORT:
            trusted = Inventory(was.gpu, NONE_OF_THEM, ())
        plan_on = common(reported, trusted)
        by = {Voucher.FIRST_REPORT: "its first report", Voucher.POLICY: "the policy",
              Voucher.OPERATOR: "an operator"}[record.voucher]
        return Judgement(Verdict.HOLD, plan_on, None,
                         f"{said}, recorded {was.describe()} (from {by}): its GPUs changed; planning on "
                         f"{_count(plan_on)} until {confirm}" + (" or the policy lists what it reports"
                                                                  if listed is not None else ""))
    if listed is not None:
        if reported.within(listed):
            return Judgement(Verdict.BELIEVE, None, new, None)
        plan_on = common(reported, listed)
        return Judgement(Verdict.HOLD, plan_on, new,
                         f"{said}, its policy inventory {listed.describe()}: planning on {_count(plan_on)}")
    if policy_lists_hosts and (record is None or record.voucher != Voucher.OPERATOR):
        return Judgement(Verdict.HOLD, Inventory(reported.gpu, NONE_OF_THEM, ()), new,
                         f"{said} and is not in the policy's hosts: planning on none of them until {confirm} "
                         "or the policy lists it")
    return Judgement(Verdict.BELIEVE, None, new, None)


def keep_in_use(plan_on: Inventory, in_use: Iterable[Sequence[int]]) -> Inventory:
    """A held host's inventory to plan on, with the GPUs of the replicas running on it (`in_use`: each
    one's GPU indices, as its agent reports them) kept: each replica outside the held groups becomes
    an NVLink group of its own, so the planner keeps it where it is; the count is unchanged, so no
    new replica is placed on those GPUs.

    >>> keep_in_use(Inventory("h100", 0, ()), [(4, 5, 6, 7)])
    Inventory(gpu='h100', gpu_count=0, nvlink_groups=((4, 5, 6, 7),))
    >>> keep_in_use(Inventory("h100", 6, ((0, 1, 2, 3, 4, 5),)), [(0, 1, 2, 3)]).groups()
    ((0, 1, 2, 3, 4, 5),)
    """
    groups = list(plan_on.groups())
    for gpus in in_use:
        g = tuple(sorted(set(gpus)))
        if g and not any(set(g) <= set(h) for h in groups):
            groups.append(g)
    if len(groups) == len(plan_on.groups()):
        return plan_on
    return Inventory(plan_on.gpu, plan_on.gpu_count, tuple(sorted(groups)))


def _count(inv: Inventory) -> str:
    return "none of them" if inv.gpu_count == NONE_OF_THEM else str(inv.gpu_count)
