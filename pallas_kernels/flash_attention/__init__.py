"""Causal flash attention over fresh packed tokens (prefill, no cached context): reference, TPU and GPU kernels."""

from pallas_kernels.flash_attention.reference import flash_attention_reference
from pallas_kernels.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"flash_attention_gpu": "pallas_kernels.flash_attention.gpu",
                                      "flash_attention_tpu": "pallas_kernels.flash_attention.tpu"})

__all__ = ["flash_attention_gpu", "flash_attention_reference", "flash_attention_tpu"]
