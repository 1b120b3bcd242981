"""dtype="auto": what a checkpoint says it stores, the rule per platform, and the engine running what it resolved."""

from __future__ import annotations

import json

import gguf
import jax
import pytest

from jaxinfer.engine.auto_dtype import auto_dtype, cpu_has_native_bf16, resolve_dtype
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.loading import default_model_path, stored_dtype
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir

FLOAT_GGML_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}


@pytest.mark.parametrize("stored, platform, native_bf16, want", [
    ("float32", "cpu", True, "float32"),  # f32 weights are never rounded
    ("float32", "gpu", False, "float32"),
    (None, "tpu", False, "float32"),  # not recorded: as transformers loads it
    ("bfloat16", "gpu", False, "bfloat16"),
    ("float16", "tpu", False, "bfloat16"),
    ("quantized", "gpu", False, "bfloat16"),
    ("quantized", "cpu", True, "bfloat16"),
    ("quantized", "cpu", False, "float32"),  # AVX2-only: bf16 dots are converted, prefill measured slower
    ("bfloat16", "cpu", False, "float32"),
])
def test_auto_dtype_rule(stored, platform, native_bf16, want) -> None:
    assert auto_dtype(stored, platform, native_bf16) == want


def test_an_explicit_dtype_is_kept() -> None:
    assert resolve_dtype("float32", None) == "float32" and resolve_dtype("bfloat16", None) == "bfloat16"


def test_stored_dtype_of_the_gguf_agrees_with_its_tensor_types() -> None:
    """SmolLM2's Q4_1 GGUF says "quantized" from its header alone; the gguf package's reader of every tensor agrees."""
    path = default_model_path()
    quantized = any(t.tensor_type not in FLOAT_GGML_TYPES for t in gguf.GGUFReader(path).tensors)
    assert quantized and stored_dtype(path) == "quantized"
    assert stored_dtype(None) == "quantized"  # None is the default model


def test_stored_dtype_of_an_hf_folder_reads_its_config(tmp_path) -> None:
    folder = make_tiny_model_dir(tmp_path / "tiny")
    assert stored_dtype(folder) == json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    for key, value, want in [("torch_dtype", "bfloat16", "bfloat16"), ("dtype", "float16", "float16"),
                             ("torch_dtype", "int3", None), (None, None, None)]:
        config = json.loads((folder / "config.json").read_text())
        config.pop("dtype", None)
        config.pop("torch_dtype", None)
        if key is not None:
            config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        assert stored_dtype(folder) == want, (key, value)
    with pytest.raises(ValueError, match="does not exist"):
        stored_dtype(tmp_path / "missing")


def test_cpu_flags_decide_native_bf16(tmp_path) -> None:
    def flags(line: str) -> bool:
        path = tmp_path / f"cpuinfo{len(line)}"
        path.write_text(f"processor\t: 0\nmodel name\t: some CPU\n{line}\n")
        return cpu_has_native_bf16(str(path))

    assert flags("flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni")
    assert flags("flags\t\t: fpu avx2 amx_bf16 amx_tile")
    assert not flags("flags\t\t: fpu sse avx2 fma avx512f")
    assert not cpu_has_native_bf16(str(tmp_path / "absent"))


def test_the_engine_runs_and_reports_the_resolved_dtype(tmp_path) -> None:
    """An HF folder of bf16 weights under dtype="auto": the engine's config names the dtype the rule picks on this
    machine, and its weights are in it; an f32 folder stays f32."""
    folder = make_tiny_model_dir(tmp_path / "tiny")
    options = dict(warmup=False, kv_cache_memory_bytes=1 << 20, max_model_len=64)
    engine = Engine(EngineConfig(model=str(folder), **options))
    assert engine.config.dtype == "float32" and engine.runner.weights.final_norm.dtype == jax.numpy.float32
    config = json.loads((folder / "config.json").read_text()) | {"dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    want = "bfloat16" if jax.default_backend() != "cpu" or cpu_has_native_bf16() else "float32"
    engine = Engine(EngineConfig(model=str(folder), **options))
    assert engine.config.dtype == want and engine.runner.weights.final_norm.dtype == jax.numpy.dtype(want)
