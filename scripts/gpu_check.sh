#!/usr/bin/env bash
# One-call device check for a lent GPU machine (jax >= 0.11.2 with CUDA preinstalled, no network); under 5 minutes.
#   run tool:  bash scripts/gpu_check.sh [--quick]     (results in $OUT: gpu_check.md, pytest.txt, env.txt, log.txt)
#   here:      bash scripts/gpu_check.sh --dry-run     (the same script on CPU: tiny sizes, kernels in interpret mode)
# It installs jaxinfer without touching the machine's jax (--no-deps), reports which of our dependencies are
# missing there (from ./wheelhouse if one was carried along: see --make-wheelhouse), then runs
# scripts/gpu_check.py: the accelerator-marked tests, the GPU attention kernels against their references at
# Llama-3-8B head shapes and contexts 1k-32k, kernel speed beside XLA's attention, and whole-engine decode of a
# random Llama-3-8B-shaped model (bf16, fp8, int8 weights) vs HBM rooflines, and the weight-only int8 / int4
# matmul kernel against XLA's dot. Each section has a budget; the report is
# rewritten after each row, so a run cut short still leaves what it measured.
#
#   bash scripts/gpu_check.sh --make-wheelhouse   # on a machine with a package index: wheels of our pure
#                                                 # dependencies for the GPU machine (Python 3.12, x86_64)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
# The machine's python (jax with CUDA preinstalled); a --dry-run here uses the project's .venv when there is one.
if [ -z "${PYTHON:-}" ] && [[ " $* " == *" --dry-run "* ]] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-python3}"
if ! "$PY" -c "import jax" 2>/dev/null; then
  echo "gpu_check: $PY cannot import jax; set PYTHON to a python with jax (here: bash scripts/setup_env.sh test," \
       "then PYTHON=.venv/bin/python)" >&2
  exit 2
fi
DEPS="tokenizers sentencepiece safetensors jinja2 psutil tqdm pytest hypothesis"

if [ "${1:-}" = "--make-wheelhouse" ]; then
  # Binary wheels for CPython 3.12 on manylinux x86_64; jax/jaxlib/numpy/scipy/ml_dtypes come from the machine.
  # Versions from constraints.txt (the tested set), its jax lines dropped.
  rm -rf wheelhouse && mkdir -p wheelhouse
  grep -v -E '^(jax|jaxlib)==' constraints.txt >wheelhouse/constraints.txt
  "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_28_x86_64 \
      --implementation cp -c wheelhouse/constraints.txt -d wheelhouse $DEPS || exit 1
  rm -f wheelhouse/jax-* wheelhouse/jaxlib-* wheelhouse/numpy-* wheelhouse/scipy-* wheelhouse/ml_dtypes-*
  du -sh wheelhouse
  exit 0
fi

mkdir -p "$OUT"
ARGS=("$@")
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
"$PY" -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())' \
    2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee -a "$OUT/env.txt"
missing=""
for m in $DEPS; do
  "$PY" -c "import $m" 2>/dev/null || missing="$missing $m"
done
if [ -n "$missing" ] && [ -d wheelhouse ] && [ $dry = 0 ]; then
  echo "installing from wheelhouse:$missing" | tee -a "$OUT/env.txt"
  "$PY" -m pip install -q --no-index --find-links wheelhouse $missing 2>&1 | tail -2 | tee -a "$OUT/env.txt"
  missing=""
  for m in $DEPS; do "$PY" -c "import $m" 2>/dev/null || missing="$missing $m"; done
fi
[ -n "$missing" ] && echo "missing:$missing (sections that need them report it and the rest go on)" | tee -a "$OUT/env.txt"
[ $dry = 1 ] || "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
# 280 s for the checks (their own budget is 265 s; GPU_CHECK_TIMEOUT=S for a longer --budget-s); the steps above
# take ~10-30 s.
timeout -k 10 "${GPU_CHECK_TIMEOUT:-280}" "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.md" "${ARGS[@]}" 2>"$OUT/log.txt"
status=$?
echo "gpu_check exit status: $status (0: all passed; 1: a check failed; 124: timed out; log: $OUT/log.txt)"
exit $status
