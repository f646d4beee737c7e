#!/usr/bin/env bash
# The one prepared run for a lent CUDA machine (the `device` tool), about 6-8 minutes:
#   run(command="bash scripts/gpu_check.sh", timeout_s=540)
# Everything it finds lands under $OUT (or ./gpu-check): device.txt, pytest.txt, and the prefill
# suite's run directory (results.json, report.md: eager vs breakable vs tc_piecewise per token
# bucket, with each variant's capture seconds and memory per bucket, cold inductor cache).
# It uses the image's python and torch: the SmolLM2 GGUF package cannot be installed there (no
# package index), so the prefill suite runs SmolLM2's shape with random weights.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
python=${PYTHON:-python}

missing=$("$python" - <<'EOF'
import importlib.util
need = ["torch", "hydra", "omegaconf", "tqdm", "matplotlib", "pytest", "numpy"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE')" 2>&1 | tee "$out/device.txt"
echo "missing modules: ${missing:-none}" | tee -a "$out/device.txt"

# 1. Correctness on tiny models: CUDA-graph segments (breakable) and piecewise CUDA graphs
#    (tc_piecewise) give eager's tokens and logits per bucket; full_graph decode equals eager.
timeout 200 "$python" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -40 | tee "$out/pytest.txt"

# 2. Prefill per bucket and capture cost per variant, on a cold inductor cache.
export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
timeout 300 "$python" -m bench.cli bench=prefill model=smollm2-135m-random device=cuda capture=eager \
  cache.num_slots=8192 bench.rounds=5 bench.steps=5 bench.progress=false \
  "hydra.run.dir=$out/prefill" 2>&1 | tail -40 | tee "$out/prefill.txt"
