"""How many KV pages the cache gets: the work the config allows, capped by memory.

The default budget (no `kv_cache_memory_bytes`) is what the work needs: `max_num_seqs` sequences of
`max_model_len` tokens, in pages. It is capped at `memory_utilization` of the memory (`memory_cap`): of total host
memory on CPU (and at most half of what is available now), of free device memory after the weights on
accelerators, as vLLM's `gpu_memory_utilization` caps its cache. On CPU the cap comes from total memory, rounded
down to 64 MiB, so that the cache's shape, and with it the persistent compilation cache's keys, stays the same from
one start to the next. A given `kv_cache_memory_bytes` is used as is (at most the work's pages), and must fit the
free memory. A page costs `models.llama.KVCache.bytes_per_page` (plus a draft model's own cache), per device on
accelerators with a mesh; every host of a multi-host run takes the leader's page count. `size_kv_cache` logs how
many tokens and sequences the cache holds, and why.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import psutil

from jaxinfer.engine import multihost
from jaxinfer.engine.config import DEFAULT_MEMORY_UTILIZATION, DTYPES, KV_CACHE_DTYPES, EngineConfig
from models.config import ModelConfig
from models.llama import KVCache

logger = logging.getLogger(__name__)

_ROUND = 64 << 20  # CPU caps are whole multiples of 64 MiB (stable cache shapes across starts)


def free_memory_bytes() -> int | None:
    """Memory a KV cache can take now, in bytes: available host memory on CPU, the first device's free memory (its
    limit minus what is in use) on accelerators; None where the device reports no memory statistics."""
    if jax.default_backend() == "cpu":
        return psutil.virtual_memory().available
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return max(stats["bytes_limit"] - stats.get("bytes_in_use", 0), 0)


def weight_bytes_bound(cfg: ModelConfig) -> int:
    """An upper bound of the bytes a model's weights take while they load (every parameter in f32, the embedding
    and LM head counted twice), from its config alone: what start-up sets aside before it sizes a KV cache ahead
    of the load (`jaxinfer.engine.startup`)."""
    d, attn = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    mlp = 3 * d * (cfg.intermediate_size + cfg.num_experts * cfg.moe_intermediate_size
                   + cfg.shared_expert_intermediate_size)
    return 4 * (2 * cfg.vocab_size * d + cfg.num_layers * (d * attn + cfg.num_heads * cfg.head_dim * d + mlp))


@dataclasses.dataclass(frozen=True)
class MemoryCap:
    """The most memory the default KV cache may take.

    Attributes:
      cap_bytes: the cap, in bytes.
      reason: what that is, in words, for the start-up log ("memory_utilization=0.1 of 23.5 GiB host memory").
      by_available: True when the cap is half of the host memory available now, below memory_utilization of the
        total (memory is short: what the weights take moves it); False for the share of total or free memory.
    """

    cap_bytes: int
    reason: str
    by_available: bool = False


def memory_cap(config: EngineConfig, reserved_bytes: int = 0) -> MemoryCap:
    """The most bytes the default KV cache may take (module docstring), and why.

    `reserved_bytes`: memory that will be taken before the cache is (weights not loaded yet), counted out of what
    is available on CPU."""
    backend = jax.default_backend()
    share = config.memory_utilization or DEFAULT_MEMORY_UTILIZATION.get(backend, 0.8)
    if backend == "cpu":
        mem = psutil.virtual_memory()
        by_total = max(int(mem.total * share) // _ROUND * _ROUND, _ROUND)
        # what is available moves from start to start: a power of two of it keeps the cache's shape (and the
        # compilation cache's keys) from moving with it
        by_available = max(_ROUND, 1 << (max(int((mem.available - reserved_bytes) * 0.5), 1).bit_length() - 1))
        if by_total <= by_available:
            return MemoryCap(by_total, f"memory_utilization={share:g} of {mem.total / 2**30:.1f} GiB host memory")
        return MemoryCap(by_available, f"half of the {mem.available / 2**30:.1f} GiB available now (rounded down to "
                                       "a power of two)", by_available=True)
    free = free_memory_bytes() or 0
    return MemoryCap(int(free * share), f"memory_utilization={share:g} of {free / 2**30:.1f} GiB free device memory")


def check_page_size(config: EngineConfig, max_model_len: int) -> None:
    """Raises a ValueError naming page_size when one page holds more tokens than the context: a page holds one
    sequence's tokens, so a larger page is memory no sequence can use."""
    if config.page_size > max_model_len:
        whose = "" if config.max_model_len is not None else ", the model's"
        raise ValueError(f"page_size={config.page_size} is larger than the context, max_model_len={max_model_len} "
                         f"tokens{whose}: a KV page holds tokens of one sequence, so it must fit the context; use a "
                         f"page_size in [1, {max_model_len}] (the default is 16)")


def check_page_fits(config: EngineConfig, budget: int, page_bytes: int) -> None:
    """Raises a ValueError naming the budget (`kv_cache_memory_bytes`, or the default cap) and page_size when the
    budget is smaller than one KV page of `page_bytes` bytes."""
    if budget >= page_bytes:
        return
    what = f"kv_cache_memory_bytes={budget}" if config.kv_cache_memory_bytes is not None else \
        f"the KV cache budget, {budget} bytes (kv_cache_memory_bytes unset: a share of free memory),"
    raise ValueError(f"{what} is smaller than one KV page of page_size={config.page_size} tokens ({page_bytes} "
                     "bytes); lower page_size or raise kv_cache_memory_bytes")


