#!/usr/bin/env bash
# Sets up and runs every check: Debian servers for the integration tests, a venv, ruff, mypy,
# import-linter (layering + purity contracts), pytest. Usage: make test  (or scripts/test.sh [pytest args])
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for bin in mosquitto:mosquitto prometheus:prometheus nginx:nginx; do
  command -v "${bin%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${bin%%:*}" ] || need+=("${bin##*:}")
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
echo "== installing fleetplan and its dev dependencies"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'

export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";          ruff check .
echo "== mypy";          mypy
echo "== import-linter"; lint-imports
echo "== pytest";        pytest -q "$@"
