"""Tests for models.moe and the MoE model families (Mixtral, Qwen2-MoE, Qwen3-MoE).

Oracles:
  * tests/data/tiny_mixtral and tiny_qwen2_moe: golden logits and greedy tokens from HF transformers 5.24, and
    tiny_qwen3_moe (q/k norms, renormalized top-2, no shared expert, 32 greedy tokens) from 5.25 (PyTorch, f32;
    scripts/make_golden.py), loaded through the same HF loader path as the dense goldens.
  * `_moe_reference`: a dense NumPy (float64) loop written here from the published definition: per token, softmax
    over the router logits, its k largest, optional renormalization, sum of the chosen experts' SwiGLU outputs;
    plus sigmoid(h @ g) times the shared expert's SwiGLU.
Expert parallelism on real (fake CPU) devices is checked in tests/sharding/multi_device_moe_checks.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.sampling_params import SamplingParams
from models import moe
from models.config import ModelConfig
from models.llama import LayerWeights, Weights, check_weights
from sharding.mesh import make_mesh


DATA = Path(__file__).resolve().parents[1] / "data"
MIXTRAL, QWEN2_MOE, QWEN3_MOE = DATA / "tiny_mixtral", DATA / "tiny_qwen2_moe", DATA / "tiny_qwen3_moe"
PAGE_SIZE, NUM_PAGES = 16, 8


def _golden(folder: Path) -> dict:
    return json.loads((folder / "golden.json").read_text())


# --- HF goldens -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny_mixtral", "tiny_qwen2_moe", "tiny_qwen3_moe"])
def hf_moe(request):
    folder = DATA / request.param
    cfg, weights = load_hf_weights(folder)
    check_weights(weights, cfg)
    return folder, cfg, weights, ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                             kv_dtype=jnp.float32)


def test_hf_moe_config_fields(hf_moe):
    folder, cfg, weights, _ = hf_moe
    hf = json.loads((folder / "config.json").read_text())
    assert cfg.num_experts == hf.get("num_local_experts", hf.get("num_experts")) == 8
    assert cfg.num_experts_per_tok == hf["num_experts_per_tok"] == 2
    assert cfg.qk_norm == (folder == QWEN3_MOE)
    if folder == MIXTRAL:
        assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (hf["intermediate_size"], 0)
        assert cfg.norm_topk_prob and not cfg.attention_bias
        assert weights.layers.s_gate is None
    elif folder == QWEN3_MOE:  # no shared expert; renormalized top-k as its config says; head_dim 32 != 64 / 4
        assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (hf["moe_intermediate_size"], 0)
        assert cfg.norm_topk_prob is hf["norm_topk_prob"] is True and not cfg.attention_bias
        assert weights.layers.s_gate is None and weights.layers.q_norm.shape == (2, cfg.head_dim) == (2, 32)
    else:
        assert cfg.moe_intermediate_size == hf["moe_intermediate_size"]
        assert cfg.shared_expert_intermediate_size == hf["shared_expert_intermediate_size"] == 48
        assert cfg.norm_topk_prob is False and cfg.attention_bias
        assert weights.layers.s_router.shape == (2, 64, 1)
    assert weights.layers.w_gate is None  # no dense MLP
    assert weights.layers.e_down.shape == (2, 8, cfg.moe_intermediate_size, 64)
    # The goldens exercise experts that receive no tokens.
    assert any(0 in layer for layer in _golden(folder)["expert_counts_per_layer"])


def test_hf_moe_logits_match_transformers(hf_moe):
    folder, _, _, runner = hf_moe
    golden = _golden(folder)
    out = runner.compute_logits([ScheduledChunk(golden["token_ids"], 0, [3, 1, 2])])
    np.testing.assert_allclose(out, np.array(golden["logits"], np.float32), rtol=1e-4, atol=1e-4)


def test_hf_moe_scanned_layers_match_transformers(hf_moe):
    folder, cfg, weights, _ = hf_moe
    golden = _golden(folder)
    runner = ModelRunner(cfg, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32,
                         scan_layers=True)
    out = runner.compute_logits([ScheduledChunk(golden["token_ids"], 0, [3, 1, 2])])
    np.testing.assert_allclose(out, np.array(golden["logits"], np.float32), rtol=1e-4, atol=1e-4)


def test_hf_moe_greedy_continuation_matches_transformers(hf_moe):
    folder, _, _, runner = hf_moe
    golden = _golden(folder)
    prompt, want = golden["token_ids"], golden["greedy_token_ids"]
    greedy, pages, got = SamplingParams(temperature=0.0), [4, 6, 5, 7, 2], []  # 5 pages: 40 + 32 tokens
    chunk = ScheduledChunk(prompt, 0, pages)
    for step in range(len(want)):  # decode steps: one token per step through the MoE block
        got.append(int(runner.execute([chunk], [SamplingRow(greedy, 0, step=step)]).token_ids[0]))
        chunk = ScheduledChunk([got[-1]], len(prompt) + step, pages)
    assert got == want


# --- the MoE block against a NumPy reference ----------------------------------------------------------------------

BLOCK = ModelConfig(architecture="mixtral", vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=8, name="moe-block")
RIGGED_EXPERT = 3


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _moe_reference(h: np.ndarray, w: LayerWeights, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per token, loop over its top-k experts (float64). Returns (output [T, D], chosen experts [T, k])."""
    h = h.astype(np.float64)
    f = {name: None if getattr(w, name) is None else np.asarray(getattr(w, name), np.float64)
         for name in ("router", "e_gate", "e_up", "e_down", "s_gate", "s_up", "s_down", "s_router")}
    out = np.zeros_like(h)
    chosen = []
    for t in range(h.shape[0]):
        logits = h[t] @ f["router"]  # [E]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[: cfg.num_experts_per_tok]
        p = probs[top] / probs[top].sum() if cfg.norm_topk_prob else probs[top]
        chosen.append(top)
        for e, pe in zip(top, p):
            out[t] += pe * (_silu(h[t] @ f["e_gate"][e]) * (h[t] @ f["e_up"][e])) @ f["e_down"][e]
        if f["s_gate"] is not None:
            gate = 1.0 / (1.0 + np.exp(-(h[t] @ f["s_router"])[0]))
            out[t] += gate * (_silu(h[t] @ f["s_gate"]) * (h[t] @ f["s_up"])) @ f["s_down"]
    return out, np.array(chosen)


