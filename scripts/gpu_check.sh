#!/usr/bin/env bash
# The one prepared run for a lent CUDA machine (the `device` tool), at most BUDGET_S = 450 s:
#   bash scripts/gpu_wheels.sh        # here, once: .gpu-wheels/ (ignored by git), what the image lacks
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=480)
# The image has no package index: the carried wheels are installed with --no-index into a folder on
# PYTHONPATH before anything imports graphexec, which runs from this working tree (not installed).
# What comes back under $OUT (or ./gpu-check), five files:
#   device.txt      nvidia-smi, python/torch/triton versions, modules still missing after the install
#   gpu_check.json  bench/gpu_check.py's parts: parity (triton vs torch_native logits per decode and
#                   extend bucket), decode_graph (full_graph vs eager per bucket, triton attention),
#                   capture (breakable vs tc_piecewise seconds per token bucket, cold caches)
#   summary.txt     the goals' verdicts (decode graph >= 5x eager at B=1; breakable capture >= 3x
#                   faster than tc_piecewise), parity, pytest's last line, each part's seconds
#   pytest.txt      pytest -m gpu over the test files that hold GPU tests
#   gpu_check.log   every step's output
# Each step runs under its own `timeout`, capped by what is left of the budget.  The model is
# SmolLM2-135M's shape with random weights (configs/model/smollm2-135m-random.yaml): its GGUF
# package is not on that machine.
# GPU_CHECK_REHEARSE=1 runs the same steps on a CPU machine (bench.cli gpu_check --rehearse: tiny model,
# Triton's interpreter, the op tape; pytest's GPU tests skip), with GPU_WHEELS_DIR built for the local
# Python (GPU_WHEELS_TARGET=local bash scripts/gpu_wheels.sh DIR).
set -u
cd "$(dirname "$0")/.."
repo="$PWD"
out="${OUT:-gpu-check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python3}"
wheels="${GPU_WHEELS_DIR:-.gpu-wheels}"
site="${GPU_CHECK_SITE:-/tmp/graphexec-site}"
rehearse=()
[[ "${GPU_CHECK_REHEARSE:-0}" == 1 ]] && rehearse=(--rehearse)
log="$out/gpu_check.log"
: >"$log"

BUDGET_S=450
# Seconds per step (tests/test_gpu_check_script.py keeps their sum at BUDGET_S, under the 480 s call).
CAP_INSTALL=30
CAP_DEVICE=15
CAP_PARITY=60
CAP_DECODE=100
CAP_CAPTURE=160
CAP_PYTEST=70        # at least: it also gets what the steps before it did not use
CAP_SUMMARY=15
start=$SECONDS

# Run "$@" under at most $1 seconds, or what is left of the budget; output to the log (and stdout).
step() {
    local cap=$1 name=$2
    shift 2
    local left=$(( BUDGET_S - (SECONDS - start) ))
    (( cap > left )) && cap=$left
    if (( cap <= 0 )); then
        echo "== $name: skipped, budget spent" | tee -a "$log"
        return 0
    fi
    echo "== $name (cap ${cap} s, ${left} s of budget left)" | tee -a "$log"
    # Through bash -c, so that the exported shell functions below run under timeout too.
    timeout -k 5 "$cap" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    (( rc == 124 )) && echo "== $name: timed out after ${cap} s" | tee -a "$log"
    echo "== $name: exit $rc after $(( SECONDS - start )) s in all" | tee -a "$log"
}

install_wheels() {
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "no wheels in $wheels: run scripts/gpu_wheels.sh here and carry the folder"
        return 0
    fi
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl
}
export -f install_wheels
export python wheels site
step "$CAP_INSTALL" "install carried wheels" install_wheels
# The working tree's graphexec first, then the carried packages, then the image's site-packages.
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Cold caches for the whole run (the capture part makes its own per variant).
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
export TRITON_CACHE_DIR="$TORCHINDUCTOR_CACHE_DIR/triton"

describe_device() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not installed"; fi
    "$python" - <<'EOF'
import importlib.util, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
need = ["torch", "triton", "hydra", "omegaconf", "gguf", "fastapi", "pydantic", "uvicorn", "tqdm", "pytest", "numpy"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("missing modules:", " ".join(missing) or "none")
EOF
}
export -f describe_device
step "$CAP_DEVICE" "device" describe_device | tee "$out/device.txt"

parts="$(mktemp -d)"
step "$CAP_PARITY" "parity" "$python" -m bench.cli gpu_check --part parity --out "$parts/parity.json" "${rehearse[@]}"
step "$CAP_DECODE" "decode_graph" "$python" -m bench.cli gpu_check --part decode_graph --out "$parts/decode_graph.json" "${rehearse[@]}"
step "$CAP_CAPTURE" "capture" "$python" -m bench.cli gpu_check --part capture --out "$parts/capture.json" "${rehearse[@]}"

# Only the files that hold GPU tests: collecting the others would import packages the image lacks
# (openai, jsonschema, lm_eval) for tests that would be deselected anyway.
mapfile -t gpu_tests < <(grep -l "pytest.mark.gpu" tests/test_*.py)
# Whatever the steps before left, less the summary's share: at least CAP_PYTEST when they kept to their caps.
pytest_cap=$(( BUDGET_S - (SECONDS - start) - CAP_SUMMARY ))
step "$pytest_cap" "pytest -m gpu" "$python" -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}" \
    | tee "$out/pytest.txt"

step "$CAP_SUMMARY" "summary" "$python" -m bench.cli gpu_check --merge "$parts" --out "$out/gpu_check.json" \
    --summary "$out/summary.txt" --pytest "$out/pytest.txt" "${rehearse[@]}"
echo "total $(( SECONDS - start )) s of a ${BUDGET_S} s budget" | tee -a "$log" "$out/summary.txt"
