"""Placement (stage 2): a model's replicas spread over hosts when there is room, packing first."""

from __future__ import annotations

from collections import Counter

from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.placement import place
from fleetplan.planner.types import ConfigKey, HostInventory, Replica, ReplicaState

H100 = GpuType.H100


def key(model: str, tp: int, engine: Engine = Engine.VLLM) -> ConfigKey:
    return ConfigKey(model, engine, H100, tp, Precision.BF16)


def hosts(n: int, gpus: int = 8) -> list[HostInventory]:
    return [HostInventory(f"h{i}", H100, gpus) for i in range(n)]


def per_host(replicas: tuple[Replica, ...], model: str) -> Counter[str]:
    return Counter(r.host for r in replicas if r.config.model == model)


def test_two_replicas_of_a_model_go_to_two_hosts() -> None:
    # plain best fit would fill h0 with both (h0 has 4 free after the first): one lost host = outage
    p = place({key("m", 4): 2}, hosts(3))
    assert not p.unplaced
    assert sorted(per_host(p.replicas, "m").values()) == [1, 1]


def test_a_model_spreads_across_its_configs_and_around_kept_replicas() -> None:
    kept = Replica("m-old", key("m", 4, Engine.TRTLLM), "h0", (0, 1, 2, 3), ReplicaState.READY, None, 0.0)
    p = place({key("m", 4, Engine.TRTLLM): 1, key("m", 4): 1}, hosts(2), [kept])
    assert p.kept == (kept,)
    assert [r.host for r in p.new] == ["h1"]  # not beside the kept replica on h0


def test_spreading_never_costs_a_replica_that_packing_would_place() -> None:
    # 2 hosts of 8 GPUs; h0 has 2 GPUs held by a build. 2 TP4 of model a and 1 TP2 of model b:
    # whatever spreading prefers, every replica must be placed (6 + 8 = 14 GPUs, 10 needed).
    hs = [HostInventory("h0", H100, 8, held_gpus=(0, 1)), HostInventory("h1", H100, 8)]
    p = place({key("a", 4): 2, key("b", 2): 1}, hs)
    assert not p.unplaced
    assert sorted(per_host(p.replicas, "a").values()) == [1, 1]
    busy = Counter((r.host, i) for r in p.replicas for i in r.gpu_indices)
    assert max(busy.values()) == 1 and not any((("h0", i) in busy) for i in (0, 1))


def test_a_full_fleet_still_packs_when_spreading_cannot_place_everything() -> None:
    # one NVLink group of 4 on each of 2 hosts, 4 GPUs of model x already on h0 GPUs 0-1 and h1 GPUs 0-1:
    # two more TP2 of x must go beside them (no host without x has room): fall back to best fit
    hs = [HostInventory("h0", H100, 4), HostInventory("h1", H100, 4)]
    cur = [Replica("x0", key("x", 2), "h0", (0, 1), ReplicaState.READY, None, 0.0),
           Replica("x1", key("x", 2), "h1", (0, 1), ReplicaState.READY, None, 0.0)]
    p = place({key("x", 2): 4}, hs, cur)
    assert not p.unplaced and len(p.replicas) == 4
    assert per_host(p.replicas, "x") == Counter({"h0": 2, "h1": 2})


def test_more_replicas_than_hosts_use_every_host() -> None:
    p = place({key("m", 2): 6}, hosts(3))
    assert not p.unplaced
    assert set(per_host(p.replicas, "m")) == {"h0", "h1", "h2"}


def test_spreading_keeps_working_past_the_first_few_hundred_placements() -> None:
    # taken segments used to stay in the scan window, so spreading stopped after 256 placements
    p = place({key("m", 4): 600}, hosts(600))
    assert not p.unplaced
    assert set(per_host(p.replicas, "m").values()) == {1}
