"""`dtype="auto"`: the dtype an engine runs a model in when the caller does not choose one.

1. What the checkpoint stores (`jaxinfer.loading.stored_dtype`): an HF folder's `torch_dtype`, a GGUF file's
   `general.file_type`, a checkpoint's JSON.
2. On a GPU or TPU: float32 weights stay float32 (unknown: float32, as transformers loads a config without
   `torch_dtype`); bfloat16, float16 and quantized weights (GGUF Q4_1 and the like) run in bfloat16 (float16 is
   not an engine dtype; bfloat16 keeps its range).
3. On CPU: float32 weights stay float32 (never silently rounded). The others run in bfloat16 where the processor
   computes bf16 natively (the `avx512_bf16` or `amx_bf16` flag: measured faster in bf16 for prefill and 32-stream
   decode, BENCHMARKS.md; batch-1 decode measured slower on Zen 4) and in float32 elsewhere (AVX2-only CPUs
   convert bf16 dots, and prefill measured slower in bf16). README ("Engine options") says the same.
"""

from __future__ import annotations

import functools
import os

from jaxinfer.loading import stored_dtype

__all__ = ["NATIVE_BF16_CPU_FLAGS", "auto_dtype", "cpu_has_native_bf16", "resolve_dtype"]

NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the first processor listed in `cpuinfo` has a bf16 dot instruction (`NATIVE_BF16_CPU_FLAGS`);
    False when it has none or the file cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(NATIVE_BF16_CPU_FLAGS & set(line.partition(":")[2].split()))
    except OSError:
        pass
    return False


def auto_dtype(stored: str | None, platform: str, native_bf16: bool) -> str:
    """The engine dtype ("float32" or "bfloat16") for weights stored as `stored` (`stored_dtype`'s values) on
    `platform` (`jax.default_backend()`: "cpu", "gpu", "tpu", ...), by the module docstring's rules.

    Args:
      stored: "float32", "float16", "bfloat16", "quantized" or None (not recorded).
      platform: the JAX backend the engine runs on.
      native_bf16: on CPU, whether the processor computes bf16 natively (`cpu_has_native_bf16`).
    """
    if stored in (None, "float32"):
        return "float32"
    if platform == "cpu" and not native_bf16:
        return "float32"
    return "bfloat16"


def resolve_dtype(dtype: str, model: str | os.PathLike | None, platform: str | None = None) -> str:
    """`dtype` itself unless it is "auto"; else `auto_dtype` for the model's stored dtype on this platform.

    A model whose metadata cannot be read (a missing path, a file that is no model) counts as not saying: the load
    that follows raises the error that names it.
    """
    if dtype != "auto":
        return dtype
    if platform is None:
        import jax  # noqa: PLC0415 - only when resolving

        platform = jax.default_backend()
    try:
        stored = stored_dtype(model)
    except (ValueError, OSError):
        stored = None
    return auto_dtype(stored, platform, platform == "cpu" and cpu_has_native_bf16())
