"""`PagedKVCache`: the device KV cache of a model runner, its host tier, and every move of a page between them
(and out of or into another engine: `gather_tokens`, `scatter_tokens`).

Every cache leaf (K, V and, for int8 / fp8 caches, their scales) leads with [L, P] (layers, pages), so each page
operation is the same indexing on every leaf and a page's scales always travel with it. On a mesh the cache is
split over KV heads. In a multi-host run each move is broadcast to the followers before it runs
(`jaxinfer.engine.multihost`), and every process keeps its own host-tier copy.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import multihost
from jaxinfer.engine.step_inputs import padded_page_ids
from jaxinfer.scheduler.prefix_cache import KVOp, KVOpKind
from models.config import ModelConfig
from models.llama import KVCache
from pallas_kernels.kv_quant import convert


def _clear_pages(kv_cache: KVCache, page_ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda a: a.at[:, page_ids].set(0), kv_cache)


def _copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src]), kv_cache)


def _gather_pages(kv_cache: KVCache, page_ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda a: a[:, page_ids], kv_cache)  # leaves [L, n, ...]


def _scatter_pages(kv_cache: KVCache, page_ids: jax.Array, pages: KVCache) -> KVCache:
    return jax.tree.map(lambda a, x: a.at[:, page_ids].set(x), kv_cache, pages)


def _gather_tokens(kv_cache: KVCache, page_ids: jax.Array, slots: jax.Array | None, dtype: jnp.dtype) -> KVCache:
    """The pages' K/V in token order, leaves [L, K, n * page_size, ...], as `dtype` pages; KV slots `slots` only
    (None: all)."""

    def tokens(a: jax.Array | None) -> jax.Array | None:
        if a is None:
            return None
        x = a[:, page_ids] if slots is None else jnp.take(a[:, page_ids], slots, axis=2)  # [L, n, K, page_size, ...]
        x = jnp.moveaxis(x, 1, 2)  # [L, K, n, page_size, ...]
        return x.reshape(*x.shape[:2], -1, *x.shape[4:])

    k, k_scale = convert(tokens(kv_cache.k), tokens(kv_cache.k_scale), dtype)
    v, v_scale = convert(tokens(kv_cache.v), tokens(kv_cache.v_scale), dtype)
    return KVCache(k, v, k_scale, v_scale)


def _write_tokens(kv_cache: KVCache, page_ids: jax.Array, tokens: KVCache, dtype: jnp.dtype) -> KVCache:
    """`_scatter_pages` of K/V in token order ([L, K, n * page_size, ...], any page dtype), converted to the cache's
    page dtype `dtype` first."""

    def pages(x: jax.Array | None) -> jax.Array | None:  # [L, K, n * page_size, ...] -> [L, n, K, page_size, ...]
        return None if x is None else jnp.moveaxis(x.reshape(*x.shape[:2], page_ids.shape[0], -1, *x.shape[3:]), 2, 1)

    k, k_scale = convert(tokens.k, tokens.k_scale, dtype)
    v, v_scale = convert(tokens.v, tokens.v_scale, dtype)
    return _scatter_pages(kv_cache, page_ids, KVCache(pages(k), pages(v), pages(k_scale), pages(v_scale)))


def _fill(zeros, future: concurrent.futures.Future) -> None:
    """Runs the compiled zero fill `zeros` and hands its cache (or its error) to `future`."""
    try:
        future.set_result(jax.block_until_ready(zeros()))
    except BaseException as e:  # noqa: BLE001 - the reader of `PagedKVCache.cache` raises it
        future.set_exception(e)


class PagedKVCache:
    """Owns the paged KV cache on device (and a draft model's own cache) and the prefix cache's host tier.

    Args:
      cfg: the target model's config (as run: TP-padded on a mesh).
      num_pages: pages in the cache, including the null page 0.
      page_size: tokens per page.
      kv_dtype: cache dtype: float32 / bfloat16, or int8 / float8_e4m3fn for a quantized cache with per-token
        scales (`models.llama.KVCache`); a draft model's own cache takes the same dtype.
      mesh: the device mesh, or None for one device.
      draft_cfg: the config of a draft model with a cache of its own (same pages, same page ids), or None.
        Copies and clears of pages apply to its cache too; host-tier offloads do not (its K/V there goes stale,
        which only lowers acceptance).

    Attributes:
      kv_dtype: the cache's page dtype (`kv_dtype` above).
      cache: the target's `KVCache`, leaves [L, num_pages, ...]; device calls donate it and store the new one. In
        one process it is zero-filled in a background thread from construction on, and the first read waits.
      draft_cache: the draft model's own `KVCache`, or None.
      sharding: per-leaf `NamedSharding` of `cache` on the mesh, or None without a mesh.
      replicated: the mesh's fully replicated sharding, or None without a mesh.
      host_pages: host tier: host page id -> one page, a `KVCache` of numpy leaves without the page axis (k, v
        [L, K, page_size, H], scales f32[L, K, page_size] for int8 / fp8). Pages start as (device batch being
        copied to the host asynchronously, index in it) and become numpy when next touched.

    Raises:
      ValueError: num_pages < 2.
    """

    def __init__(self, cfg: ModelConfig, *, num_pages: int, page_size: int, kv_dtype: jnp.dtype,
                 mesh: jax.sharding.Mesh | None = None, draft_cfg: ModelConfig | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.mesh = mesh
        self.kv_dtype = jnp.dtype(kv_dtype)
        self.sharding = self.replicated = self._token_shardings = None
        if mesh is not None:
            from sharding.rules import logical_to_spec, mesh_rules

            rules = mesh_rules(mesh)  # with pipeline stages, each stage holds its own layers' pages
            self.sharding = KVCache.per_leaf(
                jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES, rules)),
                jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.SCALE_LOGICAL_AXES, rules)), kv_dtype)
            # K/V in token order, [L, K, T, ...] (`scatter_tokens`): split over KV heads like the pages
            self._token_shardings = tuple(
                jax.sharding.NamedSharding(mesh, logical_to_spec([a for a in axes if a != "pages"], rules))
                for axes in (KVCache.LOGICAL_AXES, KVCache.SCALE_LOGICAL_AXES))
            self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        zeros = jax.jit(functools.partial(KVCache.zeros, cfg, num_pages, page_size, kv_dtype),
                        out_shardings=self.sharding)
        self._cache: KVCache | None = None
        self._filling: concurrent.futures.Future | None = None
        if multihost.is_multi_process():  # every process launches the same computations in the same order
            self._cache = zeros()
        else:  # zero-filling GiBs of fresh memory takes seconds: the rest of the start-up runs meanwhile
            self._spec = jax.eval_shape(zeros)  # one device: uncommitted, as the fill's arrays are (no sharding)
            if self.sharding is not None:
                self._spec = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                          self._spec, self.sharding)
            zeros = zeros.lower().compile()  # here, so that no compile of it lands inside a warm-up's counts
            self._filling = concurrent.futures.Future()
            # a daemon thread: a process stopped (Ctrl-C) during the start-up exits without waiting for the fill
            threading.Thread(target=_fill, args=(zeros, self._filling), name="jaxinfer-kv-fill", daemon=True).start()
        self.draft_cache = None
        if draft_cfg is not None:
            self.draft_cache = jax.jit(functools.partial(KVCache.zeros, draft_cfg, num_pages, page_size, kv_dtype))()
        self._clear = jax.jit(_clear_pages, donate_argnums=0, out_shardings=self.sharding)
        self._copy = jax.jit(_copy_pages, donate_argnums=0, out_shardings=self.sharding)
        self._scatter = jax.jit(_scatter_pages, donate_argnums=0, out_shardings=self.sharding)
        self._gather = jax.jit(_gather_pages, out_shardings=self.replicated)
        self._gather_tokens = jax.jit(_gather_tokens, static_argnames="dtype", out_shardings=self.replicated)
        self._write = jax.jit(_write_tokens, static_argnames="dtype", donate_argnums=0,
                              out_shardings=self.sharding)
        self.host_pages: dict[int, KVCache | tuple[KVCache, int]] = {}
        self._unsettled: list[int] = []  # host pages whose data are still device arrays in flight to the host

    @property
    def cache(self) -> KVCache:
        """The target's device cache; the first read waits for its zero fill (raising what the fill raised)."""
        if self._cache is None:
            self._cache, self._filling = self._filling.result(), None
        return self._cache

    @cache.setter
    def cache(self, cache: KVCache) -> None:
        self._cache, self._filling = cache, None

    def wait_filled(self) -> None:
        """Waits for the zero fill of the cache (no-op once done).

        Raises:
          what the fill raised (e.g. XLA's out-of-memory error).
        """
        self.cache  # noqa: B018 - the property waits

    def cache_for_lowering(self) -> KVCache:
        """The cache, or while its zero fill runs its shapes and shardings (`jax.ShapeDtypeStruct` leaves): enough
        for `jit(...).lower`, so a warm-up compile need not wait for the fill."""
        return self._spec if self._cache is None and not self._filling.done() else self.cache

    def _global(self, tree):
        return multihost.global_inputs(tree, self.mesh)

    def clear_pages(self, page_ids: Sequence[int]) -> None:
        """Zeroes pages (all layers, K and V and their scales, also in the draft's cache), e.g. those a sequence
        filled with NaN K/V, before they are reused.

        Attention masks the positions past a sequence's length, but a masked weight of 0 times a stale NaN is still
        NaN: without this, the next owner of such a page would inherit the failure.
        """
        if not len(page_ids):
            return
        (ids,) = padded_page_ids(page_ids)  # a follower replays the padded ids, which pad to themselves
        multihost.send(multihost.Op.CLEAR_PAGES, ids)
        self.cache = self._clear(self.cache, self._global(ids))
        if self.draft_cache is not None:
            self.draft_cache = self._clear(self.draft_cache, ids)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies device pages src[i] -> dst[i] (all layers, K and V and their scales, also in the draft's cache):
        copy-on-write of shared pages."""
        multihost.send(multihost.Op.COPY_PAGES, (list(src), list(dst)))
        s, d = padded_page_ids(src, dst)
        self.cache = self._copy(self.cache, *self._global((s, d)))
        if self.draft_cache is not None:
            self.draft_cache = self._copy(self.draft_cache, s, d)

    def offload_pages(self, page_ids: Sequence[int], host_page_ids: Sequence[int]) -> None:
        """Copies device pages to host pages (device-to-host, started asynchronously; the step may run
        meanwhile)."""
        multihost.send(multihost.Op.OFFLOAD_PAGES, (list(page_ids), list(host_page_ids)))
        self.settle_host_pages()  # earlier offloads have landed (on followers too, which run no engine loop)
        (ids,) = padded_page_ids(page_ids)
        batch = self._gather(self.cache, self._global(ids))
        for x in jax.tree.leaves(batch):
            x.copy_to_host_async()
        for i, host_page_id in enumerate(host_page_ids):
            self.host_pages[host_page_id] = (batch, i)
        self._unsettled += host_page_ids

    def _host_page(self, host_page_id: int) -> KVCache:
        entry = self.host_pages[host_page_id]
        if isinstance(entry, tuple):  # still the device batch it was gathered in: materialize this page on the host
            batch, i = entry
            entry = jax.tree.map(lambda x: np.asarray(x)[:, i], batch)
            self.host_pages[host_page_id] = entry
        return entry

    def settle_host_pages(self) -> None:
        """Turns pages offloaded by earlier steps into host numpy arrays, releasing their device copies."""
        for host_page_id in self._unsettled:
            if host_page_id in self.host_pages:  # not loaded back or dropped meanwhile
                self._host_page(host_page_id)
        self._unsettled = []

    def load_pages(self, host_page_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        """Copies host pages back into device pages (host-to-device) and frees the host pages."""
        multihost.send(multihost.Op.LOAD_PAGES, (list(host_page_ids), list(page_ids)))
        pages = [self._host_page(h) for h in host_page_ids]
        (ids,) = padded_page_ids(page_ids)

        def stack(cache_leaf: jax.Array, *page_leaves: np.ndarray) -> np.ndarray:
            out = np.zeros((cache_leaf.shape[0], len(ids), *cache_leaf.shape[2:]), cache_leaf.dtype)  # [L, n, ...]
            for i, x in enumerate(page_leaves):
                out[:, i] = x
            return out

        batch = jax.tree.map(stack, self.cache, *pages)
        self.cache = self._scatter(self.cache, *self._global((ids, batch)))
        self.drop_host_pages(host_page_ids, broadcast=False)

    def drop_host_pages(self, host_page_ids: Sequence[int], broadcast: bool = True) -> None:
        """Frees host pages (broadcast: tell the followers too; False inside a move they replay themselves)."""
        if broadcast:
            multihost.send(multihost.Op.DROP_PAGES, list(host_page_ids))
        for host_page_id in host_page_ids:
            self.host_pages.pop(host_page_id, None)

    def gather_tokens(self, page_ids: Sequence[int], num_tokens: int, slots: np.ndarray,
                      dtype: jnp.dtype) -> KVCache:
        """Copies the K/V of positions [0, num_tokens) held in `page_ids` to the host, in token order (one engine's
        pages to another's, `jaxinfer.engine.kv_handoff`).

        Args:
          page_ids: the pages holding positions [0, num_tokens), in order; ids in [1, num_pages).
          num_tokens: positions wanted, <= len(page_ids) * page_size.
          slots: i32[K], the KV slot (head axis of the cache) each returned KV head is read from: on a mesh whose
            KV heads were replicated for TP (`models.partition.tp_layout`), one slot per original head.
          dtype: page dtype of the result (`pallas_kernels.kv_quant.convert`): float32 / bfloat16, or int8 /
            float8_e4m3fn with per-token scales.

        Returns:
          A `KVCache` of numpy leaves: k, v [L, K, num_tokens, H] (fp8 as uint8 bits), k_scale, v_scale
          f32[L, K, num_tokens] for a quantized dtype, else None.
        """
        (ids,) = padded_page_ids(page_ids)
        slots = None if np.array_equal(slots, np.arange(self.cache.k.shape[2])) else np.asarray(slots, np.int32)
        out = jax.device_get(self._gather_tokens(self.cache, ids, slots, dtype=jnp.dtype(dtype)))
        return jax.tree.map(lambda x: x[:, :, :num_tokens], out)

    def scatter_tokens(self, page_ids: Sequence[int], slots: np.ndarray, tokens: KVCache) -> None:
        """Writes host K/V in token order (`gather_tokens`' result, maybe another engine's) into device pages,
        converted to this cache's dtype; on a mesh each device receives only its KV heads.

        Args:
          page_ids: pages for positions [0, T), in order, len = ceil(T / page_size); ids in [1, num_pages).
          slots: i32[K'], the given KV head each KV slot of this cache copies (`TPLayout.kv_source`).
          tokens: numpy leaves k, v [L, K, T, H], scales f32[L, K, T] or None (any page dtype).
        """
        (ids,) = padded_page_ids(page_ids)
        width = len(ids) * self.page_size
        identity = np.array_equal(slots, np.arange(tokens.k.shape[1]))

        def padded(x: np.ndarray) -> np.ndarray:  # [L, K, T, ...] -> [L, K', n_pad * page_size, ...]
            if identity and x.shape[2] == width:
                return x
            out = np.zeros((x.shape[0], len(slots), width, *x.shape[3:]), x.dtype)
            out[:, :, : x.shape[2]] = x if identity else x[:, slots]
            return out

        batch = jax.tree.map(padded, tokens)
        if self._token_shardings is not None:
            kv, scale = self._token_shardings
            batch = jax.device_put(batch, jax.tree.map(lambda x: kv if x.ndim == 4 else scale, batch))
        self.cache = self._write(self.cache, ids, batch, dtype=self.kv_dtype)

    def apply_ops(self, ops: Sequence[KVOp]) -> None:
        """Runs the prefix cache's page moves in order (`jaxinfer.scheduler.prefix_cache.KVOp`), a run of one kind
        as one call; first settles the offloads of earlier steps (they have reached the host by now)."""
        self.settle_host_pages()
        calls = {KVOpKind.OFFLOAD: self.offload_pages, KVOpKind.LOAD: self.load_pages, KVOpKind.COPY: self.copy_pages}
        for kind, group in itertools.groupby(ops, key=lambda op: op.kind):
            run = list(group)
            if kind is KVOpKind.DROP:
                self.drop_host_pages([op.src for op in run])
            else:
                calls[kind]([op.src for op in run], [op.dst for op in run])
