"""Functional Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 1/2/3) over a paged KV cache.

One entry point, `forward(params, tokens, metadata, kv_cache, cfg)`, serves a ragged batch: every sequence brings
its new tokens (one for a decode, many for a prefill chunk), flattened into `tokens`; `metadata` says where each
sequence's tokens start (`cu_q_lens`), how long its context is after this step (`kv_lens`) and where its pages are
(`page_table`). Architecture: Touvron et al. 2023 (Llama), with GQA (Ainslie et al. 2023), RoPE (Su et al. 2021),
RMSNorm (Zhang & Sennrich 2019) and SwiGLU (Shazeer 2020); Mixtral / Qwen2-MoE replace the MLP by the sparse MoE
block of `models.moe`. Family differences are `ModelConfig` fields (Qwen3's q/k norms, Gemma's GeGLU, 1 + w norms
and scaled embeddings, Gemma 2's soft caps, per-layer windows and post-norms, Gemma 3's local RoPE base), branches
of this one forward and of `models.layer`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models import moe, pytree
from models.config import ModelConfig
from models.layer import attention_inputs, attention_output_and_mlp, embed_tokens, final_logits
from models.quant import QuantizedWeight
from models.quant_matmul import layer_refs_apply, native_unless_sharded, slice_layer
from models.rope import rope_frequencies
from pallas_kernels.dispatch import REFERENCE_OPS, AttentionOps
from pallas_kernels.paged_attention import fake_quantize, write_kv
from pallas_kernels.kv_quant import SCALE_DTYPE, is_quantized, storage_dtype
from sharding.rules import EMBED, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MLP, VOCAB  # logical axis names


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Shape, logical axes and initializer scale of one weight; the single declaration shardings derive from."""

    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    init_scale: float | None  # std of the normal init; None means ones (norm scales)


@pytree.dataclass
class LayerWeights:
    """Decoder-layer weights, stacked over layers on axis 0 (L). Projections are stored input-dim first.

    Dense models carry w_gate/w_up/w_down; MoE models (`cfg.num_experts` > 0) carry router/e_* (and s_* with a
    shared expert) instead, with E experts of width Fe and a shared expert of width Fs.
    """

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, N, H]
    wk: jax.Array  # [L, D, K, H]
    wv: jax.Array  # [L, D, K, H]
    wo: jax.Array  # [L, N, H, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array | None = None  # [L, D, F] (dense MLP)
    w_up: jax.Array | None = None  # [L, D, F]
    w_down: jax.Array | None = None  # [L, F, D]
    bq: jax.Array | None = None  # [L, N, H] (attention_bias)
    bk: jax.Array | None = None  # [L, K, H]
    bv: jax.Array | None = None  # [L, K, H]
    q_norm: jax.Array | None = None  # [L, H] (qk_norm)
    k_norm: jax.Array | None = None  # [L, H]
    b_gate: jax.Array | None = None  # [L, F] (mlp_bias)
    b_up: jax.Array | None = None  # [L, F]
    b_down: jax.Array | None = None  # [L, D]
    router: jax.Array | None = None  # [L, D, E] (MoE)
    e_gate: jax.Array | None = None  # [L, E, D, Fe]
    e_up: jax.Array | None = None  # [L, E, D, Fe]
    e_down: jax.Array | None = None  # [L, E, Fe, D]
    s_gate: jax.Array | None = None  # [L, D, Fs] (MoE shared expert)
    s_up: jax.Array | None = None  # [L, D, Fs]
    s_down: jax.Array | None = None  # [L, Fs, D]
    s_router: jax.Array | None = None  # [L, D, 1]
    post_attn_norm: jax.Array | None = None  # [L, D] (post_norms: Gemma 2 / 3)
    post_mlp_norm: jax.Array | None = None  # [L, D]


DENSE_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the LayerWeights read by qeinsum only


