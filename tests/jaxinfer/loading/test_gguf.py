"""Tests for jaxinfer.loading.gguf: GGUF files written here against the HF path, errors.

Oracles:
  * tests/data/tiny_llama3 and tiny_qwen2 hold golden logits and greedy tokens computed by HF transformers
    (PyTorch, f32; see scripts/make_golden.py), independent of this code base.
  * GGUF files are written here with `gguf.GGUFWriter` the way llama.cpp's converter lays them out (its tensor
    names, metadata keys and the Q/K row permutation, written below from their description, not from the loader),
    from the same safetensors weights; the GGUF path must then reproduce the HF path's logits.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from jaxinfer.loading.gguf import gguf_metadata, load_gguf_weights, read_gguf, read_gguf_header
from jaxinfer.loading.loader import default_model_path, load_model, read_model_config
from jaxinfer.loading.hf import load_hf_weights
from tests.jaxinfer.loading.hf_goldens import LLAMA3, _golden, _hf_copy, _logits, _runner, llama_src

__all__ = ["llama_src"]  # a fixture, used by name


# --- (b) GGUF written here, against the HF path ----------------------------------------------------------------------

# llama.cpp tensor names for HF names (the converter's mapping for Llama).
_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.<rest>
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def _permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF converters' Q/K row order: within each head, rows go from half-split (all first halves of the rotary
    pairs, then all second halves) to interleaved pairs (first, second, first, second, ...)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf_tensors: dict[str, np.ndarray], hf_cfg: dict, permute: bool = True) -> dict[str, np.ndarray]:
    out = {}
    for name, w in hf_tensors.items():
        if permute and name.endswith("self_attn.q_proj.weight"):
            w = _permute_rope_rows(w, hf_cfg["num_attention_heads"])
        elif permute and name.endswith("self_attn.k_proj.weight"):
            w = _permute_rope_rows(w, hf_cfg["num_key_value_heads"])
        out[_gguf_name(name)] = w
    return out


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], hf_cfg: dict, *, arch: str = "llama",
                qtype: GGMLQuantizationType | None = None, drop_keys: tuple[str, ...] = ()) -> Path:
    """Writes metadata (llama.cpp keys) and tensors; 2-D tensors quantized to `qtype` when given (norms stay F32,
    as llama.cpp's quantizer keeps them)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny-llama3-gguf")
    meta = {
        "block_count": (writer.add_block_count, hf_cfg["num_hidden_layers"]),
        "context_length": (writer.add_context_length, hf_cfg["max_position_embeddings"]),
        "embedding_length": (writer.add_embedding_length, hf_cfg["hidden_size"]),
        "feed_forward_length": (writer.add_feed_forward_length, hf_cfg["intermediate_size"]),
        "attention.head_count": (writer.add_head_count, hf_cfg["num_attention_heads"]),
        "attention.head_count_kv": (writer.add_head_count_kv, hf_cfg["num_key_value_heads"]),
        "rope.freq_base": (writer.add_rope_freq_base, hf_cfg["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (writer.add_layer_norm_rms_eps, hf_cfg["rms_norm_eps"]),
        "vocab_size": (writer.add_vocab_size, hf_cfg["vocab_size"]),
        "rope.dimension_count": (writer.add_rope_dimension_count, hf_cfg["head_dim"]),
    }
    for key, (add, value) in meta.items():
        if key not in drop_keys:
            add(value)
    for name, w in tensors.items():
        if isinstance(w, tuple):  # (raw block bytes, their type), written as is
            writer.add_tensor(name, w[0], raw_dtype=w[1])
            continue
        w = np.ascontiguousarray(w, np.float32)
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def plain_rope(llama_src, tmp_path_factory):
    """tiny_llama3 without rope_scaling (GGUF metadata has no llama3 schedule), loaded through the HF path.

    Returns (HF-path config, runner over its weights, its logits on the golden prompt, prompt, tmp dir).
    """
    tensors, hf_cfg = llama_src
    hf_cfg = {k: v for k, v in hf_cfg.items() if k != "rope_scaling"}
    tmp = tmp_path_factory.mktemp("gguf")
    cfg, weights = load_hf_weights(_hf_copy(tmp / "tiny_llama3_plain", tensors, hf_cfg))
    assert cfg.rope_scaling is None
    runner = _runner(cfg, weights)
    prompt = _golden(LLAMA3)["token_ids"]
    ref = _logits(runner, prompt)
    # Sanity: dropping the llama3 schedule changes this model's logits, so the goldens alone pin the schedule.
    assert np.abs(ref - np.array(_golden(LLAMA3)["logits"])).max() > 1e-2
    return cfg, runner, ref, prompt, hf_cfg, tmp


def _load_gguf(path: Path):
    return load_gguf_weights(read_gguf(path))


def test_gguf_f32_matches_hf_path(llama_src, plain_rope):
    tensors, _ = llama_src
    cfg_hf, runner, ref, prompt, hf_cfg, tmp = plain_rope
    cfg, weights = _load_gguf(_write_gguf(tmp / "f32.gguf", _gguf_tensors(tensors, hf_cfg), hf_cfg))
    assert cfg.name == "tiny-llama3-gguf"
    # GGUF stores the epsilon as f32 (1e-5 -> 9.99999975e-06); everything else must be identical.
    assert cfg.rms_norm_eps == pytest.approx(cfg_hf.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(cfg, name="", rms_norm_eps=0.0) == dataclasses.replace(cfg_hf, name="", rms_norm_eps=0.0)
    # Run it with its own config, as a user of the GGUF file would.
    np.testing.assert_allclose(_logits(_runner(cfg, weights), prompt), ref, rtol=1e-6, atol=1e-6)


def test_gguf_q8_0_matches_hf_path_within_quantization_error(llama_src, plain_rope):
    tensors, _ = llama_src
    _, runner, ref, prompt, hf_cfg, tmp = plain_rope
    q8 = GGMLQuantizationType.Q8_0
    _, weights = _load_gguf(_write_gguf(tmp / "q8.gguf", _gguf_tensors(tensors, hf_cfg), hf_cfg, qtype=q8))
    got = _logits(runner, prompt, weights)

    # Exact check of the loader's plumbing: the HF path over the same Q8_0-rounded weights (quantized per row of
    # the [out, in] matrices, which the row permutation only reorders) must give the same logits.
    rounded = {k: gguf.quants.dequantize(gguf.quants.quantize(v, q8), q8).reshape(v.shape) if v.ndim == 2 else v
               for k, v in tensors.items()}
    _, rounded_weights = load_hf_weights(_hf_copy(tmp / "tiny_llama3_q8_rounded", rounded, hf_cfg))
    np.testing.assert_allclose(got, _logits(runner, prompt, rounded_weights), rtol=1e-5, atol=1e-5)

    # Against the unquantized model. Q8_0 rounds each weight to int8 times its 32-block's max|w|/127; r below is
    # the resulting relative RMS weight noise (~0.5% here). Independent noise in the 18 quantized matrices adds in
    # quadrature (sqrt(18) ~ 4.2) and passes through two residual layers, so the logits' RMS error should be a
    # few r times their spread: 10 r bounds it with ~2x margin (measured ~5.5 r). The worst single logit is a
    # tail of ~5000 values: 5x the RMS bound.
    matrices = [k for k, v in tensors.items() if v.ndim == 2]
    r = np.sqrt(sum(np.sum((rounded[k] - tensors[k]) ** 2) for k in matrices)
                / sum(np.sum(tensors[k] ** 2) for k in matrices))
    assert 1e-3 < r < 1e-2
    bound = 10 * r * ref.std()
    err = got - ref
    assert 0 < np.sqrt(np.mean(err**2)) < bound, (np.sqrt(np.mean(err**2)), bound)
    assert np.abs(err).max() < 5 * bound

    # ... and the bound is not trivially loose: the same Q8_0 file without the Q/K row permutation (what a loader
    # that forgot to undo it would compute) misses by far more.
    _, unpermuted = _load_gguf(_write_gguf(tmp / "q8_unpermuted.gguf", _gguf_tensors(tensors, hf_cfg, permute=False),
                                           hf_cfg, qtype=q8))
    assert np.sqrt(np.mean((_logits(runner, prompt, unpermuted) - ref) ** 2)) > 5 * bound


# --- (c) errors --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_parts(llama_src):
    tensors, hf_cfg = llama_src
    hf_cfg = {k: v for k, v in hf_cfg.items() if k != "rope_scaling"}
    return _gguf_tensors(tensors, hf_cfg), hf_cfg


def test_gguf_missing_tensor(gguf_parts, tmp_path):
    tensors, hf_cfg = gguf_parts
    tensors = {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        _load_gguf(_write_gguf(tmp_path / "m.gguf", tensors, hf_cfg))


@pytest.mark.parametrize("name", ["blk.0.ffn_up.weight", "blk.1.attn_k.weight", "output.weight"])
def test_gguf_tensor_with_wrong_shape(gguf_parts, tmp_path, name):
    # Transposed (same element count, so only a shape check can catch it).
    tensors, hf_cfg = gguf_parts
    tensors = dict(tensors)
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _load_gguf(_write_gguf(tmp_path / "m.gguf", tensors, hf_cfg))


def test_gguf_tensor_with_wrong_row_count(gguf_parts, tmp_path):
    tensors, hf_cfg = gguf_parts
    tensors = dict(tensors)
    tensors["blk.0.attn_q.weight"] = tensors["blk.0.attn_q.weight"][:-4]
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight"):
        _load_gguf(_write_gguf(tmp_path / "m.gguf", tensors, hf_cfg))


def test_gguf_unknown_architecture(gguf_parts, tmp_path):
    tensors, hf_cfg = gguf_parts
    with pytest.raises(ValueError, match="gpt2"):
        _load_gguf(_write_gguf(tmp_path / "m.gguf", tensors, hf_cfg, arch="gpt2"))


def test_gguf_missing_metadata_key(gguf_parts, tmp_path):
    tensors, hf_cfg = gguf_parts
    with pytest.raises(ValueError, match=r"llama\.block_count"):
        _load_gguf(_write_gguf(tmp_path / "m.gguf", tensors, hf_cfg, drop_keys=("block_count",)))


def test_gguf_quantization_type_gguf_cannot_dequantize(gguf_parts, tmp_path):
    # Q8_1 is a valid GGML type (block of 32: f16 scale, f16 sum, 32 x int8 = 36 bytes) that gguf-py has no
    # dequantizer for; the bytes below are a well-formed Q8_1 tensor of the right shape.
    if GGMLQuantizationType.Q8_1 in gguf.quants._type_traits:
        pytest.skip("this gguf version dequantizes Q8_1; pick another type it lacks")
    tensors, hf_cfg = gguf_parts
    rows, cols = tensors["blk.0.ffn_gate.weight"].shape
    block, type_size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    raw = np.zeros((rows, cols // block * type_size), np.uint8)
    tensors = {**tensors, "blk.0.ffn_gate.weight": (raw, GGMLQuantizationType.Q8_1)}
    path = _write_gguf(tmp_path / "q81.gguf", tensors, hf_cfg)
    assert read_gguf(path).get_tensor(0) is not None  # gguf-py itself reads the file
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate\.weight.*Q8_1"):
        _load_gguf(path)


@pytest.mark.parametrize("content", ["random", "empty", "truncated"])
def test_read_gguf_rejects_non_gguf(gguf_parts, tmp_path, content):
    path = tmp_path / "not.gguf"
    if content == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif content == "empty":
        path.write_bytes(b"")
    else:
        tensors, hf_cfg = gguf_parts
        whole = _write_gguf(tmp_path / "whole.gguf", tensors, hf_cfg).read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="not.gguf"):
        _load_gguf(path)


def test_header_reader_gives_the_metadata_and_config_without_the_tensors(gguf_parts, tmp_path):
    """`read_gguf_header` (what start-up checks options against before the load) agrees with the gguf package's
    reader on every key but its own GGUF.* entries, and `read_model_config` with the config the load builds
    (less what only the tensors tell: tied embeddings, biases)."""
    tensors, hf_cfg = gguf_parts
    path = _write_gguf(tmp_path / "m.gguf", tensors, hf_cfg)
    full = {k: v for k, v in gguf_metadata(read_gguf(path)).items() if not k.startswith("GGUF.")}
    assert read_gguf_header(path) == full
    loaded, _ = _load_gguf(path)
    peeked = read_model_config(path)
    assert dataclasses.replace(loaded, tie_word_embeddings=peeked.tie_word_embeddings,
                               attention_bias=peeked.attention_bias, mlp_bias=peeked.mlp_bias) == peeked
    whole = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:40])
    with pytest.raises(ValueError, match="cut.gguf' is truncated: it ends inside its GGUF header, at 40 bytes"):
        read_gguf_header(tmp_path / "cut.gguf")


@pytest.mark.parametrize("cut", [100_000, 1_000_000])  # inside the vocabulary's strings, inside the merges'
def test_header_reader_skips_a_real_vocabulary_and_finds_cuts_inside_it(tmp_path, cut):
    """SmolLM2's 49,152 tokens and its merges are skipped without decoding (`_HeaderReader.skip_strings`), with
    the same metadata as the gguf package's reader, and a file cut inside them is named truncated."""
    from jaxinfer.loading.loader import default_model_path

    path = default_model_path()
    full = {k: v for k, v in gguf_metadata(read_gguf(path)).items() if not k.startswith("GGUF.")}
    assert read_gguf_header(path) == full and full["tokenizer.ggml.tokens.count"] == 49152
    with open(path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(cut))
    with pytest.raises(ValueError, match=f"cut.gguf' is truncated: it ends inside its GGUF header, at {cut} bytes"):
        read_gguf_header(tmp_path / "cut.gguf")


def test_read_gguf_parses_a_file_once_until_it_changes(gguf_parts, tmp_path):
    """A file's parsed reader is shared (the gguf package parses every field on open: seconds for a real
    vocabulary), never past a change to the file, and only the last two files' readers are kept."""
    tensors, hf_cfg = gguf_parts
    path = _write_gguf(tmp_path / "a.gguf", tensors, hf_cfg)
    first = read_gguf(path)
    assert read_gguf(path) is first and read_gguf(tmp_path / "." / "a.gguf") is first  # one file, two spellings
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: parsed afresh
    touched = read_gguf(path)
    assert touched is not first
    _write_gguf(path, tensors, {**hf_cfg, "rope_theta": 1234.0})  # rewritten in place: the new metadata
    assert read_gguf(path) is not touched
    assert read_gguf(path).fields["llama.rope.freq_base"].contents() == 1234.0
    rewritten = read_gguf(path)
    for other in ("b.gguf", "c.gguf"):  # two more files push the first out
        assert read_gguf(_write_gguf(tmp_path / other, tensors, hf_cfg)) is not rewritten
    assert read_gguf(path) is not rewritten


# --- (c) files that are cut short or are not GGUF: a ValueError naming the file and what is wrong ----------------

SMOLLM2 = default_model_path()
SMOLLM2_BYTES = SMOLLM2.stat().st_size
HEADER_BYTES = 1 << 21  # the SmolLM2 GGUF's header (metadata, tokenizer, tensor list) lies in its first 2 MiB


def _cut(tmp_path: Path, size: int, name: str = "cut.gguf") -> Path:
    """A file of `size` bytes that starts like the SmolLM2 GGUF (past its header: zeros, written sparsely)."""
    path = tmp_path / name
    with open(SMOLLM2, "rb") as src, open(path, "wb") as f:
        f.write(src.read(min(size, HEADER_BYTES)))
        f.truncate(size)
    return path


def _refused(path: Path) -> list[str]:
    """The messages of read_model_config (start-up's check) and load_model (the load) for `path`."""
    messages = []
    for read in (read_model_config, lambda p: load_model(p, np.float32)):
        with pytest.raises(ValueError) as e:
            read(path)
        messages.append(str(e.value))
    return messages


def _last_tensor() -> tuple[str, int]:
    """(name, end in bytes) of the SmolLM2 GGUF's tensor whose data ends last, by the gguf package's reader."""
    end, name = max((t.data_offset + t.n_bytes, t.name) for t in gguf.GGUFReader(SMOLLM2).tensors)
    return name, end


@pytest.mark.parametrize("size", [SMOLLM2_BYTES // 2, SMOLLM2_BYTES - 1], ids=["half", "one_byte_short"])
def test_a_gguf_cut_short_in_its_tensors_is_named_truncated(tmp_path, size):
    """Found by a hostile-user trial: the first half of the SmolLM2 GGUF failed with a numpy reshape error."""
    name, end = _last_tensor()
    assert end == SMOLLM2_BYTES  # the whole file ends with the last tensor's data
    path = _cut(tmp_path, size)
    expected = f"{str(path)!r} is truncated: {size} bytes, but its last tensor ({name!r}) ends at byte {end} (an " \
        "interrupted download or copy?)"
    assert _refused(path) == [expected, expected]


@pytest.mark.parametrize("size", [5, 24, 1000, 1 << 20])
def test_a_gguf_cut_short_in_its_header_is_named_truncated(tmp_path, size):
    path = _cut(tmp_path, size)
    expected = f"{str(path)!r} is truncated: it ends inside its GGUF header, at {size} bytes (an interrupted " \
        "download or copy?)"
    assert _refused(path) == [expected, expected]


def test_a_whole_gguf_passes_the_check(tmp_path):
    assert read_model_config(_cut(tmp_path, SMOLLM2_BYTES)) == read_model_config(SMOLLM2)


@pytest.mark.parametrize("content, what", [
    (b"", "is empty (0 bytes), not a GGUF file"),
    (b"PK\x03\x04 a zip file, not a GGUF one", "is not a GGUF file: it does not start with the GGUF magic bytes"),
    (b"GGUF\x01\x00\x00\x00" + bytes(16), "is GGUF version 1; versions 2 and 3 are supported"),
    (b"GGUF\x03\x00\x00\x00" + bytes(8) + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"k"
     + (99).to_bytes(4, "little"), "is not a valid GGUF file: value type 99 is not a GGUF type"),
], ids=["empty", "zip", "version1", "bad_value_type"])
def test_a_file_that_is_not_gguf_is_named(tmp_path, content, what):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert _refused(path) == [f"{str(path)!r} {what}"] * 2


@pytest.mark.parametrize("padded", [True, False], ids=["as_gguf_writer_pads_it", "cut_at_the_header_end"])
def test_a_gguf_with_no_tensors_is_named(gguf_parts, tmp_path, padded):
    """Found by a new-user trial: a valid header that lists no tensors (a vocabulary-only GGUF) failed as a
    truncated file whose "last tensor (None)" ended past its end, or, padded to the data alignment as GGUFWriter
    writes it, got past the start-up check."""
    _, hf_cfg = gguf_parts
    path = _write_gguf(tmp_path / "vocab_only.gguf", {}, hf_cfg)
    reader = gguf.GGUFReader(path)
    assert not reader.tensors  # the gguf package reads it: the header is valid
    if not padded:
        header_end = max(f.offset + sum(part.nbytes for part in f.parts) for f in reader.fields.values())
        with open(path, "r+b") as f:
            f.truncate(header_end)
    assert _refused(path) == [f"{str(path)!r} holds no tensors: its GGUF header lists no weights (a vocabulary-only "
                              "GGUF?)"] * 2
