"""Pipeline parallelism: the decoder's layer stack split into stages of consecutive layers, each on its own group
of devices, with the step's token rows flowing through the stages as micro-batches (GPipe, Huang et al. 2019;
laid out as MaxText's pipeline: one SPMD program over a mesh with a stage axis, activations moved by `ppermute`).

Layout (`stage_layout`, `pad_layers`):

- The mesh is `(pp, dp, ep, tp)` (`sharding.mesh.make_mesh(pp=...)`): stage s is the s-th block of dp * ep * tp
  devices, and tensor parallelism runs inside each stage as without stages (XLA partitions the stage's matmuls
  over its `tp` devices).
- The L layers split into pp stages as evenly as possible, earlier stages taking the extra ones (10 over 4:
  3, 3, 2, 2). Every stage holds S = ceil(L / pp) slots of the stacked [pp * S, ...] weights; a stage with fewer
  real layers is padded at its end with zero-weight layers, which are exact no-ops (every block of a layer adds
  its output to the residual stream through a zero projection, wo = w_down = 0, so x + 0 = x; their K/V are zeros
  written to their own cache layer). The padded stack is an ordinary deeper model (`staged_config`): run without
  stages it gives the same logits. Padding costs the padded layers' compute and KV pages on uneven splits only.
- Layers with windows of their own (Gemma 2 / 3: local and global layers): slot i of the padded stack attends with
  the window of the layer it holds (`staged_config`; a padding slot with any, it is a no-op). A stage scans its
  slots from its first one, stage * S (traced), each slot through a `lax.switch` over the model's distinct windows
  (the attention kernels take the window as a static argument): one branch runs, all of them compile.
- The stacked layer weights and the KV cache [pp * S, P, K, page_size, H] split over the stage axis on their
  layer axis (`sharding.rules.PIPELINE_RULES`): each stage's devices hold only its layers' weights and KV pages.
  The page table is shared (one host scheduler): a page id names the same page in every stage's slice.
- A checkpoint's [L, ...] stack can be read straight into the stages only in blocks of S layers (the stack padded
  at its end, `StageLayout.blocks`); that is the stage layout for even splits and pp = 2, and `stages_from_blocks`
  moves the rest on device (`jaxinfer.loading.orbax`, module docstring).
- The embedding table and the LM head split their vocabulary over every device, pp x tp (`PIPELINE_RULES`; V
  padded to a multiple of pp * tp, the padded ids masked as for tp alone, `models.partition`), rather than living
  on the first and last stage: one SPMD program gives every operand a place on every device, so a table "on
  stage 0 only" would be zero-filled copies elsewhere, and split each device holds 1 / (pp * tp) of it (a tied
  table serves both ends anyway). The gather and the head run outside the stage loop, partitioned by XLA: the
  gather costs one all-reduce of the step's [T, D] embeddings, the head gives each device its own slice of the
  logits, and the sampler's full logits one all-gather. The final norm's gain (D values) stays replicated.

One step (`pipeline_forward`, inside the runner's one jitted step; shapes stay the step's buckets):

1. The step's T token rows (already padded to a power of two) are cut into M' = the largest divisor of T that is
   <= M (`num_microbatches`) micro-batches of T / M' consecutive rows. A sequence may straddle two micro-batches:
   each micro-batch carries its own view of the batch (`microbatch_metadata`: cu_q_lens clipped to its rows,
   kv_lens cut to its last row), exactly as two chunks of a chunked prefill. Every stage runs micro-batch m before
   m + 1, so the K/V a later row attends to is already written at every layer.
2. In a `jax.shard_map` that is manual over the stage axis only, M' + pp - 1 ticks run: at tick t stage s works on
   micro-batch t - s when that is in [0, M') (a `lax.cond`: idle stages compute and write nothing), stage 0 reading
   the micro-batch's embeddings, the others the activations `ppermute`d from stage s - 1 at the end of tick t - 1.
   With M' >= pp, every stage works on a different micro-batch in the steady state; the pp - 1 ticks at either end
   are the pipeline bubble.
3. The last stage collects its outputs; the logits rows are broadcast to every stage (a `psum` in which the other
   stages add zeros, exact) and the final norm and LM head run on them, each device for its slice of the vocabulary.

MoE layers (`models.moe`) run their expert block's own `shard_map` nested inside the stages' one: over the context's
abstract mesh (`jax.sharding.get_abstract_mesh()`, whose stage axis is already manual), manual over ep and tp too,
so a stage's experts split over its ep x tp devices and the block's one psum stays among them. Left to XLA's
partitioner instead, the expert block got collective-permutes inside the stage's `lax.cond`, which only the active
stage runs, and XLA:CPU deadlocked (its collective-permute waits for every device of the program).

Limits: attention always reads the paged cache (no flash path for fresh prompts, since a micro-batch may need the
K/V of an earlier one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from models.config import ModelConfig
from models.layer import embed_tokens, final_logits
from models.llama import AttentionMetadata, KVCache, Weights, run_layers
from models.pipeline_events import EventLog
from models.quant_matmul import native_unless_sharded
from pallas_kernels.dispatch import REFERENCE_OPS, AttentionOps
from sharding.mesh import PP_AXIS, pipeline_stages


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """How L layers split over pp stages.

    Attributes:
      num_layers: L, the model's layers.
      counts: real layers of each stage (len pp, each >= 1, summing to L).
    """

    num_layers: int
    counts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    @property
    def layers_per_stage(self) -> int:
        """S: the slots every stage holds (its real layers, then zero-weight padding layers)."""
        return max(self.counts)

    @property
    def padded_layers(self) -> int:
        return self.num_stages * self.layers_per_stage

    def source(self) -> np.ndarray:
        """i32[pp * S]: the model layer each slot of the padded stack holds, -1 for a padding layer."""
        out, first = np.full(self.padded_layers, -1, np.int32), 0
        for s, n in enumerate(self.counts):
            out[s * self.layers_per_stage : s * self.layers_per_stage + n] = np.arange(first, first + n)
            first += n
        return out


    def blocks(self) -> np.ndarray:
        """i32[pp * S]: the model layer each slot holds in the block layout, -1 past L: the [L, ...] stack padded at
        its end to [pp * S, ...], so stage s holds layers [s * S, (s + 1) * S) (`stages_from_blocks`). Equal to
        `source()` for even splits and for pp = 2."""
        return np.where(np.arange(self.padded_layers) < self.num_layers, np.arange(self.padded_layers), -1)


def stage_layout(num_layers: int, num_stages: int) -> StageLayout:
    """The split of `num_layers` layers over `num_stages` stages (earlier stages take the extra layers).

    Raises:
      ValueError: num_stages < 1, or more stages than layers (a stage would hold no layer).
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size={num_stages!r} must be a positive integer")
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} layers: a "
                         f"stage would hold no layer; use pipeline_parallel_size <= {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    return StageLayout(num_layers, tuple(base + (s < extra) for s in range(num_stages)))