def _block_case(k: int, norm: bool, shared: int, routing: str, num_tokens: int | None = None, seed: int = 0):
    """One layer's weights and activations h[T, D]; routing "random" (13 tokens), "few_tokens" (3 tokens, so at
    least 8 - 3k experts get none) or "all_to_one" (13 tokens, all with RIGGED_EXPERT first)."""
    cfg = dataclasses.replace(BLOCK, num_experts_per_tok=k, norm_topk_prob=norm,
                              shared_expert_intermediate_size=shared,
                              architecture="qwen2_moe" if shared else "mixtral")
    rng = np.random.default_rng(seed)  # numpy, not init_weights: eager jax.random compiles once per shape
    specs = Weights.abstract(cfg).layers
    w = jax.tree.map(lambda s: np.ones(s.shape[1:], np.float32) if s.init_scale is None
                     else (s.init_scale * rng.normal(size=s.shape[1:])).astype(np.float32), specs,
                     is_leaf=lambda x: hasattr(x, "logical_axes"))  # one layer
    num_tokens = num_tokens or (3 if routing == "few_tokens" else 13)
    h = rng.normal(size=(num_tokens, cfg.hidden_size)).astype(np.float32)
    if routing == "all_to_one":  # every token's top-1 is RIGGED_EXPERT by a margin of ~7 router-logit std
        h[:, 0] = 2.0
        router = w.router.copy()
        router[0, RIGGED_EXPERT] = 3.0
        w = dataclasses.replace(w, router=router)
    return cfg, w, h


