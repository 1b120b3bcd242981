"""Sharding checks that need 8 devices: run by `test_sharding.py` in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (8 fake CPU devices for the whole suite would double the
time of every other test)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward, init_weights
from sharding.mesh import make_mesh
from sharding.rules import logical_to_spec, named_shardings

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=256, name="tiny")
PAGE_SIZE, NUM_PAGES = 4, 16


def _is_spec(x) -> bool:
    return hasattr(x, "logical_axes")


def _batch(vocab_size: int = TINY.vocab_size):
    """Two sequences: a 6-token prefill on pages [3, 5] and a 5-token prefill on pages [1, 2] (also used by
    multi_device_moe_checks.py)."""
    q_lens, pages = [6, 5], [[3, 5], [1, 2]]
    tokens = np.arange(11, dtype=np.int32) * 7 % vocab_size
    positions = np.concatenate([np.arange(6), np.arange(5)]).astype(np.int32)
    kv_loc = np.array([pages[0][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(6)]
                      + [pages[1][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(5)], np.int32)
    meta = AttentionMetadata(positions=positions, cu_q_lens=np.array([0, 6, 11], np.int32),
                             kv_lens=np.array(q_lens, np.int32), page_table=np.array(pages, np.int32),
                             kv_loc=kv_loc, logits_indices=np.arange(11, dtype=np.int32), max_q_len=8)
    return tokens, meta


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_equal_single_device_and_shards_are_real(tp):
    weights = init_weights(TINY, jax.random.key(0), jnp.float32)
    tokens, meta = _batch()
    cache = KVCache.zeros(TINY, NUM_PAGES, PAGE_SIZE, jnp.float32)
    step = jax.jit(forward, static_argnames=("cfg",))
    expected, _ = step(weights, tokens, meta, cache, cfg=TINY)

    mesh = make_mesh(tp=tp)
    shardings = named_shardings(Weights.abstract(TINY), mesh, is_leaf=_is_spec)
    sharded = jax.device_put(weights, shardings)
    cache_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.device_put(cache, KVCache(k=cache_sharding, v=cache_sharding))
    # Per-device shards are what the rules say: heads, kv heads, MLP hidden and vocab split tp ways.
    L, D, N, K, H, F, V = (TINY.num_layers, TINY.hidden_size, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim,
                           TINY.intermediate_size, TINY.vocab_size)
    assert sharded.layers.wq.addressable_shards[0].data.shape == (L, D, N // tp, H)
    assert sharded.layers.wk.addressable_shards[0].data.shape == (L, D, K // tp, H)
    assert sharded.layers.wo.addressable_shards[0].data.shape == (L, N // tp, H, D)
    assert sharded.layers.w_down.addressable_shards[0].data.shape == (L, F // tp, D)
    assert sharded.embed.addressable_shards[0].data.shape == (V // tp, D)
    assert cache.k.addressable_shards[0].data.shape == (L, NUM_PAGES, K // tp, PAGE_SIZE, H)
    assert sharded.layers.attn_norm.addressable_shards[0].data.shape == (L, D)  # replicated
    got, new_cache = step(sharded, tokens, meta, cache, cfg=TINY)  # XLA partitions from the inputs' shardings
    assert new_cache.k.sharding.is_equivalent_to(cache.k.sharding, 5)  # the cache stays split over kv heads
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_quantized_cache_scales_split_over_kv_heads_through_page_ops():
    # int8: fp8 pages (uint8 bit patterns) shard and move the same way
    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.scheduler.chunk import ScheduledChunk
    from models.partition import shard_model

    tp, pages, kv_dtype = 4, [3, 5], jnp.int8
    weights = jax.tree.map(np.asarray, init_weights(TINY, jax.random.key(0), jnp.float32))
    one = ModelRunner(TINY, jax.tree.map(jnp.asarray, weights), num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                      kv_dtype=kv_dtype)
    mesh = make_mesh(tp=tp)
    sharded = shard_model(TINY, weights, mesh)
    runner = ModelRunner(sharded.cfg, sharded.weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=kv_dtype,
                         mesh=mesh)
    L, K, H = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
    cache = runner.kv_cache
    assert cache.k.addressable_shards[0].data.shape == (L, NUM_PAGES, K // tp, PAGE_SIZE, H)
    assert cache.k_scale.addressable_shards[0].data.shape == (L, NUM_PAGES, K // tp, PAGE_SIZE)
    chunk = [ScheduledChunk(list(range(3, 10)), 0, pages)]
    # Sharded sums round differently, and a quantized value may then land one step over.
    got, want = runner.compute_logits(chunk), one.compute_logits(chunk)
    print("max logit difference", np.abs(got - want).max())
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    before = [np.asarray(x) for x in jax.tree.leaves(runner.kv_cache)]
    runner.kv.copy_pages(pages, [6, 7])
    runner.kv.offload_pages(pages, [0, 1])
    runner.kv.clear_pages(pages)
    runner.kv.load_pages([0, 1], pages)
    kv_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    scale_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.SCALE_LOGICAL_AXES))
    for old, leaf in zip(before, jax.tree.leaves(runner.kv_cache)):  # k, v, k_scale, v_scale
        new = np.asarray(leaf)
        np.testing.assert_array_equal(new[:, pages], old[:, pages])
        np.testing.assert_array_equal(new[:, [6, 7]], old[:, pages])
        assert leaf.sharding.is_equivalent_to(kv_sharding if leaf.ndim == 5 else scale_sharding, leaf.ndim)


def test_indivisible_heads_are_refused_naming_the_numbers():
    cfg = dataclasses.replace(TINY, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kv_heads = 2 is not a multiple of tp = 4"):
        named_shardings(Weights.abstract(cfg), make_mesh(tp=4), is_leaf=_is_spec)


def test_mesh_sizes_are_checked():
    assert dict(make_mesh(tp=2, ep=2, dp=2).shape) == {"dp": 2, "ep": 2, "tp": 2}
    with pytest.raises(ValueError, match="16 devices"):
        make_mesh(tp=16)
    with pytest.raises(ValueError, match="tp=0"):
        make_mesh(tp=0)


# --- SmolLM2 through the engine at tp = 1, 2, 4, 8 (9 query / 3 KV heads: padded layouts at tp 2, 4, 8) ----------

import functools  # noqa: E402
import re  # noqa: E402

from jaxinfer.scheduler.chunk import ScheduledChunk  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from models.partition import shard_model  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived",
           "1, 2, 3, 4,"]
MAX_TOKENS = [12, 5, 9, 3]  # different lengths: requests leave the batch at different steps


@functools.cache
def _smollm2_run(tp: int) -> tuple[np.ndarray, list[list[int]]]:
    """(logits of one 40-token prefill, greedy tokens of PROMPTS) from an engine with tensor_parallel_size=tp."""
    # A 16-token step budget splits the longer prompts into chunks prefilled beside the others' decodes.
    llm = LLM(tensor_parallel_size=tp, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=64 << 20)
    if tp > 1:  # the weights really are split: the rules' shard shapes, on tp devices
        w = llm.runner.weights.layers
        cfg = llm.runner.cfg
        assert w.wq.addressable_shards[0].data.shape[2] == cfg.num_heads // tp
        assert w.w_down.addressable_shards[0].data.shape[1] == cfg.intermediate_size // tp
        assert len(w.wq.sharding.device_set) == tp
        assert llm.runner.kv_cache.k.addressable_shards[0].data.shape[2] == cfg.num_kv_heads // tp
    ids = llm.tokenizer.encode(" ".join(PROMPTS))[:40]
    pages = llm.page_allocator.allocate(-(-len(ids) // llm.page_size))
    logits = llm.runner.compute_logits([ScheduledChunk(ids, 0, pages)])
    llm.page_allocator.free(pages)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS])
    return logits, [o.outputs[0].token_ids for o in outs]


# tp=k computes the same f32 sums as one device in another order (the output and down projections' partial sums
# all-reduced over k shards, the embedding gathered from k vocabulary slices), so its logits differ from one
# device's by f32 rounding carried through 30 layers: the size of the difference between any two f32
# implementations of the model. Measured: jaxinfer vs HF transformers f32 up to 9.9e-5 on SmolLM2's logits (|logit|
# up to ~25) on an AMD EPYC; on an Intel Xeon tp=8 was past 1e-4. The tolerance is the one the HF goldens get, 1e-3,
# absolute (rounding error of a 576-term dot does not shrink with the logit's size); the smallest greedy margin
# (top-1 minus top-2 logit) along PROMPTS' answers is 0.015, so identical tokens follow from it.
TP_LOGIT_TOLERANCE = 1e-3


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_smollm2_tp_logits_and_greedy_tokens_equal_single_device(tp):
    want_logits, want_tokens = _smollm2_run(1)
    got_logits, got_tokens = _smollm2_run(tp)
    assert got_logits.shape == want_logits.shape  # padded vocabulary columns are not returned
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=TP_LOGIT_TOLERANCE)
    assert got_tokens == want_tokens
    assert [len(t) for t in got_tokens] == MAX_TOKENS


def test_smollm2_pipeline_stages_give_the_single_device_tokens():
    # pp = 2: layers 0-14 and 15-29 on two devices, 2 micro-batches per step, chunked prefill beside decodes
    llm = LLM(pipeline_parallel_size=2, dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=64 << 20)
    assert llm.runner.weights.layers.wq.addressable_shards[0].data.shape[0] == 15
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == _smollm2_run(1)[1]


# --- the collectives the partitioner inserts ---------------------------------------------------------------------

def _collectives(hlo: str, op: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(rf"= \S+ {op}(-start)?\(", line)]


@pytest.mark.parametrize("heads", [(8, 4), (9, 3)])
@pytest.mark.parametrize("scan", [False, True])
def test_exactly_two_all_reduces_per_layer_and_no_weight_all_gather(heads, scan):
    """Megatron TP needs one all-reduce after the attention output projection and one after the MLP down
    projection per layer, plus one for the vocabulary-split embedding lookup; nothing else, and never an
    all-gather of a weight (the partitioner's silent fallback when a sharding does not line up)."""
    cfg = dataclasses.replace(TINY, num_heads=heads[0], num_kv_heads=heads[1], num_layers=3)
    mesh = make_mesh(tp=4)
    sharded = shard_model(cfg, jax.tree.map(np.asarray, init_weights(cfg, jax.random.key(0))), mesh)
    cache_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.jit(lambda: KVCache.zeros(sharded.cfg, NUM_PAGES, PAGE_SIZE),
                    out_shardings=KVCache(k=cache_sharding, v=cache_sharding))()
    tokens, meta = _batch()
    step = jax.jit(functools.partial(forward, cfg=sharded.cfg, scan_layers=scan))
    hlo = step.lower(sharded.weights, tokens, meta, cache).compile().as_text()
    layers_in_program = 1 if scan else cfg.num_layers  # a scanned layer is one loop body
    assert len(_collectives(hlo, "all-reduce")) == 2 * layers_in_program + 1
    weight_shapes = {tuple(s.shape) for s in jax.tree.leaves(Weights.abstract(sharded.cfg), is_leaf=_is_spec)}
    weight_shapes |= {shape[1:] for shape in weight_shapes}  # one layer's slice of a stacked weight
    for line in _collectives(hlo, "all-gather"):
        shape = tuple(int(d) for d in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if d)
        assert shape not in weight_shapes, f"a whole weight is all-gathered: {line.strip()[:160]}"
    for op in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert not _collectives(hlo, op), op


# --- the engine on an MoE model with tp x ep, and on an orbax checkpoint restored onto a mesh ----------------------

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxinfer.loading import convert, default_model_path  # noqa: E402
from jaxinfer.tokenizer import Tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
MOE_PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 64, 12, 7]}, {"prompt_token_ids": [101, 2, 40]},
               {"prompt_token_ids": list(range(20, 58))}]  # the last one is prefilled in 3 chunks


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory) -> Path:
    """The tiny random HF Mixtral of tests/data (8 experts, top-2) with SmolLM2's tokenizer beside it (prompts
    are token ids below the model's 128-token vocabulary)."""
    folder = tmp_path_factory.mktemp("tiny_mixtral")
    for f in (DATA / "tiny_mixtral").iterdir():
        shutil.copy(f, folder / f.name)
    Tokenizer.from_gguf(default_model_path()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tp,ep", [(1, 8), (2, 4)])
def test_moe_engine_with_expert_parallelism_gives_the_single_device_tokens(mixtral_folder, tp, ep):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 4, 6)]
    outs = {}
    for sizes in ((1, 1), (tp, ep)):
        llm = LLM(mixtral_folder, warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
                  tensor_parallel_size=sizes[0], expert_parallel_size=sizes[1], kv_cache_memory_bytes=8 << 20)
        ids = MOE_PROMPTS[2]["prompt_token_ids"]
        pages = llm.page_allocator.allocate(-(-len(ids) // llm.page_size))
        logits = llm.runner.compute_logits([ScheduledChunk(ids, 0, pages)])
        llm.page_allocator.free(pages)
        outs[sizes] = logits, [o.outputs[0].token_ids for o in llm.generate(MOE_PROMPTS, params)]
    experts = llm.runner.weights.layers.e_gate
    assert experts.addressable_shards[0].data.shape[1] == llm.model_config.num_experts // ep  # [L, E/ep, D, Fe/tp]
    np.testing.assert_allclose(outs[(tp, ep)][0], outs[(1, 1)][0], rtol=1e-4, atol=1e-4)
    assert outs[(tp, ep)][1] == outs[(1, 1)][1]


def test_expert_parallelism_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs an MoE model"):
        LLM(warmup=False, expert_parallel_size=2)


def test_orbax_checkpoint_restored_onto_tp4_gives_the_gguf_tokens(tmp_path):
    folder = convert(None, tmp_path / "smollm2")  # the default GGUF, float32
    llm = LLM(folder, tensor_parallel_size=4, warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=64 << 20)
    assert llm.runner.weights.layers.wq.addressable_shards[0].data.shape[2] == llm.runner.cfg.num_heads // 4
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == _smollm2_run(1)[1]