def check_pipeline(cfg: ModelConfig, num_stages: int) -> StageLayout:
    """The stage layout of `cfg` over `num_stages` stages (dense and MoE models, per-layer windows or not).

    Raises:
      ValueError: from `stage_layout`.
    """
    return stage_layout(cfg.num_layers, num_stages)


def staged_config(cfg: ModelConfig, layout: StageLayout) -> ModelConfig:
    """The config of the padded stack: `layout.padded_layers` layers, each slot with the window of the layer it holds
    (`layout.source()`; a padding slot, a no-op, with layer 0's)."""
    windows = cfg.layer_sliding_windows
    if windows is not None:
        windows = tuple(windows[max(layer, 0)] for layer in layout.source())
    return dataclasses.replace(cfg, num_layers=layout.padded_layers, layer_sliding_windows=windows)


def _zero(dtype) -> np.ndarray:
    """A zero of `dtype` with all bits 0: numpy's (jnp.zeros of float8_e8m0fnu, which has no zero, is NaN, and a NaN
    scale would make a padding layer's mxfp weights NaN; bits 0, 2^-127, times zero values is 0)."""
    return np.zeros((), dtype)


def pad_layers(weights: Weights, layout: StageLayout) -> Weights:
    """The weights with their stacked layers laid out for the stages: slot i of every layer leaf (axis 0, also the
    values and scales of a `models.quant.QuantizedWeight`) holds layer `layout.source()[i]`, all-zero bits for
    padding slots (a zero-weight layer is a no-op, module docstring). numpy in, numpy out; jax arrays in, jax out."""
    source = layout.source()
    if layout.padded_layers == layout.num_layers:
        return weights

    def one(a):
        xp = np if isinstance(a, np.ndarray) else jnp
        taken = xp.take(a, np.maximum(source, 0), axis=0)
        keep = (source >= 0).reshape(-1, *[1] * (a.ndim - 1))
        return xp.where(keep, taken, _zero(a.dtype))

    return weights.replace(layers=jax.tree.map(one, weights.layers))


