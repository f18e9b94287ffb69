"""Prefill and decode pools in the replay (fleetplan/sim/disagg_proxy.py): the hand-off's timing, the
decode steps free of prefill stalls, the KV link, each pool's engine series, no request lost."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from fleetplan.models.config_key import Role
from fleetplan.models.disagg import host_link, kv_bytes_per_token, kv_transfer_ms
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.types import ConfigKey, HostInventory
from fleetplan.sim.baselines import StaticController
from fleetplan.sim.core import replay_on_core
from fleetplan.sim.des import ControllerView, Decision, Environment, FleetSim, SimResult, SimSettings
from fleetplan.sim.disagg_proxy import DecodeCore
from fleetplan.sim.groundtruth import EngineParams, build_params
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

M = "llama-3-8b"
AGG = ConfigKey(M, Engine.VLLM, GpuType.H100, 1, Precision.BF16)
PRE = replace(AGG, role=Role.PREFILL)
DEC = replace(AGG, role=Role.DECODE)
PARAMS = build_params(Engine.VLLM, M, GpuType.H100, 1, noise_sigma=0.0)


def _env(hosts: tuple[HostInventory, ...] = (HostInventory("h1", GpuType.H100, 8),)) -> Environment:
    def params_for(c: ConfigKey) -> EngineParams:
        assert c.role is Role.AGGREGATED  # a pool's replica runs the aggregated config's engine
        return PARAMS

    return Environment(hosts=hosts, price_usd_h={"h100": 2.0}, params_for=params_for,
                       startup_s=lambda c: 30.0, build_s=lambda c: None, cached=frozenset(),
                       ttft_slo_ms={M: 500.0}, itl_slo_ms={M: 50.0})


def _trace(reqs: list[tuple[float, int, int]]) -> Trace:
    return Trace("t", TraceFormat.AZURE, tuple(TraceRequest(t, p, o, M) for t, p, o in sorted(reqs)))


def _sim(reqs: list[tuple[float, int, int]], fleet: Mapping[ConfigKey, int], env: Environment | None = None,
         ctl: object = None) -> tuple[FleetSim, SimResult]:
    controller = ctl if ctl is not None else StaticController("fixed", dict(fleet))
    sim = FleetSim(_trace(reqs), controller, env or _env(), SimSettings())  # type: ignore[arg-type]
    return sim, sim.run()


def _decode_alone(prompt: int, output: int) -> tuple[float, float]:
    """(first token, last token) of one transferred request on an idle decode core, from its join."""
    core = DecodeCore(PARAMS)
    core.submit_prefilled(0, prompt, output)
    now, first, last = 0.0, float("nan"), float("nan")
    while not core.idle():
        te = core.begin(now)
        assert te is not None
        now = te
        firsts, fins, _, _ = core.end()
        if firsts:
            first = now
        if fins:
            last = now
    return first, last


def test_ttft_is_prefill_then_transfer_then_the_first_decode_step() -> None:
    prompt, output = 3000, 12
    sim, res = _sim([(0.0, prompt, output), (50.0, 10, 2)], {PRE: 1, DEC: 1})
    assert res.served == 2 and res.rejected == 0
    prefill_ttft = float(replay_on_core(PARAMS, [(0.0, prompt, 1)])[0][0])  # the core's own timing (+ front end)
    transfer_s = kv_transfer_ms(kv_bytes_per_token(AGG) or 0.0, prompt, host_link(GpuType.H100), 1) / 1000.0
    first, last = _decode_alone(prompt, output)
    oh = PARAMS.factors.ttft_overhead_s
    assert abs(res.ttft_ms[0] / 1000.0 - (prefill_ttft + transfer_s + first + oh)) < 1e-9
    assert transfer_s > 0 and first > 0
    assert abs(res.itl_ms[0] / 1000.0 - (last - first) / (output - 1)) < 1e-9  # decode steps only
    assert sim.kv_log[0][0] == 0 and not sim.kv_log[0][2]  # one host: its NVLink


def test_decode_pool_itl_has_no_prefill_stalls() -> None:
    short = [(i * 0.25, 200, 200) for i in range(240)]  # 4 rps for a minute, 200 tokens out each
    burst = [(20.0 + i * 0.05, 7800, 2) for i in range(24)]  # long prompts, short outputs

    def short_itl_p99(fleet: Mapping[ConfigKey, int], with_burst: bool) -> float:
        sim, _ = _sim(short + (burst if with_burst else []), fleet)
        idx = [i for i, r in enumerate(sim.trace.requests) if r.prompt_tokens == 200]
        itl = (sim.finish_t[idx] - sim.first_t[idx]) / 199.0
        assert not np.isnan(itl).any()
        return float(np.quantile(itl, 0.99))

    agg_quiet, agg_burst = short_itl_p99({AGG: 2}, False), short_itl_p99({AGG: 2}, True)
    pool_quiet, pool_burst = short_itl_p99({PRE: 1, DEC: 1}, False), short_itl_p99({PRE: 1, DEC: 1}, True)
    assert agg_burst > 1.5 * agg_quiet  # the long prefills stall the aggregated replicas' decode steps
    assert pool_burst < 1.1 * pool_quiet  # the decode replica runs no prefill
    assert pool_burst < agg_burst / 1.4


def test_transfer_is_slower_across_hosts() -> None:
    reqs = [(0.0, 6000, 4), (30.0, 6000, 4)]
    inside, res_in = _sim(reqs, {PRE: 1, DEC: 1})
    two = (HostInventory("h1", GpuType.H100, 1), HostInventory("h2", GpuType.H100, 1))
    across, res_across = _sim(reqs, {PRE: 1, DEC: 1}, _env(two))
    assert [x[2] for x in inside.kv_log] == [False, False] and [x[2] for x in across.kv_log] == [True, True]
    ms_in, ms_across = inside.kv_log[0][1], across.kv_log[0][1]
    expect = kv_transfer_ms(kv_bytes_per_token(AGG) or 0.0, 6000, SimSettings().kv_network_link, 1)
    assert abs(ms_across - expect) < 1e-9 and ms_across > 3 * ms_in
    gap = res_across.ttft_ms[0] - res_in.ttft_ms[0]
    assert abs(gap - (ms_across - ms_in)) < 1e-6  # the client's TTFT carries the transfer


def test_a_prefill_hands_its_kv_to_a_decode_replica_on_its_host() -> None:
    """Three hosts of two GPUs, three replicas per pool: the decode replicas fill h1 and h2, the
    prefill ones h2 and h3. The prefill replica on h2 (at 10 rps of short prompts it takes nearly
    every request: least loaded, ties to the oldest) hands its requests' KV to the decode replica
    beside it (NVLink) while that one's load stays within the bound (planner/kv_route.py), the rest
    to the others; a least-loaded pick over the three sent 72% over the network."""
    reqs = [(i * 0.1, 500 + 37 * (i % 50), 20 + i % 60) for i in range(1200)]
    sim, res = _sim(reqs, {PRE: 3, DEC: 3}, _env(tuple(HostInventory(f"h{i}", GpuType.H100, 2) for i in (1, 2, 3))))
    assert res.served == len(reqs) and res.rejected == 0
    placed = sorted((r.config.role.value, r.host) for r in sim.replicas)
    assert placed == [("decode", "h1"), ("decode", "h1"), ("decode", "h2"),
                      ("prefill", "h2"), ("prefill", "h3"), ("prefill", "h3")]
    from_h2 = [across for _, _, across, src in sim.kv_log if src == "h2"]
    assert len(from_h2) > 1000 and sum(not a for a in from_h2) > 0.6 * len(from_h2)
    assert all(across for _, _, across, src in sim.kv_log if src == "h3")


def test_each_pool_exports_its_own_series() -> None:
    rng = np.random.default_rng(1)
    reqs = [(float(t), int(p), int(o)) for t, p, o in zip(np.sort(rng.uniform(0, 60, 150)),
                                                          rng.integers(50, 3000, 150), rng.integers(1, 80, 150),
                                                          strict=True)]
    sim, res = _sim(reqs, {PRE: 2, DEC: 1})
    assert res.served == len(reqs)
    pre = [r for r in sim.replicas if r.config == PRE]
    dec = [r for r in sim.replicas if r.config == DEC]
    n, prompts, outs = len(reqs), sum(p for _, p, _ in reqs), sum(o for _, _, o in reqs)
    assert sum(r.counters.completed for r in pre) == n and all(r.counters.completed > 0 for r in pre)
    assert sum(r.counters.gen_tokens for r in pre) == n  # one token each
    assert sum(r.counters.prompt_tokens for r in pre) == prompts
    assert sum(sum(r.counters.ttft) for r in pre) == n
    assert sum(sum(r.counters.itl) for r in pre) == 0 and sum(sum(r.counters.tpot) for r in pre) == 0
    d = dec[0].counters
    assert d.completed == n and d.gen_tokens == outs and d.prompt_tokens == prompts
    assert sum(d.ttft) == n and sum(d.itl) == outs - n and sum(d.tpot) == sum(1 for *_, o in reqs if o >= 2)
    # the decode engine's TTFT runs from the request's arrival at it: the transfer and the first step
    assert d.sums[0] < sum(r.counters.sums[0] for r in pre)
    roles = dict(res.gpu_hours_by_role)
    assert set(roles) == {Role.PREFILL, Role.DECODE} and abs(roles[Role.PREFILL] - 2 * roles[Role.DECODE]) < 1e-9


def test_pools_and_aggregated_replicas_serve_together_without_loss() -> None:
    reqs = [(i * 0.1, 500 + 37 * (i % 50), 20 + i % 60) for i in range(1200)]
    sim, res = _sim(reqs, {AGG: 1, PRE: 1, DEC: 1})
    assert res.served == len(reqs) and res.rejected == 0 and res.unfinished == 0
    by = {r.config: r.counters.completed for r in sim.replicas}
    assert by[AGG] > 0 and by[PRE] > 0 and by[DEC] == by[PRE] and by[AGG] + by[PRE] == len(reqs)


@dataclass
class _Switch:
    """Aggregated, then pools, then aggregated again (make-before-break by the baseline executor)."""

    name: str = "switch"
    period_s: float = 10.0

    def decide(self, view: ControllerView) -> Decision:
        pools = 100.0 <= view.t_s < 250.0
        return Decision(targets={AGG: 0, PRE: 2, DEC: 1} if pools else {AGG: 2, PRE: 0, DEC: 0})


def test_moving_to_pools_and_back_loses_no_request() -> None:
    reqs = [(i * 0.2, 300 + 97 * (i % 30), 30 + i % 40) for i in range(2000)]  # 400 s at 5 rps
    sim, res = _sim(reqs, {}, ctl=_Switch())
    assert res.served == len(reqs) and res.rejected == 0 and res.unfinished == 0
    served_by = {c: 0.0 for c in (AGG, PRE, DEC)}
    for r in sim.replicas:
        served_by[r.config] += r.counters.completed
    assert served_by[PRE] > 0 and served_by[DEC] == served_by[PRE] and served_by[AGG] + served_by[PRE] == len(reqs)
