"""The commands' tests' model and runner: a tiny llama with a character tokenizer and a chat template, and
`jaxinfer` run as a user runs it (a subprocess of this tree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.jaxinfer.loading.multi_device_orbax_checks import make_tiny_hf_folder

REPO = Path(__file__).resolve().parents[3]
# Renders "user: hi|assistant: " (characters the tokenizer has: no newline).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
ENGINE_OPTIONS = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 20, "warmup": False}
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 20))  # ENGINE_OPTIONS as flags


def make_tiny_chat_model(folder: Path) -> Path:
    """tests/data/tiny_llama3 (context 256) with a character tokenizer and TEMPLATE, in `folder`."""
    make_tiny_hf_folder(folder, REPO / "tests" / "data" / "tiny_llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def run_jaxinfer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m jaxinfer.cli ARGS` from this tree on CPU, text in and out as UTF-8."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], input=stdin, capture_output=True,
                          text=True, encoding="utf-8", timeout=300, cwd=REPO, env=env)
