"""TensorRT-LLM engine builds are actions: with no cached engine the controller puts a build in a host's
desired state on the GPUs the plan reserves, the agent runs its build template and reports the engine,
and the planner then places TRT-LLM replicas."""

from __future__ import annotations

from fleetplan.harness.rig_tools import describe, policy_doc, ready_replicas, wait_until


async def test_trtllm_build_then_replicas(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    # TRT-LLM only, nothing cached; the lab's build template takes 200 simulated s (10 s wall)
    policy = policy_doc(engines=("trtllm",), trtllm_cached=False, build_s=200.0, min_replicas=1)
    ctrl = controller_factory(policy).start()

    def build_published() -> dict | None:  # type: ignore[type-arg]
        rep = ctrl.report()
        return next((a for a in rep["actions"] if a["kind"] == "build" and a["status"] == "published"), None)

    build = await wait_until(build_published, 30, "a build in the desired state", describe=describe(ctrl))
    rep = ctrl.report()
    assert not rep["fleet"], "no TRT-LLM replica may start before its engine exists"
    b = next(x for x in rep["builds"] if x["build_id"] == build["replica_id"])
    assert len(b["gpu_indices"]) == 4 and b["phase"] == "desired"

    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 1, 90, "build done, then a TRT-LLM replica ready",
                     describe=describe(ctrl))
    rep = ctrl.report()
    done = [a for a in rep["actions"] if a["kind"] == "build" and a["replica_id"] == build["replica_id"]]
    assert done and done[0]["status"] == "done", done
    assert all(r["engine"] == "trtllm" for r in rep["fleet"])
    assert next(x for x in rep["builds"] if x["build_id"] == build["replica_id"])["result"] == "done"
    assert not [a for a in rep["actions"] if a["kind"] == "build" and a["status"] == "published"]
