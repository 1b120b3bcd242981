"""GGUF files of the families beyond Llama / Qwen2: a Mixtral-style MoE (`llama` with `ffn_*_exps` experts),
Qwen3, Qwen3-MoE (`qwen3moe`), Gemma, Gemma 2, Gemma 3 (`gemma3`) and Phi-3, each written here from a tiny HF
golden checkpoint and loaded through `jaxinfer.loading.gguf`.

Oracles:
  * tests/data/tiny_mixtral, tiny_qwen3, tiny_qwen3_moe, tiny_gemma, tiny_gemma2, tiny_gemma3 and tiny_phi3 hold
    golden logits and greedy tokens from HF transformers (PyTorch, f32; scripts/make_golden.py), independent of
    this code base: the GGUF path must give them.
  * The files are written the way llama.cpp's `convert_hf_to_gguf.py` lays them out, from its description, not
    from our loader: tensor names from the `gguf` package's own HF -> GGUF name map (`gguf.get_tensor_name_map`);
    the experts of a layer stacked into one [E, out, in] tensor; Q/K rows permuted for `llama` files only;
    Gemma's norm gains (all of them, Gemma 3's q/k norms too) stored as 1 + w; its tied head without
    `output.weight`; Phi-3's fused qkv / gate_up kept fused, its LongRoPE factors as the `rope_factors_long` /
    `rope_factors_short` tensors with `rope.scaling.attn_factor` and `original_context_length`, its rotated width
    as `rope.dimension_count` and no `key_length`; llama.cpp's metadata keys, and for each family only those
    its converter writes (`_family_meta`). One exception: the tiny Gemma 2 / 3 use `query_pre_attn_scalar` 24,
    which no converter writes and llama.cpp derives from the model size; the files carry it as gguf's
    `attention.scale` (24 ** -0.5), and a control shows what a file without it gives.
  * Controls: the same files without the permutation, without Gemma's + 1, without Gemma 2's soft caps, Gemma 3's
    window, the attention scale or Phi-3's rope factors give other logits, so the goldens pin each of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.loading.gguf import gguf_metadata, load_gguf_weights, read_gguf
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.loading.loader import read_model_config
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig, RopeType
from models.rope import rope_attention_factor, rope_frequencies
from tests.jaxinfer.loading.hf_goldens import DATA, _golden, _logits, _runner
from tests.jaxinfer.loading.test_gguf import _permute_rope_rows

TOL = dict(rtol=1e-4, atol=1e-4)
# tiny checkpoint -> the GGUF `general.architecture` llama.cpp's converter gives it
FAMILIES = {"tiny_mixtral": "llama", "tiny_qwen3": "qwen3", "tiny_qwen3_moe": "qwen3moe", "tiny_gemma": "gemma",
            "tiny_gemma2": "gemma2", "tiny_gemma3": "gemma3", "tiny_phi3": "phi3", "tiny_llama3": "llama"}
OURS = {"tiny_mixtral": "mixtral", "tiny_qwen3_moe": "qwen3_moe", "tiny_gemma3": "gemma3_text"}  # where ours differ
_EXPERT = {"tiny_mixtral": ("block_sparse_moe.experts", ("w1", "w2", "w3")),
           "tiny_qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))}


def _hf(name: str) -> tuple[dict[str, np.ndarray], dict]:
    return load_file(DATA / name / "model.safetensors"), json.loads((DATA / name / "config.json").read_text())


def _llama3_rope_divisors(hf: dict) -> np.ndarray:
    """Meta's `apply_scaling` of Llama 3.1 as per-pair divisors of the plain frequencies, the form llama.cpp's
    converter writes to `rope_freqs.weight`: 1 for wavelengths under original / high_freq_factor, `factor` past
    original / low_freq_factor, and a smooth ramp between."""
    rope, head_dim = hf["rope_scaling"], hf["head_dim"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * hf["rope_theta"] ** (i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def _gguf_tensors(name: str, *, permute: bool | None = None, norm_plus_one: bool = True,
                  rope_freqs: bool = True) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names and layouts (see the module docstring); `permute`
    None permutes Q/K as llama.cpp does (`llama` files only), True / False for every / no file; `rope_freqs`
    False leaves out Llama 3's `rope_freqs` tensor."""
    tensors, hf = _hf(name)
    arch = FAMILIES[name]
    tensors = dict(tensors)
    if name in _EXPERT:  # experts.{j}.<proj>.weight [out, in] -> experts.<proj>.weight [E, out, in]
        block, projections = _EXPERT[name]
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        for i in range(hf["num_hidden_layers"]):
            for proj in projections:
                keys = [f"model.layers.{i}.{block}.{j}.{proj}.weight" for j in range(experts)]
                tensors[f"model.layers.{i}.{block}.{proj}.weight"] = np.stack([tensors.pop(k) for k in keys])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf["num_hidden_layers"])
    out = {}
    for key, w in tensors.items():
        if (arch == "llama" if permute is None else permute) and key.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute_rope_rows(w, hf["num_attention_heads" if "q_proj" in key else "num_key_value_heads"])
        if norm_plus_one and arch.startswith("gemma") and key.endswith("norm.weight"):
            w = w + np.float32(1)
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, key
        out[gguf_name] = w
    if arch == "phi3":  # the converter's extra tensors: LongRoPE's per-pair factors, f32
        for which in ("long", "short"):
            out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[f"ROPE_FACTORS_{which.upper()}"]] + ".weight"] = \
                np.array(hf["rope_parameters"][f"{which}_factor"], np.float32)
    if name == "tiny_llama3" and rope_freqs:  # the converter's llama3 schedule: per-pair divisors, f32
        out["rope_freqs.weight"] = _llama3_rope_divisors(hf)
    return out


