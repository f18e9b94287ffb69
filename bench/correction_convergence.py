"""The online correction on the replay: profiles made wrong on purpose, and how fast the fleet recovers.

    .venv/bin/python bench/correction_convergence.py [--trace mooncake|azure] [--factors 1.4,0.6]

Per scenario (bench/evaluate_traces.py's policies and traces), profiles are fitted on the simulator's
ground truth (the "true" profiles), then every profile is made `factor` times as fast
(fleetplan.models.mix.scaled: factor 1.4 = 40% optimistic, 0.6 = 40% pessimistic). fleetplan replays the trace
with the true profiles and with each wrong set; per run it prints GPU-hours, SLO attainment, and per
cycle the GPUs the plan holds against the true-profile run: the first cycle from which the wrong run
stays within one replica's GPUs of the true run, and the attainment of the requests that arrived
after that cycle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # evaluate_traces, a sibling script (fleetplan itself is installed)

from evaluate_traces import SCENARIOS, scenario_hour  # noqa: E402

from fleetplan.models.mix import scaled  # noqa: E402
from fleetplan.models.profile import ProfileSet  # noqa: E402
from fleetplan.sim.des import FleetSim, SimSettings  # noqa: E402
from fleetplan.sim.evaluate import (  # noqa: E402
    candidates_for,
    make_controller,
    make_environment,
    profiles_from_ground_truth,
    trace_lengths,
)


def _run(trace: object, policy: object, profiles: ProfileSet) -> tuple[object, list[tuple[float, int]]]:
    ctl = make_controller("fleetplan", trace, policy, profiles)  # type: ignore[arg-type]
    sim = FleetSim(trace, ctl, make_environment(policy), SimSettings())  # type: ignore[arg-type]
    res = sim.run()
    gpus = [(p.t_s, p.gpus) for p in res.timeline]
    return res, gpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="mooncake", choices=sorted(SCENARIOS))
    ap.add_argument("--factors", default="1.4,0.6")
    args = ap.parse_args(argv)
    tr, policy, model = scenario_hour(args.trace)
    m = policy.models[0]
    true = profiles_from_ground_truth(candidates_for(policy, model), trace_lengths(tr, model),
                                      m.slo.ttft_p99_ms, m.slo.itl_p99_ms)
    base, base_gpus = _run(tr, policy, true)
    print(f"{args.trace}: true profiles: {base.gpu_hours:.2f} GPU-h, SLO attainment "  # type: ignore[attr-defined]
          f"{100 * base.slo_attainment:.2f}%", flush=True)  # type: ignore[attr-defined]
    step = max(c.tp for c in candidates_for(policy, model))
    cycle = policy.scaling.cycle_s
    for f in [float(x) for x in args.factors.split(",") if x.strip()]:
        wrong = ProfileSet(tuple(scaled(p, f) for p in true.profiles))
        res, gpus = _run(tr, policy, wrong)
        # the first time from which the wrong run holds within one replica's GPUs of the true run
        diffs = [(t, abs(g - bg)) for (t, g), (_, bg) in zip(gpus, base_gpus, strict=False)]
        settle = next((t for i, (t, _) in enumerate(diffs) if all(d <= step for _, d in diffs[i:])), None)
        # the same on 10-cycle means (both runs follow a bursty trace: one cycle's count is noisy)
        per = max(1, round(cycle / max(gpus[1][0] - gpus[0][0], 1e-9))) if len(gpus) > 1 else 1
        wc = [g for _, g in gpus[::per]]
        bc = [g for _, g in base_gpus[::per]]
        n = min(len(wc), len(bc))
        # full windows only: the last few cycles alone are not a 10-cycle mean
        roll = [(sum(wc[i:i + 10]) / 10, sum(bc[i:i + 10]) / 10) for i in range(n - 9)]
        settle_mean = next((i for i in range(len(roll)) if all(abs(a - b) <= step for a, b in roll[i:])), None)
        after30 = sum(wc[30:n]) / max(1, sum(bc[30:n]))
        after = "-"
        if settle is not None:
            ok = [bool(met) for r, met in zip(tr.requests, res.met, strict=False)  # type: ignore[attr-defined]
                  if r.t_s >= settle]
            after = f"{100 * sum(ok) / len(ok):.2f}%" if ok else "-"
        ok30 = [bool(met) for r, met in zip(tr.requests, res.met, strict=False)  # type: ignore[attr-defined]
                if r.t_s < 30 * cycle]
        print(f"  profiles x{f:g} ({'optimistic' if f > 1 else 'pessimistic'}): {res.gpu_hours:.2f} GPU-h, "  # type: ignore[attr-defined]
              f"SLO attainment {100 * res.slo_attainment:.2f}% (first 30 cycles "  # type: ignore[attr-defined]
              f"{100 * sum(ok30) / max(1, len(ok30)):.2f}%); within one replica of the true run from "
              f"t={'-' if settle is None else format(settle, '.0f')} s "
              f"({'-' if settle is None else format(settle / cycle, '.1f')} cycles; attainment after: {after}); "
              f"10-cycle means within one replica from cycle {'-' if settle_mean is None else settle_mean}; "
              f"GPUs after cycle 30 x{after30:.2f} the true run's", flush=True)
        print("    GPUs per cycle (true/this): " + " ".join(f"{b}/{a}" for a, b in zip(wc[:n], bc[:n], strict=False)),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
