"""Stage 2 with disaggregated pools: how long `place()` takes and how many prefill replicas it pairs.

    .venv/bin/python bench/pair_placement.py --hosts 10000 --models 500

Synthetic fleet: hosts of 8 GPUs, H100 and A100 alternating (one NVLink group each); half the
models pooled (prefill TP1 : decode TP1 = 6:1), the other half aggregated TP2, together ~70% of
the GPUs. Timed (CPU seconds, the median of --repeat runs): the placement on an empty fleet, then
with three quarters of it running (kept) and one prefill replica more per family. Prints per case
the replicas placed, unplaced, and the prefill replicas that share a host with a decode replica of
their family (`placement.paired_prefill`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from fleetplan.models.config_key import Role
from fleetplan.models.names import Engine, GpuType, Precision
from fleetplan.planner.placement import Placement, paired_prefill, place
from fleetplan.planner.types import ConfigKey, HostInventory, Replica, ReplicaState

GPUS = (GpuType.H100, GpuType.A100)


def fleet(n_hosts: int, n_models: int) -> tuple[list[HostInventory], dict[ConfigKey, int]]:
    hosts = [HostInventory(f"host-{i:05d}", GPUS[i % 2], 8) for i in range(n_hosts)]
    per_model_gpus = n_hosts * 8 * 0.7 / n_models
    counts: dict[ConfigKey, int] = {}
    for j in range(n_models):
        gpu = GPUS[j % 2]
        if j % 2 == 0:
            d = max(1, int(per_model_gpus / 7))
            counts[ConfigKey(f"m{j}", Engine.VLLM, gpu, 1, Precision.BF16, Role.DECODE)] = d
            counts[ConfigKey(f"m{j}", Engine.VLLM, gpu, 1, Precision.BF16, Role.PREFILL)] = 6 * d
        else:
            counts[ConfigKey(f"m{j}", Engine.VLLM, gpu, 2, Precision.BF16)] = max(1, int(per_model_gpus / 2))
    return hosts, counts


def timed(repeat: int, counts: dict[ConfigKey, int], hosts: list[HostInventory],
          current: list[Replica] | None = None) -> tuple[float, Placement]:
    spent = []
    p = None
    for _ in range(repeat):
        t = time.process_time()
        p = place(counts, hosts, current or ())
        spent.append(time.process_time() - t)
    assert p is not None
    return statistics.median(spent), p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    hosts, counts = fleet(args.hosts, args.models)
    s, first = timed(args.repeat, counts, hosts)
    running = [replace(r, state=ReplicaState.READY, since_s=0.0) for i, r in enumerate(first.replicas) if i % 4]
    more = {c: n + (1 if c.role is Role.PREFILL else 0) for c, n in counts.items()}
    s2, second = timed(args.repeat, more, hosts, running)
    for name, secs, p, want in (("empty fleet", s, first, counts), ("3/4 running", s2, second, more)):
        prefill = sum(n for c, n in want.items() if c.role is Role.PREFILL)
        print(f"{name}: hosts={args.hosts} models={args.models} replicas={len(p.replicas)} "
              f"unplaced={sum(p.unplaced.values())} paired_prefill={sum(paired_prefill(p.replicas).values())}/"
              f"{prefill} place_s={secs:.3f}")


if __name__ == "__main__":
    main()
