"""Which attention implementation a model call uses: the `jnp` references or the Pallas kernels of a platform.

| backend       | TPU                   | GPU                   | CPU                                          |
|---------------|-----------------------|-----------------------|----------------------------------------------|
| `"auto"`      | TPU (Mosaic) kernels  | GPU (Triton) kernels  | native decode attention, else references (*) |
| `"pallas"`    | TPU (Mosaic) kernels  | GPU (Triton) kernels  | TPU kernels in generic interpret mode (slow) |
| `"reference"` | references            | references            | references                                   |

(*) `pallas_kernels.cpu_gemv.paged_attention.paged_attention_cpu`: steps with at most `MAX_Q_LEN` query rows per
sequence (decodes, verify windows) run the native CPU kernel when the native kernels are on, built and allowed
(not on a multi-device mesh); prefill steps, and every step with `JAXINFER_NATIVE_KERNELS=0` or no compiler, run
the reference.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax

from pallas_kernels.cpu_gemv.paged_attention import paged_attention_cpu
from pallas_kernels.paged_attention import paged_attention_reference


class AttentionBackend(enum.Enum):
    AUTO = "auto"
    REFERENCE = "reference"
    PALLAS = "pallas"


@dataclasses.dataclass(frozen=True)
class AttentionOps:
    """The attention functions of one backend.

    Attributes:
      name: what runs, e.g. "reference", "cpu" (native decode attention, reference otherwise), "pallas-tpu",
        "pallas-gpu", "pallas-tpu-interpret".
      paged: ragged paged attention, signature of `paged_attention_reference`.
      flash: causal attention over fresh tokens only (no cached context), signature of
        `flash_attention_reference`; None when `paged` serves those steps too (the reference path, where one
        gathered einsum is as fast).
    """

    name: str
    paged: Callable[..., jax.Array]
    flash: Callable[..., jax.Array] | None


REFERENCE_OPS = AttentionOps("reference", paged_attention_reference, None)
CPU_OPS = AttentionOps("cpu", paged_attention_cpu, None)  # native decode attention where it applies, else reference


def select_attention(backend: str | AttentionBackend = "auto", platform: str | None = None) -> AttentionOps:
    """Picks the attention functions for a backend choice on a platform (table in the module docstring).

    Args:
      backend: "auto", "reference" or "pallas".
      platform: "cpu", "gpu" (also "cuda", "rocm") or "tpu"; default `jax.default_backend()`.

    Returns:
      The chosen AttentionOps.

    Raises:
      ValueError: for an unknown backend or platform.
    """
    try:
        choice = AttentionBackend(backend)
    except ValueError:
        raise ValueError(f"attention_backend={backend!r} is not one of "
                         f"{', '.join(repr(b.value) for b in AttentionBackend)}") from None
    platform = (platform or jax.default_backend()).lower()
    if platform in ("cuda", "rocm"):
        platform = "gpu"
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform={platform!r} is not one of 'cpu', 'gpu', 'tpu'")
    if choice is AttentionBackend.REFERENCE:
        return REFERENCE_OPS
    if choice is AttentionBackend.AUTO and platform == "cpu":
        return CPU_OPS
    if platform == "gpu":
        from pallas_kernels.flash_attention.gpu import flash_attention_gpu  # TPU / GPU kernels: imported when chosen
        from pallas_kernels.paged_attention.gpu import paged_attention_gpu

        return AttentionOps("pallas-gpu", paged_attention_gpu, flash_attention_gpu)
    from pallas_kernels.flash_attention.tpu import flash_attention_tpu
    from pallas_kernels.paged_attention.tpu import paged_attention_tpu

    if platform == "tpu":
        return AttentionOps("pallas-tpu", paged_attention_tpu, flash_attention_tpu)
    return AttentionOps("pallas-tpu-interpret", functools.partial(paged_attention_tpu, interpret=True),
                        functools.partial(flash_attention_tpu, interpret=True))