@pytree.dataclass
class Weights:
    """All weights of a decoder. `lm_head` is None when tied to `embed`."""

    embed: jax.Array  # [V, D]
    layers: LayerWeights
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]

    @staticmethod
    def abstract(cfg: ModelConfig, separate_head: bool = False) -> Weights:
        """The `WeightSpec` of every weight, in the same pytree structure as the real weights.

        Args:
          cfg: the model config.
          separate_head: also give a tied model (`cfg.tie_word_embeddings`) an `lm_head` [D, V]: quantization
            gives a tied model its own head when only one of the gather and the head is quantized
            (`models.quant.quantize_weights`).
        """
        L, V, D, F = cfg.num_layers, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        std_in, std_attn_out, std_mlp_out = D**-0.5, (N * H) ** -0.5, F**-0.5

        def spec(shape: tuple[int, ...], axes: tuple[str, ...], scale: float | None) -> WeightSpec:
            return WeightSpec(shape, axes, scale)

        bias = cfg.attention_bias
        mlp_bias = cfg.mlp_bias
        dense = not cfg.is_moe
        E, Fe, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shared = cfg.is_moe and Fs > 0

        def layer_spec(shape: tuple[int, ...], axes: tuple[str, ...], scale: float | None, present: bool):
            return spec((L, *shape), (LAYERS, *axes), scale) if present else None
        layers = LayerWeights(
            attn_norm=spec((L, D), (LAYERS, EMBED), None),
            wq=spec((L, D, N, H), (LAYERS, EMBED, HEADS, HEAD_DIM), std_in),
            wk=spec((L, D, K, H), (LAYERS, EMBED, KV_HEADS, HEAD_DIM), std_in),
            wv=spec((L, D, K, H), (LAYERS, EMBED, KV_HEADS, HEAD_DIM), std_in),
            wo=spec((L, N, H, D), (LAYERS, HEADS, HEAD_DIM, EMBED), std_attn_out),
            mlp_norm=spec((L, D), (LAYERS, EMBED), None),
            w_gate=spec((L, D, F), (LAYERS, EMBED, MLP), std_in) if dense else None,
            w_up=spec((L, D, F), (LAYERS, EMBED, MLP), std_in) if dense else None,
            w_down=spec((L, F, D), (LAYERS, MLP, EMBED), std_mlp_out) if dense else None,
            bq=spec((L, N, H), (LAYERS, HEADS, HEAD_DIM), 0.02) if bias else None,
            bk=spec((L, K, H), (LAYERS, KV_HEADS, HEAD_DIM), 0.02) if bias else None,
            bv=spec((L, K, H), (LAYERS, KV_HEADS, HEAD_DIM), 0.02) if bias else None,
            q_norm=layer_spec((H,), (HEAD_DIM,), None, cfg.qk_norm),  # replicated: no TP-split axis
            k_norm=layer_spec((H,), (HEAD_DIM,), None, cfg.qk_norm),
            b_gate=spec((L, F), (LAYERS, MLP), 0.02) if mlp_bias else None,
            b_up=spec((L, F), (LAYERS, MLP), 0.02) if mlp_bias else None,
            b_down=spec((L, D), (LAYERS, EMBED), 0.02) if mlp_bias else None,
            router=layer_spec((D, E), moe.ROUTER_AXES, std_in, cfg.is_moe),
            e_gate=layer_spec((E, D, Fe), moe.EXPERT_IN_AXES, std_in, cfg.is_moe),
            e_up=layer_spec((E, D, Fe), moe.EXPERT_IN_AXES, std_in, cfg.is_moe),
            e_down=layer_spec((E, Fe, D), moe.EXPERT_OUT_AXES, max(Fe, 1) ** -0.5, cfg.is_moe),
            s_gate=layer_spec((D, Fs), moe.SHARED_IN_AXES, std_in, shared),
            s_up=layer_spec((D, Fs), moe.SHARED_IN_AXES, std_in, shared),
            s_down=layer_spec((Fs, D), moe.SHARED_OUT_AXES, max(Fs, 1) ** -0.5, shared),
            s_router=layer_spec((D, 1), moe.SHARED_GATE_AXES, std_in, shared),
            post_attn_norm=layer_spec((D,), (EMBED,), None, cfg.post_norms),
            post_mlp_norm=layer_spec((D,), (EMBED,), None, cfg.post_norms),
        )
        return Weights(
            embed=spec((V, D), (VOCAB, EMBED), 1.0),
            layers=layers,
            final_norm=spec((D,), (EMBED,), None),
            lm_head=None if cfg.tie_word_embeddings and not separate_head else spec((D, V), (EMBED, VOCAB), std_in),
        )


def _is_spec(x: object) -> bool:
    return isinstance(x, WeightSpec)