@pytest.mark.parametrize("routing", ["random", "few_tokens", "all_to_one"])
@pytest.mark.parametrize("shared", [0, 12])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("k", [1, 2])
def test_moe_block_matches_numpy_reference(k, norm, shared, routing):
    cfg, w, h = _block_case(k, norm, shared, routing)
    want, chosen = _moe_reference(h, w, cfg)
    counts = np.bincount(chosen.ravel(), minlength=cfg.num_experts)
    assert counts.sum() == h.shape[0] * k  # dropless: every assignment counted
    if routing != "random":
        assert (counts == 0).sum() >= 2  # experts that receive no tokens
    if routing == "all_to_one":
        assert (chosen[:, 0] == RIGGED_EXPERT).all()
    got = jax.jit(moe.moe_block, static_argnames=("cfg", "mesh"))(h, w, cfg=cfg)
    assert got.shape == h.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_route_weights_and_experts():
    cfg, w, h = _block_case(2, True, 0, "random")
    weights, experts = moe.route(jnp.asarray(h), jnp.asarray(w.router), cfg)
    _, chosen = _moe_reference(h, w, cfg)
    np.testing.assert_array_equal(np.asarray(experts), chosen)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    assert (np.diff(np.asarray(weights), axis=-1) <= 0).all()  # descending
    raw, _ = moe.route(jnp.asarray(h), jnp.asarray(w.router), dataclasses.replace(cfg, norm_topk_prob=False))
    assert (np.asarray(raw).sum(-1) < 1.0).all()  # unnormalized: the chosen probabilities only


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_moe_block_single_tokens(num_tokens):
    cfg, w, h = _block_case(2, True, 12, "random", num_tokens=num_tokens, seed=3)
    want, _ = _moe_reference(h, w, cfg)
    np.testing.assert_allclose(np.asarray(moe.moe_block(h, w, cfg)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [0, 16])
def test_rank_partials_sum_to_the_whole(shared):
    """The per-rank computation of an ep=4 x tp=2 split, run rank by rank on one device: each rank's partial sum
    (its 2 experts, its half of every hidden width, the shared expert's hidden split over both axes) adds up to
    the unsharded output, i.e. what the one psum of `moe_block` completes."""
    cfg, w, h = _block_case(2, True, shared, "random", seed=5)
    ep, tp = 4, 2
    E_loc, Fe_loc, Fs_part = cfg.num_experts // ep, cfg.moe_intermediate_size // tp, shared // tp // ep
    total = np.zeros_like(h, np.float64)
    for e in range(ep):
        for t in range(tp):
            experts = slice(e * E_loc, (e + 1) * E_loc)
            hidden = slice(t * Fe_loc, (t + 1) * Fe_loc)
            ws = {"router": w.router, "e_gate": w.e_gate[experts, :, hidden], "e_up": w.e_up[experts, :, hidden],
                  "e_down": w.e_down[experts, hidden, :]}
            shared_slice = None
            if shared:
                s_hidden = slice(t * (shared // tp), (t + 1) * (shared // tp))
                ws |= {"s_gate": w.s_gate[:, s_hidden], "s_up": w.s_up[:, s_hidden], "s_down": w.s_down[s_hidden],
                       "s_router": w.s_router}
                shared_slice = (e * Fs_part, Fs_part)
            total += np.asarray(moe._moe_partial(jnp.asarray(h), ws, cfg, e * E_loc, shared_slice, True))
    want, _ = _moe_reference(h, w, cfg)
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-5)


def test_one_device_mesh_gives_the_same_answer():
    """ep = tp = 1: `moe_block` takes the local path (no shard_map, no psum); the 8-device checks cover the rest."""
    cfg, w, h = _block_case(2, False, 12, "random", seed=7)
    want, _ = _moe_reference(h, w, cfg)
    got = jax.jit(moe.moe_block, static_argnames=("cfg", "mesh"))(h, w, cfg=cfg, mesh=make_mesh())
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_moe_block_bfloat16_is_close_to_float32():
    cfg, w, h = _block_case(2, True, 12, "random", seed=9)
    w16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), w)
    h16 = jnp.asarray(h, jnp.bfloat16)
    # The reference sees the same bf16-rounded inputs, so it routes like the f32 router of `route` does.
    want, _ = _moe_reference(np.asarray(h16, np.float32), jax.tree.map(lambda a: np.asarray(a, np.float32), w16), cfg)
    got = moe.moe_block(h16, w16, cfg)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=5e-2, atol=5e-2)


def test_weights_abstract_declares_moe_axes():
    cfg = dataclasses.replace(BLOCK, architecture="qwen2_moe", shared_expert_intermediate_size=12)
    specs = Weights.abstract(cfg).layers
    assert specs.w_gate is None and specs.w_down is None
    assert specs.router.logical_axes == ("layers", "embed", "router_experts")
    assert specs.e_gate.logical_axes == ("layers", "experts", "embed", "mlp")
    assert specs.e_down.logical_axes == ("layers", "experts", "mlp", "embed")
    assert specs.s_down.shape == (1, 12, 16) and specs.s_router.shape == (1, 16, 1)


# --- configs and checkpoints that are refused ---------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    (dict(num_experts_per_tok=0), r"num_experts_per_tok=0 must be in \[1, num_experts=8\]"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size=0 must be >= 1 with num_experts=8"),
    (dict(num_experts=-2), r"num_experts=-2 must be a non-negative integer"),
    (dict(num_experts=0), r"architecture 'mixtral' needs num_experts >= 1"),
    (dict(architecture="llama", num_experts=0), r"num_experts=0 \(dense MLP\) but \{'num_experts_per_tok': 2"),
    (dict(mlp_bias=True), r"mlp_bias=True is not supported with num_experts=8"),
    (dict(shared_expert_intermediate_size=-1), r"shared_expert_intermediate_size=-1 must be a non-negative"),
])
def test_bad_moe_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BLOCK, **changes)


