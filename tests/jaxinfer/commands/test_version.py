"""`jaxinfer --version`: the installed versions and the compilation cache's folder, printed without loading jax."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import jax
import jaxlib
import pytest

from jaxinfer.commands.version import version_text
from pallas_kernels import cpu_features
from tests.jaxinfer.commands.tiny_chat import REPO

PROBE = """
import sys
from jaxinfer.cli import main
try:
    main(["--version"])
except SystemExit as e:
    print("exit", e.code)
print("jax loaded:", "jax" in sys.modules)
"""


@pytest.mark.parametrize("cache", ["/some/where/xla", ""])
def test_version_prints_versions_and_the_cache_without_jax(cache: str) -> None:
    env = {**os.environ, "JAXINFER_COMPILATION_CACHE": cache, "JAXINFER_MODEL_CACHE": cache and "/some/models"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    folder = (f"{cache} ($JAXINFER_COMPILATION_CACHE or --compilation-cache-dir move it; empty turns it off)" if cache
              else "off ($JAXINFER_COMPILATION_CACHE is empty)")
    assert done.stdout.splitlines() == [
        f"jaxinfer {importlib.metadata.version('jaxinfer')}",
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"XLA compilation cache: {folder}",
        "prepared-model cache: " + ("/some/models (GGUF files dequantized once; $JAXINFER_MODEL_CACHE moves it; empty "
                                    "turns it off)" if cache else "off ($JAXINFER_MODEL_CACHE is empty)"),
        f"native CPU kernels: {_native_line()}",
        "exit 0",
        "jax loaded: False",
    ]


def _native_line() -> str:
    levels = cpu_features.supported_levels()
    if os.environ.get("JAXINFER_NATIVE_KERNELS", "1") in ("0", "off", "false", "no"):
        return "off ($JAXINFER_NATIVE_KERNELS)"
    level = os.environ.get("JAXINFER_NATIVE_ISA") or levels[-1]
    return f"ISA level {level} (this CPU runs {', '.join(levels)}; $JAXINFER_NATIVE_ISA picks one)"


@pytest.mark.parametrize("variables,line", [
    ({"JAXINFER_NATIVE_KERNELS": "0"}, "off ($JAXINFER_NATIVE_KERNELS)"),
    ({"JAXINFER_NATIVE_ISA": "avx2"}, "ISA level avx2 (this CPU runs {levels}; $JAXINFER_NATIVE_ISA picks one)"),
    ({"JAXINFER_NATIVE_ISA": "sse9"}, "refused: JAXINFER_NATIVE_ISA='sse9' is not a level; known: {known}"),
])
def test_version_names_the_native_kernels_level(monkeypatch, variables: dict, line: str) -> None:
    for name in ("JAXINFER_NATIVE_KERNELS", "JAXINFER_NATIVE_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    expected = line.format(levels=", ".join(cpu_features.supported_levels()), known=", ".join(cpu_features.ISA_LEVELS))
    assert version_text().splitlines()[-1] == f"native CPU kernels: {expected}"
