"""Pipeline-parallel checks that need 8 devices (run by `test_sharding.py` in a child process, see
multi_device_checks.py): `pipeline_forward` against the one-device `forward` (a tiny Llama, Gemma 2 / 3's per-layer
windows, MoE experts split inside each stage), where each stage's weights and KV pages live, and whole engines at
pp = 2, 4, pp = 2 x tp = 2 and pp = 2 x ep = 2 x tp = 2 against pp = 1 token for token, each device holding its own
1 / (pp * tp) of the vocabulary; orbax checkpoints (float and quantized, an int8 table among them) restored straight
into the stage layout: what each device was asked to read, what it holds, and engines on them against pp = 1."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.llm import LLM
from jaxinfer.loading import convert, load_model
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.sampling_params import SamplingParams
from models.llama import AttentionMetadata, KVCache, forward, init_weights
from models.partition import shard_model
from models.pipeline import pad_layers, pipeline_forward, stage_layout, staged_config, stages_from_blocks
from models.quant import QuantizedWeight
from sharding.mesh import PP_AXIS, TP_AXIS, make_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jaxinfer" / "engine"))
from multi_device_checks import NUM_PAGES, PAGE_SIZE, TINY, _batch  # noqa: E402  (two prefills of 6 and 5 tokens)
from tiny_model import make_tiny_model_dir, random_prompts  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"


def _padded_batch(extra: int = 5):
    """`_batch` plus `extra` padding rows (16 rows: micro-batches of 4 cut the 6-token sequence at row 4)."""
    tokens, meta = _batch()
    pad = lambda a: np.concatenate([a, np.zeros(extra, np.int32)])  # noqa: E731  (padding writes the null page)
    return pad(tokens), meta.replace(positions=pad(meta.positions), kv_loc=pad(meta.kv_loc))


# 3 layers over 2 stages (2 + 1) in 4 micro-batches of 4 rows (the 6-token sequence straddles two); 5 layers over
# 4 stages (2 + 1 + 1 + 1) of tp = 2 devices each, in 2 micro-batches (fewer than stages: bubbles, still exact).
@pytest.mark.parametrize("num_layers,pp,tp,micro", [(3, 2, 1, 4), (5, 4, 2, 2)])
def test_pipeline_forward_equals_forward_and_stages_hold_their_layers(num_layers, pp, tp, micro):
    cfg = dataclasses.replace(TINY, num_layers=num_layers)
    weights = init_weights(cfg, jax.random.key(num_layers))
    tokens, meta = _padded_batch()
    want, want_cache = jax.jit(forward, static_argnames="cfg")(
        weights, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE), cfg=cfg)

    layout = stage_layout(num_layers, pp)
    mesh = make_mesh(tp=tp, pp=pp)
    model = shard_model(staged_config(cfg, layout), jax.tree.map(np.asarray, pad_layers(weights, layout)), mesh)
    sharding = model.kv_cache_sharding()
    cache = jax.device_put(KVCache.zeros(model.cfg, NUM_PAGES, PAGE_SIZE), KVCache(sharding, sharding))
    step = jax.jit(functools.partial(pipeline_forward, cfg=model.cfg, mesh=mesh, num_microbatches=micro))
    got, got_cache = step(model.weights, tokens, meta, cache)
    # another order of the same f32 sums (micro-batches of other row counts, tp partial sums): rounding only
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    source = layout.source()
    for slot, layer in enumerate(source):  # every real layer's K/V where its slot is; padding slots stay zero
        expected = np.asarray(want_cache.k[layer]) if layer >= 0 else 0
        np.testing.assert_allclose(np.asarray(got_cache.k[slot]), expected, rtol=1e-5, atol=1e-5)

    slots = layout.layers_per_stage
    for s in range(pp):  # stage s's devices hold slots [s * S, (s + 1) * S) of every layer leaf and of the cache
        devices = set(mesh.devices[s].flat)
        for leaf in (*jax.tree.leaves(model.weights.layers), got_cache.k, got_cache.v):
            shards = [x for x in leaf.addressable_shards if x.device in devices]
            assert len(shards) == tp and all(x.index[0] == slice(s * slots, (s + 1) * slots) for x in shards)
    assert got_cache.k.sharding.spec[0] == PP_AXIS


def test_pipeline_forward_compiles_and_agrees_in_bfloat16():
    """Found by a fresh-user trial: a bf16 psum of the logits over the stages aborted XLA:CPU's compiler (the
    process died); the logits are now summed in f32."""
    cfg = dataclasses.replace(TINY, num_layers=3)
    weights = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                           init_weights(cfg, jax.random.key(3)))
    tokens, meta = _padded_batch()
    want, _ = jax.jit(forward, static_argnames="cfg")(
        weights, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE, jnp.bfloat16), cfg=cfg)
    layout, mesh = stage_layout(3, 2), make_mesh(pp=2)
    model = shard_model(staged_config(cfg, layout), jax.tree.map(np.asarray, pad_layers(weights, layout)), mesh)
    sharding = model.kv_cache_sharding()
    cache = jax.device_put(KVCache.zeros(model.cfg, NUM_PAGES, PAGE_SIZE, jnp.bfloat16), KVCache(sharding, sharding))
    got, _ = jax.jit(functools.partial(pipeline_forward, cfg=model.cfg, mesh=mesh, num_microbatches=4))(
        model.weights, tokens, meta, cache)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0.05, atol=0.05)


def _long_batch(length: int = 28, rows: int = 32):
    """One prefill of `length` tokens on pages 1, 2, ... (longer than Gemma 2's window of 8 and Gemma 3's of 20),
    padded to `rows` rows."""
    pages = np.arange(1, -(-length // PAGE_SIZE) + 1, dtype=np.int32)
    pad = np.zeros(rows - length, np.int32)
    meta = AttentionMetadata(positions=np.concatenate([np.arange(length, dtype=np.int32), pad]),
                             cu_q_lens=np.array([0, length], np.int32), kv_lens=np.array([length], np.int32),
                             page_table=pages[None], kv_loc=np.concatenate([np.arange(length, dtype=np.int32)
                                                                            + PAGE_SIZE, pad]),
                             logits_indices=np.arange(length, dtype=np.int32), max_q_len=rows)
    return np.concatenate([np.arange(length, dtype=np.int32) * 5 % 128, pad]), meta


# Gemma 3 (7 layers, local but layer 5): stage 1 holds layers 4, 5, 6 and a padding slot; Gemma 2 (4 layers,
# local / global alternating) over 3 stages: slots [0 1 | 2 pad | 3 pad], so stage 2's first slot is global.
@pytest.mark.parametrize("name,pp,tp", [("tiny_gemma3", 2, 1), ("tiny_gemma3", 2, 2), ("tiny_gemma2", 3, 1)])
def test_pipeline_forward_gives_each_layer_its_own_window(name, pp, tp):
    cfg, weights = load_hf_weights(DATA / name)
    weights = jax.tree.map(np.asarray, weights)
    tokens, meta = _long_batch()
    run = jax.jit(forward, static_argnames="cfg")
    want, _ = run(weights, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE), cfg=cfg)
    global_only = dataclasses.replace(cfg, layer_sliding_windows=None)  # the windows matter in this batch
    other, _ = run(weights, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE), cfg=global_only)
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-2

    layout, mesh = stage_layout(cfg.num_layers, pp), make_mesh(tp=tp, pp=pp)
    model = shard_model(staged_config(cfg, layout), pad_layers(weights, layout), mesh)
    sharding = model.kv_cache_sharding()
    cache = jax.device_put(KVCache.zeros(model.cfg, NUM_PAGES, PAGE_SIZE), KVCache(sharding, sharding))
    got, _ = jax.jit(functools.partial(pipeline_forward, cfg=model.cfg, mesh=mesh, num_microbatches=4))(
        model.weights, tokens, meta, cache)
    got = np.asarray(got)  # the vocabulary splits over pp x tp: 128 ids padded to 129 over 3 stages, logit 0
    np.testing.assert_array_equal(got[:, cfg.vocab_size:], 0)
    np.testing.assert_allclose(got[:, :cfg.vocab_size], np.asarray(want), rtol=1e-5, atol=1e-5)


def _collectives(hlo: str, op: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(rf"= \S+ {op}(-start)?\(", line)]


# 2 layers over 2 stages, each stage's experts over its ep x tp devices (the shared expert over tp x ep too)
@pytest.mark.parametrize("name,ep,tp", [("tiny_qwen2_moe", 2, 2), ("tiny_mixtral", 4, 1)])
def test_pipeline_forward_runs_moe_experts_inside_each_stage(name, ep, tp):
    cfg, weights = load_hf_weights(DATA / name)
    weights = jax.tree.map(np.asarray, weights)
    tokens, meta = _padded_batch()
    want, _ = jax.jit(forward, static_argnames="cfg")(weights, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE),
                                                      cfg=cfg)
    layout, mesh = stage_layout(cfg.num_layers, 2), make_mesh(tp=tp, ep=ep, pp=2)
    model = shard_model(staged_config(cfg, layout), pad_layers(weights, layout), mesh)
    e_gate = model.weights.layers.e_gate  # [L, E, D, Fe]: a device holds 1 layer, E / ep experts, Fe / tp columns
    assert e_gate.addressable_shards[0].data.shape == (1, cfg.num_experts // ep, cfg.hidden_size,
                                                       cfg.moe_intermediate_size // tp)
    sharding = model.kv_cache_sharding()
    cache = jax.device_put(KVCache.zeros(model.cfg, NUM_PAGES, PAGE_SIZE), KVCache(sharding, sharding))
    step = jax.jit(functools.partial(pipeline_forward, cfg=model.cfg, mesh=mesh, num_microbatches=4)).lower(
        model.weights, tokens, meta, cache).compile()
    # checked before it runs: the expert block's own shard_map gives one all-reduce in the scanned layer's MoE
    # block and no collective-permute but the stages' ppermute (left to XLA's partitioner, the block got one inside
    # the stage's cond, and XLA:CPU deadlocked)
    hlo = step.as_text()
    assert len([line for line in _collectives(hlo, "all-reduce") if "/moe/" in line]) == 1
    assert len(_collectives(hlo, "collective-permute")) == 1 and not _collectives(hlo, "all-gather")
    got, _ = step(model.weights, tokens, meta, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_pipeline_mesh_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"pp=4 x dp=1 x ep=1 x tp=4 = 16 devices needs more than the 8"):
        make_mesh(tp=4, pp=4)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        stage_layout(2, 3)


# 10 layers over 8 stages: blocks of 2 hold layers 0-9 in stages 0-4, the stages hold 2, 2, then 1 each: layers move
# 0 to 3 stages on (four ppermute shifts); 10 over 4 x tp 2; 7 over 2 x tp 4 (the layouts agree: nothing moves)
@pytest.mark.parametrize("num_layers,pp,tp", [(10, 8, 1), (10, 4, 2), (7, 2, 4)])
def test_stages_from_blocks_moves_every_layer_to_its_stage(num_layers, pp, tp):
    layout, mesh = stage_layout(num_layers, pp), make_mesh(tp=tp, pp=pp)
    stack = np.random.default_rng(0).standard_normal((num_layers, 3, 4)).astype(np.float32)
    blocks = np.zeros((layout.padded_layers, 3, 4), np.float32)
    blocks[:num_layers] = stack
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(PP_AXIS, None, "tp"))
    tree = {"f32": jax.device_put(blocks, sharding), "i8": jax.device_put(blocks.astype(np.int8), sharding)}
    moved = stages_from_blocks(tree, layout)
    source = layout.source()
    want = np.where((source >= 0)[:, None, None], stack[np.maximum(source, 0)], 0)  # slot i: layer source[i]
    for x in moved.values():
        assert x.sharding == sharding
        np.testing.assert_array_equal(np.asarray(x), want.astype(x.dtype))
    if (source != layout.blocks()).any():  # an array not split over the stages is refused
        with pytest.raises(ValueError, match="split over 'pp' on axis 0"):
            stages_from_blocks([jax.device_put(blocks)], layout)


# --- engines: a 5-layer tiny Llama (uneven stages) ---------------------------------------------------------------

NUM_LAYERS = 5
SHARED = random_prompts(1, seed=3, min_len=20, max_len=20)[0]  # a shared 20-token prefix: two full pages of 8
TAILS = random_prompts(5, seed=4, min_len=3, max_len=24)
PROMPTS = [{"prompt_token_ids": SHARED + t} for t in TAILS]
PARAMS = ([SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)] * 3
          + [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=6, ignore_eos=True) for i in range(2)])


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory) -> Path:
    """tiny_llama3 with 5 layers: layer i is its layer 0 plus noise (norms kept), so no two layers are equal."""
    root = make_tiny_model_dir(tmp_path_factory.mktemp("tiny5"))
    tensors, cfg = load_file(str(root / "model.safetensors")), json.loads((root / "config.json").read_text())
    rng, out = np.random.default_rng(0), {}
    for name, w in tensors.items():
        if not name.startswith("model.layers."):
            out[name] = w
        elif name.startswith("model.layers.0."):
            for i in range(NUM_LAYERS):
                noisy = w if "norm" in name else w + 0.5 * w.std() * rng.standard_normal(w.shape)
                out[name.replace("layers.0.", f"layers.{i}.")] = np.ascontiguousarray(noisy, np.float32)
    save_file(out, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": NUM_LAYERS}))
    return root


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Engine folders of tests/data/tiny_gemma3 and tiny_qwen2_moe with tiny_model's word-level tokenizer over the
    same 128 ids."""
    out = {}
    for name in ("tiny_gemma3", "tiny_qwen2_moe"):
        root = make_tiny_model_dir(tmp_path_factory.mktemp(name))
        for f in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(DATA / name / f, root / f)
        out[name] = root
    return out


