"""Placing a model on a mesh: head padding when `tp` does not divide the head counts, then sharded weights.

The model-free part (shardings from logical axes, placing host arrays) is `sharding/`; this module knows the
model: its config, its weights and their quantized form.

Megatron-style tensor parallelism (Shoeybi et al. 2019) gives every TP rank a contiguous block of query heads, the
KV heads they read, and a block of the MLP hidden dimension. Real models do not always divide: SmolLM2-135M has
9 query heads over 3 KV heads, which no `tp` in {2, 4, 8} divides. Instead of refusing, `tp_layout` builds an
exact padded layout:

- **KV heads are replicated** into K' slots (K' a multiple of tp); each slot is a copy of one original KV head, so
  its K/V projections, and the cache it writes, are that head's.
- **Query heads are regrouped** into N' = K' * G' slots, G' per KV slot; every original query head sits in exactly
  one slot of its own KV head; the other slots are zero query heads whose output-projection rows are zero, so they
  add exactly nothing to the layer output.
- **MLP hidden and vocabulary** are zero-padded to multiples of the devices they split over (tp; the vocabulary
  over pp * tp with pipeline stages, `sharding.rules.PIPELINE_RULES`): a zero gate column gives silu(0) * up = 0
  and a zero down-projection row adds nothing; padded vocabulary ids get logit 0 and are masked by the sampler's
  `vocab_limit` (the runner never samples or reports them).

Among the layouts, the one with the fewest padded query heads (per-rank attention work) wins, then the fewest KV
slots (per-rank cache memory). A mesh that cannot be served usefully (more TP ranks than query heads, experts not
divisible over `ep`, an MoE mesh axis on a dense model) is refused with an error that names the numbers.

Quantized weights (`models.quant.QuantizedWeight`, e.g. from a quantized checkpoint) are padded as they are: values
move with their heads and zero slots get zero values (packed formats: the codes of zero) and scale 1, exactly
what quantizing the padded float weight gives (absmax scaling: a zero channel gets scale 1, and a channel's absmax
does not change when zeros or copies join it). Dequantizing, padding and quantizing again would not be exact: the
values come back the same, but `amax / qmax` recomputed from the dequantized `q * scale` differs from `scale` in its
last bit for a few to half of the channels (measured on random weights, int8 and fp8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models.config import ModelConfig
from models.llama import KVCache, Weights
from models import quant4
from models.quant import PACKED_FORMATS, QuantizedWeight
from models.quant_sharding import quantized_sharding
from sharding.mesh import EP_AXIS, TP_AXIS
from sharding.placement import put_sharded
from sharding.rules import HEADS, KV_HEADS, MLP, VOCAB, logical_to_spec, mesh_axes_size, mesh_rules


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one model's heads, MLP and vocabulary are padded for `tp` ranks.

    Attributes:
      tp: number of TP ranks.
      q_source: i32[N'], the original query head each query slot holds (0 for padding slots).
      q_valid: bool[N'], False for zero padding slots.
      kv_source: i32[K'], the original KV head each KV slot copies.
      vocab_shards: the devices the vocabulary splits over: tp, or pp * tp with pipeline stages.
    """

    tp: int
    q_source: np.ndarray
    q_valid: np.ndarray
    kv_source: np.ndarray
    vocab_shards: int

    @property
    def num_heads(self) -> int:
        return len(self.q_source)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_source)

    @property
    def heads_identity(self) -> bool:
        """True when heads need no padding, regrouping or replication."""
        return bool(self.q_valid.all() and (self.q_source == np.arange(self.num_heads)).all()
                    and (self.kv_source == np.arange(self.num_kv_heads)).all())

    def num_shards(self, name: str) -> int:
        """The devices a padded dimension of logical axis `name` splits over: `vocab_shards` for VOCAB, else tp."""
        return self.vocab_shards if name == VOCAB else self.tp

    def pad_size(self, size: int, name: str = MLP) -> int:
        """A dimension split over devices (MLP hidden, vocabulary), of logical axis `name`, padded to a multiple of
        `num_shards(name)`."""
        return -(-size // self.num_shards(name)) * self.num_shards(name)


def tp_layout(cfg: ModelConfig, tp: int, vocab_shards: int | None = None) -> TPLayout:
    """The padded head layout of `cfg` for `tp` ranks (identity when tp divides both head counts), with the
    vocabulary split over `vocab_shards` devices (default tp; a multiple of tp, pp * tp with pipeline stages).

    Raises:
      ValueError: tp < 1, tp larger than the number of query heads (ranks would hold only padding), or
        vocab_shards not a positive multiple of tp.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    vocab_shards = tp if vocab_shards is None else vocab_shards
    if not isinstance(vocab_shards, int) or vocab_shards < 1 or vocab_shards % tp:
        raise ValueError(f"vocab_shards={vocab_shards!r} must be a positive multiple of tp={tp}")
    N, K, G = cfg.num_heads, cfg.num_kv_heads, cfg.num_queries_per_kv
    if tp > N:
        extra = tp - N
        raise ValueError(f"tp={tp} is more than the model's {N} query heads: {extra} TP rank{'s' * (extra > 1)} "
                         f"would hold only padding; use tp <= {N}")
    best: tuple[int, int] | None = None  # (N', K')
    for k_slots in range(-(-K // tp) * tp, K * tp + 1, tp):
        per_slot = -(-G // (k_slots // K))  # a KV head with the fewest slots spreads G query heads over them
        key = (k_slots * per_slot, k_slots)
        best = key if best is None or key < best else best
    n_slots, k_slots = best
    per_slot = n_slots // k_slots
    base, extra = divmod(k_slots, K)
    kv_source, q_source, q_valid = [], [], []
    for head in range(K):
        slots = base + (head < extra)
        sizes = [G // slots + (j < G % slots) for j in range(slots)]  # as even as possible, each <= per_slot
        first = head * G
        for size in sizes:
            kv_source.append(head)
            q_source += list(range(first, first + size)) + [0] * (per_slot - size)
            q_valid += [True] * size + [False] * (per_slot - size)
            first += size
    return TPLayout(tp=tp, q_source=np.array(q_source, np.int32), q_valid=np.array(q_valid, bool),
                    kv_source=np.array(kv_source, np.int32), vocab_shards=vocab_shards)


def padded_config(cfg: ModelConfig, layout: TPLayout) -> ModelConfig:
    """The config of the padded model: N', K', and the split sizes rounded up to multiples of their devices."""
    changes: dict[str, Any] = dict(num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
                                   intermediate_size=layout.pad_size(cfg.intermediate_size),
                                   vocab_size=layout.pad_size(cfg.vocab_size, VOCAB))
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE widths, where the config has them
        if getattr(cfg, name, 0):
            changes[name] = layout.pad_size(getattr(cfg, name))
    return dataclasses.replace(cfg, **changes)


def _pad_axis(x: Any, axis: int, size: int, fill: float = 0.0) -> Any:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return (np if isinstance(x, np.ndarray) else jnp).pad(x, widths, constant_values=fill)


def _pad_quantized(q: QuantizedWeight, spec: Any, layout: TPLayout) -> QuantizedWeight:
    """`pad_weights` of one quantized weight, equal to quantizing the padded float weight with the same static
    fields (values moved, never requantized; see the module docstring), bit for bit (+-0 included).

    The scale (and int4's min) is handled with its group axis unflattened, [*kept, *contracted groups]: size 1 on
    every contracted axis for a per-channel scale (padding a contracted axis leaves each channel's absmax, so its
    scale, unchanged), and for a per-group scale the contracted axes with the last one counted in groups. Kept axes
    (and a grouped scale's leading contracted axes) are gathered or padded like the values, with scale 1 and min 0
    on zero slots. Packed formats (int4, mxfp4, nvfp4) pad their packed last axis in bytes of two codes. Zero slots
    hold what quantizing zeros gives: int4 code 8 (symmetric) or 0 (asymmetric); the sign of a zeroed query slot
    (the float path multiplies by 0, keeping -0) in fp8 / mxfp8 values and in E2M1 codes (code 8 is -0). nvfp4's
    tensor scale is per layer (and expert), axes padding never touches, and padding leaves each tensor's absmax.

    Raises:
      ValueError: a grouped (or packed) last contracted axis that would need a padding that is not a whole number
        of groups (or of bytes), or a head gather along it: the padded weight has no layout that equals the
        checkpoint's; or groups spanning more than the last contracted axis (a checkpoint's o_proj groups across
        heads) where padding is needed.

    A weight that needs no gather or padding (tp divides its heads and widths) is returned as it is, whatever its
    format or groups.
    """
    if layout.heads_identity and all(name not in (MLP, VOCAB) or layout.pad_size(n, name) == n
                                     for name, n in zip(spec.logical_axes, q.shape)):
        return q  # nothing is gathered or padded
    xp = np if isinstance(q.values, np.ndarray) else jnp
    nd, order, fmt = q.ndim, q._order(), q.format
    num_kept = nd - len(q.contract_axes)
    packed = fmt in PACKED_FORMATS
    zero_code = quant4.SYMMETRIC_ZERO * 0x11 if fmt == "int4" and q.min is None else 0  # a byte of two zero codes
    values = q.values
    contracted = [q.shape[a] for a in order[num_kept:]]
    if q.group_size and contracted[-1] % q.group_size:
        raise ValueError(f"a {fmt} weight of shape {q.shape} stored with group_size {q.group_size} cannot be "
                         f"padded for tp={layout.tp} (its groups span more than its last input axis); use a tp that "
                         "divides the heads, KV heads and MLP width, or one device")
    groups = (*contracted[:-1], contracted[-1] // q.group_size) if q.group_size else (1,) * len(contracted)
    fills = {"scale": 1.0, "min": 0.0}  # what a zero slot's group gets
    per_group = {k: getattr(q, k).reshape(*getattr(q, k).shape[:-1], *groups) for k in fills
                 if getattr(q, k) is not None}

    def where_padding(x: Any, mask: np.ndarray, axis: int, fill: Any) -> Any:
        shape = [1] * x.ndim
        shape[axis] = -1
        return xp.where(mask.reshape(shape), x, fill)

    for own_axis, name in enumerate(spec.logical_axes):
        pos = order.index(own_axis)  # the axis in values and in the unflattened scale
        last = pos == nd - 1
        grouped_last = bool(q.group_size) and last
        moves = {k: a.shape[pos] == values.shape[pos] and not grouped_last for k, a in per_group.items()}
        if name in (HEADS, KV_HEADS) and not layout.heads_identity:
            if grouped_last or (packed and last):
                raise ValueError(f"cannot pad a per-group or packed quantized weight along its grouped {name} axis")
            source = layout.q_source if name == HEADS else layout.kv_source
            values = xp.take(values, source, axis=pos)
            per_group = {k: xp.take(a, source, axis=pos) if moves[k] else a for k, a in per_group.items()}
            if name == HEADS:  # zero query slots: what quantizing the float path's w * 0 gives
                if fmt == "int4":
                    zeroed = xp.asarray(zero_code, values.dtype)
                elif packed:  # E2M1 +-0: the sign bits of both codes
                    zeroed = values & xp.asarray(0x88, values.dtype)
                else:
                    zeroed = values * xp.zeros((), values.dtype)
                values = where_padding(values, layout.q_valid, pos, zeroed)
                per_group = {k: where_padding(a, layout.q_valid, pos, xp.asarray(fills[k], a.dtype)) if moves[k]
                             else a for k, a in per_group.items()}
        elif name in (MLP, VOCAB):
            width = 2 if packed and last else 1  # codes per byte along this axis of values
            length = values.shape[pos] * width
            size = layout.pad_size(length, name)
            extra = size - length
            if not extra:
                continue
            if (grouped_last and extra % q.group_size) or extra % width:
                shards = layout.num_shards(name)
                over = ("tp", f"tp={shards}") if shards == layout.tp else ("pp x tp", f"pp x tp = {shards}")
                raise ValueError(f"a weight quantized {fmt} with group_size {q.group_size} along its {name} axis of "
                                 f"size {length} cannot be padded to {size} for {over[1]} (not whole groups or "
                                 f"bytes); use a {over[0]} that divides {length}, a per-channel quantization, or "
                                 f"quantize at load instead of from a quantized checkpoint")
            values = _pad_axis(values, pos, size // width, fill=zero_code)
            for k, a in per_group.items():
                if grouped_last:
                    per_group[k] = _pad_axis(a, pos, a.shape[pos] + extra // q.group_size, fill=fills[k])
                elif moves[k]:
                    per_group[k] = _pad_axis(a, pos, size, fill=fills[k])
    return q.replace(values=values, **{k: a.reshape(*a.shape[:num_kept], -1) for k, a in per_group.items()})


def pad_weights(weights: Any, specs: Any, layout: TPLayout) -> Any:
    """Applies `layout` to every weight by its logical axes (numpy in, numpy out; jax arrays in, jax out).

    Args:
      weights: a weight pytree (e.g. `models.llama.Weights`) of the unpadded model; leaves may be
        `models.quant.QuantizedWeight`s (padded by `_pad_quantized`: exactly what quantizing the padded float
        weight gives).
      specs: the same tree of objects with `.shape` and `.logical_axes` (`Weights.abstract(cfg)`).
      layout: from `tp_layout`.

    Returns:
      The padded tree: HEADS axes gathered by `q_source` and zeroed where not `q_valid`, KV_HEADS axes gathered
      by `kv_source`, MLP and VOCAB axes zero-padded to multiples of tp and `vocab_shards`.

    Raises:
      ValueError: from `_pad_quantized` (a per-group quantized weight that cannot keep whole groups).
    """
    def one(spec: Any, w: Any) -> Any:
        if w is None:
            return None
        if isinstance(w, QuantizedWeight):
            return _pad_quantized(w, spec, layout)
        xp = np if isinstance(w, np.ndarray) else jnp
        for axis, name in enumerate(spec.logical_axes):
            if name == HEADS and not layout.heads_identity:
                w = xp.take(w, layout.q_source, axis=axis)
                shape = [1] * w.ndim
                shape[axis] = -1
                w = w * layout.q_valid.reshape(shape).astype(w.dtype)
            elif name == KV_HEADS and not layout.heads_identity:
                w = xp.take(w, layout.kv_source, axis=axis)
            elif name in (MLP, VOCAB):
                w = _pad_axis(w, axis, layout.pad_size(w.shape[axis], name))
        return w

    return jax.tree.map(one, specs, weights, is_leaf=lambda x: x is None or hasattr(x, "logical_axes"))


def check_mesh(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> None:
    """Refuses meshes this model cannot be served on, naming the numbers.

    Raises:
      ValueError: tp larger than the query heads (from `tp_layout`), ep > 1 on a dense model, or experts not a
        multiple of ep.
    """
    tp_layout(cfg, mesh.shape[TP_AXIS])
    ep = mesh.shape[EP_AXIS]
    experts = getattr(cfg, "num_experts", 0)
    if ep > 1 and not experts:
        raise ValueError(f"expert_parallel_size={ep} needs an MoE model; this model ({cfg.architecture}) is dense")
    if experts and experts % ep:
        raise ValueError(f"num_experts={experts} is not a multiple of expert_parallel_size={ep}")


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """A model placed on a mesh.

    Attributes:
      cfg: the padded config the forward pass runs with (`padded_config`).
      original: the checkpoint's config (vocabulary and head counts as trained).
      weights: the padded weights, each with its `NamedSharding`.
      mesh: the mesh.
      layout: the TP head layout.
    """

    cfg: ModelConfig
    original: ModelConfig
    weights: Any
    mesh: jax.sharding.Mesh
    layout: TPLayout

    def kv_cache_sharding(self) -> NamedSharding:
        """The KV cache's sharding: split over (padded) KV heads."""
        return NamedSharding(self.mesh, logical_to_spec(KVCache.LOGICAL_AXES, mesh_rules(self.mesh)))


def shard_model(cfg: ModelConfig, weights: Any, mesh: jax.sharding.Mesh) -> ShardedModel:
    """Pads a model for the mesh's tp size and places every weight with the sharding its logical axes give.

    Args:
      cfg: the checkpoint's config.
      weights: `models.llama.Weights` of numpy arrays (host) or jax arrays (e.g. restored sharded by orbax into
        `sharding.placement.replicated_where_indivisible` shardings; padding then runs on device). Leaves may be
        `models.quant.QuantizedWeight`s (a quantized checkpoint): they are padded exactly and their values and
        scales placed as `models.quant_sharding.quantize_sharded` places them; a tied model may then carry its own
        `lm_head` (see `Weights.abstract`'s `separate_head`).
      mesh: from `sharding.mesh.make_mesh`.

    Raises:
      ValueError: from `check_mesh`, or from `pad_weights` for a per-group quantized weight that cannot be padded.
    """
    check_mesh(cfg, mesh)
    vocab_shards = mesh_axes_size(mesh, logical_to_spec((VOCAB,), mesh_rules(mesh))[0])  # tp, or pp * tp
    layout = tp_layout(cfg, mesh.shape[TP_AXIS], vocab_shards)
    padded_cfg = padded_config(cfg, layout)
    separate_head = cfg.tie_word_embeddings and weights.lm_head is not None
    specs = Weights.abstract(cfg, separate_head)
    is_spec = lambda x: hasattr(x, "logical_axes")  # noqa: E731
    own = jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.logical_axes, mesh_rules(mesh))),
                       Weights.abstract(padded_cfg, separate_head), is_leaf=is_spec)
    pad = lambda w: pad_weights(w, specs, layout)  # noqa: E731
    target = jax.tree.map(lambda sharding, a: quantized_sharding(sharding, a) if isinstance(a, QuantizedWeight)
                          else sharding, own, jax.eval_shape(pad, weights))
    host = all(isinstance(x, np.ndarray) for x in jax.tree.leaves(weights))
    if host:
        placed = put_sharded(pad(weights), target)
    else:
        placed = jax.jit(pad, out_shardings=target)(weights)
    return ShardedModel(cfg=padded_cfg, original=cfg, weights=placed, mesh=mesh, layout=layout)