def _family_meta(name: str, hf: dict) -> dict:
    """The metadata (keys without the `<arch>.` prefix) llama.cpp's converter writes for `name`'s config beyond
    the shared ones (see the module docstring for Gemma's `attention.scale`)."""
    rope = hf.get("rope_parameters") or {}
    if name == "tiny_gemma2":
        return {"attn_logit_softcapping": float(hf["attn_logit_softcapping"]),
                "final_logit_softcapping": float(hf["final_logit_softcapping"]),
                "attention.sliding_window": hf["sliding_window"],
                "attention.scale": float(hf["query_pre_attn_scalar"]) ** -0.5}
    if name == "tiny_gemma3":  # the global layers' base and scaling; llama.cpp hard-codes the local ones'
        glob = rope["full_attention"]
        assert glob["rope_type"] == "linear" and hf["final_logit_softcapping"] is None
        return {"rope.freq_base": float(glob["rope_theta"]), "rope.scaling.type": "linear",
                "rope.scaling.factor": float(glob["factor"]), "attention.sliding_window": hf["sliding_window"],
                "attention.scale": float(hf["query_pre_attn_scalar"]) ** -0.5}
    if name == "tiny_phi3":
        original, context = rope["original_max_position_embeddings"], hf["max_position_embeddings"]
        scale = context / original
        rotary = int(rope["partial_rotary_factor"] * hf["hidden_size"]) // hf["num_attention_heads"]
        return {"rope.scaling.original_context_length": original, "rope.dimension_count": rotary,
                "attention.sliding_window": hf["sliding_window"] or 0,
                "rope.scaling.attn_factor": math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0}
    return {}


