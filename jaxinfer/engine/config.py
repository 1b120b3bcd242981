"""`EngineConfig`: every engine option in one frozen dataclass, with the defaults and limits it checks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxinfer.engine.spec_decode.config import SpeculativeConfig
from models.quant import QuantizationConfig
from pallas_kernels.dispatch import AttentionBackend

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# KV cache dtypes besides "auto" (the model dtype): quantized pages with per-token scales (models.llama.KVCache)
KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
DEFAULT_KV_CACHE_HOST_FRACTION = 0.1  # of available host memory, when no budget is given on CPU
DEFAULT_KV_CACHE_DEVICE_FRACTION = 0.8  # of free accelerator memory after the weights
# Shortest run of host-tier pages worth copying back instead of recomputing, per backend (BENCHMARKS.md,
# "Prefix caching"): on CPU one page back is already cheaper than one page of prefill.
DEFAULT_OFFLOAD_MIN_PAGES = {"cpu": 1, "gpu": 1, "tpu": 1}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine options (names as vLLM's engine arguments).

    Attributes:
      model: `.gguf` file, HF folder, or None for the default SmolLM2-135M-Instruct.
      dtype: "float32" or "bfloat16" (weights, activations, and the KV cache unless `kv_cache_dtype` is set).
      page_size: tokens per KV page.
      max_num_seqs: most sequences in one step.
      max_num_batched_tokens: most tokens (decodes + prefill chunks) in one step.
      max_model_len: context limit in tokens; default: the model's.
      kv_cache_memory_bytes: KV cache budget; default 10% of total host memory (at most half of what is
        available) on CPU, 80% of free device memory after the weights on accelerators.
      scan_layers: `lax.scan` over layers (default; BENCHMARKS.md) instead of an unrolled loop.
      seed: seeds the per-request seeds drawn for requests that give none.
      warmup: compile the decode and single-prefill shape buckets at start-up (progress bar on stderr), so no
        request waits for a compile; tests and one-shot scripts turn it off.
      attention_backend: "auto" (Pallas kernels on TPU and GPU, the `jnp` reference on CPU), "reference", or
        "pallas" (on CPU: the TPU kernels in interpret mode, for testing; slow). See `pallas_kernels.dispatch`.
      tensor_parallel_size: TP ranks: attention heads, MLP hidden and vocabulary split over this many devices
        (Megatron-style; head counts that do not divide are padded exactly, see `sharding.partition`).
      enable_prefix_caching: reuse the KV pages of earlier requests' identical prefixes (full pages, exact token
        match, per `cache_salt`); see `jaxinfer.scheduler.prefix_cache`.
      kv_offload_bytes: host-memory budget of the prefix cache's second tier: evicted cached pages are copied
        there and brought back on a hit instead of being recomputed (0 disables it).
      kv_offload_min_pages: shortest run of host-tier pages worth loading back (shorter runs are recomputed);
        None takes `DEFAULT_OFFLOAD_MIN_PAGES` for the backend (BENCHMARKS.md measures the break-even).
      expert_parallel_size: EP ranks: an MoE model's experts split over this many devices (MoE models only).
        The mesh is `tensor_parallel_size * expert_parallel_size` devices (`sharding.mesh.make_mesh`); on CPU,
        `XLA_FLAGS=--xla_force_host_platform_device_count=N` gives N devices.
      speculative_config: speculative decoding (`jaxinfer.engine.spec_decode`): a `SpeculativeConfig`, a dict of its
        fields as vLLM's `speculative_config` (e.g. `{"method": "ngram", "num_speculative_tokens": 4}`), a JSON
        object string, or None (off). Lossless: outputs keep the target model's distribution (greedy: the same
        tokens). "draft_model" runs in one process with tensor_parallel_size = expert_parallel_size = 1.
      quantization: weight quantization at load (`models.quant`): None (weights in `dtype`), "int8" (symmetric,
        per output channel), "fp8" (e4m3, per output channel), both weight-only, or a dict / JSON object of
        `models.quant.QuantizationConfig` fields (`format`, `group_size`, `quantize_activations` (w8a8: dynamic
        per-token activations and the int8 x int8 -> int32 dot, the fast path on CPU), `quantize_embedding`,
        `quantize_lm_head`, `activation_group_size`). The weights
        are read in f32 and quantized once; norms, biases and MoE routers stay in `dtype`, which is also the
        activation dtype. A draft model (speculative decoding) is quantized the same way. A quantized checkpoint
        (`jaxinfer convert --quantization`) is loaded as stored, never quantized again: None then means the
        checkpoint's quantization, and any other value must equal it (ValueError naming both). The effective
        config is `Engine.quantization`.
      kv_cache_dtype: "auto" (the model's dtype), "int8" or "fp8" (float8_e4m3fn): quantized KV pages with one f32
        scale per token per KV head, used on every path that reads or moves pages (prefix-cache hits, copies,
        the host tier, the draft model's cache); README "KV cache quantization".
    """

    model: str | None = None
    dtype: str = "float32"
    page_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    scan_layers: bool = True
    seed: int = 0
    warmup: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    enable_prefix_caching: bool = True
    kv_offload_bytes: int = 0
    kv_offload_min_pages: int | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None
    quantization: QuantizationConfig | dict | str | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", QuantizationConfig.from_value(self.quantization))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size * self.expert_parallel_size > 1:
            raise ValueError("speculative method 'draft_model' runs on one device; use tensor_parallel_size = "
                             "expert_parallel_size = 1, or method 'ngram' / 'self_draft'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of auto, "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "expert_parallel_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("scan_layers", "warmup", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        choices = [b.value for b in AttentionBackend]
        if self.attention_backend not in choices:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of {', '.join(choices)}")
        if not is_int(self.kv_offload_bytes) or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes={self.kv_offload_bytes!r} must be an integer >= 0")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload_bytes={self.kv_offload_bytes} needs prefix caching, which is off")
        if self.kv_offload_min_pages is not None and (not is_int(self.kv_offload_min_pages)
                                                      or self.kv_offload_min_pages < 1):
            raise ValueError(f"kv_offload_min_pages={self.kv_offload_min_pages!r} must be None or an integer >= 1")
        if self.kv_cache_memory_bytes is not None and (not is_int(self.kv_cache_memory_bytes)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be a positive integer")