def init_weights(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> Weights:
    """Random weights for tests and benchmarks, drawn from the shapes in `Weights.abstract(cfg)`."""
    specs = Weights.abstract(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    arrays = [
        jnp.ones(s.shape, dtype) if s.init_scale is None
        else (s.init_scale * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
        for s, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, arrays)


def logical_axes(cfg: ModelConfig) -> Weights:
    """The logical axis names of every weight, as a pytree of tuples shaped like `Weights`."""
    return jax.tree.map(lambda s: s.logical_axes, Weights.abstract(cfg), is_leaf=_is_spec)


def check_weights(weights: Weights, cfg: ModelConfig, separate_head: bool = False) -> None:
    """Checks every weight's shape against `Weights.abstract(cfg, separate_head)`; a `models.quant.QuantizedWeight`
    is checked by its shape in the weight's own layout.

    Raises:
      ValueError: naming the first weight whose presence or shape disagrees with the config.
    """
    specs = jax.tree_util.tree_flatten_with_path(Weights.abstract(cfg, separate_head),
                                                 is_leaf=lambda x: x is None or _is_spec(x))[0]
    values = dict(jax.tree_util.tree_flatten_with_path(
        weights, is_leaf=lambda x: x is None or isinstance(x, QuantizedWeight))[0])
    for path, spec in specs:
        value = values.get(path)
        name = jax.tree_util.keystr(path)
        if (spec is None) != (value is None):
            raise ValueError(f"weight {name}: expected {'none' if spec is None else spec.shape}, "
                             f"got {'none' if value is None else value.shape}")
        if spec is not None and tuple(value.shape) != spec.shape:
            raise ValueError(f"weight {name}: shape {tuple(value.shape)} does not match config shape {spec.shape}")


@pytree.dataclass
class KVCache:
    """Paged KV cache of all layers; per-layer layout is defined in `pallas_kernels.paged_attention`.

    Float caches (f32, bf16) hold K/V as they are; int8 and fp8 caches hold quantized values (fp8 as float8_e4m3fn
    bit patterns in uint8) and one f32 scale per token per kv head (`pallas_kernels.kv_quant`), None for float
    caches. Every leaf leads with [L, P], so page copies, clears and host transfers are the same indexing on every
    leaf (`jax.tree.map`).
    """

    k: jax.Array  # [L, P, K, page_size, H]
    v: jax.Array  # [L, P, K, page_size, H]
    k_scale: jax.Array | None = None  # f32[L, P, K, page_size] (int8 / fp8 caches)
    v_scale: jax.Array | None = None  # f32[L, P, K, page_size]

    # Logical axes of k and v: split over kv heads like wk / wv, so attention runs without communication.
    LOGICAL_AXES = (LAYERS, "pages", KV_HEADS, "page_slots", HEAD_DIM)
    SCALE_LOGICAL_AXES = (LAYERS, "pages", KV_HEADS, "page_slots")  # of k_scale and v_scale, split like k and v

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def scale_args(self) -> dict[str, jax.Array]:
        """`k_scale`, `v_scale` as keyword arguments of `write_kv` and the attention ops; {} for a float cache."""
        return dict(k_scale=self.k_scale, v_scale=self.v_scale) if self.quantized else {}

    @staticmethod
    def zeros(cfg: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """An empty cache of `num_pages` pages (page 0 is the null page) of `page_size` tokens.

        `dtype`: float32 / bfloat16, or int8 / float8_e4m3fn for a quantized cache with zero scales (fp8 pages are
        stored as uint8 bit patterns, `kv_quant.storage_dtype`).
        """
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        pages = [jnp.zeros(shape, storage_dtype(dtype)) for _ in "kv"]  # distinct buffers: k and v are donated
        scales = [jnp.zeros(shape[:-1], SCALE_DTYPE) for _ in "kv"] if is_quantized(dtype) else [None, None]
        return KVCache(*pages, *scales)

    @staticmethod
    def per_leaf(kv: object, scale: object, dtype: jnp.dtype) -> KVCache:
        """A cache-shaped tree for a `dtype` cache: `kv` at k and v, `scale` at the scales (None for a float
        cache); e.g. the shardings of a cache, for `out_shardings` or `device_put`."""
        quantized = is_quantized(dtype)
        return KVCache(k=kv, v=kv, k_scale=scale if quantized else None, v_scale=scale if quantized else None)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: jnp.dtype) -> int:
        """Bytes one page takes over all layers, K and V (and their f32 scales for int8 / fp8)."""
        scale_bytes = jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0
        per_token = cfg.head_dim * jnp.dtype(dtype).itemsize + scale_bytes
        return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * per_token


@pytree.dataclass
class AttentionMetadata:
    """Per-step inputs of a ragged batch of B sequences with T flat tokens.

    Attributes:
      positions: i32[T], absolute position of each token in its sequence (padding: 0).
      cu_q_lens: i32[B + 1], prefix sums of the sequences' new-token counts; sequence b owns tokens
        `cu_q_lens[b] : cu_q_lens[b+1]`.
      kv_lens: i32[B], context length of each sequence after this step (cached + new); 0 for padding sequences.
      page_table: i32[B, max_pages_per_seq], entries in [0, num_pages); unused entries are the null page 0.
      kv_loc: i32[T], flat cache address `page * page_size + offset` each token's K/V is written to; padding tokens
        point into the null page.
      logits_indices: i32[R], flat token rows whose logits are returned (usually each sequence's last token).
      max_q_len: static bound on any sequence's new-token count (1 for a decode-only batch).
      fresh_prefill: static; True when no sequence has cached context (every kv_len equals its q_len), so
        attention may run over the new tokens alone (flash attention) instead of reading them back from pages.
    """

    positions: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    kv_loc: jax.Array
    logits_indices: jax.Array
    max_q_len: int = pytree.field(static=True, default=1)
    fresh_prefill: bool = pytree.field(static=True, default=False)


def unstack_layers(weights: Weights) -> Weights:
    """The same weights with `layers` as a tuple of per-layer `LayerWeights` (leaves without the L axis).

    `forward` runs such weights in an unrolled loop that reads each layer's arrays directly: XLA:CPU materializes
    a slice of a stacked [L, ...] weight as a copy before every matmul (scan or not), which doubles a decode
    step's weight traffic (BENCHMARKS.md). The stacked arrays are not kept: delete the input to free them.
    """
    if isinstance(weights.layers, tuple):
        return weights
    num_layers = weights.layers.attn_norm.shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], weights.layers) for i in range(num_layers))
    return weights.replace(layers=layers)


