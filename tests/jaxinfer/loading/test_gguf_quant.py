"""GGUF tensors kept quantized (`jaxinfer.loading.gguf_quant`, `quantization="gguf"`).

Oracles:
  * `gguf.quants.dequantize` (the `gguf` package's own numpy dequantizer, independent of this code base): every
    kept weight must dequantize to exactly its values, and the dequantize-at-load path (tested against HF goldens
    in test_gguf.py / test_gguf_families.py) must agree with it bit for bit.
  * A hand-built Q4_0 block whose codes are written from llama.cpp's block description (element j in the low
    nibble of byte j, element j + 16 in its high nibble), so a reordering that `gguf.quants` shared would still
    be caught.
  * Through the engine: the kept-quantized model must give the greedy tokens of the dequantized one, and logits
    equal up to float rounding (the dots run in another order).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxinfer.llm import LLM
from jaxinfer.loading import convert
from jaxinfer.loading.gguf import load_gguf_weights, read_gguf
from jaxinfer.loading.gguf_quant import decode_blocks
from jaxinfer.sampling_params import SamplingParams
from models import quant4
from models.quant import QuantizationConfig, QuantizedWeight, weight_bytes
from models.quant_matmul import native_matmuls
from tests.jaxinfer.loading import test_gguf_families as families
from tests.jaxinfer.loading.hf_goldens import LLAMA3, _logits, _runner

KEPT = (T.Q8_0, T.Q4_0, T.Q4_1)
_is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: T) -> np.ndarray:
    """Rows of GGUF blocks quantized by the gguf package from floats with a few all-zero, constant and wide rows."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], (rows, 1))
    w[0] = 0.0
    w[1 % rows] = 0.25
    return gguf.quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", KEPT)
def test_decoded_blocks_dequantize_to_gguf_quants_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    data = _blocks(rng, 6, 96, qtype)  # 6 rows of 3 blocks
    values, scale, mins = decode_blocks(data, qtype)
    assert scale.shape == (6, 3) and scale.dtype == np.float32
    assert (mins is not None) == (qtype == T.Q4_1)
    q = QuantizedWeight(values=values, scale=scale, min=mins, contract_axes=(-1,), group_size=32)
    assert q.format == ("int8" if qtype == T.Q8_0 else "int4") and q.shape == (6, 96)
    want = gguf.quants.dequantize(data, qtype)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), want)  # jax, as the model runs it
    if qtype != T.Q8_0:
        np.testing.assert_array_equal(quant4.dequantize(values, scale, mins, 1), want)  # numpy


def test_q4_0_nibble_order_follows_llama_cpp():
    # One block: d = 0.5 (f16), then qs[j] = (j) | (15 - j) << 4, so element j < 16 has code j and element
    # j + 16 has code 15 - j; w = d * (code - 8).
    qs = np.array([j | (15 - j) << 4 for j in range(16)], np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs])[None]  # [1 row, 18 bytes]
    codes = np.array(list(range(16)) + [15 - j for j in range(16)])
    values, scale, _ = decode_blocks(block, T.Q4_0)
    np.testing.assert_array_equal(quant4.unpack(values)[0], codes)  # ours: element 2j low nibble, 2j+1 high
    np.testing.assert_array_equal(scale, [[0.5]])
    np.testing.assert_array_equal(gguf.quants.dequantize(block, T.Q4_0)[0], 0.5 * (codes - 8))


def test_decode_blocks_refuses_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="Q6_K is not kept"):
        decode_blocks(np.zeros((1, 210), np.uint8), T.Q6_K)
    with pytest.raises(ValueError, match="not whole 34-byte blocks"):
        decode_blocks(np.zeros((1, 35), np.uint8), T.Q8_0)


# --- tiny models written here ----------------------------------------------------------------------------------------

# llama.cpp tensor name part -> the type written; the file mixes all three kept types
TYPES = {"attn_q.": T.Q4_0, "attn_k.": T.Q4_1, "attn_v.": T.Q8_0, "attn_output": T.Q4_1, "attn_qkv": T.Q4_1,
         "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0, "output.": T.Q4_0}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 2, 1, 32, 96, 128, 2


def _qtype(name: str, types: dict[str, T]) -> T | None:
    return next((t for part, t in types.items() if part in name), None)


def _quantized(tensors: dict[str, np.ndarray], types: dict[str, T]) -> dict:
    """Matrices (2-D, and 3-D expert stacks) whose name matches `types`, as (raw blocks, type); the rest as is."""
    out = {}
    for name, w in tensors.items():
        qtype = _qtype(name, types) if w.ndim >= 2 and "ffn_gate_inp" not in name else None
        out[name] = w if qtype is None else (gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype), qtype)
    return out