def stages_from_blocks(layers: Any, layout: StageLayout) -> Any:
    """Stacked layer arrays moved from the block layout (`StageLayout.blocks`) to the stage layout (`pad_layers`) on
    the mesh they live on, without gathering the stack anywhere.

    Layer i sits in block b = i // S and belongs to a stage t >= b (every stage's first layer is at or before its
    block's first: earlier stages take the extra layers). For each shift k = t - b that occurs, one `ppermute` sends
    every stage's block to the stage k further on, which keeps the rows it needs: a device receives at most one
    block per shift, never the stack, and leaves move one at a time (a transient of one leaf's block per shift).
    Padding slots get all-zero bits, as in `pad_layers`. Where the layouts agree (even splits, pp = 2) the arrays are
    returned as they are.

    Args:
      layers: a pytree of `jax.Array`s [pp * S, ...] (slot i holding layer i, anything past L), each with a
        `NamedSharding` whose first axis is split over the mesh's stage axis `PP_AXIS` alone (other axes as they
        are); donated.
      layout: the stage layout.

    Returns:
      The same tree: slot i of every leaf holds layer `layout.source()[i]`, with the leaf's sharding.

    Raises:
      ValueError: a leaf that is not [pp * S, ...] split over the stage axis.
    """
    source, blocks = layout.source(), layout.blocks()
    if (source == blocks).all():
        return layers
    leaves, treedef = jax.tree.flatten(layers)
    for x in leaves:
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if x.shape[0] != layout.padded_layers or not spec or spec[0] != PP_AXIS:
            raise ValueError(f"stages_from_blocks needs [{layout.padded_layers}, ...] arrays split over "
                             f"{PP_AXIS!r} on axis 0; got shape {x.shape}, sharding {getattr(x, 'sharding', None)}")
    num_stages, slots = layout.num_stages, layout.layers_per_stage
    stage_of = np.arange(layout.padded_layers) // slots
    shift = np.where(source >= 0, stage_of - source // slots, -1).reshape(num_stages, slots)  # [pp, S]
    row = np.where(source >= 0, source % slots, 0).reshape(num_stages, slots)  # [pp, S], in the sender's block

    def move(block: jax.Array) -> jax.Array:  # [S, ...], this device's block
        stage = jax.lax.axis_index(PP_AXIS)
        keep = lambda mask: mask.reshape(-1, *[1] * (block.ndim - 1))  # noqa: E731
        out = jnp.broadcast_to(_zero(block.dtype), block.shape)
        for k in sorted(set(shift[shift >= 0].tolist())):
            got = block if k == 0 else jax.lax.ppermute(block, PP_AXIS, [(s, s + k) for s in range(num_stages - k)])
            rows = jnp.take(got, jnp.asarray(row)[stage], axis=0)
            out = jnp.where(keep(jnp.asarray(shift)[stage] == k), rows, out)
        return out

    def one(x: jax.Array) -> jax.Array:  # a leaf at a time: at most a block per shift of one leaf on top
        spec = x.sharding.spec
        return jax.jit(jax.shard_map(move, mesh=x.sharding.mesh, in_specs=spec, out_specs=spec), donate_argnums=0)(x)

    return jax.tree.unflatten(treedef, [one(x) for x in leaves])


def microbatch_metadata(metadata: AttentionMetadata, m: jax.Array, size: int) -> AttentionMetadata:
    """The batch as seen by micro-batch m: token rows [m * size, (m + 1) * size) of the step.

    It holds the W = min(B, size + 1) consecutive sequences that can own its rows (the first with a row at or past
    the micro-batch's start, or the last W), each with its row of the page table; a sequence's new tokens are those
    of its rows inside the micro-batch (cu_q_lens clipped to them, possibly none) and its context ends at the last
    of them (kv_lens less the sequence's tokens after the micro-batch), as for a chunk of a chunked prefill.
    `fresh_prefill` is off: a micro-batch may attend to K/V an earlier one wrote. Every sequence of the step must
    own at least one row (padding sequences, with none, come last), as the engine's steps do.

    Args:
      metadata: the step's metadata over T rows.
      m: i32 scalar, in [0, T / size).
      size: rows per micro-batch (static).
    """
    start = m * size
    num_seqs = metadata.kv_lens.shape[0]
    # Only the W sequences from the first one with a row at or past `start` can own rows of the micro-batch (one
    # that began before it, then at most one a row: every sequence of a step has a row), so attention runs over W,
    # not B (a decode step of 128 sequences in 8 micro-batches: 17 a micro-batch instead of 128).
    window = min(num_seqs, size + 1)
    first = jnp.minimum(jnp.sum(metadata.cu_q_lens[1:] <= start), num_seqs - window)
    seqs = lambda a: jax.lax.dynamic_slice_in_dim(a, first, window)  # noqa: E731
    cu = jax.lax.dynamic_slice_in_dim(metadata.cu_q_lens, first, window + 1)  # [W + 1]
    after = jnp.maximum(cu[1:] - jnp.maximum(cu[:-1], start + size), 0)  # [W], tokens past the micro-batch
    rows = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size)  # noqa: E731
    return metadata.replace(positions=rows(metadata.positions), kv_loc=rows(metadata.kv_loc),
                            cu_q_lens=jnp.clip(cu - start, 0, size), kv_lens=seqs(metadata.kv_lens) - after,
                            page_table=seqs(metadata.page_table), max_q_len=min(metadata.max_q_len, size),
                            fresh_prefill=False)