VOCAB_SPLIT = (PP_AXIS, TP_AXIS)  # the vocabulary's mesh axes with pipeline stages (sharding.rules.PIPELINE_RULES)


def _vocab_blocks(mesh: jax.sharding.Mesh, vocab_size: int) -> tuple[int, dict]:
    """(V' / (pp * tp) rows a device holds, device -> its block s * tp + r (stage s, TP rank r)): V' is vocab_size
    padded to a multiple of pp * tp."""
    shards = mesh.shape[PP_AXIS] * mesh.shape[TP_AXIS]
    block = {d: int(i[0]) * mesh.shape[TP_AXIS] + int(i[-1]) for i, d in np.ndenumerate(mesh.devices)}
    return -(-vocab_size // shards), block


def _assert_vocab_split(weights, mesh: jax.sharding.Mesh, vocab_size: int) -> None:
    """Each device holds its own V' / (pp * tp) rows of the embedding table and columns of a separate LM head (the
    values and scales alike of a quantized one, whose vocabulary axis comes first)."""
    rows, block = _vocab_blocks(mesh, vocab_size)
    tables = [weights.embed] + ([] if weights.lm_head is None else [weights.lm_head])
    arrays = [a for t in tables for a in ((t.values, t.scale) if isinstance(t, QuantizedWeight) else (t,))]
    assert len(arrays) >= 1 + (weights.lm_head is not None)
    for a in arrays:
        axis = list(a.sharding.spec).index(VOCAB_SPLIT)  # [V', ...], or a float head's [D, V']
        assert a.shape[axis] == rows * len(set(block.values()))
        for shard in a.addressable_shards:
            b = block[shard.device]
            assert shard.data.shape[axis] == rows and shard.index[axis] == slice(b * rows, (b + 1) * rows)


@functools.cache
def _run(root: Path, pp: int, tp: int, ep: int = 1) -> tuple[list[list[int]], list[int], int]:
    """(token ids of every request, cached prompt tokens per request, preemptions) of one engine: the first two
    prompts alone (they fill the prefix cache), then all five in 16-token steps (chunked prefill beside decodes)
    with 10 free pages of 8 tokens, too few for all at their longest (preemption)."""
    llm = LLM(str(root), pipeline_parallel_size=pp, tensor_parallel_size=tp, expert_parallel_size=ep,
              dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=16, page_size=8,
              kv_cache_memory_bytes=2 << 20)
    num_layers = llm.engine.model_config.num_layers  # the model's own (an HF folder or an orbax checkpoint)
    assert llm.runner.cfg.num_layers == pp * -(-num_layers // pp)
    if pp > 1:
        _assert_vocab_split(llm.runner.weights, llm.engine.mesh, llm.engine.model_config.vocab_size)
    first = llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
    alloc = llm.page_allocator
    held = alloc.allocate(alloc.num_free_pages - 10)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        alloc.free(held)
    tokens = [o.outputs[0].token_ids for o in first + outs]
    return tokens, [o.num_cached_tokens for o in outs], llm.engine.scheduler.num_preemptions


@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 1), (2, 2)])
def test_engine_tokens_equal_one_stage(five_layers, pp, tp):
    want = _run(five_layers, 1, 1)
    assert max(want[1]) >= 16 and want[2] > 0  # the prefix cache hit and a sequence was preempted
    assert _run(five_layers, pp, tp) == want


