"""A plan that cannot be carried out (planner/act_execute.py) without servers: it needs hosts no agent
serves while agents are online for hosts the policy does not list -> one alert naming both sides; an
action deferred for the same cause cycle after cycle is one action-log row with a count."""

from __future__ import annotations

import dataclasses

from fleetplan.planner import act
from fleetplan.planner.act import ActSettings, Record
from fleetplan.planner.act_types import DeferCause, Deferral, Repeat
from fleetplan.planner.types import Action, ActionKind
from tests.unit.planner.test_act import NOW, action, host, row, view

LISTED = ActSettings(listed_hosts=frozenset({"gpu-01", "gpu-02"}))
KEY = act.AlertKey(act.AlertKind.UNREACHABLE)


def starts_on_gpu01() -> list[Action]:
    return [action(ActionKind.START, f"new{i}", gpus=(i,), host_name="gpu-01") for i in range(3)]


def test_a_plan_on_hosts_without_agents_is_one_alert_naming_both_sides() -> None:
    v = view(host("host-a"), host("host-b"), settings=LISTED)
    d = act.execute(v, starts_on_gpu01())
    text = d.alerts[KEY]
    assert "gpu-01" in text and "no agent is online" in text and "3 action(s) deferred" in text
    assert "host-a, host-b" in text and "do not list" in text
    assert len([k for k in d.alerts if k.kind is act.AlertKind.UNREACHABLE]) == 1
    # every start deferred for that cause
    assert [e.note.cause for e in d.effects if isinstance(e, Record)] == [DeferCause.NO_AGENT] * 3


def test_agents_only_for_hosts_the_policy_does_not_list_are_one_alert_without_any_action() -> None:
    # the unlisted agents are held (planner/inventory.py): the plan places nothing, nothing is deferred
    d = act.execute(view(host("host-a"), host("host-b"), settings=LISTED), [])
    assert "no host the policy lists has an online agent (gpu-01, gpu-02)" in d.alerts[KEY]
    assert "host-a, host-b" in d.alerts[KEY]
    # one listed host with an agent: the others are its business (maintenance), no alert
    assert KEY not in act.execute(view(host("gpu-02"), host("host-a"), settings=LISTED), []).alerts


def test_the_alert_clears_once_the_plan_can_be_carried_out() -> None:
    d = act.execute(view(host("gpu-01"), settings=LISTED), starts_on_gpu01())
    assert KEY not in d.alerts and KEY in d.cleared
    assert d.counts["start"] == 3


def test_an_agent_restarting_within_the_grace_is_not_a_plan_nobody_can_carry_out() -> None:
    restarting = dataclasses.replace(host("gpu-01"), online=False, offline_since_s=NOW - 10)
    d = act.execute(view(restarting, settings=LISTED), starts_on_gpu01())
    assert KEY not in d.alerts and d.counts["deferred"] == 3
    lost = dataclasses.replace(host("gpu-01"), online=False, offline_since_s=NOW - 3600)
    assert "gpu-01" in act.execute(view(lost, settings=LISTED), starts_on_gpu01()).alerts[KEY]


def test_without_strangers_the_alert_says_so() -> None:
    d = act.execute(view(host("gpu-02"), settings=LISTED), starts_on_gpu01())
    assert "no agent is online for a host the policy does not list" in d.alerts[KEY]


def test_a_repeated_deferral_is_a_count_on_its_first_row() -> None:
    v = view(host("host-a"), settings=LISTED)
    first = act.execute(v, starts_on_gpu01())
    notes = [e.note for e in first.effects if isinstance(e, Record)]
    assert len(notes) == 3 and first.deferrals == {}  # new: their rows get ids once written
    keys = [n.defer_key() for n in notes]
    assert len(set(keys)) == 3  # three starts, three rows
    # the store wrote them as rows 11, 12, 13 (controller/executor.py keeps them open)
    open_ = {k: Deferral(11 + i, 1, NOW - 5) for i, k in enumerate(keys) if k is not None}
    again = act.execute(dataclasses.replace(v, deferrals=open_), starts_on_gpu01())
    repeats = [e for e in again.effects if isinstance(e, Repeat)]
    assert [r.action_id for r in repeats] == [11, 12, 13] and all(r.count == 2 for r in repeats)
    assert not [e for e in again.effects if isinstance(e, Record)]
    assert "deferred 2 times in 5 s" in repeats[0].note.detail
    assert again.deferrals is not None and set(again.deferrals) == set(open_)
    assert again.counts["deferred"] == 3  # each cycle's deferrals still counted


def test_a_deferral_for_another_cause_is_a_new_row() -> None:
    v = view(host("host-a"), settings=LISTED)
    (k,) = {e.note.defer_key() for e in act.execute(v, starts_on_gpu01()[:1]).effects if isinstance(e, Record)}
    assert k is not None
    busy = dataclasses.replace(v, hosts={"gpu-01": dataclasses.replace(host("gpu-01"), port_range=(8000, 8000))},
                               replicas=(), deferrals={k: Deferral(11, 4, NOW - 60)})
    busy = dataclasses.replace(busy, replicas=(row("r1", gpus=(7,), port=8000),))
    d = act.execute(busy, starts_on_gpu01()[:1])
    (rec,) = [e for e in d.effects if isinstance(e, Record)]
    assert rec.note.cause == DeferCause.NO_PORT and not [e for e in d.effects if isinstance(e, Repeat)]
    assert d.deferrals == {}  # the no-agent deferral ended


def test_deferrals_while_mqtt_is_down_repeat_too() -> None:
    v = view(host("gpu-01"), connected_since_s=None)
    first = act.execute(v, starts_on_gpu01()[:1])
    (rec,) = first.effects
    assert isinstance(rec, Record) and rec.note.cause == DeferCause.MQTT_DOWN
    k = rec.note.defer_key()
    assert k is not None
    again = act.execute(dataclasses.replace(v, deferrals={k: Deferral(5, 1, NOW)}), starts_on_gpu01()[:1])
    assert isinstance(again.effects[0], Repeat) and again.effects[0].count == 2
