"""KV handoff between engines (disaggregated prefill / decode): a prefilled request's KV pages as host arrays.

1. A prefill engine runs a request with `prefill_only=True` (`Engine.add_request`): it prefills the prompt, samples
   the first token, and finishes the request with finish_reason "handoff", keeping its KV pages.
2. `Engine.export_kv` reads those pages to the host in token order (`PagedKVCache.gather_tokens`: only the pages
   the request uses, every layer, K and V, the model's own KV heads, not a TP layout's replicas), optionally
   converted to another page dtype for the wire (int8 / fp8 with per-token scales: `pallas_kernels.kv_quant`),
   frees the pages and returns a `KVHandoff`: those arrays plus what the request needs to go on (prompt, the
   tokens generated so far, the resolved seed, the cache salt).
3. `Engine.import_kv` on a decode engine checks the payload against its model (`check_handoff`), allocates pages of
   its own (its page size may differ: the arrays are in token order), writes the K/V in with its own page dtype
   and KV-head layout (`PagedKVCache.scatter_tokens`: a TP degree of its own, each device receiving its heads'
   slice), and resumes the request from the generated tokens (`jaxinfer.engine.admission`): the stream goes on
   as if that engine had prefilled the prompt itself. Full pages join its prefix cache after the first step.

The host hop (device -> host numpy -> device) is the only path, on every backend (no `jax.experimental.transfer`
yet), in single-process engines. A draft model with a cache of its own (speculative decoding) gets no imported
K/V: its drafts for such a request are worse, never the output (verification keeps it lossless).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.kv_cache import PagedKVCache
from jaxinfer.prompt import Prompt
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.prefix_cache import PrefixCache
from jaxinfer.scheduler.sequence import Sequence as Seq
from models.config import ModelConfig
from models.llama import KVCache
from pallas_kernels.kv_quant import is_quantized, storage_dtype

# Page dtypes a payload may carry, by the names `export_kv` takes ("fp8" is float8_e4m3fn, sent as uint8 bits).
WIRE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True, eq=False)
class KVHandoff:
    """A request's K/V for positions [0, num_tokens) and the state to continue it on another engine.

    Picklable (numpy arrays and plain values), e.g. for Ray's object store.

    Attributes:
      prompt: the request's prompt (ids, text, cache salt).
      output_token_ids: tokens generated so far (the first token, from a prefill-only request), >= 1.
      num_tokens: positions whose K/V the arrays hold: prompt + output - 1 (the newest token's K/V is computed by
        the next step, on the receiving engine).
      seed: the request's resolved seed in [0, 2**32) (its `SamplingParams.seed`, or the one the engine drew): the
        receiver samples token t with the key token t would have had.
      page_size: the sending engine's page size, tokens (informative: the arrays are in token order).
      kv_dtype: the arrays' page dtype name: "float32", "bfloat16", "int8" or "float8_e4m3fn" (as uint8 bits).
      k, v: [L, K, num_tokens, H] in `kv_dtype` (the model's KV heads, unpadded by any TP layout).
      k_scale, v_scale: f32[L, K, num_tokens], the per-token scales of int8 / fp8 values; None for float ones.
    """

    prompt: Prompt
    output_token_ids: tuple[int, ...]
    num_tokens: int
    seed: int
    page_size: int
    kv_dtype: str
    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V arrays and their scales (what moves between engines; the ids are a few bytes)."""
        return sum(x.nbytes for x in (self.k, self.v, self.k_scale, self.v_scale) if x is not None)

    def tokens(self) -> KVCache:
        """The arrays as a `KVCache` of numpy leaves in token order (`PagedKVCache.scatter_tokens`' input)."""
        return KVCache(self.k, self.v, self.k_scale, self.v_scale)


def resolve_wire_dtype(name: str | None, cache_dtype: jnp.dtype) -> jnp.dtype:
    """The page dtype named `name` (a `WIRE_DTYPES` key), or `cache_dtype` for None.

    Raises:
      ValueError: an unknown name.
    """
    if name is None:
        return jnp.dtype(cache_dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype={name!r} is not supported; choose one of {', '.join(WIRE_DTYPES)} (or None: "
                         "the cache's own dtype)")
    return jnp.dtype(WIRE_DTYPES[name])


def kv_slot_sources(cfg: ModelConfig, mesh: jax.sharding.Mesh | None) -> np.ndarray:
    """i32[K'], the model's KV head each KV slot of an engine's cache holds: `models.partition.tp_layout`'s
    `kv_source` on a mesh whose TP degree does not divide the heads (replicas), else 0 .. K - 1."""
    if mesh is None:
        return np.arange(cfg.num_kv_heads, dtype=np.int32)
    from models.partition import tp_layout
    from sharding.mesh import TP_AXIS

    return tp_layout(cfg, mesh.shape[TP_AXIS]).kv_source


def export_handoff(kv: PagedKVCache, cfg: ModelConfig, mesh: jax.sharding.Mesh | None, seq: Seq,
                   prompt_text: str | None, dtype: jnp.dtype) -> KVHandoff:
    """The payload of a sequence that holds the K/V of its first `num_computed_tokens` positions in its pages: its
    model's own KV heads (the first KV slot holding each) as `dtype` pages (`PagedKVCache.gather_tokens`)."""
    sources = kv_slot_sources(cfg, mesh)
    first_slots = np.array([int(np.flatnonzero(sources == h)[0]) for h in range(cfg.num_kv_heads)], np.int32)
    n = seq.num_computed_tokens
    tokens = kv.gather_tokens(seq.page_ids[: -(-n // kv.page_size)], n, first_slots, dtype)
    return KVHandoff(Prompt(seq.prompt_token_ids, prompt_text, seq.cache_salt), tuple(seq.output_token_ids), n,
                     seq.seed, kv.page_size, jnp.dtype(dtype).name, tokens.k, tokens.v, tokens.k_scale, tokens.v_scale)


def write_handoff(kv: PagedKVCache, cfg: ModelConfig, mesh: jax.sharding.Mesh | None, allocator: PageAllocator,
                  prefix_cache: PrefixCache | None, seq: Seq, handoff: KVHandoff) -> bool:
    """Allocates pages for a payload's positions to a fresh sequence and writes its K/V in
    (`PagedKVCache.scatter_tokens`); `seq` then starts after them (`num_computed_tokens`).

    Returns:
      False, leaving `seq` fresh (to recompute), when fewer pages are free than the payload needs.
    """
    need = -(-handoff.num_tokens // kv.page_size)
    if need > allocator.num_free_pages:
        return False
    seq.page_ids = allocator.allocate(need)
    if prefix_cache is not None:  # cached pages evicted to make room are offloaded before they are overwritten
        kv.apply_ops(prefix_cache.take_ops())
    kv.scatter_tokens(seq.page_ids, kv_slot_sources(cfg, mesh), handoff.tokens())
    seq.num_computed_tokens = handoff.num_tokens
    return True


def check_handoff(handoff: KVHandoff, cfg: ModelConfig) -> None:
    """Checks that a payload fits an engine running the model of `cfg` (as trained, not TP-padded).

    Raises:
      ValueError: naming the numbers: another layer count, KV head count or head dim, arrays whose shapes or
        dtypes disagree with each other or with `kv_dtype`, `num_tokens` not prompt + output - 1, no output token.
    """
    if not isinstance(handoff, KVHandoff):
        raise ValueError(f"handoff must be a KVHandoff, got {type(handoff).__name__}")
    ours = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    theirs = (handoff.num_layers, handoff.num_kv_heads, handoff.head_dim) if np.ndim(handoff.k) == 4 else None
    if theirs != ours:
        raise ValueError(f"the KV handoff's model shape (layers, KV heads, head dim) = {theirs} (k of shape "
                         f"{handoff.k.shape}) differs from this engine's model, {ours}")
    if not handoff.output_token_ids:
        raise ValueError("the KV handoff has no output token (the first token comes from the prefill)")
    expected = len(handoff.prompt.token_ids) + len(handoff.output_token_ids) - 1
    if handoff.num_tokens != expected:
        raise ValueError(f"the KV handoff holds num_tokens={handoff.num_tokens} positions, but its prompt "
                         f"({len(handoff.prompt.token_ids)}) and output ({len(handoff.output_token_ids)}) tokens "
                         f"need {expected}")
    if handoff.kv_dtype not in {jnp.dtype(d).name for d in WIRE_DTYPES.values()}:
        raise ValueError(f"the KV handoff's kv_dtype={handoff.kv_dtype!r} is not a page dtype")
    dtype = jnp.dtype(handoff.kv_dtype)
    shape = (*ours[:2], handoff.num_tokens, ours[2])
    values = (shape, storage_dtype(dtype))
    scales = (shape[:3], jnp.dtype(jnp.float32)) if is_quantized(dtype) else None
    for name, want in (("k", values), ("v", values), ("k_scale", scales), ("v_scale", scales)):
        x = getattr(handoff, name)
        got = None if x is None else (np.shape(x), jnp.dtype(x.dtype))
        if got != want:
            raise ValueError(f"the KV handoff's {name} is {got}; kv_dtype {dtype.name} with {handoff.num_tokens} "
                             f"tokens needs {want}")
