"""Kernel tile sizes: one small table keyed by backend, phase and shape, so no kernel carries literal sizes.

Tiles are in tokens. `block_q`: query tokens per program (all G query heads of one kv head ride along, so a
program's query tile has `block_q * G` rows). `block_kv`: cached tokens a program loads per step of its KV loop
(a whole number of pages). `num_splits`: programs that share one sequence's KV range (FlashDecoding); their
partial results are merged by log-sum-exp weights.

The numbers are first guesses from the hardware (TPU VMEM and GPU shared memory budgets, MXU / tensor-core tile
sizes) and from the tiles jax's own Pallas attention kernels default to; none is tuned on hardware yet.
`scripts/gpu_check.sh` measures the GPU ones.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one attention kernel call.

    Attributes:
      block_q: query tokens per program (>= 1; a power of two for the GPU kernels).
      block_kv: KV tokens per loop step; for paged attention a multiple of page_size.
      num_splits: programs per sequence over its KV range (paged attention only; 1 = no split).
    """

    block_q: int
    block_kv: int
    num_splits: int = 1

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "num_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclasses.dataclass(frozen=True)
class _Rule:
    backend: str  # "tpu" | "gpu"
    phase: str  # "decode" (max_q_len == 1) | "prefill"
    min_context: int  # tokens; the rule applies from this page-table capacity up
    max_seqs: int  # the rule applies up to this many sequences (split-K pays off only when programs are few)
    block_q: int
    block_kv: int
    num_splits: int


# First matching row wins; the last row of each (backend, phase) has min_context 0 and catches the rest.
# Decode: one query token per sequence, so the KV tile is what matters; long contexts at small batch split the
# KV range so that more programs than sequences x kv heads stream the cache (FlashDecoding).
_TABLE: tuple[_Rule, ...] = (
    _Rule("tpu", "decode", 8192, 8, block_q=1, block_kv=512, num_splits=8),
    _Rule("tpu", "decode", 2048, 4, block_q=1, block_kv=512, num_splits=4),
    _Rule("tpu", "decode", 0, 1 << 30, block_q=1, block_kv=512, num_splits=1),
    _Rule("tpu", "prefill", 0, 1 << 30, block_q=128, block_kv=512, num_splits=1),
    _Rule("gpu", "decode", 8192, 8, block_q=1, block_kv=64, num_splits=16),
    _Rule("gpu", "decode", 2048, 4, block_q=1, block_kv=64, num_splits=4),
    _Rule("gpu", "decode", 0, 1 << 30, block_q=1, block_kv=64, num_splits=1),
    # GPU query tiles stay small: the f32 accumulator (block_q x G_pad x H) lives in registers; 16 tokens x 4
    # heads x 128 dims x 4 bytes = 32 KiB per program.
    _Rule("gpu", "prefill", 0, 1 << 30, block_q=16, block_kv=64, num_splits=1),
)


def paged_block_sizes(backend: str, *, max_q_len: int, page_size: int, max_kv_len: int,
                      num_seqs: int) -> BlockSizes:
    """Tiles for paged attention from `_TABLE`, clamped to the call's shape.

    Args:
      backend: "tpu" or "gpu".
      max_q_len: static bound on query tokens per sequence (1 = pure decode).
      page_size: tokens per page; `block_kv` is rounded to whole pages (at least one).
      max_kv_len: page-table capacity in tokens (pages per sequence x page_size).
      num_seqs: sequences in the batch (padded).

    Returns:
      BlockSizes with `block_q <= max_q_len` and `block_kv` a multiple of page_size not above max_kv_len's pages.

    Raises:
      ValueError: for an unknown backend.
    """
    phase = "decode" if max_q_len == 1 else "prefill"
    rule = _lookup(backend, phase, max_kv_len, num_seqs)
    pages = max(1, min(rule.block_kv // page_size, -(-max_kv_len // page_size)))
    return BlockSizes(block_q=min(rule.block_q, max_q_len), block_kv=pages * page_size,
                      num_splits=rule.num_splits)


def flash_block_sizes(backend: str, *, num_tokens: int) -> BlockSizes:
    """Tiles for causal flash attention over `num_tokens` fresh tokens (the prefill rows of `_TABLE`).

    Raises:
      ValueError: for an unknown backend.
    """
    rule = _lookup(backend, "prefill", num_tokens, 1)
    return BlockSizes(block_q=min(rule.block_q, num_tokens), block_kv=min(rule.block_kv, num_tokens))


def _lookup(backend: str, phase: str, context: int, num_seqs: int) -> _Rule:
    for rule in _TABLE:
        if rule.backend == backend and rule.phase == phase and context >= rule.min_context \
                and num_seqs <= rule.max_seqs:
            return rule
    raise ValueError(f"no block sizes for {backend=} (expected 'tpu' or 'gpu')")
