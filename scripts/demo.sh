#!/usr/bin/env bash
# The demo: sets up (scripts/setup.sh) and runs `fleetplan demo`: a lab of 4 simulated hosts x 8 H100
# (Mosquitto, Prometheus, nginx, one agent per host), benchmark + fit of the simulated engines, the
# controller, and a day of traffic replayed at 20x for about 3 minutes. Everything is stopped at the end.
# Usage: scripts/demo.sh [--trace FILE] [--minutes M] [--dir D --keep]      (make demo is the same)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec fleetplan demo "$@"