# Gemma 3's 7 layers over 2 stages (4 + 3): prompts of 23-44 tokens and their decodes reach past its window of 20
@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_engine_tokens_with_per_layer_windows_equal_one_stage(family_dirs, pp, tp):
    want = _run(family_dirs["tiny_gemma3"], 1, 1)
    assert max(want[1]) >= 16 and want[2] > 0
    assert _run(family_dirs["tiny_gemma3"], pp, tp) == want


# Qwen2-MoE's 2 layers over 2 stages, the experts of each stage over its ep x tp devices
@pytest.mark.parametrize("pp,ep,tp", [(2, 1, 1), (2, 2, 2)])
def test_engine_tokens_of_moe_model_equal_one_stage(family_dirs, pp, ep, tp):
    want = _run(family_dirs["tiny_qwen2_moe"], 1, 1)
    assert max(want[1]) >= 16 and want[2] > 0
    assert _run(family_dirs["tiny_qwen2_moe"], pp, tp, ep) == want


def test_engine_refuses_more_stages_than_layers(five_layers):
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=8 is more than the model's {NUM_LAYERS} layers"):
        LLM(str(five_layers), pipeline_parallel_size=8, warmup=False)
    with pytest.raises(ValueError, match="pp=4 x dp=1 x ep=1 x tp=4 = 16 devices"):
        LLM(str(five_layers), pipeline_parallel_size=4, tensor_parallel_size=4, warmup=False)


