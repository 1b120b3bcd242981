"""Paged attention over a ragged batch: the `jnp` reference (CPU path, oracle) and the TPU and GPU kernels.

Layout of the KV cache: `pallas_kernels.paged_attention.reference`; int8 / fp8 pages and their scales:
`pallas_kernels.paged_attention.quant`. Backend choice: `pallas_kernels.dispatch`.
"""

from pallas_kernels.paged_attention.gpu import paged_attention_gpu
from pallas_kernels.paged_attention.quant import dequantize, fake_quantize, is_quantized, quantize
from pallas_kernels.paged_attention.reference import paged_attention_reference, validate_inputs, write_kv
from pallas_kernels.paged_attention.tpu import paged_attention_tpu
from pallas_kernels.ragged import DEFAULT_MASK_VALUE

__all__ = ["DEFAULT_MASK_VALUE", "dequantize", "fake_quantize", "is_quantized", "paged_attention_gpu",
           "paged_attention_reference", "paged_attention_tpu", "quantize", "validate_inputs", "write_kv"]
