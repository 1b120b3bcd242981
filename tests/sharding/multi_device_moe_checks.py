"""Expert-parallel checks that need 8 devices: run by `test_sharding.py` in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.

Expected collectives, written down from the design of `models.moe.moe_block` before reading any HLO: tokens are
replicated, so the expert exchange is a local selection and the MoE block ends in exactly ONE all-reduce (the
psum over ("ep", "tp")) per layer, the shared expert included. Attention adds one all-reduce per layer when
tp > 1 (the output projection contracts the tp-split heads) and none when tp = 1; the vocabulary-split embedding
lookup adds one when tp > 1. So an unrolled L-layer step has L all-reduces at tp = 1 (any ep > 1), 2L + 1 at
tp = 2, and none on a one-device mesh; no all-gather, all-to-all or collective-permute anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer.loading.hf import load_hf_weights
from models import moe
from models.config import ModelConfig
from models.llama import KVCache, Weights, forward
from sharding.mesh import make_mesh
from sharding.rules import logical_to_spec, named_shardings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_device_checks import NUM_PAGES, PAGE_SIZE, _batch  # noqa: E402  (the same two-prefill batch)

DATA = Path(__file__).resolve().parents[1] / "data"
MESHES = [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2)]  # (ep, tp)


def _is_spec(x) -> bool:
    return hasattr(x, "logical_axes")


@functools.cache
def _model(name: str) -> tuple[ModelConfig, Weights]:
    if name == "qwen2_moe_fs36":  # shared width 36: 36 / tp=2 = 18 is not a multiple of ep=4 (ep rank 0 adds it)
        cfg, _ = _model("tiny_qwen2_moe")
        cfg = dataclasses.replace(cfg, shared_expert_intermediate_size=36, name=name)
        rng = np.random.default_rng(3)  # numpy, not init_weights: eager jax.random costs seconds per shape here
        specs = Weights.abstract(cfg)
        return cfg, jax.tree.map(lambda s: np.ones(s.shape, np.float32) if s.init_scale is None else
                                 (s.init_scale * rng.normal(size=s.shape)).astype(np.float32), specs, is_leaf=_is_spec)
    cfg, weights = load_hf_weights(DATA / name)
    return cfg, jax.tree.map(np.asarray, weights)


STEP = jax.jit(forward, static_argnames=("cfg", "mesh", "scan_layers"))


def _placed(cfg: ModelConfig, weights: Weights, mesh: jax.sharding.Mesh) -> tuple[Weights, KVCache]:
    sharded = jax.device_put(weights, named_shardings(Weights.abstract(cfg), mesh, is_leaf=_is_spec))
    cache_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.device_put(KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE), KVCache(k=cache_sharding, v=cache_sharding))
    return sharded, cache


@functools.cache
def _single_device_logits(name: str) -> np.ndarray:
    cfg, weights = _model(name)
    tokens, meta = _batch(cfg.vocab_size)
    logits, _ = STEP(weights, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE), cfg=cfg)
    return np.asarray(logits)


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("ep, tp", MESHES)
def test_mixtral_logits_equal_single_device_and_expert_shards_are_real(ep, tp):
    cfg, weights = _model("tiny_mixtral")
    mesh = make_mesh(tp=tp, ep=ep)
    sharded, cache = _placed(cfg, weights, mesh)
    L, D, E, Fe = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    layers = sharded.layers
    assert layers.e_gate.addressable_shards[0].data.shape == (L, E // ep, D, Fe // tp)
    assert layers.e_up.addressable_shards[0].data.shape == (L, E // ep, D, Fe // tp)
    assert layers.e_down.addressable_shards[0].data.shape == (L, E // ep, Fe // tp, D)
    assert layers.router.addressable_shards[0].data.shape == (L, D, E)  # replicated: every rank routes
    assert len(layers.e_gate.sharding.device_set) == ep * tp
    # Each device holds a different block of experts x hidden columns: the ep*tp shards tile the weight.
    blocks = {tuple((s.start, s.stop) for s in shard.index[1:4:2]) for shard in layers.e_gate.addressable_shards}
    assert len(blocks) == ep * tp
    tokens, meta = _batch(cfg.vocab_size)
    got, new_cache = STEP(sharded, tokens, meta, cache, cfg=cfg, mesh=mesh)
    assert new_cache.k.sharding.is_equivalent_to(cache.k.sharding, 5)
    np.testing.assert_allclose(np.asarray(got), _single_device_logits("tiny_mixtral"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, ep, tp", [("tiny_mixtral", 4, 2), ("tiny_qwen2_moe", 4, 2), ("tiny_qwen2_moe", 8, 1),
                                          ("qwen2_moe_fs36", 4, 2), ("tiny_qwen3_moe", 4, 2)])
def test_scanned_layers_and_shared_expert_equal_single_device(name, ep, tp):
    cfg, weights = _model(name)
    mesh = make_mesh(tp=tp, ep=ep)
    sharded, cache = _placed(cfg, weights, mesh)
    if cfg.shared_expert_intermediate_size:
        assert sharded.layers.s_gate.addressable_shards[0].data.shape == (
            cfg.num_layers, cfg.hidden_size, cfg.shared_expert_intermediate_size // tp)
    tokens, meta = _batch(cfg.vocab_size)
    got, _ = STEP(sharded, tokens, meta, cache, cfg=cfg, mesh=mesh, scan_layers=True)
    np.testing.assert_allclose(np.asarray(got), _single_device_logits(name), rtol=1e-4, atol=1e-4)


# --- the collectives in the compiled step ---------------------------------------------------------------------------

def _collectives(hlo: str, op: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(rf"= \S+ {op}(-start)?\(", line)]


def _result_shape(line: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if d)


COUNT_CASES = ([("tiny_mixtral", ep, tp, False) for ep, tp in MESHES]
               + [("tiny_qwen2_moe", ep, tp, False) for ep, tp in MESHES if ep * tp > 1]
               + [(name, ep, tp, True) for name in ("tiny_mixtral", "tiny_qwen2_moe") for ep, tp in [(8, 1), (4, 2)]])


@pytest.mark.parametrize("name, ep, tp, scan", COUNT_CASES)
def test_exactly_one_all_reduce_per_moe_layer_and_no_expert_all_gather(name, ep, tp, scan):
    cfg, weights = _model(name)
    mesh = make_mesh(tp=tp, ep=ep)
    sharded, cache = _placed(cfg, weights, mesh)
    tokens, meta = _batch(cfg.vocab_size)
    hlo = STEP.lower(sharded, tokens, meta, cache, cfg=cfg, mesh=mesh, scan_layers=scan).compile().as_text()
    L = 1 if scan else cfg.num_layers  # layers in the program: a scanned layer is one loop body
    all_reduces = _collectives(hlo, "all-reduce")
    moe_all_reduces = [line for line in all_reduces if "/moe/" in line]
    if ep * tp == 1:
        assert not all_reduces
    else:
        assert len(moe_all_reduces) == L, moe_all_reduces  # one psum per MoE layer, shared expert included
        assert len(all_reduces) == (2 * L + 1 if tp > 1 else L), [line.strip()[:160] for line in all_reduces]
    specs = Weights.abstract(cfg).layers
    expert_shapes = {getattr(specs, f).shape for f in ("e_gate", "e_up", "e_down")}
    expert_shapes |= {shape[1:] for shape in expert_shapes} | {shape[2:] for shape in expert_shapes}
    all_shapes = {s.shape for s in jax.tree.leaves(Weights.abstract(cfg), is_leaf=_is_spec)}
    all_shapes |= {shape[1:] for shape in all_shapes}
    for line in _collectives(hlo, "all-gather"):
        assert _result_shape(line) not in expert_shapes | all_shapes, f"a whole weight is gathered: {line[:160]}"
        assert "/moe/" not in line, f"an all-gather inside the MoE block: {line.strip()[:160]}"
    for op in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        assert not _collectives(hlo, op), (op, _collectives(hlo, op)[:2])


def test_indivisible_expert_splits_are_refused_naming_the_numbers():
    cfg, weights = _model("tiny_mixtral")
    layer = jax.tree.map(lambda a: a[0], weights.layers)
    h = np.zeros((4, cfg.hidden_size), np.float32)
    six = dataclasses.replace(cfg, num_experts=6)
    layer6 = dataclasses.replace(layer, router=layer.router[:, :6], e_gate=layer.e_gate[:6], e_up=layer.e_up[:6],
                                 e_down=layer.e_down[:6])
    with pytest.raises(ValueError, match=r"num_experts = 6 is not a multiple of ep = 4"):
        jax.eval_shape(functools.partial(moe.moe_block, cfg=six, mesh=make_mesh(ep=4)), h, layer6)
    with pytest.raises(ValueError, match=r"experts = 6 is not a multiple of ep = 4"):
        named_shardings(Weights.abstract(six), make_mesh(ep=4), is_leaf=_is_spec)
    with pytest.raises(ValueError, match=r"moe_intermediate_size = 32 is not a multiple of tp = 3"):
        jax.eval_shape(functools.partial(moe.moe_block, cfg=cfg, mesh=make_mesh(tp=3)), h, layer)
    with pytest.raises(ValueError, match=r"lack \['ep'\]"):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
        jax.eval_shape(functools.partial(moe.moe_block, cfg=cfg, mesh=mesh), h, layer)
