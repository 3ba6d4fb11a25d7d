#!/usr/bin/env bash
# Create .venv and install phalanx into it, with its test dependencies.
# On a machine without an NVIDIA GPU the CPU build of torch goes in first, so that the
# `torch` requirement is already met and pip never pulls the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        $PIP install -q torch
    else
        $PIP install -q --retries 0 --timeout 10 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
            || $PIP install -q torch==2.13.0
    fi
fi
$PIP install -q -e '.[test]'
