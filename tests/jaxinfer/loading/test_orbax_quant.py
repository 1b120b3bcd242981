"""Quantized orbax checkpoints (`jaxinfer.loading.convert(..., quantization=...)`, `jaxinfer convert --quantization`):
bit-identical restores, the same greedy tokens as quantizing at load, refusals, exact padding of quantized weights
for tensor parallelism, and (in a child process with 8 fake CPU devices,
tests/jaxinfer/loading/multi_device_orbax_quant_checks.py, run by test_orbax.py) sharded restores."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.loading import convert, load_model, orbax, orbax_format, stored_quantization
from models.config import ModelConfig
from models.llama import Weights, init_weights
from models import quant
from models.quant import QuantizationConfig, QuantizedWeight, quantize, quantize_weights
from models.partition import pad_weights, tp_layout
from tests.jaxinfer.loading.multi_device_orbax_checks import make_tiny_hf_folder

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
F32 = np.dtype(np.float32)

# name -> (source model, quantization as a user gives it)
CASES = {
    "int8": ("tiny_llama3", '{"format": "int8", "quantize_activations": true}'),  # w8a8: norm gains folded
    "fp8": ("tiny_llama3", "fp8"),
    "fp8-g16": ("tiny_llama3", '{"format": "fp8", "group_size": 16}'),
    "int8-tied-float-head": ("tiny_qwen2", {"format": "int8", "quantize_lm_head": False}),
    "int4": ("tiny_llama3", "int4"),  # packed values, f32 group scales
    "int4-int8-table": ("tiny_qwen2", {"format": "int4", "embedding_format": "int8"}),  # tied: one int8 table
    "int4-w4a8": ("tiny_llama3", {"format": "int4", "quantize_activations": True}),  # blocks of 32 where they fit
    "mxfp8-w8a8": ("tiny_llama3", {"format": "mxfp8", "quantize_activations": True}),  # float8_e8m0fnu scales
    "nvfp4": ("tiny_qwen2", "nvfp4"),  # packed values, float8_e4m3fn block scales, f32 tensor scales; tied
}

is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {name: make_tiny_hf_folder(root / name, DATA / name) for name in ("tiny_llama3", "tiny_qwen2")}


@pytest.fixture(scope="module")
def checkpoint(sources, tmp_path_factory):
    """case name -> its quantized checkpoint, converted once per module."""
    @functools.cache
    def get(case: str) -> Path:
        src, quantization = CASES[case]
        return convert(sources[src], tmp_path_factory.mktemp("ckpt") / case,
                       quantization=quantization)

    return get


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


def _assert_identical(got, want) -> None:
    """Same pytree structure (QuantizedWeight static fields included), dtypes, shapes and bits."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        where = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, (where, x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=where)


def _quantized_at_load(src: Path, quantization, dtype=jnp.float32):
    """What the engine does with `EngineConfig.quantization`: float32 weights quantized in one jitted call."""
    cfg, weights, _ = load_model(src, F32)
    qcfg = QuantizationConfig.from_value(quantization)
    return jax.device_get(jax.jit(functools.partial(quantize_weights, cfg=cfg, qcfg=qcfg, dtype=dtype))(weights))


