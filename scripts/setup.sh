#!/usr/bin/env bash
# Create .venv and install phalanx into it, with its test dependencies.
# On a machine without an NVIDIA GPU the CPU build of torch goes in first, so that the
# `torch` requirement is already met and pip never pulls the multi-GB CUDA build.
# Each step says what it does on stderr (pip itself runs quietly), since the whole takes a
# minute or two on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $*" >&2; }
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $PY"
    "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
say "upgrading pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        say "installing torch with CUDA (an NVIDIA GPU is present; a few GB, the longest step)"
        $PIP install -q torch
    else
        say "installing torch 2.13.0, CPU build (no NVIDIA GPU here; the longest step)"
        $PIP install -q --retries 0 --timeout 10 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
            || $PIP install -q torch==2.13.0
    fi
fi
say "installing phalanx (editable) and its test dependencies"
$PIP install -q -e '.[test]'
say "done: .venv is ready"
