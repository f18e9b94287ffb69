"""A policy edit moves a model from aggregated replicas to disaggregated pools and back in the
replay, through fleetplan's own control path (plan, make-before-break, act, `act.routes`, drains):
every request is served, none rejected for want of a route. Long prompts, short outputs and a 10 ms
ITL target make the pools the cheaper fleet (one prefill and one decode replica against eight or
nine aggregated ones, whose decode steps wait behind 4,096-token prefills)."""

from __future__ import annotations

from sim_policies import two_hosts_8b_pools

from fleetplan.models.config_key import Role
from fleetplan.planner.policy import load_policy_text
from fleetplan.sim.control import FleetplanController
from fleetplan.sim.des import FleetSim, SimSettings
from fleetplan.sim.evaluate import candidates_for, make_environment, profiles_from_ground_truth
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest

M = "llama-3-8b"
RPS, ISL, OSL, TTFT_MS, ITL_MS = 1.5, 4096, 32, 600.0, 10.0
TO_POOLS_S, BACK_S, END_S = 300.0, 600.0, 900.0


def _policy(allowed: bool) -> str:
    return two_hosts_8b_pools(allowed, ttft_ms=TTFT_MS, itl_ms=ITL_MS, startup_s=40, cycle_s=30,
                              scale_down_delay_s=60, headroom=0.2, isl=ISL, osl=OSL)


def test_a_policy_edit_moves_a_model_to_pools_and_back_without_a_request_lost() -> None:
    agg, pools = load_policy_text(_policy(False), "p"), load_policy_text(_policy(True), "p")
    profiles = profiles_from_ground_truth(candidates_for(agg, M), [(ISL, OSL)] * 50, TTFT_MS, ITL_MS, n=300)
    trace = Trace("t", TraceFormat.AZURE, tuple(TraceRequest(k / RPS, ISL, OSL, M) for k in range(int(END_S * RPS))))
    ctl = FleetplanController("fleetplan", agg, profiles, reloads=((TO_POOLS_S, pools), (BACK_S, agg)))
    sim = FleetSim(trace, ctl, make_environment(agg), SimSettings())  # type: ignore[arg-type]
    res = sim.run()
    assert res.rejected == 0 and res.served == res.arrived == int(END_S * RPS)
    assert res.slo_attainment >= 0.99
    by_role = dict(res.gpu_hours_by_role)
    assert by_role.get(Role.PREFILL, 0.0) > 0 and by_role.get(Role.DECODE, 0.0) > 0

    first = [r for r in sim.replicas if r.config.role is Role.AGGREGATED and r.t_start < TO_POOLS_S]
    pool = [r for r in sim.replicas if r.config.role is not Role.AGGREGATED]
    back = [r for r in sim.replicas if r.config.role is Role.AGGREGATED and r.t_start >= BACK_S]
    assert len(first) > len(pool) and {r.config.role for r in pool} == {Role.PREFILL, Role.DECODE}
    # make-before-break both ways: the pools ready before the first aggregated replica stops, the
    # aggregated replicas of the way back ready before the first pool replica stops
    assert all(r.t_ready is not None for r in pool + back)
    assert max(r.t_ready for r in pool if r.t_ready is not None) < min(r.t_stop or END_S for r in first)
    assert TO_POOLS_S < min(r.t_stop or END_S for r in first) < BACK_S
    assert min(r.t_ready for r in back if r.t_ready is not None) < min(r.t_stop or END_S for r in pool) < END_S
    # the pools served requests: their engines counted them (a decode replica each one it decoded)
    assert sum(r.counters.completed for r in pool if r.config.role is Role.DECODE) > 0
