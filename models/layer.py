"""One decoder layer's math around attention: RMSNorm, the q / k / v projections (with Qwen3's per-head q / k
norms) and RoPE, the output projection and the gated (SwiGLU / GeGLU) or MoE MLP with their residuals (with
Gemma 2's post-attention / post-MLP norms), and the final-logit soft cap. `models.llama.forward` runs them around
the paged attention. Sources: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021), SwiGLU and GeGLU (Shazeer
2020), soft-capping (Gemma team 2024b, Gemma 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from models import moe
from models.config import Activation, ModelConfig
from models.quant_matmul import embed_lookup, qeinsum, qeinsums
from models.rope import apply_rope, rope_attention_factor

if TYPE_CHECKING:
    from models.llama import LayerWeights, Weights


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in one fixed order per row: the row zero-padded to a power of two, then halved by
    elementwise adds (a pairwise tree). XLA's own reductions change their order with the number of rows (XLA:CPU
    from 8 rows, where it vectorizes across them), so a row's sum, and with it a greedy token, would depend on the
    other sequences of the batch; elementwise adds do not.

    Args:
      x: [..., C], a float dtype.

    Returns:
      [..., 1] in x's dtype.
    """
    c = x.shape[-1]
    width = 1 << max(c - 1, 0).bit_length()
    if width != c:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - c)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis, computed in f32, returned in x's dtype; the mean square in a fixed order per
    row (`row_sum`), so a token's norm does not depend on the batch it is in.

    Args:
      x: [..., C], any float dtype.
      scale: [C], the stored gain w; the output is normalized x times (offset + w), added in f32.
      eps: added to the mean square.
      offset: 0 for Llama-style norms, 1 for Gemma's (`ModelConfig.norm_weight_offset`).
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(row_sum(x32 * x32) / x32.shape[-1] + eps)
    gain = (scale.astype(jnp.float32) + offset) if offset else scale.astype(jnp.float32)
    return (x32 * gain).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`rms_norm` with the model's epsilon and gain offset."""
    return rms_norm(x, scale, cfg.rms_norm_eps, cfg.norm_weight_offset)


def gate_activation(gate: jax.Array, kind: Activation) -> jax.Array:
    """The gated MLP's nonlinearity: SiLU, or GELU with the tanh approximation (PyTorch's `gelu(approximate=
    "tanh")`, transformers' `gelu_pytorch_tanh`)."""
    if kind is Activation.GELU_TANH:
        return jax.nn.gelu(gate, approximate=True)
    return jax.nn.silu(gate)


def add_bias(x: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x + bias in x's dtype; x itself when there is no bias."""
    return x if bias is None else x + bias.astype(x.dtype)


def attention_inputs(
    x: jax.Array, w: LayerWeights, positions: jax.Array, cfg: ModelConfig, inv_freq: np.ndarray
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RMSNorm, q/k/v projections, per-head q/k RMSNorm (`cfg.qk_norm`) and RoPE of one layer: x[T, D] ->
    q[T, N, H], k[T, K, H], v[T, K, H]."""
    h = layer_norm(x, w.attn_norm, cfg)
    q, k, v = qeinsums(("td,dnh->tnh", "td,dkh->tkh", "td,dkh->tkh"), h, (w.wq, w.wk, w.wv))
    q, k, v = add_bias(q, w.bq), add_bias(k, w.bk), add_bias(v, w.bv)  # [T, N, H], [T, K, H], [T, K, H]
    if cfg.qk_norm:  # over H, one gain per head-dim channel shared by all heads
        q, k = layer_norm(q, w.q_norm, cfg), layer_norm(k, w.k_norm, cfg)
    factor = rope_attention_factor(cfg)  # YaRN / LongRoPE scale cos and sin
    return apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor), v


def attention_output_and_mlp(x: jax.Array, attn: jax.Array, w: LayerWeights, cfg: ModelConfig,
                              mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """Output projection with residual, then the gated (or MoE) MLP block with residual: x[T, D] -> [T, D].
    With `cfg.post_norms` (Gemma 2) each block's output is RMSNormed (`post_attn_norm`, `post_mlp_norm`) before
    its residual add."""
    out = qeinsum("tnh,nhd->td", attn, w.wo)
    x = x + (layer_norm(out, w.post_attn_norm, cfg) if cfg.post_norms else out)
    with jax.named_scope("mlp"):
        h = layer_norm(x, w.mlp_norm, cfg)
        if cfg.is_moe:
            with jax.named_scope("moe"):
                out = moe.moe_block(h, w, cfg, mesh)
        else:  # gate and up stay f32 until the product: a bf16 activation rounded after every op (five converts)
            gate, up = qeinsums(("td,df->tf", "td,df->tf"), h, (w.w_gate, w.w_up), preferred_element_type=jnp.float32)
            gate, up = add_bias(gate, w.b_gate), add_bias(up, w.b_up)  # [T, F]
            act = (gate_activation(gate, cfg.mlp_activation) * up).astype(x.dtype)
            out = add_bias(qeinsum("tf,fd->td", act, w.w_down), w.b_down)
        return x + (layer_norm(out, w.post_mlp_norm, cfg) if cfg.post_norms else out)


def soft_cap_logits(logits: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 2's final-logit soft cap c * tanh(logits / c) with c = `cfg.final_logit_softcapping` (in the logits'
    dtype, f32 from the LM head); the logits themselves when it is None. logits: [R, V]."""
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def embed_tokens(params: Weights, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The token embeddings x[T, D] of tokens i32[T] (in [0, V)), in `params.final_norm`'s dtype; Gemma scales them
    by `cfg.embed_scale` (sqrt(D), rounded to the activation dtype first, as transformers does)."""
    with jax.named_scope("embed"):
        x = embed_lookup(params.embed, tokens, params.final_norm.dtype)  # [T, D]
        if cfg.embed_scale != 1.0:
            x = x * jnp.asarray(cfg.embed_scale, jnp.float32).astype(x.dtype)
        return x


def final_logits(params: Weights, x: jax.Array, logits_indices: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final norm and LM head (the embedding, when tied) of the rows `logits_indices` (i32[R], in [0, T)) of
    x[T, D]: logits f32[R, V], soft-capped (`soft_cap_logits`)."""
    with jax.named_scope("lm_head"):
        x = jnp.take(x, logits_indices, axis=0)  # [R, D]
        x = layer_norm(x, params.final_norm, cfg)
        if params.lm_head is None:
            logits = qeinsum("rd,vd->rv", x, params.embed, preferred_element_type=jnp.float32)
        else:
            logits = qeinsum("rd,dv->rv", x, params.lm_head, preferred_element_type=jnp.float32)
    return soft_cap_logits(logits, cfg)
