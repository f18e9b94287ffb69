#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every check: ruff, mypy, import-linter (layering + purity
# contracts), pytest (unit, integration against real servers, e2e on the lab).
# Usage: scripts/test.sh [pytest args]      (make test is the same)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev

export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";          ruff check .
echo "== mypy";          mypy
echo "== import-linter"; lint-imports
echo "== pytest";        pytest -q "$@"
