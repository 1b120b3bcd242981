"""The prepared-model cache (`jaxinfer.loading.model_cache`): a GGUF file's second load restores the first one's
result exactly (config, every weight bit for bit, tokenizer) without opening the file's tensors; a changed file,
dtype or loader makes a new key; storing replaces older entries of the same file; an empty folder turns it off."""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.loading import gguf, loader, model_cache
from jaxinfer.loading.loader import default_model_path, load_model
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(model_cache.CACHE_VARIABLE, str(tmp_path / "models"))
    return tmp_path / "models"


def test_a_second_load_restores_the_first_exactly(cache, monkeypatch):
    first = load_model(None, np.dtype(ml_dtypes.bfloat16))
    entries = list(cache.iterdir())
    assert len(entries) == 1 and model_cache.lookup(default_model_path(), np.dtype(ml_dtypes.bfloat16)) == entries[0]
    monkeypatch.setattr(loader, "read_gguf", lambda *_: pytest.fail("the GGUF file was read again"))
    cfg, weights, tokenizer = load_model(None, np.dtype(ml_dtypes.bfloat16))
    assert cfg == first[0]
    assert jax.tree.structure(weights) == jax.tree.structure(first[1])
    for got, want in zip(jax.tree.leaves(weights), jax.tree.leaves(first[1]), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got.view(np.uint16),
                                                                                      want.view(np.uint16))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld <|im_end|> 12"}]
    assert tokenizer.apply_chat_template(messages) == first[2].apply_chat_template(messages)
    assert tokenizer.encode(messages[1]["content"]) == first[2].encode(messages[1]["content"])
    assert tokenizer.eos_ids == first[2].eos_ids and tokenizer.vocab_size == first[2].vocab_size


def test_the_key_follows_the_content_and_the_dtype_and_old_entries_go(cache, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(gguf.__file__, model)  # only its content and name enter the key
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    key = model_cache.entry_path(model, f32)
    assert model_cache.entry_path(model, bf16) != key
    (tmp_path / "clone").mkdir()
    shutil.copy(model, tmp_path / "clone" / "m.gguf")  # another checkout's copy of the same file: the same entry
    os.utime(tmp_path / "clone" / "m.gguf", ns=(1, 2))
    assert model_cache.entry_path(tmp_path / "clone" / "m.gguf", f32) == key
    model.write_bytes(model.read_bytes() + b"#")
    newer = model_cache.entry_path(model, f32)
    assert newer != key and newer.parent == key.parent == cache
    key.mkdir(parents=True)  # an entry of the file as it was
    (key / "config.json").write_text("{}")
    assert model_cache.lookup(model, f32) is None  # not the changed file's
    cfg, weights, tokenizer = load_model(make_tiny_model_dir(tmp_path / "tiny"), f32)  # any model
    assert model_cache.store(model, f32, cfg, weights, tokenizer) == newer
    assert not key.exists() and model_cache.lookup(model, f32) == newer


def test_an_empty_folder_turns_the_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv(model_cache.CACHE_VARIABLE, "")
    assert model_cache.cache_dir() is None and model_cache.entry_path(default_model_path(), np.float32) is None
    assert model_cache.store(default_model_path(), np.float32, None, None, None) is None


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "swapped", "config edited"])
def test_a_damaged_entry_is_deleted_and_the_model_file_loaded_again(cache, monkeypatch, damage):
    first = load_model(None, np.dtype(ml_dtypes.bfloat16))
    (entry,) = cache.iterdir()
    weights = entry / "weights.safetensors"
    data = weights.read_bytes()
    middle = len(data) // 2
    if damage == "truncated":
        weights.write_bytes(data[:1000])
    elif damage == "overwritten":  # the same size, parseable, one weight's bytes changed: only the checksum can tell
        weights.write_bytes(data[:middle] + bytes(b ^ 0x5A for b in data[middle:middle + 64]) + data[middle + 64:])
    elif damage == "swapped":  # two blocks of words trade places (rows swapped): the same words, other positions
        a, b = data[middle:middle + 64], data[middle + 4096:middle + 4160]
        assert a != b
        weights.write_bytes(data[:middle] + b + data[middle + 64:middle + 4096] + a + data[middle + 4160:])
    else:  # valid JSON, another RoPE base: only the config's digest can tell
        config = json.loads((entry / "config.json").read_text())
        config["rope_theta"] = config["rope_theta"] / 20
        (entry / "config.json").write_text(json.dumps(config))
    loaded = []
    monkeypatch.setattr(loader, "read_gguf", lambda *a, **k: loaded.append(1) or real_read_gguf(*a, **k))
    cfg, weights_again, _ = load_model(None, np.dtype(ml_dtypes.bfloat16))
    assert loaded and cfg == first[0]  # read from the GGUF file again
    for got, want in zip(jax.tree.leaves(weights_again), jax.tree.leaves(first[1]), strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert model_cache.lookup(default_model_path(), np.dtype(ml_dtypes.bfloat16)) is not None  # stored anew


real_read_gguf = loader.read_gguf


def test_the_mapped_reader_reads_what_safetensors_wrote(tmp_path):
    """`read_mapped` (the restore's zero-copy reader) against the safetensors library's own reader, every dtype the
    cache may hold and odd shapes; a cut file is a ValueError (a damaged entry, reloaded), not a crash."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    arrays = {"a/f32": rng.standard_normal((3, 5)).astype(np.float32),
              "b/bf16": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
              "c/f16": rng.standard_normal((2, 1, 3)).astype(np.float16),
              "d/i32": rng.integers(-9, 9, (4, 4)).astype(np.int32), "e/u8": rng.integers(0, 255, (5,)).astype(np.uint8),
              "f/scalar": np.array(2.5, np.float32), "g/empty": np.zeros((0, 3), np.float32)}
    save_file(arrays, tmp_path / "w.safetensors", metadata={"source": "test"})
    got, want = model_cache.read_mapped(tmp_path / "w.safetensors"), load_file(tmp_path / "w.safetensors")
    assert sorted(got) == sorted(want) == sorted(arrays)
    for name in arrays:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert got[name].tobytes() == want[name].tobytes() == arrays[name].tobytes()
        assert not got[name].flags.writeable
    data = (tmp_path / "w.safetensors").read_bytes()
    for cut in (4, len(data) - 3):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(ValueError):
            model_cache.read_mapped(tmp_path / "cut.safetensors")
