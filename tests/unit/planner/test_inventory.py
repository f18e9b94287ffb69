"""The inventory rule (planner/inventory.py) without servers: a first report is recorded, a later
change is held and alerted until confirmed (operator or policy), listed host or not; a host the
policy does not list is not believed silently."""

from __future__ import annotations

from fleetplan.planner.inventory import Inventory, InventoryRecord, Verdict, Voucher, common, judge

H8 = Inventory("h100", 8, (tuple(range(8)),))
H24 = Inventory("h100", 24, (tuple(range(24)),))
H4 = Inventory("h100", 4, ((0, 1, 2, 3),))


def rec(inv: Inventory, by: Voucher = Voucher.FIRST_REPORT) -> InventoryRecord:
    return InventoryRecord(inv, 100.0, by)


def test_a_first_report_is_recorded_and_believed_when_the_policy_lists_no_hosts() -> None:
    j = judge("h", H8, None, None, policy_lists_hosts=False, now_s=5.0)
    assert j.verdict == Verdict.BELIEVE and j.plan_on is None and j.alert is None
    assert j.record == InventoryRecord(H8, 5.0, Voucher.FIRST_REPORT)


def test_a_later_change_is_held_on_what_record_and_report_share_and_alerted() -> None:
    more = judge("h", H24, rec(H8), None, policy_lists_hosts=False, now_s=5.0)
    assert more.verdict == Verdict.HOLD and more.record is None
    assert more.plan_on is not None and more.plan_on.gpu_count == 8 and more.plan_on.groups() == (tuple(range(8)),)
    assert more.alert is not None and "24" in more.alert and "recorded 8" in more.alert
    assert "fleetplan hosts confirm h" in more.alert
    fewer = judge("h", H4, rec(H8), None, policy_lists_hosts=False, now_s=5.0)  # a GPU failed: held on the 4
    assert fewer.verdict == Verdict.HOLD and fewer.plan_on == common(H4, H8) and fewer.plan_on.gpu_count == 4
    other = judge("h", Inventory("a100", 8), rec(H8), None, policy_lists_hosts=False, now_s=5.0)
    assert other.verdict == Verdict.HOLD and other.plan_on is not None and other.plan_on.gpu_count == 0
    # the same count in other NVLink groups is a change too: planned in the groups both agree on
    split = Inventory("h100", 8, ((0, 1, 2, 3), (4, 5, 6, 7)))
    regroup = judge("h", H8, rec(split), None, policy_lists_hosts=False, now_s=5.0)
    assert regroup.verdict == Verdict.HOLD and regroup.plan_on is not None
    assert regroup.plan_on.groups() == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_a_confirmed_change_is_believed() -> None:
    j = judge("h", H24, rec(H24, Voucher.OPERATOR), None, policy_lists_hosts=False, now_s=5.0)
    assert j.verdict == Verdict.BELIEVE and j.alert is None and j.plan_on is None


def test_a_host_the_policy_does_not_list_is_held_until_confirmed() -> None:
    first = judge("gpu-09", H24, None, None, policy_lists_hosts=True, now_s=5.0)
    assert first.verdict == Verdict.HOLD and first.plan_on is not None and first.plan_on.gpu_count == 0
    assert first.record == InventoryRecord(H24, 5.0, Voucher.FIRST_REPORT)  # recorded all the same
    assert first.alert is not None and "not in the policy's hosts" in first.alert
    again = judge("gpu-09", H24, first.record, None, policy_lists_hosts=True, now_s=9.0)
    assert again.verdict == Verdict.HOLD and again.plan_on is not None and again.plan_on.gpu_count == 0
    ok = judge("gpu-09", H24, rec(H24, Voucher.OPERATOR), None, policy_lists_hosts=True, now_s=9.0)
    assert ok.verdict == Verdict.BELIEVE and ok.alert is None
    # confirmed, then it changes: held on what the confirmation and the report share
    changed = judge("gpu-09", H8, rec(H24, Voucher.OPERATOR), None, policy_lists_hosts=True, now_s=9.0)
    assert changed.verdict == Verdict.HOLD and changed.plan_on is not None and changed.plan_on.gpu_count == 8
    # unconfirmed and changed: still nothing
    held = judge("gpu-09", H8, rec(H24), None, policy_lists_hosts=True, now_s=9.0)
    assert held.plan_on is not None and held.plan_on.gpu_count == 0


def test_a_listed_host_is_bounded_by_its_policy_entry() -> None:
    cut = judge("gpu-01", H24, None, H8, policy_lists_hosts=True, now_s=5.0)
    assert cut.verdict == Verdict.HOLD and cut.plan_on is not None and cut.plan_on.gpu_count == 8
    assert cut.alert is not None and "policy inventory 8" in cut.alert and "planning on 8" in cut.alert
    assert cut.record is not None  # the first report is recorded even when the policy bounds it
    fewer = judge("gpu-01", H4, None, H8, policy_lists_hosts=True, now_s=5.0)  # a failed GPU: believed
    assert fewer.verdict == Verdict.BELIEVE and fewer.alert is None
    other = judge("gpu-01", Inventory("a100", 8), None, H8, policy_lists_hosts=True, now_s=5.0)
    assert other.plan_on is not None and other.plan_on.gpu_count == 0 and "none of them" in (other.alert or "")


def test_a_listed_host_that_changes_is_held_even_within_its_policy_entry() -> None:
    j = judge("gpu-01", H4, rec(H8, Voucher.POLICY), H8, policy_lists_hosts=True, now_s=5.0)
    assert j.verdict == Verdict.HOLD and j.plan_on is not None and j.plan_on.gpu_count == 4 and j.alert
    assert "or the policy lists what it reports" in j.alert
    # the operator confirms the 4: believed (within the policy's 8)
    ok = judge("gpu-01", H4, rec(H4, Voucher.OPERATOR), H8, policy_lists_hosts=True, now_s=6.0)
    assert ok.verdict == Verdict.BELIEVE and ok.alert is None


def test_a_policy_entry_equal_to_the_report_confirms_a_change() -> None:
    j = judge("gpu-01", H24, rec(H8), H24, policy_lists_hosts=True, now_s=7.0)
    assert j.verdict == Verdict.BELIEVE and j.alert is None
    assert j.record == InventoryRecord(H24, 7.0, Voucher.POLICY)
    # the same once recorded by the policy: nothing to store again
    assert judge("gpu-01", H24, rec(H24, Voucher.POLICY), H24, policy_lists_hosts=True, now_s=8.0).record is None


def test_no_gpus_reported_is_nothing_to_judge() -> None:
    j = judge("h", None, rec(H8), None, policy_lists_hosts=True, now_s=5.0)
    assert j == judge("h", None, None, H8, policy_lists_hosts=False, now_s=5.0)
    assert j.verdict == Verdict.BELIEVE and j.plan_on is None and j.record is None and j.alert is None


def test_inventories_compare_by_type_count_and_groups_whatever_the_spelling() -> None:
    assert Inventory("H100", 8).same(Inventory("h100", 8, (tuple(range(8)),)))
    assert not Inventory("h100", 8).same(Inventory("h100", 8, ((0, 1, 2, 3), (4, 5, 6, 7))))
    assert Inventory("h100", 4).within(H8) and not H24.within(H8) and not Inventory("a100", 4).within(H8)
