"""Paged attention over a ragged batch: the `jnp` reference (CPU path, oracle) and the TPU and GPU kernels.

Layout of the KV cache: `pallas_kernels.paged_attention.reference`; int8 / fp8 pages and their scales:
`pallas_kernels.kv_quant`. Backend choice: `pallas_kernels.dispatch`.
"""

from pallas_kernels.kv_quant import dequantize, fake_quantize, is_quantized, load_values, quantize, storage_dtype
from pallas_kernels.paged_attention.reference import paged_attention_reference, validate_inputs, write_kv
from pallas_kernels.lazy import lazy_exports
from pallas_kernels.ragged import DEFAULT_MASK_VALUE

__getattr__ = lazy_exports(__name__, {"paged_attention_gpu": "pallas_kernels.paged_attention.gpu",
                                      "paged_attention_tpu": "pallas_kernels.paged_attention.tpu"})

__all__ = ["DEFAULT_MASK_VALUE", "dequantize", "fake_quantize", "is_quantized", "load_values", "paged_attention_gpu",
           "paged_attention_reference", "paged_attention_tpu", "quantize", "storage_dtype", "validate_inputs",
           "write_kv"]
