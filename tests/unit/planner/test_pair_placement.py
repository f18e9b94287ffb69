"""Disaggregated pools are placed in pairs: a prefill replica goes to a host that holds a decode
replica of its engine and GPU type where one has room (its KV cache then moves over the host's own
link, which the pools' capacities assume), and the plan's explanation says how many are paired."""

from __future__ import annotations

from dataclasses import replace

from planner_helpers import hosts, key

from fleetplan.models.config_key import Role
from fleetplan.planner.disagg_plan import paired_prefill
from fleetplan.planner.placement import place
from fleetplan.planner.types import Replica, ReplicaState

AGG = key("m8")
PRE, DEC = replace(AGG, role=Role.PREFILL), replace(AGG, role=Role.DECODE)


def _by_role(replicas: tuple[Replica, ...]) -> dict[Role, list[str]]:
    out: dict[Role, list[str]] = {}
    for r in replicas:
        out.setdefault(r.config.role, []).append(r.host)
    return out


def test_prefill_replicas_join_their_decode_replica_on_its_host() -> None:
    # spreading alone puts each new replica of a model on a host without it: the three prefill
    # replicas would land on the other hosts, away from the decode replica's KV link
    p = place({DEC: 1, PRE: 3}, hosts(4))
    where = _by_role(p.replicas)
    assert len(where[Role.DECODE]) == 1 and set(where[Role.PREFILL]) == set(where[Role.DECODE])
    assert paired_prefill(p.replicas, "m8") == (3, 3)


def test_a_kept_decode_replica_draws_the_new_prefill_replicas() -> None:
    kept = Replica("d0", DEC, "h02", (0,), ReplicaState.READY, 0.0, None)
    p = place({DEC: 1, PRE: 2}, hosts(4), current=(kept,))
    assert [r.replica_id for r in p.kept] == ["d0"]
    assert {r.host for r in p.new} == {"h02"}


def test_without_room_on_the_partner_the_rest_place_anyway_and_are_counted_unpaired() -> None:
    # two hosts of 2 GPUs: one decode and one prefill fit on the decode's host, the third goes elsewhere
    p = place({DEC: 1, PRE: 3}, hosts(2, count=2))
    assert not p.unplaced and len(p.replicas) == 4
    assert paired_prefill(p.replicas, "m8") == (1, 3)


def test_aggregated_replicas_place_as_before() -> None:
    # no pools: spreading as before, one replica per host
    p = place({AGG: 3}, hosts(4))
    assert sorted(r.host for r in p.replicas) == ["h00", "h01", "h02"]
