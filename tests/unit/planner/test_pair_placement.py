"""Placement pairs a pool family's prefill replicas with its decode replicas on one host
(planner/placement.py), and the plan's explanation carries the pairing it placed
(ModelPools.paired_prefill, `paired_prefill_replicas` in the plan document, rendered by the reports)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import replace

from fleetplan.controller.page import pairing_line
from fleetplan.controller.plan_text import render_plan
from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType
from fleetplan.models.profile import ProfileSet
from fleetplan.planner.core import plan, plan_to_dict
from fleetplan.planner.placement import Placement, paired_prefill, place
from fleetplan.planner.types import (
    ConfigKey,
    Fleet,
    HostInventory,
    ModelObservation,
    Observation,
    PlannerState,
    PlanResult,
    Replica,
    ReplicaState,
)
from tests.unit.planner.planner_helpers import hosts, key, policy
from tests.unit.planner.test_disagg_plan import ALLOW, MODEL, NOW, RAG, _fitted

H100, A100 = GpuType.H100, GpuType.A100
M = "m"


PRE, DEC = key(M, role=Role.PREFILL), key(M, role=Role.DECODE)


def ready(rid: str, c: ConfigKey, host: str, gpus: tuple[int, ...]) -> Replica:
    return Replica(rid, c, host, gpus, ReplicaState.READY, None, 0.0)


def roles_on(p: Placement) -> dict[str, Counter[Role]]:
    out: dict[str, Counter[Role]] = {}
    for r in p.replicas:
        out.setdefault(r.host, Counter())[r.config.role] += 1
    return out


def assert_disjoint(p: Placement) -> None:
    used = Counter((r.host, i) for r in p.replicas for i in r.gpu_indices)
    assert max(used.values()) == 1


# ---- an empty fleet ---------------------------------------------------------------------------

def test_on_an_empty_fleet_prefill_replicas_fill_the_decode_replicas_host() -> None:
    # 5 prefill + 1 decode TP1 on 2 hosts of 8: all 5 beside the decode replica (spreading alone
    # sent the first prefill replica to the other host)
    p = place({PRE: 5, DEC: 1}, hosts(2))
    assert not p.unplaced
    assert roles_on(p) == {"h00": Counter({Role.DECODE: 1, Role.PREFILL: 5})}
    assert paired_prefill(p.replicas) == {M: 5}
    # 9 + 1: the decode host holds 7 prefill partners, the other 2 go to the other host
    p = place({PRE: 9, DEC: 1}, hosts(2))
    assert not p.unplaced and len(p.replicas) == 10
    assert_disjoint(p)
    assert roles_on(p) == {"h00": Counter({Role.DECODE: 1, Role.PREFILL: 7}), "h01": Counter({Role.PREFILL: 2})}
    assert paired_prefill(p.replicas) == {M: 7}


def test_several_decode_replicas_each_get_their_share_of_prefill_partners() -> None:
    # 3 decode replicas spread over 3 of 4 hosts; the 9 prefill replicas go 3 beside each
    p = place({PRE: 9, DEC: 3}, hosts(4))
    assert not p.unplaced
    assert roles_on(p) == {h: Counter({Role.DECODE: 1, Role.PREFILL: 3}) for h in ("h00", "h01", "h02")}
    assert paired_prefill(p.replicas) == {M: 9}


def test_pairing_is_per_family_and_deterministic() -> None:
    # a TensorRT-LLM family of the same model on the same hosts: its prefill replicas pair with its
    # own decode replica, not with the vLLM one
    tp, td = key(M, Engine.TRTLLM, role=Role.PREFILL), key(M, Engine.TRTLLM, role=Role.DECODE)
    counts = {PRE: 3, DEC: 1, tp: 3, td: 1}
    p = place(counts, hosts(2))
    assert not p.unplaced
    dec_host = {r.config.engine: r.host for r in p.replicas if r.config.role is Role.DECODE}
    assert dec_host[Engine.VLLM] != dec_host[Engine.TRTLLM]  # spread: one lost host keeps a family
    for r in p.replicas:
        if r.config.role is Role.PREFILL:
            assert r.host == dec_host[r.config.engine], r
    assert paired_prefill(p.replicas) == {M: 6}
    assert place(counts, hosts(2)) == p


# ---- kept replicas ----------------------------------------------------------------------------

def test_new_prefill_replicas_go_beside_a_kept_decode_replica() -> None:
    # the kept decode replica runs on h2; the kept prefill replica on h0 stays where it is
    cur = [ready("d-old", DEC, "h02", (3,)), ready("p-old", PRE, "h00", (0,))]
    p = place({PRE: 4, DEC: 1}, hosts(3), cur)
    assert set(p.kept) == set(cur)
    assert {r.host for r in p.new} == {"h02"} and len(p.new) == 3
    assert paired_prefill(p.replicas) == {M: 3}  # the kept one on h0 stays unpaired


def test_a_new_decode_replica_goes_to_the_kept_prefill_replicas_without_a_partner() -> None:
    # the family's decode replica was lost; its 3 prefill replicas still run on h1
    cur = [ready(f"p{i}", PRE, "h01", (i,)) for i in range(3)]
    p = place({PRE: 3, DEC: 1}, hosts(3), cur)
    assert set(p.kept) == set(cur)
    assert [(r.config.role, r.host) for r in p.new] == [(Role.DECODE, "h01")]
    assert paired_prefill(p.replicas) == {M: 3}


# ---- no room for a pair -----------------------------------------------------------------------

def test_prefill_replicas_without_room_beside_a_decode_replica_are_placed_unpaired() -> None:
    # hosts of 4 GPUs: the decode host holds 3 partners, the other 3 replicas are placed anyway
    p = place({PRE: 6, DEC: 1}, hosts(2, count=4))
    assert not p.unplaced and len(p.replicas) == 7
    assert_disjoint(p)
    assert paired_prefill(p.replicas) == {M: 3}
    # a decode replica that fills its host leaves no room at all: every prefill replica unpaired
    wide = key(M, tp=4, role=Role.DECODE)
    q = place({PRE: 4, wide: 1}, hosts(2, count=4))
    assert not q.unplaced and len(q.replicas) == 5
    assert paired_prefill(q.replicas) == {M: 0}


def test_pairing_never_costs_a_replica_the_plain_packing_places() -> None:
    # one host of two NVLink pairs: the decode replicas first, each on the emptiest group, would
    # leave no pair of GPUs for the TP2 prefill replica; best-fit-decreasing places all three
    h = [HostInventory("h0", H100, 4, ((0, 1), (2, 3)))]
    pre2, dec1 = key(M, tp=2, role=Role.PREFILL), key(M, role=Role.DECODE)
    p = place({pre2: 1, dec1: 2}, h)
    assert not p.unplaced and len(p.replicas) == 3
    assert_disjoint(p)
    assert paired_prefill(p.replicas) == {M: 1}


# ---- the explanation ---------------------------------------------------------------------------

def _pooled_plan(n_hosts: int, gpus: int) -> PlanResult:
    """35 rps of 4,096-token prompts under ITL 20 ms (test_disagg_plan.py): 9 prefill + 1 decode
    replicas of vLLM H100 TP1, on `n_hosts` hosts of `gpus` GPUs."""
    pol = policy(models=(MODEL,), model_extra={MODEL: {**RAG, **ALLOW, "allowed": {"engines": ["vllm"], "tp": [1]}}})
    obs = Observation({MODEL: ModelObservation(MODEL, 35.0, 4096.0, 32.0)})
    return plan(obs, Fleet(tuple(HostInventory(f"h{i}", H100, gpus) for i in range(n_hosts))), pol,
                ProfileSet((_fitted(1),)), PlannerState.initial(), NOW)


def test_the_explanation_carries_the_pairing_placed() -> None:
    r = _pooled_plan(2, 8)
    me = r.explanation.models[0]
    assert me.pools is not None and me.pools.replicas() == (9, 1)
    assert me.pools.paired_prefill == 7 == paired_prefill(r.plan.replicas)[me.model]
    assert not any("not paired" in n or "like any replica" in n for n in me.notes)
    doc = plan_to_dict(r)
    assert doc["explanation"]["models"][0]["pools"]["paired_prefill_replicas"] == 7
    text = render_plan(doc)
    assert ("placed: 7 of 9 prefill replicas share a host with a decode replica of their pool; 2 have none on "
            "their host (their KV moves over the network)") in text
    # the same document after a trip through JSON text (the state store) renders the same
    assert render_plan(json.loads(json.dumps(doc))) == text


def test_the_explanation_reports_unpaired_prefill_replicas_where_hosts_are_small() -> None:
    # hosts of 4 GPUs: 3 prefill replicas beside the decode replica, 6 over the network
    small = _pooled_plan(3, 4)
    me = small.explanation.models[0]
    assert me.pools is not None and me.pools.replicas() == (9, 1)
    assert me.pools.paired_prefill == 3
    line = pairing_line(plan_to_dict(small)["explanation"]["models"][0])
    assert line is not None and "3 of 9 prefill replicas" in line and "; 6 have none on their host" in line
    # hosts of 16: all nine beside it, nothing over the network
    big = _pooled_plan(2, 16)
    pools = big.explanation.models[0].pools
    assert pools is not None and pools.replicas() == (9, 1) and pools.paired_prefill == 9
    line = pairing_line(plan_to_dict(big)["explanation"]["models"][0])
    assert line is not None and "9 of 9 prefill replicas" in line and "network" not in line
    # a model without pools: no pairing line
    assert pairing_line({"model": "x", "pools": None}) is None


# ---- models without pools place exactly as before ---------------------------------------------

def _summary(p: Placement) -> tuple[object, ...]:
    return (sorted((r.replica_id, r.host, r.gpu_indices) for r in p.replicas), sorted(r.replica_id for r in p.kept),
            sorted(r.replica_id for r in p.removed), sorted((c.label(), n) for c, n in p.unplaced.items()))


def _digest(p: Placement) -> str:
    return hashlib.sha256(repr(_summary(p)).encode()).hexdigest()[:16]


def test_a_fleet_without_pools_places_as_before_pairing() -> None:
    # kept replicas, a replica being removed, a draining one, GPUs held by a build, two NVLink groups,
    # an engine on one host only and a second GPU type; recorded from the placement before pairing
    hs = [HostInventory("h0", H100, 8), HostInventory("h1", H100, 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
          HostInventory("h2", H100, 8, held_gpus=(6, 7)), HostInventory("h3", H100, 8),
          HostInventory("h4", A100, 8)]
    cur = [ready("a-kept", key("a", tp=4), "h1", (0, 1, 2, 3)), ready("b-kept", key("b", tp=2), "h3", (4, 5)),
           ready("c-gone", key("c", tp=1), "h0", (7,)),
           Replica("b-drain", key("b", tp=2), "h0", (0, 1), ReplicaState.DRAINING, None, 0.0)]
    trt = key("e", Engine.TRTLLM, tp=2)
    counts = {key("a", tp=4): 3, key("a", tp=1): 2, key("b", tp=2): 3, key("c", tp=8): 1, key("d", gpu=A100): 5, trt: 1}
    p = place(counts, hs, cur, engine_hosts={trt: {"h3"}})
    assert _summary(p) == (
        [("a-kept", "h1", (0, 1, 2, 3)), ("a_vllm_tp1_h3_g6", "h3", (6,)), ("a_vllm_tp1_h3_g7", "h3", (7,)),
         ("a_vllm_tp4_h1_g4-5-6-7", "h1", (4, 5, 6, 7)), ("a_vllm_tp4_h2_g0-1-2-3", "h2", (0, 1, 2, 3)),
         ("b-kept", "h3", (4, 5)), ("b_vllm_tp2_h2_g4-5", "h2", (4, 5)), ("b_vllm_tp2_h3_g2-3", "h3", (2, 3)),
         ("c_vllm_tp8_h0_g0-1-2-3-4-5-6-7", "h0", (0, 1, 2, 3, 4, 5, 6, 7)),
         ("d_vllm_tp1_h4_g0", "h4", (0,)), ("d_vllm_tp1_h4_g1", "h4", (1,)), ("d_vllm_tp1_h4_g2", "h4", (2,)),
         ("d_vllm_tp1_h4_g3", "h4", (3,)), ("d_vllm_tp1_h4_g4", "h4", (4,)), ("e_trtllm_tp2_h3_g0-1", "h3", (0, 1))],
        ["a-kept", "b-kept"], ["c-gone"], [])
    assert paired_prefill(p.replicas) == {}


def test_a_large_fleet_without_pools_places_as_before_pairing() -> None:
    # 200 hosts of two GPU types, 20 models at TP 1-8 from an empty fleet, then again with two
    # thirds of it running and the counts moved by -1..+1; digests recorded before pairing
    hs = [HostInventory(f"h{i:03d}", (H100, A100)[i % 2], 8) for i in range(200)]
    counts: dict[ConfigKey, int] = {}
    for j in range(20):
        for tp in (1, 2, 4, 8):
            n = (j * 7 + tp * 3) % 6
            if n:
                counts[key(f"m{j:02d}", gpu=(H100, A100)[(j + tp) % 2], tp=tp)] = n
    first = place(counts, hs)
    running = [replace(r, state=ReplicaState.READY, since_s=0.0) for i, r in enumerate(first.replicas) if i % 3]
    again = {c: n + ((c.tp * 5 + int(c.model[1:])) % 3) - 1 for c, n in counts.items()}
    second = place(again, hs, running)
    assert (len(first.replicas), len(second.replicas), len(second.kept), len(second.removed)) == (190, 185, 119, 7)
    assert (_digest(first), _digest(second)) == ("4c3513e4b6f87544", "3a6ce6794e6acdd0")
