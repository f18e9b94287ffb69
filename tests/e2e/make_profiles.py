"""Regenerate fleetplan/harness/profiles-sim.json (the lab's profiles, installed as package data):
bench the simulated engines and fit (the user's workflow).

    .venv/bin/python -m tests.e2e.make_profiles
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fleetplan.harness.demo import EngineOptions, bench_and_fit
from fleetplan.harness.rig_tools import ISL, MAX_NUM_SEQS, MODEL, OSL, PROFILES, K


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fleetplan-e2e-profiles-") as d:
        out = bench_and_fit(EngineOptions(time_scale=K, max_num_seqs=MAX_NUM_SEQS), Path(d), (MODEL,),
                            ("vllm", "trtllm"), isl=ISL, osl=OSL, tp=4, concurrency=(1, 4, 8, 16), num_prompts=24)
        PROFILES.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, PROFILES)
    print(f"wrote {PROFILES}")


if __name__ == "__main__":
    main()