# --- bit-identical restores --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_restores_bit_identical(case, sources, checkpoint):
    src, quantization = CASES[case]
    ckpt = checkpoint(case)
    qcfg = QuantizationConfig.from_value(quantization)
    meta = json.loads((ckpt / orbax_format.CHECKPOINT_JSON).read_text())
    assert meta["dtype"] == "float32"
    assert QuantizationConfig(**meta["quantization"]["config"]) == qcfg.resolved()
    assert meta["quantization"]["config"]["quantize_activations"] is qcfg.activations  # resolved, not null
    assert stored_quantization(ckpt) == qcfg.resolved() and stored_quantization(sources[src]) is None

    expected = _quantized_at_load(sources[src], quantization)
    cfg, restored, _ = orbax.load(ckpt, "float32")
    _assert_identical(restored, expected)
    assert isinstance(restored.layers.wq, QuantizedWeight) and isinstance(restored.layers.wq.values, np.ndarray)
    assert (restored.lm_head is not None) is (case == "int8-tied-float-head" or not cfg.tie_word_embeddings)
    assert meta["quantization"]["separate_lm_head"] is (case == "int8-tied-float-head")

    # On disk the arrays have their real dtypes (orbax metadata, not what `load` asks for).
    stored = orbax._stored_arrays(ckpt / "weights", ckpt)
    values_dtype, scale_dtype = quant.dtypes_of(qcfg.format)
    assert np.dtype(stored["layers"]["wq"]["values"].dtype) == values_dtype
    assert np.dtype(stored["layers"]["wq"]["scale"].dtype) == scale_dtype
    assert ("tensor_scale" in stored["layers"]["wq"]) is (qcfg.format == "nvfp4")
    assert np.dtype(stored["layers"]["attn_norm"].dtype) == np.float32
    assert set(meta["quantization"]["weights"]) == {".".join(p) for p in orbax_format.quantized_leaves(restored)}


def test_int8_values_and_scales_match_a_numpy_reference(sources, checkpoint):
    # An independent check of the stored layout and arithmetic (not through models.quant): wq [L, D, N, H] is
    # stored output-major [L, N, H, D] with one scale per (layer, head, head-dim) channel, absmax / 127; int8 w8a8
    # first folds the attention norm's gain into wq (its rows scaled by attn_norm), and stores the norm as ones.
    _, src_weights, _ = load_model(sources["tiny_llama3"], F32)
    _, restored, _ = orbax.load(checkpoint("int8"), "float32")
    gain = np.asarray(src_weights.layers.attn_norm, np.float32)[:, :, None, None]
    w = np.transpose(np.asarray(src_weights.layers.wq) * gain, (0, 2, 3, 1))
    assert np.all(np.asarray(restored.layers.attn_norm) == 1)
    scale = restored.layers.wq.scale
    # XLA may compute amax / 127 as amax * (1 / 127): within one float32 rounding of the exact quotient
    np.testing.assert_allclose(scale, np.abs(w).max(-1, keepdims=True) / np.float32(127), rtol=2**-23, atol=0)
    np.testing.assert_array_equal(restored.layers.wq.values, np.clip(np.rint(w / scale), -127, 127).astype(np.int8))
    assert restored.layers.wq.contract_axes == (-3,) and restored.layers.wq.quantize_activations


def test_unquantized_weights_restore_in_the_requested_dtype(sources, checkpoint):
    _, restored, _ = orbax.load(checkpoint("int8"), "bfloat16")
    assert restored.final_norm.dtype == jnp.bfloat16 and restored.layers.wq.values.dtype == np.int8
    _assert_identical(restored, _quantized_at_load(sources["tiny_llama3"], CASES["int8"][1], dtype=jnp.bfloat16))


# --- through the engine ----------------------------------------------------------------------------------------------


def test_generation_from_the_checkpoint_equals_quantization_at_load(sources, checkpoint):
    # The tied model with its separate float head (the other cases restore bit-identical weights as well, and the
    # engine's computation is a function of the weights). The config spelled out is accepted: quantize_activations
    # resolves to int8's default (weight-only).
    case, engine_quantization = "int8-tied-float-head", {"format": "int8", "quantize_lm_head": False,
                                                         "quantize_activations": False}
    src, quantization = CASES[case]
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = {"prompt_token_ids": [1, 40, 50, 60, 70, 33, 21]}
    options = dict(warmup=False, kv_cache_memory_bytes=1 << 20)
    at_load = LLM(str(sources[src]), quantization=quantization, **options)
    from_ckpt = LLM(str(checkpoint(case)), quantization=engine_quantization, **options)
    assert from_ckpt.engine.quantization == at_load.engine.quantization == \
        QuantizationConfig.from_value(quantization).resolved()
    assert from_ckpt.engine.weight_bytes == at_load.engine.weight_bytes
    assert from_ckpt.engine.weight_bytes["quantized_share"] > 0.5
    _assert_identical(from_ckpt.runner.weights, at_load.runner.weights)
    want = at_load.generate(prompt, params)[0].outputs[0].token_ids
    got = from_ckpt.generate(prompt, params)[0].outputs[0].token_ids
    assert len(got) == 12 and got == want


