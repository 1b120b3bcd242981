"""Causal flash attention over fresh packed tokens (prefill, no cached context): reference, TPU and GPU kernels."""

from pallas_kernels.flash_attention.gpu import flash_attention_gpu
from pallas_kernels.flash_attention.reference import flash_attention_reference
from pallas_kernels.flash_attention.tpu import flash_attention_tpu

__all__ = ["flash_attention_gpu", "flash_attention_reference", "flash_attention_tpu"]
