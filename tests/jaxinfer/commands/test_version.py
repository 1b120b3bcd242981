"""`jaxinfer --version`: the installed versions and the compilation cache's folder, printed without loading jax."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import jax
import jaxlib
import pytest

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
        "exit 0",
        "jax loaded: False",
    ]
