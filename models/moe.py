"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): top-k routing, dropless grouped expert matmuls,
and expert plus tensor parallelism inside one `jax.shard_map` that ends in a single `psum`.

Math, per token h[D] (Shazeer et al. 2017, "Outrageously large neural networks"; Jiang et al. 2024, "Mixtral of
Experts"): p = softmax(h @ router) over E experts (f32), keep the k largest (`lax.top_k`), optionally renormalize
them to sum to 1 (`norm_topk_prob`), and return sum_j p_j * SwiGLU_j(h), SwiGLU_j(h) = (silu(h @ G_j) * (h @ U_j))
@ W_j. Qwen2-MoE (Qwen team 2024) adds an always-on shared expert, sigmoid(h @ g) * SwiGLU_s(h).

Dropless grouped matmul (MegaBlocks, Gale et al. 2023): the T * k token-expert assignments are sorted by expert,
so each expert's tokens form one contiguous run of rows, and `jax.lax.ragged_dot(x[A, D], w[E, D, F],
group_sizes[E])` multiplies run j by expert j. No capacity: every assignment is computed, however unbalanced the
routing. Semantics measured on jax 0.12.0.1 (CPU): rows past `sum(group_sizes)` come out as zeros; we still mask
them explicitly, since the docstring does not promise it. On CPU, XLA lowers `ragged_dot` to a masked dense dot
over all (local) groups (seen in the compiled HLO), so its cost there is E_local times the grouped cost; GPU and
TPU have grouped-GEMM lowerings, not measured here (no accelerator was available when this was written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.quant_matmul import dequantize_if_quantized
from sharding.mesh import EP_AXIS, TP_AXIS
from sharding.rules import EMBED, EXPERTS, MLP, ROUTER, logical_to_spec

if TYPE_CHECKING:
    from models.llama import LayerWeights

# Logical axes of one layer's MoE weights (`models.llama.Weights.abstract` prepends LAYERS). The router is never
# split (ROUTER has no rule); experts split over `ep`, their hidden width over `tp`, like a dense MLP's.
ROUTER_AXES = (EMBED, ROUTER)  # router [D, E]
EXPERT_IN_AXES = (EXPERTS, EMBED, MLP)  # e_gate, e_up [E, D, Fe]
EXPERT_OUT_AXES = (EXPERTS, MLP, EMBED)  # e_down [E, Fe, D]
SHARED_IN_AXES = (EMBED, MLP)  # s_gate, s_up [D, Fs]
SHARED_OUT_AXES = (MLP, EMBED)  # s_down [Fs, D]
SHARED_GATE_AXES = (EMBED, ROUTER)  # s_router [D, 1]


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of every token.

    Args:
      h: [T, D] normalized activations, any float dtype.
      router: [D, E] router weights.
      cfg: supplies k = `num_experts_per_tok` and `norm_topk_prob`.

    Returns:
      (weights f32[T, k], experts i32[T, k] in [0, E)), weights in descending order; they sum to 1 per token
      when `norm_topk_prob`, else they are the raw softmax probabilities of the chosen experts.
    """
    logits = jnp.einsum("td,de->te", h.astype(jnp.float32), router.astype(jnp.float32))  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _swiglu(h: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Dense SwiGLU (Shazeer 2020): h[T, D], gate/up [D, F], down [F, D] -> [T, D] in h's dtype."""
    return jnp.einsum("tf,fd->td", jax.nn.silu(h @ gate) * (h @ up), down)


def _routed_experts(h: jax.Array, weights: jax.Array, experts: jax.Array, e_gate: jax.Array, e_up: jax.Array,
                    e_down: jax.Array, first_expert: jax.Array | int) -> jax.Array:
    """The weighted sum over a token's chosen experts, restricted to experts [first_expert, first_expert + E_loc).

    Dispatch is a local selection: every rank holds every token, so "sending" an assignment to its expert is a
    gather of the token's row. Assignments whose expert lives on another rank are sorted into a trailing group
    that `group_sizes` leaves out, and their combine weight is masked to zero.

    Args:
      h: [T, D] activations.
      weights, experts: f32[T, k], i32[T, k] from `route` (global expert ids in [0, E)).
      e_gate, e_up: [E_loc, D, Fe_loc]; e_down: [E_loc, Fe_loc, D], this rank's experts (and hidden slice).
      first_expert: global id of local expert 0 (a traced scalar inside `shard_map`).

    Returns:
      f32[T, D], this rank's partial sum (complete when it holds every expert and the whole hidden width).
    """
    T, k = experts.shape
    num_local = e_gate.shape[0]
    local = experts.reshape(-1) - first_expert  # [A], A = T * k assignments, token-major
    is_local = (local >= 0) & (local < num_local)
    group = jnp.where(is_local, local, num_local)  # [A]; group num_local = other ranks' experts, sorted last
    order = jnp.argsort(group, stable=True)  # [A], assignments sorted by local expert
    token = order // k  # [A], the token of each sorted assignment
    group_sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)  # [E_loc]
    with jax.named_scope("dispatch"):
        x = jnp.take(h, token, axis=0)  # [A, D]
    with jax.named_scope("grouped_swiglu"):
        gate = jax.lax.ragged_dot(x, e_gate, group_sizes)  # [A, Fe_loc]
        up = jax.lax.ragged_dot(x, e_up, group_sizes)  # [A, Fe_loc]
        y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, e_down, group_sizes)  # [A, D]
    with jax.named_scope("combine"):
        w = jnp.where(is_local, weights.reshape(-1), 0.0)[order]  # [A] f32, 0 for other ranks' assignments
        y = jnp.where(is_local[order][:, None], y.astype(jnp.float32) * w[:, None], 0.0)  # [A, D]
        return jax.ops.segment_sum(y, token, num_segments=T)  # [T, D]


def _shared_expert(h: jax.Array, s_gate: jax.Array, s_up: jax.Array, s_down: jax.Array,
                   s_router: jax.Array) -> jax.Array:
    """sigmoid(h @ s_router) * SwiGLU_s(h): h[T, D], s_gate/s_up [D, Fs], s_down [Fs, D], s_router [D, 1] -> f32[T, D].

    Linear in the hidden slice, so a slice of Fs gives a partial sum that `psum` completes.
    """
    g = jax.nn.sigmoid(jnp.einsum("td,do->to", h.astype(jnp.float32), s_router.astype(jnp.float32)))  # [T, 1]
    return g * _swiglu(h, s_gate, s_up, s_down).astype(jnp.float32)


def _moe_partial(h: jax.Array, ws: dict[str, jax.Array], cfg: ModelConfig, first_expert: jax.Array | int,
                 shared_slice: tuple[jax.Array, int] | None, shared_on: jax.Array | bool) -> jax.Array:
    """Routed experts plus shared expert over this rank's weights: f32[T, D] partial sum (whole when unsharded).

    `shared_slice` = (start, size) selects a slice of the local shared hidden width (the ep share); `shared_on`
    zeroes the shared expert on ranks that must not add it.
    """
    with jax.named_scope("route"):
        weights, experts = route(h, ws["router"], cfg)  # [T, k]
    out = _routed_experts(h, weights, experts, ws["e_gate"], ws["e_up"], ws["e_down"], first_expert)  # [T, D]
    if "s_gate" in ws:
        with jax.named_scope("shared_expert"):
            s_gate, s_up, s_down = ws["s_gate"], ws["s_up"], ws["s_down"]
            if shared_slice is not None:
                start, size = shared_slice
                s_gate = jax.lax.dynamic_slice_in_dim(s_gate, start, size, axis=1)  # [D, Fs / (tp * ep)]
                s_up = jax.lax.dynamic_slice_in_dim(s_up, start, size, axis=1)
                s_down = jax.lax.dynamic_slice_in_dim(s_down, start, size, axis=0)
            shared = _shared_expert(h, s_gate, s_up, s_down, ws["s_router"])  # [T, D]
            out = out + jnp.where(shared_on, shared, 0.0)
    return out


_WEIGHT_AXES = {
    "router": ROUTER_AXES, "e_gate": EXPERT_IN_AXES, "e_up": EXPERT_IN_AXES, "e_down": EXPERT_OUT_AXES,
    "s_gate": SHARED_IN_AXES, "s_up": SHARED_IN_AXES, "s_down": SHARED_OUT_AXES, "s_router": SHARED_GATE_AXES,
}


def moe_block(h: jax.Array, w: LayerWeights, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """The MoE MLP of one layer (without the residual): routed experts plus the optional shared expert.

    Without a mesh (or with ep = tp = 1), one rank holds all experts and the computation below runs once, outside
    any `shard_map` and with no collective.

    With a mesh (axes "ep" and "tp", e.g. `sharding.mesh.make_mesh`), the work runs inside `jax.shard_map`:
      1. Every rank holds every token: h is replicated (the attention output projection already ended in an
         all-reduce). Every rank routes every token with the replicated router (E dot products per token, cheap).
      2. Exchange. Rank (e, t) owns experts [e * E/ep, (e + 1) * E/ep) and hidden columns t of each. It keeps the
         assignments whose expert is local and sorts them by local expert; the rest go to a trailing group
         outside `group_sizes`. The exchange is this local selection because tokens are replicated over `ep`.
         With data-parallel attention (tokens split over ranks; future), each rank would instead have to send
         every assignment to its expert's rank with an all-to-all (`lax.ragged_all_to_all`, after exchanging the
         per-expert counts, since dropless sizes depend on the data) and bring the results back with a second
         all-to-all before the combine; the `ep` psum below would then disappear.
      3. `ragged_dot` over the local experts with the local hidden slice; the down projection contracts that
         slice, so each rank's result is a partial sum over its hidden columns. The row buffer is static at
         A = T * k rows on every rank: dropless means one rank may get every assignment.
      4. Combine: weight each assignment by its routing weight (0 for non-local ones) and segment-sum them back
         to their tokens.
      5. The shared expert's hidden width is split over tp (its weights' placement) and, inside the shard_map,
         over ep as well (each ep rank takes 1/ep of its tp slice), so its partial sums need the same psum; when
         Fs/tp is not a multiple of ep, ep rank 0 alone adds it (the other ep ranks compute it and drop it).
      6. ONE `psum` over ("ep", "tp") adds the experts of all ep ranks and the hidden slices of all tp ranks.
         Each rank sums its own assignments in f32; the psum runs in h's dtype (the bytes of a dense TP MLP's
         all-reduce), so in bf16 the cross-rank sum rounds more than the single-device one.

    The `shard_map` in_specs come from `sharding.rules.DEFAULT_RULES`, so weights placed by `named_shardings`
    enter without any resharding (experts on ep, Fe and Fs on tp, router replicated).

    Args:
      h: [T, D] normalized activations (f32 or bf16), replicated over the mesh.
      w: one layer's weights: router [D, E], e_gate/e_up [E, D, Fe], e_down [E, Fe, D], and with
        `cfg.shared_expert_intermediate_size` > 0 s_gate/s_up [D, Fs], s_down [Fs, D], s_router [D, 1].
      cfg: static model config with num_experts > 0.
      mesh: None, or a mesh whose axes include "ep" and "tp" (other axes, e.g. "dp", see replicated data).

    Returns:
      [T, D] in h's dtype, replicated over the mesh.

    Raises:
      ValueError: at trace time, if the mesh lacks an "ep" or "tp" axis, E is not a multiple of ep, or Fe or Fs
        is not a multiple of tp (the message names the numbers).
    """
    names = ["router", "e_gate", "e_up", "e_down"]
    if cfg.shared_expert_intermediate_size:
        names += ["s_gate", "s_up", "s_down", "s_router"]
    # Quantized expert weights are stored low-precision and dequantized here, one layer at a time: ragged_dot
    # has no quantized path yet.
    ws = {name: dequantize_if_quantized(getattr(w, name), h.dtype) for name in names}
    if mesh is not None:
        missing = [a for a in (EP_AXIS, TP_AXIS) if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"moe_block: mesh axes {mesh.axis_names} lack {missing}")
    ep, tp = (1, 1) if mesh is None else (mesh.shape[EP_AXIS], mesh.shape[TP_AXIS])
    if ep * tp == 1:  # all experts on every device: nothing to split, no psum (XLA keeps one-member all-reduces)
        return _moe_partial(h, ws, cfg, 0, None, True).astype(h.dtype)

    E, Fe, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    for what, size, axis, n in (("num_experts", E, "ep", ep), ("moe_intermediate_size", Fe, "tp", tp),
                                ("shared_expert_intermediate_size", Fs, "tp", tp)):
        if size % n:
            raise ValueError(f"moe_block: {what} = {size} is not a multiple of {axis} = {n}")
    split_shared = (Fs // tp) % ep == 0

    def shard(h: jax.Array, ws: dict[str, jax.Array]) -> jax.Array:
        ep_index = jax.lax.axis_index(EP_AXIS)
        shared_slice = (ep_index * (Fs // tp // ep), Fs // tp // ep) if Fs and split_shared else None
        shared_on = True if split_shared else ep_index == 0
        out = _moe_partial(h, ws, cfg, ep_index * (E // ep), shared_slice, shared_on)  # [T, D] partial
        with jax.named_scope("moe_psum"):
            return jax.lax.psum(out.astype(h.dtype), (EP_AXIS, TP_AXIS))  # experts over ep, hidden over tp

    specs = {name: logical_to_spec(_WEIGHT_AXES[name]) for name in names}
    return jax.shard_map(shard, mesh=mesh, in_specs=(PartitionSpec(), specs), out_specs=PartitionSpec())(h, ws)
