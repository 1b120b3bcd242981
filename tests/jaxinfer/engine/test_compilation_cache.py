"""The persistent compilation cache across restarts: the same config compiles nothing the second time (every shape
a cache hit), other weights of the same config reuse the entries, and a changed dtype, mesh or model config reuses
none. Counted with jax's compilation-cache monitoring events (`jaxinfer.engine.compilation_cache.counts`), in a
child process with a fresh cache folder and 8 CPU devices (tiny random Llama-3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file, save_file
from jaxinfer.engine import compilation_cache
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir

tmp = Path(sys.argv[1])
base = make_tiny_model_dir(tmp / "base")
other = make_tiny_model_dir(tmp / "other")  # the same config, other weights
weights = load_file(other / "model.safetensors")
save_file({k: (v * 0.5).astype(v.dtype) for k, v in weights.items()}, other / "model.safetensors")
wider = make_tiny_model_dir(tmp / "wider")  # another model config: another RoPE base
config = json.loads((wider / "config.json").read_text())
config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
(wider / "config.json").write_text(json.dumps(config))
runs = {}
for name, model, options in [("first", base, {}), ("again", base, {}), ("other weights", other, {}),
                             ("bfloat16", base, {"dtype": "bfloat16"}), ("tp=2", base, {"tensor_parallel_size": 2}),
                             ("model config", wider, {})]:
    options = {"dtype": "float32", **options}
    hits, misses = compilation_cache.counts()
    engine = Engine(EngineConfig(model=str(model), warmup=True, page_size=8, max_num_seqs=1,
                                 max_num_batched_tokens=16, max_model_len=32, kv_cache_memory_bytes=1 << 20,
                                 compilation_cache_dir=str(tmp / "xla"), **options))
    assert engine.warmup.wait(timeout=600)
    runs[name] = {"shapes": len(engine.warmup.shapes), "hits": engine.warmup.cache_hits,
                  "misses": engine.warmup.cache_misses, "background": engine.warmup.background,
                  "tokens": engine.runner.num_pages}
import jax
runs["lock"] = {"max_size": jax.config.jax_compilation_cache_max_size,
                "lockfile": (tmp / "xla" / ".lockfile").exists()}
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAXINFER_NATIVE_KERNELS": "0",
           "JAXINFER_COMPILATION_CACHE": str(tmp / "unused")}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cold_cache_compiles_and_stores_every_shape(runs):
    first = runs["first"]
    assert first["misses"] == first["shapes"] > 0 and first["hits"] == 0 and not first["background"]


@pytest.mark.parametrize("name", ["again", "other weights"])
def test_the_same_config_compiles_nothing_again(runs, name):
    """Weights are arguments of the step, not constants: other weights of the same config hit too."""
    run = runs[name]
    assert run["hits"] == run["shapes"] == runs["first"]["shapes"] and run["misses"] == 0
    assert run["background"]  # a warm cache loads the shapes while the engine serves


@pytest.mark.parametrize("name", ["bfloat16", "tp=2", "model config"])
def test_a_changed_dtype_mesh_or_model_config_reuses_no_entry(runs, name):
    run = runs[name]
    assert run["hits"] == 0 and run["misses"] == run["shapes"] > 0 and not run["background"]


def test_the_cache_is_bounded_and_locked_across_processes(runs):
    """Unbounded, jax writes an entry in place while another process may read it half written (a test worker
    crashed deserializing one); bounded, its reads and writes take a file lock (filelock is installed here)."""
    from jaxinfer.engine.compilation_cache import MAX_CACHE_BYTES

    assert runs["lock"] == {"max_size": MAX_CACHE_BYTES, "lockfile": True}