@pytest.mark.parametrize("case, engine_quantization", [
    ("int4-w4a8", "int4"), ("int4", {"format": "int4", "quantize_activations": True})])
def test_an_int4_checkpoint_runs_with_or_without_w4a8(case, engine_quantization, sources, checkpoint):
    """w4a8 is how int4's matmuls run, not what is stored: either checkpoint runs either way, with the weights (and
    their static fields) that quantizing at load with the engine's config gives."""
    src, _ = CASES[case]
    options = dict(warmup=False, kv_cache_memory_bytes=1 << 20)
    at_load = LLM(str(sources[src]), quantization=engine_quantization, **options)
    from_ckpt = LLM(str(checkpoint(case)), quantization=engine_quantization, **options)
    wanted = QuantizationConfig.from_value(engine_quantization).resolved()
    assert from_ckpt.engine.quantization == at_load.engine.quantization == wanted
    assert from_ckpt.runner.weights.layers.wq.quantize_activations is wanted.activations
    _assert_identical(from_ckpt.runner.weights, at_load.runner.weights)
    params, prompt = SamplingParams(max_tokens=8, temperature=0), {"prompt_token_ids": [1, 40, 50, 60, 70]}
    assert (from_ckpt.generate(prompt, params)[0].outputs[0].token_ids
            == at_load.generate(prompt, params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("engine_quantization, message", [
    ("fp8", r"the quantization asked for differs from the one the checkpoint .* is stored with in format 'fp8' "
            r"\(stored: 'int8'\), quantize_activations False \(stored: True\), quantize_embedding False "
            r"\(stored: True\), quantize_lm_head False \(stored: True\); leave out the quantization"),
    ({"format": "int8", "quantize_activations": False}, r"stored with in quantize_activations False \(stored: "
                                                        r"True\); leave"),
])
def test_a_different_quantization_than_the_checkpoints_is_refused(engine_quantization, message, checkpoint):
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig.create(model=str(checkpoint("int8")), quantization=engine_quantization, warmup=False))


# --- refusals and broken checkpoints ---------------------------------------------------------------------------------


def test_save_and_convert_refusals(sources, checkpoint, tmp_path):
    cfg, weights, tokenizer = load_model(sources["tiny_llama3"], F32)
    quantized = _quantized_at_load(sources["tiny_llama3"], "int8")
    with pytest.raises(ValueError, match=r"weights hold quantized weights \(embed, layers.wq, .*pass the quantization"):
        orbax.save(tmp_path / "a", cfg, quantized, tokenizer)
    with pytest.raises(ValueError, match="quantization='int8' given, but no weight is quantized"):
        orbax.save(tmp_path / "b", cfg, weights, tokenizer, quantization="int8")
    with pytest.raises(ValueError, match="int8 values with float32 scales do not fit quantization format 'fp8'"):
        orbax.save(tmp_path / "c", cfg, quantized, tokenizer, quantization="fp8")
    with pytest.raises(ValueError, match="is a quantized checkpoint already"):
        convert(checkpoint("int8"), tmp_path / "d", quantization="fp8")
    with pytest.raises(ValueError, match="unknown quantization config key"):
        convert(sources["tiny_llama3"], tmp_path / "e", quantization='{"format": "int8", "bits": 8}')
    assert not any((tmp_path / name).exists() and any((tmp_path / name).iterdir()) for name in "abcde")


@pytest.mark.parametrize("edit, message", [
    (lambda q: q["weights"]["layers.wq"].update(group_size=7),
     r"quantization.weights.layers.wq: .* does not fit a int8 weight of shape \(2, 64, 4, 16\)"),
    (lambda q: q["weights"].update({"layers.w_made_up": q["weights"]["layers.wq"]}),
     "'layers.w_made_up' is not a weight of this model"),
    (lambda q: q["config"].update(quantize_activations=None), "expected a resolved quantization config"),
    (lambda q: q["config"].update(format="fp8"), r"weight .embed.values is stored as int8, expected float8_e4m3fn"),
    (lambda q: q.update(separate_lm_head=True), r"separate_lm_head: True \(true only for tied embeddings\)"),
], ids=["bad-group", "unknown-weight", "unresolved", "wrong-format", "separate-head-untied"])
def test_a_malformed_quantization_record_is_one_clear_value_error(edit, message, checkpoint, tmp_path):
    import shutil

    ckpt = Path(shutil.copytree(checkpoint("int8"), tmp_path / "broken"))
    meta = json.loads((ckpt / orbax_format.CHECKPOINT_JSON).read_text())
    edit(meta["quantization"])
    (ckpt / orbax_format.CHECKPOINT_JSON).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=message) as e:
        orbax.load(ckpt, "float32")
    assert str(ckpt) in str(e.value) and "\n" not in str(e.value)