def _write_llama(path: Path, tensors: dict) -> Path:
    """A tiny `llama` GGUF (random weights; byte-level BPE tokenizer of VOCAB tokens) of `tensors`."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-gguf-quant")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    alphabet = [chr(c) for lo, hi in (("!", "~"), ("¡", "¬"), ("®", "ÿ")) for c in range(ord(lo), ord(hi) + 1)]
    tokens = alphabet[:VOCAB - 1] + ["!!"]
    writer.add_token_list(tokens)
    writer.add_token_merges(["! !"])
    for name, w in tensors.items():
        if isinstance(w, tuple):
            writer.add_tensor(name, w[0], raw_dtype=w[1])
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_tensors(seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.15).astype(np.float32)  # noqa: E731
    out = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": 1 + w(HIDDEN)}
    if not tied:
        out["output.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        out.update({f"blk.{i}.attn_norm.weight": 1 + w(HIDDEN), f"blk.{i}.ffn_norm.weight": 1 + w(HIDDEN),
                    f"blk.{i}.attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN),
                    f"blk.{i}.attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                    f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                    f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
                    f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN), f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
                    f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN)})
    return out


def _assert_kept_equal_dequantized(path: Path) -> tuple:
    """Loads `path` both ways; every kept weight must dequantize to exactly the dequantize-at-load weight, and
    every other leaf must be that weight itself. Returns (config, kept weights, dequantized weights)."""
    reader = read_gguf(path)
    cfg, kept = load_gguf_weights(reader, np.float32, keep_quantized=True)
    cfg_plain, plain = load_gguf_weights(reader, np.float32)
    assert cfg == cfg_plain
    leaves = jax.tree_util.tree_leaves_with_path(kept, is_leaf=_is_q)
    plain_leaves = jax.tree.leaves(plain)
    assert len(leaves) == len(plain_leaves)
    for (where, got), want in zip(leaves, plain_leaves):
        got = np.asarray(got.dequantize()) if _is_q(got) else got
        assert got.shape == want.shape, where
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(where))
    return cfg, kept, plain


def _kept_fields(weights) -> set[str]:
    fields = {f for f in vars(weights.layers) if _is_q(getattr(weights.layers, f))}
    return fields | {f for f in ("embed", "lm_head") if _is_q(getattr(weights, f))}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """(all kept, a mixed-type field, tied with a Q4_0 embedding) tiny llama GGUFs."""
    tmp = tmp_path_factory.mktemp("gguf_quant")
    tensors = _llama_tensors()
    kept = _write_llama(tmp / "kept.gguf", _quantized(tensors, TYPES))
    mixed = _quantized(tensors, TYPES)
    mixed["blk.1.ffn_down.weight"] = _quantized({"x": tensors["blk.1.ffn_down.weight"]}, {"x": T.Q4_1})["x"]
    mixed["blk.0.attn_q.weight"] = tensors["blk.0.attn_q.weight"]  # F32 in one layer only
    tied = _quantized(_llama_tensors(1, tied=True), {**TYPES, "token_embd": T.Q4_0})
    return kept, _write_llama(tmp / "mixed.gguf", mixed), _write_llama(tmp / "tied.gguf", tied)


def test_tiny_llama_kept_weights_equal_the_dequantized_ones(tiny_files):
    kept_path, mixed_path, tied_path = tiny_files
    _, kept, plain = _assert_kept_equal_dequantized(kept_path)
    assert _kept_fields(kept) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed", "lm_head"}
    layers = kept.layers
    assert (layers.wq.format, layers.wk.format, layers.wv.format) == ("int4", "int4", "int8")
    assert layers.wq.min is None and layers.wk.min is not None and layers.wq.group_size == 32
    assert weight_bytes(kept)["bytes"] < weight_bytes(plain)["bytes"] / 4

    # A field whose layers differ in type (Q8_0 / Q4_1, or F32 / Q4_0) is dequantized; the others stay kept.
    _, mixed, _ = _assert_kept_equal_dequantized(mixed_path)
    assert _kept_fields(mixed) == {"wk", "wv", "wo", "w_gate", "w_up", "embed", "lm_head"}

    # A Q4_0 embedding: the gather reads no packed table, so it (and the tied head it serves) is dequantized.
    _, tied, _ = _assert_kept_equal_dequantized(tied_path)
    assert tied.lm_head is None and not _is_q(tied.embed) and _is_q(tied.layers.wq)


def test_tiny_llama_through_the_engine_equals_the_dequantized_model(tiny_files):
    kept_path, mixed_path, _ = tiny_files
    cfg, kept, plain = _assert_kept_equal_dequantized(kept_path)
    prompt = [5, 17, 99, 3, 64, 127, 0, 42, 8]
    with native_matmuls(False):  # XLA's dots on both (the native kernels round int8 / int4 activation rows)
        want = _logits(_runner(cfg, plain), prompt)
        got = _logits(_runner(cfg, kept), prompt)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 1  # not a flat model: the comparison has something to compare

    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1)
    options = dict(dtype="float32", warmup=False, kv_cache_memory_bytes=1 << 20, max_num_seqs=2)
    outs = {}
    for quantization in ("gguf", None):
        llm = LLM(str(kept_path), quantization=quantization, **options)
        outs[quantization] = (llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0],
                              llm.engine.weight_bytes, llm.engine.quantization)
    (q_out, q_bytes, q_cfg), (f_out, f_bytes, f_cfg) = outs["gguf"], outs[None]
    assert q_cfg == QuantizationConfig("gguf").resolved() and f_cfg is None
    assert len(q_out.token_ids) == 10 and q_out.token_ids == f_out.token_ids
    q_lp = [next(iter(lp.values())).logprob for lp in q_out.logprobs]
    f_lp = [next(iter(lp.values())).logprob for lp in f_out.logprobs]
    # decode steps run the native CPU kernels, whose weight-only paths round activation rows to int16
    # (tests/jaxinfer/engine/test_native_matmuls.py states the same tolerance)
    np.testing.assert_allclose(q_lp, f_lp, rtol=0, atol=5e-3)
    assert q_bytes["bytes"] < f_bytes["bytes"] / 4 and q_bytes["quantized_share"] > 0.9


@pytest.mark.parametrize("name", ["tiny_phi3", "tiny_qwen3_moe", "tiny_mixtral"])
def test_fused_expert_and_permuted_families_keep_their_weights_exactly(name, tmp_path):
    # Phi-3's fused qkv / gate-up split along rows, Qwen3-MoE's and Mixtral's [E, out, in] experts, Mixtral's
    # permuted Q/K rows (a `llama` file): all kept weights must still equal the dequantized ones.
    tensors = _quantized(families._gguf_tensors(name), {**TYPES, "_exps": T.Q4_1})
    _, kept, _ = _assert_kept_equal_dequantized(families._write(tmp_path / f"{name}.gguf", name, tensors))
    fields = _kept_fields(kept)
    expected = {"tiny_phi3": {"wq", "wk", "wv", "w_gate", "w_up", "w_down"},  # wo: 16-wide heads, no 32-blocks
                "tiny_qwen3_moe": {"wq", "wk", "wv", "wo", "e_gate", "e_up", "e_down"},
                "tiny_mixtral": {"wq", "wk", "wv", "e_gate", "e_up", "e_down"}}[name]
    assert expected <= fields, fields


# --- the switch ------------------------------------------------------------------------------------------------------


def test_gguf_quantization_is_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file.*pick one of int8, fp8, int4, mxfp8, mxfp4, nvfp4"):
        LLM(str(LLAMA3), quantization="gguf", warmup=False)
    for bad in ({"format": "gguf", "quantize_embedding": True}, {"format": "gguf", "quantize_activations": True},
                {"format": "gguf", "quantize_embedding": False}, {"format": "gguf", "quantize_lm_head": False},
                {"format": "gguf", "asymmetric": True}):  # false is refused too: the file decides (user trial)
        with pytest.raises(ValueError, match="gguf keeps the GGUF file's own types"):
            QuantizationConfig.from_value(bad)
    with pytest.raises(ValueError, match="group_size is for fp8, int4 and the microscaling formats; gguf"):
        QuantizationConfig.from_value({"format": "gguf", "group_size": 32})
    with pytest.raises(ValueError, match="quantization gguf is not stored in checkpoints"):
        convert(None, tmp_path / "out", quantization="gguf")


@pytest.mark.slow
def test_smollm2_q4_1_kept_quantized_generates_as_the_dequantized_model():
    params = SamplingParams(max_tokens=16, temperature=0)
    prompt = "The GNU General Public License is a free, copyleft license for"
    options = dict(dtype="float32", warmup=False, kv_cache_memory_bytes=16 << 20, max_num_seqs=2)
    kept = LLM(quantization="gguf", **options)
    got = kept.generate(prompt, params)[0].outputs[0].token_ids
    wb = kept.engine.weight_bytes
    del kept
    plain = LLM(**options)
    assert len(got) == 16 and got == plain.generate(prompt, params)[0].outputs[0].token_ids
    assert wb["bytes"] < 120e6 < 500e6 < plain.engine.weight_bytes["bytes"]  # Q4_1 layers, Q8_0 embedding vs f32
