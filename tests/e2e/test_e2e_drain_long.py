"""A scale-down under load with requests of 2,000 output tokens: the drain waits for the longest
request at the SLO's pace (the policy's max_output_tokens), not a fixed deadline, and no request
fails. The controller's own drain_timeout_s floor is set below one such request on purpose: a
fixed deadline would cut them."""

from __future__ import annotations

import signal
import time

from fleetplan.harness.rig_tools import ISL, MODEL, K, Load, describe, policy_doc, ready_replicas, wait_until

LONG_OSL = 2000


def _policy(replicas: int) -> dict:  # type: ignore[type-arg]
    doc = policy_doc(min_replicas=replicas, max_replicas=replicas, osl=LONG_OSL, scale_down_delay_s=0.0)
    for m in doc["models"]:
        m["max_output_tokens"] = int(LONG_OSL * 1.2)
    return doc


async def test_a_scale_down_waits_for_2000_token_requests(rig, controller_factory) -> None:  # type: ignore[no-untyped-def]
    ctrl = controller_factory(_policy(2), drain_timeout_s=1.0).start()
    await wait_until(lambda: len(ready_replicas(ctrl.report())) == 2, 60, "two replicas ready", describe=describe(ctrl))
    load = Load(rig.lab.nginx_url, MODEL, speed=K, isl=ISL, osl=LONG_OSL)
    load.start(0.15)
    try:
        await wait_until(lambda: load.unfinished_before(time.monotonic()) >= 2, 30, "long requests in flight")
        ctrl.write_policy(_policy(1))
        ctrl.signal(signal.SIGHUP)

        def drained() -> dict | None:  # type: ignore[type-arg]
            rep = ctrl.report()
            stops = [a for a in rep["actions"] if a["kind"] == "stop" and "drained" in (a.get("reason") or "")]
            return stops[-1] if stops and len(ready_replicas(rep)) == 1 else None

        stop = await wait_until(drained, 90, "one replica drained and stopped", describe=describe(ctrl))
        load.rate_rps = 0.0
    finally:
        results = await load.stop()
    assert "in-flight requests reached 0" in stop["reason"], stop
    long_done = [r for r in results if r.outcome == "ok" and r.output_tokens >= LONG_OSL // 2]
    assert long_done, "no long request completed"
    longest_wall_s = max(r.e2e_s or 0.0 for r in long_done) / K
    print(f"{len(long_done)} requests of ~{LONG_OSL} tokens, the longest {longest_wall_s:.1f} s wall; {stop['reason']}")
    assert longest_wall_s > 1.0  # longer than the controller's drain_timeout_s floor: a fixed deadline cuts
    bad = load.failures()
    assert not bad, f"{len(bad)} failed requests, e.g. {bad[:3]}"