# --- tensor-parallel padding of quantized weights (one device) ---------------------------------------------------


TIED_9_OVER_3 = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=70, num_layers=2,
                            num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=64,
                            tie_word_embeddings=True, name="9-over-3")


@pytest.mark.parametrize("quantization, tp", [
    ({"format": "int8", "quantize_lm_head": False}, 2),  # separate float head [D, V], padded along V
    ({"format": "int8", "quantize_lm_head": False}, 4),
    ({"format": "fp8"}, 4),
    ({"format": "fp8", "group_size": 8, "quantize_embedding": False}, 4),  # wo's groups move with their heads
    ({"format": "fp8", "group_size": 2}, 4),  # w_down grouped along the padded MLP axis (70 -> 72: whole groups)
    # int4 (GGUF Q4_0 / Q4_1 kept as stored): groups of gcd(32, axis): 2 on w_down's packed MLP axis, padded in
    # bytes; zero slots are code 8 (symmetric) or code 0 with min 0 (asymmetric)
    ({"format": "int4"}, 4),
    ("int4-asymmetric", 4),
    # packed codes (zero slots: code 8, or E2M1 +-0), e8m0 / e4m3 block scales, nvfp4's tensor scales; blocks are
    # gcd(block, axis): 16 along D = 48, 2 along F = 70 (so 70 -> 72 pads one whole block, one byte)
    ({"format": "int4", "quantize_lm_head": True}, 4), ({"format": "mxfp8", "quantize_activations": True}, 2),
    ({"format": "mxfp4"}, 4), ({"format": "nvfp4", "quantize_lm_head": True}, 4),
], ids=["int8-float-head-tp2", "int8-float-head-tp4", "fp8-tp4", "fp8-g8-tp4", "fp8-g2-tp4", "int4-tp4",
        "int4-asym-tp4", "int4-head-tp4", "mxfp8-w8a8-tp2", "mxfp4-tp4", "nvfp4-tp4"])