def _write(path: Path, name: str, tensors: dict[str, np.ndarray], f16: bool = False,
           drop: tuple[str, ...] = ()) -> Path:
    """A GGUF file of `tensors` with the metadata llama.cpp's converter writes for `name`'s config, but for the
    keys in `drop` (without the `<arch>.` prefix): f32, or with `f16` its matrices in F16 but for the router
    (`ffn_gate_inp`), which llama.cpp's converter keeps F32."""
    _, hf = _hf(name)
    arch = FAMILIES[name]
    writer = gguf.GGUFWriter(path, arch)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    meta = {
        "block_count": hf["num_hidden_layers"], "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"], "attention.head_count_kv": hf["num_key_value_heads"],
        "rope.freq_base": float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]), "vocab_size": hf["vocab_size"],
        "attention.key_length": head_dim, "attention.value_length": head_dim,
    }
    if name in _EXPERT:
        meta["expert_count"] = hf.get("num_local_experts", hf.get("num_experts"))
        meta["expert_used_count"] = hf["num_experts_per_tok"]
    if "moe_intermediate_size" in hf:
        meta["expert_feed_forward_length"] = hf["moe_intermediate_size"]
    if arch == "phi3":  # its converter writes no key_length: the head is hidden / heads
        del meta["attention.key_length"], meta["attention.value_length"]
    meta.update(_family_meta(name, hf))
    for key, value in meta.items():
        if key in drop:
            continue
        vtype = {float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}.get(type(value),
                                                                                     gguf.GGUFValueType.UINT32)
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    writer.add_name(name)
    for key, w in tensors.items():
        if isinstance(w, tuple):  # (raw block bytes, their type), written as is (test_gguf_quant.py)
            writer.add_tensor(key, w[0], raw_dtype=w[1])
            continue
        half = f16 and w.ndim >= 2 and "ffn_gate_inp" not in key
        writer.add_tensor(key, np.ascontiguousarray(w, np.float16 if half else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def gguf_family(request, tmp_path_factory):
    """(name, GGUF-path config, weights, runner over them)."""
    name = request.param
    path = _write(tmp_path_factory.mktemp("gguf") / f"{name}.gguf", name, _gguf_tensors(name))
    cfg, weights = load_gguf_weights(read_gguf(path))
    return name, path, cfg, weights, _runner(cfg, weights)


def _float32_fields(cfg: ModelConfig, hf_cfg: ModelConfig) -> dict:
    """The fields a GGUF file holds as float32 (the RMSNorm epsilon, Gemma's attention scale, Phi-3's LongRoPE
    factors and attention factor), checked within float32 rounding of `hf_cfg`'s: `hf_cfg`'s values, to replace."""
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-7)
    same = dict(name="", rms_norm_eps=hf_cfg.rms_norm_eps)
    if hf_cfg.query_pre_attn_scalar is not None:
        assert cfg.query_pre_attn_scalar == pytest.approx(hf_cfg.query_pre_attn_scalar, rel=1e-6)
        same["query_pre_attn_scalar"] = hf_cfg.query_pre_attn_scalar
    got, want = cfg.rope_scaling, hf_cfg.rope_scaling
    if want is not None and want.rope_type is RopeType.LONGROPE:
        close = {f: getattr(want, f) for f in ("attention_factor", "short_factor", "long_factor")}
        for field, value in close.items():
            np.testing.assert_allclose(getattr(got, field), value, rtol=1e-7)
        same["rope_scaling"] = dataclasses.replace(got, **close)
        assert same["rope_scaling"] == want  # the rest exactly: type, factor, original context
    if want is not None and want.rope_type is RopeType.LLAMA3:  # the file holds only the divisors
        np.testing.assert_allclose(rope_frequencies(cfg), rope_frequencies(hf_cfg), rtol=1e-6)
        assert rope_attention_factor(cfg) == rope_attention_factor(hf_cfg) == 1.0
        same["rope_scaling"] = want
    return same


def test_gguf_config_equals_the_hf_folders(gguf_family):
    name, path, cfg, _, _ = gguf_family
    hf_cfg, _ = load_hf_weights(DATA / name)
    assert cfg.architecture == OURS.get(name, FAMILIES[name])
    # the whole config: experts, top-k renormalization, q/k norms, Gemma's GeGLU / 1 + w / sqrt(D), tied head, Gemma
    # 2 / 3's layer windows, soft caps, post-norms and local RoPE base, Phi-3's LongRoPE and partial rotary
    same = _float32_fields(cfg, hf_cfg)
    assert dataclasses.replace(cfg, **same) == dataclasses.replace(hf_cfg, **same)
    # from the header alone (Phi-3's rope factors read from their tensors' bytes): the same, but for the head's
    # tying (a tensor)
    header = read_model_config(path)
    assert dataclasses.replace(header, tie_word_embeddings=cfg.tie_word_embeddings, name=cfg.name) == cfg


def test_gguf_logits_match_transformers(gguf_family):
    name, _, _, _, runner = gguf_family
    golden = _golden(DATA / name)
    np.testing.assert_allclose(_logits(runner, golden["token_ids"]), np.array(golden["logits"], np.float32), **TOL)


def test_gguf_greedy_decode_matches_transformers(gguf_family):
    name, _, _, _, runner = gguf_family
    golden = _golden(DATA / name)
    prompt, want = golden["token_ids"], golden["greedy_token_ids"]
    greedy, pages, got = SamplingParams(temperature=0.0), [4, 6, 5, 7, 2], []  # 5 pages: up to 80 tokens
    chunk = ScheduledChunk(prompt, 0, pages)
    for step in range(len(want)):  # decode steps, one token each
        got.append(int(runner.execute([chunk], [SamplingRow(greedy, 0, step=step)]).token_ids[0]))
        chunk = ScheduledChunk([got[-1]], len(prompt) + step, pages)
    assert got == want


@pytest.mark.parametrize("name, control", [("tiny_mixtral", dict(permute=False)), ("tiny_qwen3_moe", dict(permute=True)),
                                           ("tiny_gemma", dict(norm_plus_one=False)),
                                           ("tiny_llama3", dict(rope_freqs=False))])
def test_gguf_conventions_matter(name, control, tmp_path):
    """A llama file left in HF's row order, a qwen3moe file permuted as if it were llama, a Gemma file with HF's
    w, or a Llama 3 file without its `rope_freqs`, loads to other logits: the loader's un-permutation (llama only),
    its - 1 (Gemma) and the RoPE divisors are what the goldens check."""
    tensors = _gguf_tensors(name, **control)
    cfg, weights = load_gguf_weights(read_gguf(_write(tmp_path / "m.gguf", name, tensors)))
    golden = _golden(DATA / name)
    err = np.abs(_logits(_runner(cfg, weights), golden["token_ids"]) - np.array(golden["logits"])).max()
    assert err > 1e-2


def test_f16_gguf_moe_equals_the_hf_weights_rounded_to_f16(tmp_path):
    """F16 experts (3-D tensors), attention and embeddings dequantize to exactly the f16 roundings of the HF
    weights: the logits equal the HF path's over those rounded weights (the router and norms stay f32)."""
    cfg, weights = load_gguf_weights(read_gguf(_write(tmp_path / "f16.gguf", "tiny_mixtral",
                                                      _gguf_tensors("tiny_mixtral"), f16=True)))
    hf_cfg, hf_weights = load_hf_weights(DATA / "tiny_mixtral")
    f16 = lambda a: np.asarray(a).astype(np.float16).astype(np.float32)  # noqa: E731
    layers = dataclasses.replace(hf_weights.layers, **{f: f16(getattr(hf_weights.layers, f)) for f in (
        "wq", "wk", "wv", "wo", "e_gate", "e_up", "e_down")})
    rounded = hf_weights.replace(layers=layers, embed=f16(hf_weights.embed), lm_head=f16(hf_weights.lm_head))
    np.testing.assert_array_equal(weights.layers.e_down, rounded.layers.e_down)
    ids = _golden(DATA / "tiny_mixtral")["token_ids"]
    runner = _runner(cfg, weights)
    got = _logits(runner, ids)
    np.testing.assert_allclose(got, _logits(runner, ids, weights=rounded), **TOL)
    assert np.abs(got - np.array(_golden(DATA / "tiny_mixtral")["logits"])).max() > 1e-5  # f16 did round


# --- MoE files that are refused ---------------------------------------------------------------------------------


def test_gguf_moe_missing_or_misshapen_experts_are_named(tmp_path):
    tensors = _gguf_tensors("tiny_mixtral")
    del tensors["blk.1.ffn_up_exps.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up_exps\.weight'"):
        load_gguf_weights(read_gguf(_write(tmp_path / "missing.gguf", "tiny_mixtral", tensors)))
    tensors = _gguf_tensors("tiny_mixtral")
    tensors["blk.0.ffn_down_exps.weight"] = tensors["blk.0.ffn_down_exps.weight"][:6]  # 6 of 8 experts
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down_exps\.weight' has shape \(6, 64, 32\)"):
        load_gguf_weights(read_gguf(_write(tmp_path / "six.gguf", "tiny_mixtral", tensors)))


@pytest.mark.parametrize("name, change, match", [
    ("tiny_mixtral", {"llama.expert_used_count": None}, "needs llama.expert_used_count >= 1"),
    ("tiny_qwen3_moe", {"qwen3moe.expert_count": None}, "needs qwen3moe.expert_count >= 1"),
    ("tiny_mixtral", {"llama.expert_used_count": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    ("tiny_mixtral", {"llama.expert_shared_count": 1}, r"llama.expert_shared_count=1 is not supported"),
    ("tiny_qwen3_moe", {"qwen3moe.expert_gating_func": 2}, r"qwen3moe.expert_gating_func=2 is not supported"),
    ("tiny_qwen3", {"qwen3.expert_count": 8}, r"qwen3.expert_count=8: experts are read only"),
])
def test_gguf_moe_metadata_errors_name_the_key(tmp_path, name, change, match):
    meta = gguf_metadata(read_gguf(_write(tmp_path / "m.gguf", name, _gguf_tensors(name))))
    meta = {k: v for k, v in {**meta, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(meta)


# --- Gemma 2 / 3 and Phi-3: what their metadata decides ----------------------------------------------------------


@pytest.mark.parametrize("name, drop, changed", [
    ("tiny_gemma2", ("attn_logit_softcapping", "final_logit_softcapping"),
     dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),  # llama.cpp's and Gemma2Config's defaults
    ("tiny_gemma2", ("attention.scale",), dict(query_pre_attn_scalar=32.0)),  # llama.cpp's rule: head_dim
    ("tiny_gemma3", ("attention.sliding_window",), dict(layer_sliding_windows=(None,) * 7)),  # every layer global
    ("tiny_phi3", ("rope_factors_long.weight", "rope_factors_short.weight"), dict(rope_scaling=None)),
])
def test_gguf_gemma_and_phi3_metadata_matters(name, drop, changed, tmp_path):
    """A Gemma 2 file without its soft caps (the defaults 50 / 30 apply) or its attention scale (llama.cpp's rule
    applies), a Gemma 3 file without its window, or a Phi-3 file without its rope factor tensors loads to the
    config llama.cpp would run and to other logits than transformers': each key is what the goldens check."""
    tensors = {k: v for k, v in _gguf_tensors(name).items() if k not in drop}
    cfg, weights = load_gguf_weights(read_gguf(_write(tmp_path / "m.gguf", name, tensors, drop=drop)))
    assert {field: getattr(cfg, field) for field in changed} == changed
    golden = _golden(DATA / name)
    err = np.abs(_logits(_runner(cfg, weights), golden["token_ids"]) - np.array(golden["logits"])).max()
    assert err > 1e-2


def _meta(tmp_path: Path, name: str) -> dict:
    return gguf_metadata(read_gguf(_write(tmp_path / "m.gguf", name, _gguf_tensors(name))))


def test_gguf_gemma_layer_pattern_and_attention_scale_rules(tmp_path):
    """llama.cpp's assumptions where the converter writes nothing: a `sliding_window_pattern` period or bool list
    when a file has one, and the 27B models' attention scale (hidden / heads) chosen by their layer count."""
    meta = _meta(tmp_path, "tiny_gemma3")
    cfg = ModelConfig.from_gguf_metadata(meta)
    local = [w is not None for w in cfg.layer_sliding_windows]
    assert local == [True] * 5 + [False, True]  # the 5 : 1 pattern llama.cpp hard-codes, = the HF config's
    as_list = ModelConfig.from_gguf_metadata({**meta, "gemma3.attention.sliding_window_pattern": local})
    assert as_list.layer_sliding_windows == cfg.layer_sliding_windows
    period_2 = ModelConfig.from_gguf_metadata({**meta, "gemma3.attention.sliding_window_pattern": 2})
    assert period_2.layer_sliding_windows == (20, None) * 3 + (20,)
    no_scale = {k: v for k, v in meta.items() if k != "gemma3.attention.scale"}
    assert ModelConfig.from_gguf_metadata(no_scale).query_pre_attn_scalar == 16.0  # head_dim
    big = ModelConfig.from_gguf_metadata({**no_scale, "gemma3.block_count": 62})
    assert big.query_pre_attn_scalar == 8.0  # hidden 32 / 4 heads, as llama.cpp's 27B rule
    assert cfg.rope_local_theta == 10000.0 and cfg.sliding_window is None


@pytest.mark.parametrize("name, change, match", [
    ("tiny_gemma2", {"gemma2.attn_logit_softcapping": -5.0},
     r"gemma2\.attn_logit_softcapping=-5\.0 must be a positive number"),
    ("tiny_gemma2", {"gemma2.attention.sliding_window_pattern": [True, False]},
     r"gemma2\.attention\.sliding_window_pattern=\[True, False\] must be a period >= 1 or one bool per layer"),
    ("tiny_gemma3", {"gemma3.attention.sliding_window": 2.5}, r"gemma3\.attention\.sliding_window=2\.5 must be a "
                                                              "positive integer"),
    ("tiny_gemma3", {"gemma3.attention.scale": "x"}, r"gemma3\.attention\.scale='x' must be a positive number"),
    ("tiny_gemma3", {"gemma3.rope.freq_base_swa": -1.0}, r"gemma3\.rope\.freq_base_swa=-1\.0"),
    ("tiny_phi3", {"rope_factors_short.weight": None}, r"tensor 'rope_factors_short\.weight' is missing"),
    ("tiny_phi3", {"rope_factors_long.weight": [1.0] * 5},
     r"'rope_factors_long\.weight' \(5 values\) .* phi3\.rope\.dimension_count / 2 = 6"),
    ("tiny_phi3", {"phi3.rope.dimension_count": 13}, r"phi3\.rope\.dimension_count=13 must be an even number"),
    ("tiny_phi3", {"phi3.rope.scaling.type": "yarn"}, r"phi3\.rope\.scaling\.type='yarn' with rope_factors"),
    ("tiny_llama3", {"rope_freqs.weight": [1.0] * 7}, r"'rope_freqs\.weight' \(7 values\) .* = 8 each"),
    ("tiny_llama3", {"rope_freqs.weight": [1.0] * 7 + [0.0]}, r"'rope_freqs\.weight' holds a divisor that is not"),
    ("tiny_llama3", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
     r"'rope_freqs\.weight' with llama\.rope\.scaling\.type='linear'"),
])
def test_gguf_gemma_and_phi3_metadata_errors_name_the_key(tmp_path, name, change, match):
    meta = {k: v for k, v in {**_meta(tmp_path, name), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(meta)


def test_gguf_phi3_f16_rope_factors_read_alike_from_the_header_and_the_file(tmp_path):
    tensors = _gguf_tensors("tiny_phi3")
    tensors["rope_factors_long.weight"] = tensors["rope_factors_long.weight"].astype(np.float16)
    path = _write(tmp_path / "f16.gguf", "tiny_phi3", tensors)
    header, (cfg, _) = read_model_config(path), load_gguf_weights(read_gguf(path))
    assert header.rope_scaling == cfg.rope_scaling
    want = _hf("tiny_phi3")[1]["rope_parameters"]["long_factor"]
    np.testing.assert_allclose(header.rope_scaling.long_factor, want, rtol=1e-3)  # f16 rounding