@native_unless_sharded
def forward(
    params: Weights,
    tokens: jax.Array,
    metadata: AttentionMetadata,
    kv_cache: KVCache,
    cfg: ModelConfig,
    *,
    scan_layers: bool = False,
    attention: AttentionOps = REFERENCE_OPS,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs the decoder on a ragged batch, writing new K/V into the paged cache.

    Args:
      params: weights, plain or with `models.quant.QuantizedWeight` projections (activations take
        `params.final_norm`'s dtype).
      tokens: i32[T], flat new tokens of all sequences, in [0, V); padding tokens are any valid id.
      metadata: positions, lengths, page table and logits rows of this step (see `AttentionMetadata`).
      kv_cache: cache with layers stacked on axis 0; donate it in the caller's `jit`. An int8 / fp8 cache is
        written quantized with its scales, and every attention path reads the values it holds (the flash path of
        fresh prefills attends over quantized-then-dequantized K/V, so it agrees with a later prefix-cache hit).
      cfg: static model config. Stacked layer weights (and the cache) may hold more layers than
        `cfg.num_layers`: only the first `cfg.num_layers` run and only their cache layers are written
        (self-drafting runs the target's first layers this way, see `jaxinfer.engine.spec_decode.draft`).
      scan_layers: `lax.scan` over layers (compile time flat in depth) instead of an unrolled Python loop; both
        update the stacked cache in place (timings in BENCHMARKS.md). Weights whose `layers` is a tuple of
        per-layer `LayerWeights` (`unstack_layers`), and models whose layers differ in window (Gemma 2 / 3), always
        run unrolled.
      attention: attention functions (`pallas_kernels.dispatch.select_attention`); steps marked
        `metadata.fresh_prefill` use `attention.flash` when there is one.
      mesh: static; the device mesh the weights are placed on, or None. MoE layers run their experts in a
        `shard_map` over its "ep" and "tp" axes (`models.moe.moe_block`); dense layers are partitioned by XLA from
        the inputs' shardings, so on a mesh of several devices no matmul uses the native CPU kernels
        (`models.quant_matmul`).

    Returns:
      (logits f32[R, V] for the rows `metadata.logits_indices`, the updated cache).
    """
    x = embed_tokens(params, tokens, cfg)  # [T, D]
    x, kv_cache = run_layers(x, params.layers, metadata, kv_cache, cfg, num_layers=cfg.num_layers,
                             scan_layers=scan_layers, attention=attention, mesh=mesh)
    return final_logits(params, x, metadata.logits_indices, cfg), kv_cache


def run_layers(x: jax.Array, layers: LayerWeights | tuple[LayerWeights, ...], metadata: AttentionMetadata,
               kv_cache: KVCache, cfg: ModelConfig, *, num_layers: int, scan_layers: bool,
               attention: AttentionOps = REFERENCE_OPS, mesh: jax.sharding.Mesh | None = None,
               first_layer: int | jax.Array = 0) -> tuple[jax.Array, KVCache]:
    """The decoder layers 0 .. num_layers - 1 of `forward` on x[T, D] -> [T, D], writing their K/V into the stacked
    cache (cache layer i for layer i). Arguments as `forward`; `layers` is stacked [L, ...] with L >= num_layers, or
    a tuple of per-layer weights (`unstack_layers`). Slot i attends with the window of cfg's layer first_layer + i:
    cfg may have more layers (a pipeline stage runs its slice of the stack, `models.pipeline`, its first layer an
    i32 scalar; layers whose windows differ then scan, each through a `lax.switch` over the windows)."""
    def layer_step(x: jax.Array, w: LayerWeights, kv: KVCache, i: int | jax.Array,
                   window: int | None) -> tuple[jax.Array, KVCache]:
        # Layer i writes into and reads from the stacked cache in place (no per-layer slice copies).
        with jax.named_scope("attention"):
            kw = dict(sm_scale=cfg.attention_scale, sliding_window=window, soft_cap=cfg.attn_logit_softcapping)
            rope_cfg = cfg.layer_rope(window)  # Gemma 3's local layers rotate by a base of their own
            q, k, v = attention_inputs(x, w, metadata.positions, rope_cfg, rope_frequencies(rope_cfg))
            kv = KVCache(*write_kv(kv.k, kv.v, k, v, metadata.kv_loc, layer=i, **kv.scale_args()))
            if metadata.fresh_prefill and attention.flash is not None:
                if kv.quantized:  # attend over the numbers the cache holds, as a later prefix-cache hit will
                    k, v = fake_quantize(k, kv.k.dtype), fake_quantize(v, kv.v.dtype)
                attn = attention.flash(q, k, v, metadata.cu_q_lens, **kw)  # [T, N, H]
            else:
                attn = attention.paged(q, kv.k, kv.v, metadata.kv_lens, metadata.page_table, metadata.cu_q_lens,
                                       i, max_q_len=metadata.max_q_len, **kw, **kv.scale_args())  # [T, N, H]
        return attention_output_and_mlp(x, attn, w, cfg, mesh), kv

    def any_window_step(x: jax.Array, w: LayerWeights, kv: KVCache, i: int | jax.Array) -> tuple[jax.Array, KVCache]:
        if cfg.uniform_windows or isinstance(first_layer + i, int):  # per layer: Gemma 2 / 3 mix local and global
            return layer_step(x, w, kv, i, cfg.layer_window(first_layer + i))
        windows, kinds = cfg.window_kinds()
        branches = [functools.partial(layer_step, window=window) for window in windows]
        return jax.lax.switch(jnp.asarray(kinds, jnp.int32)[first_layer + i], branches, x, w, kv, i)

    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    if isinstance(layers, tuple) or (not cfg.uniform_windows and isinstance(first_layer, int)):
        scan_layers = False  # per-layer arrays, or layers with differing windows (static args), run unrolled
    # on CPU the native matmul kernels read each dense projection inside its stack (no slice copied per layer)
    refs = DENSE_PROJECTIONS if scan_layers and layer_refs_apply(x.shape[0]) else ()
    if scan_layers and layers.attn_norm.shape[0] == num_layers and not refs:
        def body(carry: tuple, xs: tuple) -> tuple[tuple, None]:
            (x, kv), (w, i) = carry, xs
            return any_window_step(x, w, kv, i), None

        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (layers, layer_ids))
    elif scan_layers:  # index the stacks in the loop: LayerRefs, or a deeper stack's first layers (self-drafting)
        def indexed_body(carry: tuple, i: jax.Array) -> tuple[tuple, None]:
            return any_window_step(carry[0], slice_layer(layers, i, refs), carry[1], i), None

        (x, kv_cache), _ = jax.lax.scan(indexed_body, (x, kv_cache), layer_ids)
    else:
        for i in range(num_layers):
            w = layers[i] if isinstance(layers, tuple) else jax.tree.map(lambda a, i=i: a[i], layers)
            with jax.named_scope(f"layer_{i}"):
                x, kv_cache = any_window_step(x, w, kv_cache, i)
    return x, kv_cache