def min_page_bytes(config: EngineConfig, cfg: ModelConfig) -> int:
    """A lower bound of `kv_page_bytes` from the model's config alone (before the load): padded heads and a
    draft's cache only add bytes."""
    page_bytes = KVCache.bytes_per_page(cfg, config.page_size, KV_CACHE_DTYPES.get(config.kv_cache_dtype,
                                                                                   DTYPES[config.dtype]))
    if config.num_devices > 1 and jax.default_backend() != "cpu":
        page_bytes //= config.tensor_parallel_size * config.pipeline_parallel_size
    return page_bytes


def kv_page_bytes(config: EngineConfig, run_cfg: ModelConfig, draft, mesh) -> int:
    """Bytes of one KV page: the target's plus a draft's own cache (`draft`: a `DraftModel` or None); per device on
    accelerators with a mesh."""
    kv_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, DTYPES[config.dtype])
    page_bytes = KVCache.bytes_per_page(run_cfg, config.page_size, kv_dtype)  # over all devices
    if draft is not None and not draft.shares_target_cache:  # the draft's cache has a page for every page
        page_bytes += KVCache.bytes_per_page(draft.cfg, config.page_size, kv_dtype)
    if mesh is not None and jax.default_backend() != "cpu":
        # the budget is per device there (CPU devices share the host's); a stage holds its layers' share
        page_bytes //= config.tensor_parallel_size * config.pipeline_parallel_size
    return page_bytes


def budget_bytes(config: EngineConfig) -> int:
    """The budget the page count is cut from: `kv_cache_memory_bytes`, else the memory cap."""
    return config.kv_cache_memory_bytes or memory_cap(config).cap_bytes


@dataclasses.dataclass(frozen=True)
class KVSizing:
    """The KV cache's size and its reason.

    Attributes:
      num_pages: pages, the null page included (the same on every host).
      tokens: tokens the cache holds ((num_pages - 1) * page_size).
      sequences: how many sequences of max_model_len tokens that is (a float).
      reason: why the cache has this size, in words (the start-up log line's tail: "sized to all the work: ..." or
        "capped at ...").
    """

    num_pages: int
    tokens: int
    sequences: float
    reason: str

    def sequences_text(self) -> str:
        """`sequences` in words, to two decimals at most: "1 sequence", "3 sequences", "1.4 sequences"."""
        n = round(self.sequences, 2)
        return f"{n:g} sequence{'' if n == 1 else 's'}"


def size_kv_cache(config: EngineConfig, page_bytes: int, max_model_len: int) -> KVSizing:
    """The KV cache's pages (module docstring), logged with how many tokens and sequences they hold and why.

    Raises:
      ValueError: a budget smaller than one page, or a `kv_cache_memory_bytes` that gives a cache larger than the
        free memory (`free_memory_bytes`).
    """
    pages_per_seq = -(-max_model_len // config.page_size)
    work_pages = config.max_num_seqs * pages_per_seq
    work = f"max_num_seqs={config.max_num_seqs} sequences of max_model_len={max_model_len} tokens"
    if config.kv_cache_memory_bytes is not None:
        budget, cap_why = config.kv_cache_memory_bytes, f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    else:
        cap = memory_cap(config)
        budget, cap_why = cap.cap_bytes, cap.reason
    num_pages = multihost.agree(min(int(budget) // page_bytes, work_pages) + 1)  # same on every host
    if num_pages < 2:
        check_page_fits(config, budget, page_bytes)
        raise ValueError(f"the leader process's KV cache budget is smaller than one KV page of page_size="
                         f"{config.page_size} tokens ({page_bytes} bytes); lower page_size or raise "
                         "kv_cache_memory_bytes")
    cache_bytes, free = (num_pages - 1) * page_bytes, free_memory_bytes()
    if config.kv_cache_memory_bytes is not None and free is not None and cache_bytes > free:
        raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} gives a KV cache of {num_pages - 1} "
                         f"pages ({cache_bytes} bytes), more than the free memory ({free} bytes"
                         f"{'' if jax.default_backend() == 'cpu' else ' on each device'}); lower kv_cache_memory_bytes "
                         f"or max_num_seqs (the cache holds at most max_num_seqs={config.max_num_seqs} sequences of "
                         f"max_model_len={max_model_len} tokens)")
    tokens = (num_pages - 1) * config.page_size
    sequences = (num_pages - 1) / pages_per_seq
    if num_pages - 1 == work_pages:
        reason = f"sized to all the work: {work} ({cache_bytes / 2**20:.1f} MiB, within {cap_why})"
    else:
        reason = (f"capped at {cap_why} ({cache_bytes / 2**20:.1f} MiB), less than the work needs, {work} "
                  f"({work_pages * page_bytes / 2**20:.1f} MiB): sequences beyond it wait or are preempted; "
                  + ("raise kv_cache_memory_bytes" if config.kv_cache_memory_bytes is not None else
                     "raise memory_utilization or give kv_cache_memory_bytes") + ", or lower max_num_seqs or "
                  "max_model_len")
    return KVSizing(num_pages=num_pages, tokens=tokens, sequences=sequences, reason=reason)
