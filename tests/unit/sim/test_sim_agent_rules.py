"""The replay's simulated agents accept what a real agent accepts (planner/agent_rules.py): a start
that double-books GPUs or leaves the host's port range is refused, counted and named."""

from __future__ import annotations

from sim_policies import ONE_HOST_8B as POLICY

from fleetplan.planner import act
from fleetplan.planner.policy import load_policy_text
from fleetplan.sim.des import FleetSim, SimSettings
from fleetplan.sim.des_types import Decision
from fleetplan.sim.evaluate import make_environment
from fleetplan.sim.traces import Trace, TraceFormat, TraceRequest


class _Idle:
    name = "idle"
    period_s = 60.0

    def decide(self, view: object) -> Decision:
        return Decision()


def _row(rid: str, gpus: tuple[int, ...], port: int) -> act.ReplicaRow:
    return act.ReplicaRow(rid, "h1", "llama-3-8b", "vllm", "h100", len(gpus), "bf16", gpus, port, "vllm",
                          act.Phase.DESIRED, "planned", 0.0, 0.0, None, None)


def _sim() -> FleetSim:
    trace = Trace("t", TraceFormat.AZURE, (TraceRequest(0.0, 500, 50, "llama-3-8b"),
                                           TraceRequest(60.0, 500, 50, "llama-3-8b")))
    return FleetSim(trace, _Idle(), make_environment(load_policy_text(POLICY, "p")), SimSettings())


def test_a_start_on_gpus_in_use_is_refused_and_named() -> None:
    sim = _sim()
    sim.launch(_row("r1", (0,), 8000), 0.0)
    sim.launch(_row("r2", (0,), 8001), 1.0)
    assert [r.rid for r in sim.replicas] == ["r1"]
    assert sim.conflicts == 1
    assert "GPU 0 used by both r1 and r2" in sim.notes[-1]


def test_a_start_outside_the_port_range_or_the_host_gpus_is_refused() -> None:
    sim = _sim()
    sim.launch(_row("r1", (8,), 9500), 0.0)
    assert sim.replicas == [] and sim.conflicts == 1
    assert "port 9500 outside this host's range 8000-8999" in sim.notes[-1]
    assert "GPU index 8 out of range (host h1 has 8 GPUs: 0-7)" in sim.notes[-1]


def test_the_simulated_agent_reports_each_replica_with_its_own_port() -> None:
    sim = _sim()
    sim.launch(_row("r1", (2,), 8123), 0.0)
    reported = sim.reports(0.0)["h1"]
    assert [(r.replica_id, r.port, r.template) for r in reported.replicas] == [("r1", 8123, "vllm")]
    assert reported.port_range == (8000, 8999)
