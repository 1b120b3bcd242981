"""Pre-quantized HF folders (`jaxinfer.loading.prequantized`, tiny folders in tests/data/prequantized written by
scripts/make_prequantized.py): the loaded `QuantizedWeight`s dequantize exactly to each format's own formula,
computed here in numpy from the formats' documentation (not through the loader's code); the model on them gives the
logits of the float model run with those dequantized weights; the engine takes its quantization from the folder;
unsupported options are refused by name."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxinfer import LLM, SamplingParams
from jaxinfer.loading import convert, stored_quantization
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.loading.prequantized import Scheme, _rows, read_scheme
from models.quant import QuantizationConfig, QuantizedWeight
from models.quant_matmul import native_matmuls
from tests.jaxinfer.loading.hf_goldens import _logits, _runner
from tests.jaxinfer.loading.multi_device_orbax_checks import make_tiny_hf_folder

REPO = Path(__file__).resolve().parents[3]
PREQUANTIZED = REPO / "tests" / "data" / "prequantized"
CASES = ("fp8_block", "fp8_tensor", "ct_fp8_channel", "gptq", "gptq_asym", "awq", "ct_w4a16")
FIELDS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
          "down_proj": "w_down"}
# What each folder loads as (what the engine reports): fp8_block's group is its block's 32 input columns.
EXPECTED = {
    "fp8_block": QuantizationConfig("fp8", group_size=32), "fp8_tensor": QuantizationConfig("fp8"),
    "ct_fp8_channel": QuantizationConfig("fp8", quantize_lm_head=True),
    "gptq": QuantizationConfig("int4", 32), "gptq_asym": QuantizationConfig("int4", 32, asymmetric=True),
    "awq": QuantizationConfig("int4", 32, asymmetric=True), "ct_w4a16": QuantizationConfig("int4", 32),
}
AWQ_REVERSE_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # output column c sits in nibble AWQ_REVERSE_ORDER[c % 8]


# --- an independent reader and dequantizer ------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file (u64 header size, JSON header, data), F8_E4M3 included."""
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32,
              "I32": np.int32, "I64": np.int64}
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    return {k: np.frombuffer(raw[8 + size + v["data_offsets"][0]:8 + size + v["data_offsets"][1]],
                             dtypes[v["dtype"]]).reshape(v["shape"]) for k, v in header.items()}


