"""fleetplan's own control path runs a disaggregated model in the replay: the plan chooses prefill
and decode pools (planner/disagg_plan.py), the act core starts them with their roles' templates,
the simulated proxy serves through them (sim/disagg_proxy.py), the replay's Prometheus reads each
request once (planner/queries.py Leg), and `fleetplan evaluate` reports GPU-hours per role."""

from __future__ import annotations

import math

from sim_policies import two_hosts_8b_pools

from fleetplan.models.config_key import Role
from fleetplan.planner.policy import load_policy_text
from fleetplan.sim.control import FleetplanController
from fleetplan.sim.des import FleetSim, SimResult, SimSettings
from fleetplan.sim.evaluate import candidates_for, make_environment, profiles_from_ground_truth
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

M = "llama-3-8b"
RPS, ISL, OSL, ITL_MS = 20.0, 4096, 32, 20.0  # long prompts, short outputs, a tight ITL target


def _policy(allowed: bool) -> str:
    return two_hosts_8b_pools(allowed, ttft_ms=600, itl_ms=ITL_MS, startup_s=30, cycle_s=60,
                              scale_down_delay_s=120, headroom=0.1, isl=ISL, osl=OSL)


def _replay(allowed: bool) -> tuple[FleetSim, SimResult]:
    policy = load_policy_text(_policy(allowed), "p")
    profiles = profiles_from_ground_truth(candidates_for(policy, M), [(ISL, OSL)] * 50, 600.0, ITL_MS, n=300)
    trace = Trace("t", TraceFormat.AZURE, tuple(TraceRequest(k / RPS, ISL, OSL, M) for k in range(int(600 * RPS))))
    sim = FleetSim(trace, FleetplanController("fleetplan", policy, profiles), make_environment(policy),
                   SimSettings())  # type: ignore[arg-type]
    return sim, sim.run()


def test_fleetplan_runs_pools_where_they_are_cheaper_and_reads_each_request_once() -> None:
    sim, res = _replay(True)
    assert res.rejected == 0 and res.served == res.arrived == int(600 * RPS)
    assert res.slo_attainment >= 0.99
    by_role = dict(res.gpu_hours_by_role)
    assert by_role.get(Role.PREFILL, 0.0) > 0 and by_role.get(Role.DECODE, 0.0) > 0
    assert Role.AGGREGATED not in by_role  # the warm start already chose the pools
    # started through the act core with their roles' templates
    assert {(r.config.role, r.template) for r in sim.replicas} == {(Role.PREFILL, "vllm-prefill"),
                                                                  (Role.DECODE, "vllm-decode")}
    control = sim.control
    assert control is not None
    planned = [d.result for _t, d in control.decisions if d.result is not None]
    m = planned[-1].explanation.models[0]
    # the decode pool's completions are not arrivals: the rate read is the trace's, not twice it
    assert m.observed_rps is not None and math.isclose(m.observed_rps, RPS, rel_tol=0.1)
    assert any("prefill" in n and "decode" in n for n in m.notes)
    # the same model aggregated: more GPU-hours for no better attainment (its replicas reach the ITL
    # target only once the load at which they missed it bounds what each is counted for)
    _sim, agg = _replay(False)
    assert dict(agg.gpu_hours_by_role).keys() == {Role.AGGREGATED}
    assert res.gpu_hours < agg.gpu_hours
    assert res.slo_attainment >= agg.slo_attainment