def test_padding_quantized_weights_equals_quantizing_padded_weights(quantization, tp):
    # 9 query heads over 3 KV heads: tp=2 and tp=4 pad query heads (zero slots), replicate KV heads and pad MLP
    # (70) and vocabulary (101). Quantizing the padded float weights is the reference; bit for bit, +-0 included.
    cfg, layout = TIED_9_OVER_3, tp_layout(TIED_9_OVER_3, tp)
    weights = init_weights(cfg, jax.random.key(tp))
    weights = weights.replace(embed=weights.embed.at[3].set(0.0))  # an all-zero channel before padding too
    asymmetric = quantization == "int4-asymmetric"
    qcfg = QuantizationConfig.from_value("int4" if asymmetric else quantization)
    quantized = jax.jit(functools.partial(quantize_weights, cfg=cfg, qcfg=qcfg, dtype=jnp.float32))(weights)
    if asymmetric:  # the same groups with mins (no config asks for them: GGUF Q4_1 files do)
        asym = lambda q, w: quantize(w, "int4", q.contract_axes, group_size=q.group_size,  # noqa: E731
                                     asymmetric=True) if is_q(q) else q
        quantized = quantized.replace(layers=jax.tree.map(asym, quantized.layers, weights.layers, is_leaf=is_q))
    separate = quantized.lm_head is not None
    specs = Weights.abstract(cfg, separate)
    pad = jax.jit(lambda w: pad_weights(w, specs, layout))  # one compiled call instead of op-by-op dispatch

    @jax.jit
    def reference(weights):  # the padded float weights quantized with the same static fields
        padded = pad_weights(weights.replace(lm_head=weights.embed.T) if separate else weights, specs, layout)
        return jax.tree.map(lambda q, w: quantize(w, q.format, q.contract_axes, group_size=q.group_size,
                                                  quantize_activations=q.quantize_activations,
                                                  asymmetric=q.min is not None,
                                                  stacked_axes=quant.stacked_axes_of(q)) if is_q(q) else w,
                            jax.eval_shape(pad, quantized), padded, is_leaf=is_q)

    want = reference(weights)
    for host in (False, True):
        got = pad_weights(jax.device_get(quantized), specs, layout) if host else pad(quantized)
        assert isinstance(got.layers.wq.values, np.ndarray) is host
        _assert_identical(got, want)
    assert got.layers.wq.values.shape[1] == layout.num_heads > cfg.num_heads
    assert not np.asarray(got.layers.wq.dequantize())[:, :, ~layout.q_valid].any()  # wq [L, D, N', H]
    assert (got.layers.wq.scale[:, ~layout.q_valid] == 1).all()  # zero slots: scale 1, as quantize gives them
    if qcfg.group_size == 2 and tp == 4 or qcfg.format == "int4":
        assert got.layers.w_down.group_size == 2 and got.layers.w_down.scale.shape[-1] == 36
    assert (got.layers.w_down.min is not None) == asymmetric


def test_padding_that_would_split_a_group_is_refused():
    cfg, layout = TIED_9_OVER_3, tp_layout(TIED_9_OVER_3, 4)
    quantized = quantize_weights(init_weights(cfg, jax.random.key(0)), cfg,
                                 QuantizationConfig(format="fp8", group_size=5), jnp.float32)
    assert quantized.layers.w_down.group_size == 5  # 70 = 14 groups of 5; padded to 72: not whole groups
    with pytest.raises(ValueError, match="group_size 5 along its mlp axis of size 70 cannot be padded to 72 for tp=4"):
        pad_weights(quantized, Weights.abstract(cfg), layout)


def test_padding_asymmetric_int4_and_refusing_half_a_byte():
    cfg, layout = TIED_9_OVER_3, tp_layout(TIED_9_OVER_3, 4)
    specs, layers = Weights.abstract(cfg).layers, init_weights(cfg, jax.random.key(5)).layers
    for name, group in (("wq", 16), ("wo", 16), ("w_gate", 16), ("w_down", 2)):  # heads, MLP kept and contracted
        axes, spec = quant.CONTRACT_AXES[name], {"w": getattr(specs, name)}
        q = functools.partial(quantize, fmt="int4", contract_axes=axes, group_size=group, asymmetric=True)
        pad = lambda w, spec=spec: pad_weights({"w": w}, spec, layout)["w"]  # noqa: E731
        got, want = jax.jit(lambda w, q=q, pad=pad: (pad(q(w)), q(pad(w))))(getattr(layers, name))
        _assert_identical(got, want)  # mins 0 and scales 1 on zero slots
    cfg = dataclasses.replace(cfg, intermediate_size=68)  # tp=3: 68 -> 69, half a byte of w_down's packed codes
    w_down = quantize(init_weights(cfg, jax.random.key(6)).layers.w_down, "int4", (-2,))
    with pytest.raises(ValueError, match="int4 with group_size 0 along its mlp axis of size 68 cannot be padded to 69"):
        pad_weights({"w": w_down}, {"w": Weights.abstract(cfg).layers.w_down}, tp_layout(cfg, 3))