def _hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("folder, family", [(QWEN2_MOE, "Qwen2-MoE"), (QWEN3_MOE, "Qwen3-MoE")])
@pytest.mark.parametrize("changes, message", [
    (dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]: {} with dense MLP layers is not supported"),
    (dict(decoder_sparse_step=2), r"decoder_sparse_step=2: only 1 .* for {}"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
])
def test_bad_qwen_moe_hf_configs_are_refused(folder, family, changes, message):
    with pytest.raises(ValueError, match=message.format(family)):
        ModelConfig.from_hf_config({**_hf_config(folder), **changes})


def test_qwen3_moe_hf_config_keys():
    hf = _hf_config(QWEN3_MOE)  # transformers 5.25 saves num_experts as num_local_experts; the hub says num_experts
    cfg = ModelConfig.from_hf_config(hf)
    hub = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_hf_config(hub) == cfg
    bare = {k: v for k, v in hub.items() if k not in ("norm_topk_prob", "head_dim", "decoder_sparse_step",
                                                      "mlp_only_layers")}
    cfg = ModelConfig.from_hf_config(bare)  # Qwen3MoeConfig's defaults: no renormalization, head_dim D / N, sparse
    assert (cfg.norm_topk_prob, cfg.head_dim, cfg.num_experts, cfg.qk_norm) == (False, 16, 8, True)
    with pytest.raises(ValueError, match="missing required key 'num_experts'"):
        ModelConfig.from_hf_config({k: v for k, v in hf.items() if k != "num_local_experts"})
    with pytest.raises(ValueError, match="missing required key 'moe_intermediate_size'"):
        ModelConfig.from_hf_config({k: v for k, v in hf.items() if k != "moe_intermediate_size"})


def test_mixtral_hf_config_without_expert_count_is_refused():
    hf = _hf_config(MIXTRAL)
    del hf["num_local_experts"]
    with pytest.raises(ValueError, match="num_local_experts"):
        ModelConfig.from_hf_config(hf)




@pytest.mark.parametrize("folder, name", [
    (MIXTRAL, "model.layers.1.block_sparse_moe.experts.5.w3.weight"),
    (MIXTRAL, "model.layers.0.block_sparse_moe.gate.weight"),
    (QWEN2_MOE, "model.layers.1.mlp.shared_expert_gate.weight"),
    (QWEN2_MOE, "model.layers.0.mlp.experts.7.down_proj.weight"),
    (QWEN3_MOE, "model.layers.1.mlp.experts.2.up_proj.weight"),
    (QWEN3_MOE, "model.layers.0.mlp.gate.weight"),
])
@pytest.mark.parametrize("fault", ["missing", "transposed"])
def test_moe_checkpoint_faults_name_the_tensor(tmp_path, folder, name, fault):
    tensors = load_file(folder / "model.safetensors")
    if fault == "missing":
        del tensors[name]
    else:
        tensors[name] = np.ascontiguousarray(tensors[name].T)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(folder / "config.json", tmp_path)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf_weights(tmp_path)


def test_hf_moe_config_attention_keys():
    mixtral, qwen = _hf_config(MIXTRAL), _hf_config(QWEN2_MOE)
    assert ModelConfig.from_hf_config({**mixtral, "sliding_window": 8}).sliding_window == 8  # honoured, as Mistral
    assert ModelConfig.from_hf_config({**qwen, "sliding_window": 8}).sliding_window is None  # use_sliding_window off
    old_qwen = {k: v for k, v in qwen.items() if k != "qkv_bias"}  # pre-v5 configs: q/k/v biases always
    assert ModelConfig.from_hf_config(old_qwen).attention_bias
    assert not ModelConfig.from_hf_config({**qwen, "qkv_bias": False}).attention_bias


# --- Qwen3-MoE through the engine -------------------------------------------------------------------------------


def test_qwen3_moe_engine_greedy_with_chunked_prefill_and_prefix_cache_matches_transformers(with_tokenizer, tmp_path):
    from jaxinfer.llm import LLM

    golden = _golden(QWEN3_MOE)
    prompt, want = golden["token_ids"], golden["greedy_token_ids"]
    # 16-token steps over 16-token pages: the 40-token prompt is prefilled in 3 chunks, then 32 decode steps
    llm = LLM(with_tokenizer(QWEN3_MOE), dtype="float32",
              warmup=False, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=8 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], [greedy], use_tqdm=False)[0]
    assert first.outputs[0].token_ids == want
    again = llm.generate([{"prompt_token_ids": prompt}], [greedy], use_tqdm=False)[0]  # 2 full pages cached
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == want
