#!/usr/bin/env bash
# CI job: the kernel tests also pass under the oldest jax that setup.py allows (0.11.2, what the GPU machines have).
#
#   bash scripts/ci_kernels_min_jax.sh            # creates/reuses .venv-jax0112, runs tests/pallas_kernels
#   JAX_VERSION=0.11.2 VENV=.venv-jax0112 bash scripts/ci_kernels_min_jax.sh [extra pytest args]
#
# The venv holds only what the kernel tests import: jax/jaxlib at $JAX_VERSION, numpy, ml_dtypes, pytest,
# hypothesis (other versions from constraints.txt, jax lines dropped), and jaxinfer itself with --no-deps. The
# Python is the one scripts/setup_env.sh would pick ($PYTHON, else python3.12 / 3.13 / python3 >= 3.12, else pyenv).
# Tests that need the rest of the package (tokenizers, ...) are not in tests/pallas_kernels or skip
# themselves. First run ~1-2 minutes of installs; later runs reuse the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-jax0112}"
JAX_VERSION="${JAX_VERSION:-0.11.2}"

# Reuse setup_env.sh's interpreter finder (its is_ok and find_python functions) without running that script.
eval "$(sed -n -e '/^is_ok()/p' -e '/^find_python()/,/^}/p' scripts/setup_env.sh)"
if ! declare -F find_python >/dev/null; then
  echo "ci_kernels_min_jax: could not read find_python from scripts/setup_env.sh" >&2; exit 1
fi

start=$SECONDS
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$JAX_VERSION')" \
    2>/dev/null; then
  echo "ci_kernels_min_jax: $VENV does not have jax $JAX_VERSION; recreating it" >&2
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  if ! PY="$(find_python)"; then
    echo "ci_kernels_min_jax: error: needs Python >= 3.12 (jax > 0.10.2 requires it) and none was found;" \
         "set PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  echo "ci_kernels_min_jax: creating $VENV with $PY ($("$PY" --version))" >&2
  "$PY" -m venv "$VENV"
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
grep -v -E '^(jax|jaxlib)==' constraints.txt >"$constraints"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" -c "$constraints" "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" numpy ml_dtypes pytest hypothesis
"${PIP[@]}" --no-deps -e .
echo "ci_kernels_min_jax: venv ready in $((SECONDS - start)) s:" \
     "$("$VENV/bin/python" -c 'import jax, sys; print("jax", jax.__version__, "python", sys.version.split()[0])')" >&2

status=0
"$VENV/bin/python" -m pytest -q tests/pallas_kernels "$@" || status=$?
echo "ci_kernels_min_jax: done in $((SECONDS - start)) s (exit status $status)" >&2
exit $status
