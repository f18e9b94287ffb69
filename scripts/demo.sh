#!/usr/bin/env bash
# The demo: sets up (Debian servers, .venv) and runs `fleetplan demo`: a simulated lab of 4 hosts x 8 H100
# (Mosquitto, Prometheus, nginx, one agent per host), benchmark + fit of the simulated engines, the
# controller, and a day of traffic replayed at 20x for about 3 minutes. Everything is stopped at the end.
# Usage: make demo   (or scripts/demo.sh [--trace FILE] [--minutes M] [--dir D --keep])
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for bin in mosquitto:mosquitto prometheus:prometheus nginx:nginx; do
  command -v "${bin%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${bin%%:*}" ] || [ -x "/usr/bin/${bin%%:*}" ] \
    || need+=("${bin##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import controller.cli, ortools, aiomqtt, apscheduler" >/dev/null 2>&1; then
  echo "== installing fleetplan"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
export PATH="$PWD/.venv/bin:$PATH"
exec fleetplan demo "$@"