def num_microbatches_for(num_tokens: int, num_microbatches: int) -> int:
    """M': the largest divisor of the step's token rows that is <= the wanted micro-batches (>= 1)."""
    m = max(1, min(num_microbatches, num_tokens))
    while num_tokens % m:
        m -= 1
    return m


@native_unless_sharded
def pipeline_forward(params: Weights, tokens: jax.Array, metadata: AttentionMetadata, kv_cache: KVCache,
                     cfg: ModelConfig, *, mesh: jax.sharding.Mesh, num_microbatches: int, scan_layers: bool = True,
                     attention: AttentionOps = REFERENCE_OPS,
                     events: EventLog | None = None) -> tuple[jax.Array, KVCache]:
    """`models.llama.forward` over pipeline stages (module docstring): same arguments, same results.

    Args:
      params: weights laid out by `pad_layers`, their layer axis split over the mesh's stage axis.
      tokens, metadata: as `forward` (T rows).
      kv_cache: [pp * S, P, ...] leaves split over the stage axis; donate it in the caller's `jit`.
      cfg: the padded stack's config (`staged_config`).
      mesh: static; a mesh with the stage axis `sharding.mesh.PP_AXIS`.
      num_microbatches: static; M, micro-batches per step (M' of the module docstring are used).
      scan_layers: must be True (stages scan over their stacked slots).
      attention: as `forward`; its flash path is not used.
      events: static; None (default: nothing recorded, no cost), or a log that receives each stage's wall-clock
        interval of work per micro-batch (`models.pipeline_events`: what the stamps bracket, their overhead).

    Returns:
      (logits f32[R, V] for the rows `metadata.logits_indices`, the updated cache).

    Raises:
      ValueError: scan_layers False, a mesh without pipeline stages, or events with dp, ep or tp > 1.
    """
    num_stages = pipeline_stages(mesh)
    if events is not None and mesh.size != num_stages:
        raise ValueError(f"pipeline_forward records events only on a mesh of stages alone (dp = ep = tp = 1); got "
                         f"{dict(mesh.shape)}")
    if not scan_layers or isinstance(params.layers, tuple) or num_stages < 2:
        raise ValueError(f"pipeline_forward needs stacked layers (scan_layers=True) and a mesh with a stage axis "
                         f"of size > 1; got scan_layers={scan_layers}, {num_stages} stage(s)")
    num_slots = cfg.num_layers // num_stages
    total = tokens.shape[0]
    num_micro = num_microbatches_for(total, num_microbatches)
    size = total // num_micro
    x = embed_tokens(params, tokens, cfg)  # [T, D]

    def stages(x: jax.Array, layers, metadata: AttentionMetadata, kv: KVCache) -> tuple[jax.Array, KVCache]:
        stage = jax.lax.axis_index(PP_AXIS)
        last = stage == num_stages - 1

        def work(inputs: jax.Array, kv: KVCache, m: jax.Array) -> tuple[jax.Array, KVCache]:
            if events is not None:
                inputs = events.bracket(0, stage, m, inputs)
            y, kv = run_layers(inputs, layers, microbatch_metadata(metadata, m, size), kv, cfg, num_layers=num_slots,
                               scan_layers=True, attention=attention, first_layer=stage * num_slots,
                               mesh=jax.sharding.get_abstract_mesh())  # MoE: nested shard_map, module docstring
            return (y, kv) if events is None else (events.bracket(1, stage, m, y), kv)

        def tick(t: jax.Array, carry: tuple) -> tuple:
            received, out, kv = carry  # [size, D], [T, D]
            m = t - stage
            active = (m >= 0) & (m < num_micro)
            m = jnp.clip(m, 0, num_micro - 1)
            inputs = jnp.where(stage == 0, jax.lax.dynamic_slice_in_dim(x, m * size, size), received)
            y, kv = jax.lax.cond(active, work, lambda inputs, kv, m: (inputs, kv), inputs, kv, m)
            kept = jax.lax.dynamic_slice_in_dim(out, m * size, size)
            out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(active & last, y, kept), m * size, 0)
            received = jax.lax.ppermute(y, PP_AXIS, [(s, s + 1) for s in range(num_stages - 1)])
            return received, out, kv

        carry = (jnp.zeros((size, x.shape[1]), x.dtype), jnp.zeros_like(x), kv)
        _, out, kv = jax.lax.fori_loop(0, num_micro + num_stages - 1, tick, carry)
        rows = jnp.take(out, metadata.logits_indices, axis=0)  # [R, D]
        # summed in f32: exact (the other stages add zeros), and XLA:CPU aborts compiling a bf16 all-reduce here
        # ("Invalid binary instruction opcode copy" in AllReducePromotion)
        rows32 = jnp.where(last, rows, jnp.zeros((), rows.dtype)).astype(jnp.float32)
        return jax.lax.psum(rows32, PP_AXIS).astype(rows.dtype), kv

    # host callbacks need every mesh axis manual: recording runs only where the stage axis is the whole mesh
    manual = set(mesh.axis_names) if events is not None else {PP_AXIS}
    stacked, whole = PartitionSpec(PP_AXIS), PartitionSpec()
    rows, kv_cache = jax.shard_map(stages, mesh=mesh, in_specs=(whole, stacked, whole, stacked),
                                   out_specs=(whole, stacked), axis_names=manual, check_vma=False)(
        x, params.layers, metadata, kv_cache)
    return final_logits(params, rows, jnp.arange(rows.shape[0]), cfg), kv_cache