def _nibble(words: np.ndarray, rows: np.ndarray, cols: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Nibble `position` (bits 4p..4p+3) of words[rows, cols], as int64."""
    return (words.astype(np.int64)[rows, cols] >> (4 * position)) & 0xF


def dequantize(case: str, t: dict[str, np.ndarray], m: str, qc: dict) -> np.ndarray:
    """The float32 [out, in] weight of module `m` by its format's own formula (module docstring of
    jaxinfer/loading/prequantized.py; computed in float64, exact for these products, then rounded to float32)."""
    if case.startswith("fp8") or case == "ct_fp8_channel":
        v = t[f"{m}.weight"].astype(np.float64)
        out, size_in = v.shape
        if case == "fp8_block":
            bo, bi = qc["weight_block_size"]
            s = t[f"{m}.weight_scale_inv"].astype(np.float64)[np.arange(out)[:, None] // bo,
                                                               np.arange(size_in)[None, :] // bi]
        else:  # per tensor: one value; per channel: [out, 1]
            s = t[f"{m}.weight_scale"].astype(np.float64).reshape(-1, 1)
        return (v * s).astype(np.float32)
    if case == "ct_w4a16":
        out, size_in = (int(x) for x in t[f"{m}.weight_shape"])
        o, i = np.arange(out)[:, None], np.arange(size_in)[None, :]
        q = _nibble(t[f"{m}.weight_packed"], o, i // 8, i % 8) - 8
        g = qc["config_groups"]["group_0"]["weights"]["group_size"]
        return (t[f"{m}.weight_scale"].astype(np.float64)[o, i // g] * q).astype(np.float32)
    scales = t[f"{m}.scales"].astype(np.float64)  # [in/g, out]
    g = qc["group_size"]
    if case == "awq":
        size_in, out = t[f"{m}.qweight"].shape[0], scales.shape[1]
        i, o = np.arange(size_in)[:, None], np.arange(out)[None, :]
        q = _nibble(t[f"{m}.qweight"], i, o // 8, AWQ_REVERSE_ORDER[o % 8])  # [in, out]
        z = _nibble(t[f"{m}.qzeros"], i // g, o // 8, AWQ_REVERSE_ORDER[o % 8])
        return (scales[i // g, o] * (q - z)).T.astype(np.float32)
    size_in, out = 8 * t[f"{m}.qweight"].shape[0], scales.shape[1]
    i, o = np.arange(size_in)[:, None], np.arange(out)[None, :]
    gi = t[f"{m}.g_idx"].astype(np.int64)[:, None]  # each input's group, as GPTQ's kernels look it up
    q = _nibble(t[f"{m}.qweight"], i // 8, o, i % 8)  # [in, out]
    z = _nibble(t[f"{m}.qzeros"], gi, o // 8, o % 8) + (qc.get("checkpoint_format", "gptq") == "gptq")  # v1: +1
    return (scales[gi, o] * (q - z)).T.astype(np.float32)


def dense_folder(case: str, dst: Path, src: Path | None = None) -> Path:
    """An unquantized copy of a pre-quantized folder: quantized modules replaced by their dequantized float32
    weights, plain tensors as stored, config.json without `quantization_config`."""
    src = src or PREQUANTIZED / case
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    t = read_safetensors(src / "model.safetensors")
    modules = {k.rsplit(".", 1)[0] for k in t if k.endswith((".qweight", ".weight_packed", ".weight_scale",
                                                              ".weight_scale_inv"))}
    dense = {k: v for k, v in t.items() if k.rsplit(".", 1)[0] not in modules}
    dense.update({f"{m}.weight": dequantize(case, t, m, qc) for m in modules})
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in dense.items()}, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """case -> (config, weights loaded kept quantized, the float weights of `dense_folder`)."""
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for case in CASES:
        cfg, weights = load_hf_weights(PREQUANTIZED / case)
        _, ref = load_hf_weights(dense_folder(case, root / case))
        out[case] = cfg, weights, ref
    return out


# --- exact weights and logits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_dequantized_weights_equal_the_formats_formula(case, loaded):
    cfg, weights, ref = loaded[case]
    fmt = EXPECTED[case].format
    for field in FIELDS.values():
        q = getattr(weights.layers, field)
        assert isinstance(q, QuantizedWeight) and q.format == fmt and q.values.dtype == {
            "fp8": ml_dtypes.float8_e4m3fn, "int4": np.uint8}[fmt]
        assert q.scale.dtype == np.float32 and (q.min is None) == (case not in ("gptq_asym", "awq"))
        np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), getattr(ref.layers, field),
                                      err_msg=f"{case} {field}")
    head = weights.lm_head
    assert isinstance(head, QuantizedWeight) is (case == "ct_fp8_channel")
    np.testing.assert_array_equal(np.asarray(head.dequantize()) if isinstance(head, QuantizedWeight) else head,
                                  ref.lm_head)
    np.testing.assert_array_equal(weights.embed, ref.embed)
    # symmetric GPTQ / compressed-tensors keep no mins: code 8 is zero (GPTQ v1 stores 7 = 8 - 1)
    if case == "gptq":
        assert np.all(read_safetensors(PREQUANTIZED / case / "model.safetensors")[
            "model.layers.0.self_attn.q_proj.qzeros"].view(np.uint32) == 0x77777777)


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_the_float_model_on_the_dequantized_weights(case, loaded):
    cfg, weights, ref = loaded[case]
    tokens = [int(x) for x in (np.arange(24) * 37 + 5) % cfg.vocab_size]
    with native_matmuls(False):  # XLA's dots (the native int4 kernels round activation rows to int16)
        got = _logits(_runner(cfg, jax.tree.map(jnp.asarray, weights)), tokens)
        want = _logits(_runner(cfg, jax.tree.map(jnp.asarray, ref)), tokens)
    # Grouped weights are dequantized inside the matmul (the same values as the reference's); per-channel ones
    # scale after the dot: float32 rounding apart.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts_load_quantized(tmp_path, case="gptq_asym"):
    # tiny_qwen3_moe written by the script (not committed): 8 experts per layer, each stored quantized on its own,
    # stacked into [L, E, ...] QuantizedWeights; the router stays float. The MoE matmuls dequantize the experts.
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_prequantized.py"), "--source",
                    str(REPO / "tests" / "data" / "tiny_qwen3_moe"), "--out", str(tmp_path), "--only", case],
                   check=True, capture_output=True)
    cfg, weights = load_hf_weights(tmp_path / case)
    _, ref = load_hf_weights(dense_folder(case, tmp_path / "dense", tmp_path / case))
    for field in ("wq", "wo", "e_gate", "e_up", "e_down"):
        q = getattr(weights.layers, field)
        assert isinstance(q, QuantizedWeight), field
        np.testing.assert_array_equal(np.asarray(q.dequantize()), getattr(ref.layers, field), err_msg=field)
    assert weights.layers.e_down.values.shape[:2] == (cfg.num_layers, cfg.num_experts)
    assert not isinstance(weights.layers.router, QuantizedWeight)
    tokens = [int(x) for x in (np.arange(24) * 37 + 5) % cfg.vocab_size]
    with native_matmuls(False):  # as above
        want = _logits(_runner(cfg, jax.tree.map(jnp.asarray, ref)), tokens)
        got = _logits(_runner(cfg, jax.tree.map(jnp.asarray, weights)), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fp8_blocks_of_128_with_partial_blocks():
    # DeepSeek-V3 / Qwen3-FP8 blocks of [128, 128] over a [200, 320] weight: the last row block holds 72 rows and the
    # last column block 64 columns; groups become gcd(128, 320) = 64 wide, each block scale repeated over 2 groups.
    rng = np.random.default_rng(0)
    w = rng.normal(size=(200, 320)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2, size=(2, 3)).astype(np.float32)
    rows = _rows(Scheme("fp8", "fp8", "block", group_size=128, block_rows=128), "m",
                 {"m.weight": w, "m.weight_scale_inv": s}.__getitem__, ())
    assert rows.group_size == 64 and rows.scale.shape == (200, 5)
    got = rows.values.astype(np.float32).reshape(200, 5, 64) * rows.scale[..., None]
    want = w.astype(np.float32) * s[np.arange(200)[:, None] // 128, np.arange(320)[None, :] // 128]
    np.testing.assert_array_equal(got.reshape(200, 320), want)


# --- through the engine --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_the_quantization_comes_from_the_folder(case):
    assert stored_quantization(PREQUANTIZED / case) == EXPECTED[case].resolved()


def test_the_engine_runs_a_prequantized_folder_as_stored(tmp_path):
    src = make_tiny_hf_folder(tmp_path / "gptq", PREQUANTIZED / "gptq")
    ref = make_tiny_hf_folder(tmp_path / "ref", dense_folder("gptq", tmp_path / "dense"))
    options = dict(warmup=False, kv_cache_memory_bytes=1 << 20)
    llm = LLM(str(src), **options)
    assert llm.engine.quantization == EXPECTED["gptq"].resolved()
    assert llm.engine.weight_bytes["quantized_share"] > 0.5
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = {"prompt_token_ids": [1, 40, 50, 60, 70, 33, 21]}
    want = LLM(str(ref), **options).generate(prompt, params)[0].outputs[0].token_ids
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match=r"differs from the one the checkpoint .* is stored with in format 'int8' "
                                         r"\(stored: 'int4'\)"):
        LLM(str(src), quantization="int8", **options)
    with pytest.raises(ValueError, match="is a pre-quantized HF folder"):
        convert(src, tmp_path / "ckpt")


# --- refusals ------------------------------------------------------------------------------------------------------


def _config(case: str) -> dict:
    return json.loads((PREQUANTIZED / case / "config.json").read_text())


@pytest.mark.parametrize("case, edit, message", [
    ("gptq", {"desc_act": True}, "desc_act=True is not supported"),
    ("gptq", {"bits": 8}, "bits=8 is not supported"),
    ("gptq", {"group_size": -1}, "group_size=-1 is not supported"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
    ("gptq", {"dynamic": {"-:.*down": {}}}, "dynamic=.* is not supported"),
    ("awq", {"version": "gemv"}, "version='gemv' is not supported"),
    ("awq", {"zero_point": False}, "zero_point=False is not supported"),
    ("awq", {"bits": 3}, "bits=3 is not supported"),
    ("fp8_block", {"activation_scheme": "static"}, "activation_scheme='static' is not supported"),
    ("fp8_block", {"fmt": "e5m2"}, "fmt='e5m2' is not supported"),
    ("fp8_block", {"weight_block_size": [128]}, "weight_block_size=.* must be 2 positive integers"),
    ("fp8_block", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    ("ct_w4a16", {"format": "marlin-24"}, "format='marlin-24' is not supported"),
    ("ct_w4a16", {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme=.* is not supported"),
    ("ct_w4a16", {"config_groups.weights": {"symmetric": False}}, "symmetric=False is not supported"),
    ("ct_w4a16", {"config_groups.weights": {"actorder": "group"}}, "actorder='group' is not supported"),
    ("ct_fp8_channel", {"config_groups.input_activations": {"dynamic": False, "strategy": "tensor"}},
     "input_activations=.*: static activation quantization is not supported"),
])
def test_unsupported_options_are_refused_by_name(case, edit, message):
    hf = _config(case)
    qc = hf["quantization_config"]
    for key, value in edit.items():
        if key.startswith("config_groups."):
            part = key.split(".", 1)[1]
            group = qc["config_groups"]["group_0"]
            group[part] = {**group[part], **value} if isinstance(group.get(part), dict) else value
        else:
            qc[key] = value
    with pytest.raises(ValueError, match=message):
        read_scheme(hf)


def _edited_copy(case: str, dst: Path, change) -> Path:
    shutil.copytree(PREQUANTIZED / case, dst)
    t = read_safetensors(dst / "model.safetensors")
    t = {k: np.array(v) for k, v in t.items()}
    hf = json.loads((dst / "config.json").read_text())
    change(t, hf)
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


Q = "model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("case, change, message", [
    ("gptq", lambda t, hf: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"][::-1].copy()}),
     rf"{Q}.g_idx' reorders the input channels' groups \(act-order / desc_act\)"),
    ("gptq_asym", lambda t, hf: hf["quantization_config"].update(sym=True),
     r"gptq checkpoint, module 'model.layers.0.self_attn.q_proj': tensor '.*q_proj.qzeros' holds zero points other "
     "than 8 although quantization_config says sym=true"),
    ("fp8_tensor", lambda t, hf: t.pop(f"{Q}.weight_scale"),
     rf"tensor '{Q}.weight' is stored as float8_e4m3fn without the scales"),
    ("fp8_tensor", lambda t, hf: t.update({f"{Q}.weight": t[f"{Q}.weight"].astype(np.float32)}) or
     t.pop(f"{Q}.weight_scale"), "stores wq quantized in some layers or experts and not in others"),
    ("ct_fp8_channel", lambda t, hf: t.update({"model.embed_tokens.weight_scale": np.ones((128, 1), np.float32)}),
     "stores 'model.embed_tokens.weight' quantized; embed is only loaded unquantized"),
    ("awq", lambda t, hf: t.update({f"{Q}.scales": t[f"{Q}.scales"][:1]}),
     rf"awq checkpoint, module '{Q}': tensor '{Q}.scales' is float16 \(1, 64\); expected any dtype \(2, 64\)"),
], ids=["gptq-g_idx", "gptq-sym-zeros", "fp8-no-scale", "mixed-layers", "quantized-embedding", "awq-scales-shape"])
def test_stored_tensors_we_cannot_load_exactly_are_refused_by_name(case, change, message, tmp_path):
    folder = _edited_copy(case, tmp_path / case, change)
    with pytest.raises(ValueError, match=message):
        load_hf_weights(folder)


def test_the_folders_are_what_the_script_writes(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_prequantized.py"), "--source",
                    str(REPO / "tests" / "data" / "tiny_llama3"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for case in CASES:
        for name in ("config.json", "model.safetensors"):
            assert (tmp_path / case / name).read_bytes() == (PREQUANTIZED / case / name).read_bytes(), (case, name)


def test_sharded_over_fake_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "jaxinfer" / "loading" / "multi_device_prequantized_checks.py")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout
