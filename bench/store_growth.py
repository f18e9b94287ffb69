"""Growth of the controller's state store over a simulated week, with and without retention.

    .venv/bin/python bench/store_growth.py                       # 60 s and 5 s cycles, 1 and 10 models
    .venv/bin/python bench/store_growth.py --cases 60:1 --days 7 --without-days 7

Each case (cycle seconds : models) drives a real StateStore (controller/state.py) in a temporary
directory on disk, on a simulated clock, with what a cycle of the daemon writes: the clock, the
hosts' statuses (4 hosts, upserted), the cycle row, the observation (~2 KB per model), the plan
(`--plan-kb`, default 7 KB per model, with the planner state), the decision record (~2 KB per
model), the alerts, the cycle's end; every 10 simulated minutes a start and a drain per model with
their acks. The payloads are JSON of measured sizes: 10-12 KB per model and cycle in the daemon with
one config observed; a model whose four configs were observed through an hour of bursty traffic
carries a 24-26 KB plan (its planner state 11.6 KB, of which the TTFT windows and the verdicts are
1.8 KB each: the coding-like hour, seed 4, `plan_to_dict` of the replay's last cycles).

With retention, each cycle then runs one `prune_step` (controller/state_retention.py) with the
controller's default settings (or --keep-days / --keep-plans-days / --max-mb). Without, the store
is written for --without-days and its growth per day extrapolated to the week (it is linear).

Printed per case: the file size (database + WAL, MiB) every 12 simulated hours, the rows pruned, the
longest prune transaction (ms; the longest write lock retention takes), and the last line
`case=<c> with_mb=<final> max_with_mb=<peak> without_week_mb=<extrapolated> longest_prune_ms=<ms>`.
SQLite runs with synchronous=OFF here (the sizes do not depend on it; a week of fsyncs would take
hours); the daemon runs FULL.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetplan.controller.settings import RetentionSettings  # noqa: E402
from fleetplan.controller.state import StateStore  # noqa: E402
from fleetplan.controller.state_retention import DAY_S, RetentionRules, prune_step  # noqa: E402

HALF_DAY_S = DAY_S / 2
ACTION_EVERY_S = 600.0


def blob(rng: random.Random, nbytes: int) -> str:
    """`nbytes` of JSON-safe text (SQLite stores it as it is; a string costs json.dumps little)."""
    return "".join(rng.choice("0123456789.,") for _ in range(nbytes))


def payloads(models: int, seed: int = 0, plan_kb: float = 7.0) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    rng = random.Random(seed)
    names = [f"model-{i:02d}" for i in range(models)]
    obs: dict[str, Any] = {m: {"series": blob(rng, 2000)} for m in names}
    plan: dict[str, Any] = {"models": {m: {"explanation": blob(rng, round(plan_kb * 1000))} for m in names}}
    decision: dict[str, Any] = {"models": {m: {"why": blob(rng, 2000)} for m in names}}
    return obs, plan, decision


def size_mb(path: Path) -> float:
    wal = Path(f"{path}-wal")
    return (path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)) / 2**20


def run(cycle_s: float, models: int, days: float, rules: RetentionRules | None, t0: float = 1.7e9,
        plan_kb: float = 7.0) -> dict[str, float]:
    clock = [t0]
    with tempfile.TemporaryDirectory(prefix="store-growth-") as d:
        path = Path(d) / "state.db"
        store = StateStore(path, clock=lambda: clock[0])
        store._db.execute("PRAGMA synchronous=OFF")
        obs, plan, decision = payloads(models, plan_kb=plan_kb)
        statuses = {f"host-{c}": {"host": f"host-{c}", "online": True, "gpu": "h100", "gpu_count": 8}
                    for c in "abcd"}
        cycles = int(days * DAY_S / cycle_s)
        next_print = t0 + HALF_DAY_S
        next_action = t0
        peak = 0.0
        pruned = 0
        longest = 0.0
        seq = 0
        for _ in range(cycles):
            now = clock[0]
            store.set_kv("clock_last", {"wall": now, "sim": now})
            store.save_host_statuses(statuses)
            cid = store.begin_cycle(now)
            if rules is not None:
                p = prune_step(store, rules, now)
                pruned += p.rows
                longest = max(longest, p.longest_step_s)
            store.save_observation(cid, obs)
            store.save_plan(cid, plan, 0.05, {"state": "x" * 500})
            store.save_decision({"cycle_id": cid, "decision_id": f"d{cid}", "now_s": now, **decision})
            if now >= next_action:
                next_action += ACTION_EVERY_S
                with store.tx() as c:
                    for m in range(models):
                        seq += 1
                        for kind in ("start", "drain"):
                            store.add_action(c, cycle_id=cid, kind=kind, replica_id=f"r{seq:05d}", host="host-a",
                                             model=f"model-{m:02d}", status="published", reason="demand",
                                             detail="host-a port 8000, GPUs [0]")
                for h in ("host-a", "host-b"):
                    store.record_ack(h, seq, True, [])
            store.set_alerts("", {"observe/0": "no request-rate series"})
            store.finish_cycle(cid, "ok", {"now_s": now, "alerts": 1})
            clock[0] += cycle_s
            mb = size_mb(path)
            peak = max(peak, mb)
            if clock[0] >= next_print:
                next_print += HALF_DAY_S
                print(f"    day {(clock[0] - t0) / DAY_S:4.1f}: {mb:8.1f} MiB"
                      + (f"  ({pruned} rows pruned so far)" if rules is not None else ""), flush=True)
        final = size_mb(path)
        store.close()
    return {"final_mb": final, "peak_mb": peak, "pruned": pruned, "longest_s": longest, "cycles": cycles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="60:1,60:10,5:1,5:10", help="cycle_s:models, comma-separated")
    ap.add_argument("--days", type=float, default=7.0, help="simulated days with retention")
    ap.add_argument("--without-days", type=float, default=1.0, help="simulated days without retention")
    defaults = RetentionSettings()
    ap.add_argument("--keep-days", type=float, default=defaults.keep_days)
    ap.add_argument("--keep-plans-days", type=float, default=defaults.keep_plans_days)
    ap.add_argument("--max-mb", type=float, default=defaults.max_mb)
    ap.add_argument("--rows-per-cycle", type=int, default=defaults.rows_per_cycle)
    ap.add_argument("--plan-kb", type=float, default=7.0, help="the plan document per model and cycle (KB)")
    args = ap.parse_args(argv)
    rules = RetentionRules(keep_s=args.keep_days * DAY_S, keep_documents_s=args.keep_plans_days * DAY_S,
                           max_bytes=int(args.max_mb * 2**20), rows_per_cycle=args.rows_per_cycle)
    print(f"retention: keep {args.keep_days:g} days, plans {args.keep_plans_days:g} days, bound {args.max_mb:g} MiB, "
          f"at most {args.rows_per_cycle} rows per cycle; SQLite {sqlite3.sqlite_version}")
    for case in args.cases.split(","):
        cycle_s, models = float(case.split(":")[0]), int(case.split(":")[1])
        t = time.perf_counter()
        print(f"case {case} ({cycle_s:g} s cycles, {models} model(s)), without retention, "
              f"{args.without_days:g} day(s):", flush=True)
        without = run(cycle_s, models, args.without_days, None, plan_kb=args.plan_kb)
        week = without["final_mb"] / args.without_days * 7
        print(f"    {without['final_mb'] / args.without_days:.1f} MiB per day -> {week:.0f} MiB a week (extrapolated), "
              f"{without['final_mb'] * 2**20 / without['cycles'] / 1024:.1f} KiB per cycle", flush=True)
        print(f"  with retention, {args.days:g} day(s):", flush=True)
        with_ = run(cycle_s, models, args.days, rules, plan_kb=args.plan_kb)
        print(f"case={case} with_mb={with_['final_mb']:.1f} max_with_mb={with_['peak_mb']:.1f} "
              f"without_week_mb={week:.0f} longest_prune_ms={with_['longest_s'] * 1000:.1f} "
              f"rows_pruned={with_['pruned']:.0f} wall_s={time.perf_counter() - t:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
