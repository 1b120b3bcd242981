"""GGUF files of the families beyond Llama / Qwen2: a Mixtral-style MoE (`llama` with `ffn_*_exps` experts),
Qwen3, Qwen3-MoE (`qwen3moe`) and Gemma, each written here from a tiny HF golden checkpoint and loaded through
`jaxinfer.loading.gguf`.

Oracles:
  * tests/data/tiny_mixtral, tiny_qwen3, tiny_qwen3_moe and tiny_gemma hold golden logits and greedy tokens from HF
    transformers (PyTorch, f32; scripts/make_golden.py), independent of this code base: the GGUF path must give
    them.
  * The files are written the way llama.cpp's `convert_hf_to_gguf.py` lays them out, from its description, not
    from our loader: tensor names from the `gguf` package's own HF -> GGUF name map (`gguf.get_tensor_name_map`);
    the experts of a layer stacked into one [E, out, in] tensor; Q/K rows permuted for `llama` files only;
    Gemma's norm gains stored as 1 + w; its tied head without `output.weight`; llama.cpp's metadata keys.
  * Controls: the same files without the permutation, or without Gemma's + 1, give other logits, so the goldens
    pin both conventions.
"""

from __future__ import annotations

import dataclasses
import json
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
from models.config import ModelConfig
from tests.jaxinfer.loading.hf_goldens import DATA, _golden, _logits, _runner
from tests.jaxinfer.loading.test_gguf import _permute_rope_rows

TOL = dict(rtol=1e-4, atol=1e-4)
# tiny checkpoint -> the GGUF `general.architecture` llama.cpp's converter gives it
FAMILIES = {"tiny_mixtral": "llama", "tiny_qwen3": "qwen3", "tiny_qwen3_moe": "qwen3moe", "tiny_gemma": "gemma"}
_EXPERT = {"tiny_mixtral": ("block_sparse_moe.experts", ("w1", "w2", "w3")),
           "tiny_qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))}


def _hf(name: str) -> tuple[dict[str, np.ndarray], dict]:
    return load_file(DATA / name / "model.safetensors"), json.loads((DATA / name / "config.json").read_text())


def _gguf_tensors(name: str, *, permute: bool | None = None, norm_plus_one: bool = True) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names and layouts (see the module docstring); `permute`
    None permutes Q/K as llama.cpp does (`llama` files only), True / False for every / no file."""
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
        if norm_plus_one and arch == "gemma" and key.endswith("norm.weight"):
            w = w + np.float32(1)
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, key
        out[gguf_name] = w
    return out


def _write(path: Path, name: str, tensors: dict[str, np.ndarray], f16: bool = False) -> Path:
    """A GGUF file of `tensors` with the metadata llama.cpp's converter writes for `name`'s config: f32, or with
    `f16` its matrices in F16 but for the router (`ffn_gate_inp`), which llama.cpp's converter keeps F32."""
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
    for key, value in meta.items():
        writer.add_key_value(f"{arch}.{key}", value,
                             gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32)
    writer.add_name(name)
    for key, w in tensors.items():
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


def test_gguf_config_equals_the_hf_folders(gguf_family):
    name, path, cfg, _, _ = gguf_family
    hf_cfg, _ = load_hf_weights(DATA / name)
    assert cfg.architecture == {"llama": "mixtral", "qwen3moe": "qwen3_moe"}.get(FAMILIES[name], FAMILIES[name])
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-7)  # GGUF holds it as a float32
    # the whole config: experts, top-k renormalization, q/k norms, Gemma's GeGLU / 1 + w / sqrt(D), tied head
    same = dict(name="", rms_norm_eps=hf_cfg.rms_norm_eps)
    assert dataclasses.replace(cfg, **same) == dataclasses.replace(hf_cfg, **same)
    header = read_model_config(path)  # from the header alone: the same, but for the head's tying (a tensor)
    assert dataclasses.replace(header, tie_word_embeddings=cfg.tie_word_embeddings, **same) == \
        dataclasses.replace(cfg, **same)


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
                                           ("tiny_gemma", dict(norm_plus_one=False))])
def test_gguf_conventions_matter(name, control, tmp_path):
    """A llama file left in HF's row order, a qwen3moe file permuted as if it were llama, or a Gemma file with HF's
    w, loads to other logits: the loader's un-permutation (llama only) and its - 1 (Gemma) are what the goldens
    check."""
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
