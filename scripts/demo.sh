#!/usr/bin/env bash
# The demo: sets up (scripts/setup.sh) and runs `fleetplan demo`: a lab of 4 simulated hosts x 8 H100
# (Mosquitto, Prometheus, nginx, one agent per host), benchmark + fit of the simulated engines, the
# controller, and a day of traffic replayed at 20x for about 3 minutes; everything is stopped, the same day is
# replayed in the simulator (fleetplan evaluate) and D/summary.json holds live vs replay (docs/lab.md).
# Usage: scripts/demo.sh [--trace FILE] [--minutes M] [--peak-rps R] [--dir D --keep]      (make demo is the same)
#   e.g. scripts/demo.sh --trace data/traces/azure_llm_conv_2023.csv --dir /tmp/demo --keep
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec fleetplan demo "$@"
