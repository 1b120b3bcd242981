"""Double-buffered manual DMA for the TPU kernels' KV loops: tile j + 1 is in flight while tile j is computed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.experimental import pallas as pl

# copies(j, slot) -> the DMA descriptors that bring KV tile j into buffer slot `slot` (0 or 1)
Copies = Callable[[jax.Array, jax.Array], Sequence]


def start_first(copies: Copies, lo: jax.Array, hi: jax.Array) -> None:
    """Starts tile `lo`'s copies into slot 0, unless the range [lo, hi) is empty."""
    @pl.when(lo < hi)
    def _():
        for c in copies(lo, 0):
            c.start()


def next_tile(copies: Copies, j: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Inside the loop over tiles [lo, hi): starts tile j + 1 into the other slot, waits for tile j's copies, and
    returns tile j's slot."""
    slot = (j - lo) % 2

    @pl.when(j + 1 < hi)
    def _():
        for c in copies(j + 1, 1 - slot):
            c.start()

    for c in copies(j, slot):
        c.wait()
    return slot
