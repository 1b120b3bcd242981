#!/usr/bin/env bash
# One-call device check for a lent GPU machine (jax >= 0.11.2 with CUDA preinstalled, no network).
#   run tool:  bash scripts/gpu_check.sh        (results in $OUT/gpu_check.md and $OUT/pytest.txt)
# It installs jaxinfer without touching the machine's jax (--no-deps), reports which of our dependencies are
# missing there, runs the accelerator-marked tests, then times SmolLM2-shaped prefill/decode on the device
# (scripts/gpu_check.py). Budget: well under 5 minutes including start-up.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
"$PY" -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())' | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee -a "$OUT/env.txt"
for m in flax gguf tokenizers sentencepiece safetensors jinja2 psutil tqdm pytest hypothesis; do
  "$PY" -c "import $m" 2>/dev/null || echo "missing: $m" | tee -a "$OUT/env.txt"
done
if [ -d wheelhouse ]; then "$PY" -m pip install -q --no-index --find-links wheelhouse flax gguf tokenizers \
    sentencepiece safetensors jinja2 psutil tqdm pytest hypothesis 2>&1 | tail -2; fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 120 "$PY" -m pytest -q -m accelerator tests 2>&1 | tail -5 | tee "$OUT/pytest.txt"
timeout 240 "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.md"
echo "gpu_check exit status: $?"