# --- orbax checkpoints restored into the stage layout --------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(five_layers, tmp_path_factory):
    """quantization (None: float32) -> the 5-layer model converted to an orbax checkpoint, once each."""
    cache: dict = {}

    def get(quantization: str | None) -> Path:
        if quantization not in cache:
            cache[quantization] = convert(five_layers, tmp_path_factory.mktemp("ckpt") / "c", quantization=quantization)
        return cache[quantization]

    return get


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


# int4 layers with an int8 embedding table and LM head (per-row scales, which split with their rows)
INT4_INT8_TABLE = '{"format": "int4", "embedding_format": "int8"}'


# 5 layers: pp = 2 holds 3 + 2 (the block layout is the stage layout); pp = 4 holds 2 + 1 + 1 + 1 in slots of 2,
# whose blocks hold layers 0-1, 2-3, 4, none: layers 2-4 move to later stages on device
@pytest.mark.parametrize("quantization,pp,tp", [(None, 2, 1), (None, 4, 2), (INT4_INT8_TABLE, 4, 1)],
                         ids=["f32-pp2", "f32-pp4-tp2", "int4-int8table-pp4"])
def test_checkpoint_restores_straight_into_the_stage_layout(checkpoints, quantization, pp, tp, monkeypatch):
    ckpt = checkpoints(quantization)
    cfg, host, _ = load_model(ckpt, np.dtype(np.float32))
    layout, mesh = stage_layout(NUM_LAYERS, pp), make_mesh(tp=tp, pp=pp)
    asked = []  # the restore arguments orbax received: what each device reads
    restore = ocp.PyTreeCheckpointer.restore
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", lambda self, directory, args: asked.append(
        args.restore_args) or restore(self, directory, args=args))
    _, restored, _ = load_model(ckpt, np.dtype(np.float32), mesh=mesh)

    slots = layout.layers_per_stage
    stage_of = {d: s for s in range(pp) for d in mesh.devices[s].flat}
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(ckpt / "weights").item_metadata.tree["layers"]
    layer_args = [a for args in asked for a in jax.tree.leaves(args["layers"])] if asked else []
    assert len(layer_args) == len(jax.tree.leaves(stored))
    for args in layer_args:  # stage s reads at most the checkpoint's layers [s * S, (s + 1) * S)
        assert args.global_shape[0] == pp * slots and not args.strict
        for device, index in args.sharding.devices_indices_map(tuple(args.global_shape)).items():
            s = stage_of[device]
            assert index[0] == slice(s * slots, (s + 1) * slots)
    # one storage chunk per layer: a read of some layers reads only those
    assert all(a.storage.chunk_shape[0] == 1 for a in jax.tree.leaves(stored))
    # the vocabulary (128 ids, a multiple of pp * tp): each device reads only its rows of the table and of the head
    rows, block = _vocab_blocks(mesh, cfg.vocab_size)
    table_args = [a for args in asked for name in ("embed", "lm_head") if name in args
                  for a in jax.tree.leaves(args[name])]
    assert len(table_args) == (4 if quantization else 2)  # values and scale of the int8 table and head
    for args in table_args:
        indices = args.sharding.devices_indices_map(tuple(args.global_shape))
        axis = list(args.sharding.spec).index(VOCAB_SPLIT)
        assert all(index[axis] == slice(block[d] * rows, (block[d] + 1) * rows) for d, index in indices.items())
    _assert_vocab_split(shard_model(staged_config(cfg, layout), restored, mesh).weights, mesh, cfg.vocab_size)

    want = jax.tree.leaves(pad_layers(host, layout).layers)  # the host path: pad_layers of the [L] stack
    for (path, got), expected in zip(jax.tree_util.tree_flatten_with_path(restored.layers)[0], want, strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(expected), err_msg=jax.tree_util.keystr(path))
        assert got.sharding.spec[0] == PP_AXIS
        for shard in got.addressable_shards:  # each device holds only its stage's slots
            s = stage_of[shard.device]
            assert shard.index[0] == slice(s * slots, (s + 1) * slots)


@pytest.mark.parametrize("quantization,pp,tp", [(None, 2, 1), (None, 4, 1), (None, 2, 2), (INT4_INT8_TABLE, 2, 1)],
                         ids=["f32-pp2", "f32-pp4", "f32-pp2-tp2", "int4-int8table-pp2"])
def test_engine_on_a_checkpoint_gives_one_stage_tokens(checkpoints, quantization, pp, tp):
    assert _run(checkpoints(quantization), pp, tp) == _run(checkpoints(quantization), 1, 1)
