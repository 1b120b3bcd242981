"""The quality workload's flip prompts, the character tokenizer for tokenizer-less HF folders, and golden.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer.benchmarks.quality_runs import flip_prompts, has_tokenizer, hf_golden, loadable, with_char_tokenizer
from jaxinfer.tokenizer import Tokenizer
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA


def test_flip_prompts_hand_case():
    ids = list(range(10))
    # points 10 * (i + 1) // 4 = 2, 5, 7, 10; prompts: the up to 3 ids before each point
    assert flip_prompts(ids, 4, 3) == [[0, 1], [2, 3, 4], [4, 5, 6], [7, 8, 9]]
    assert flip_prompts(ids, 1, 100) == [ids]
    for bad in ((0, 3), (11, 3), (2, 0)):
        with pytest.raises(ValueError, match="flips"):
            flip_prompts(ids, *bad)


def test_char_tokenizer_folder(tmp_path):
    assert not has_tokenizer(TINY_LLAMA)
    folder = loadable(str(TINY_LLAMA), tmp_path / "tiny")
    assert has_tokenizer(folder) and not (folder / "golden.json").exists()
    assert (folder / "model.safetensors").resolve() == (TINY_LLAMA / "model.safetensors").resolve()
    tok = Tokenizer.from_hf_dir(folder)
    text = "def f(x):\n\treturn x  # é"
    expected = [ord(c) if ord(c) < 128 else 0 for c in text]  # ASCII code, else <unk> (0)
    assert tok.encode(text) == expected and tok.vocab_size == 128
    assert tok.decode(tok.encode("a b\n")) == "a b\n"
    assert loadable(None, tmp_path / "x") is None and not (tmp_path / "x").exists()


def test_char_tokenizer_needs_128_ids(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(ValueError, match="vocabulary of 100 ids"):
        with_char_tokenizer(small, tmp_path / "out")
    with pytest.raises(ValueError, match="no config.json"):
        with_char_tokenizer(tmp_path, tmp_path / "out2")


def test_hf_golden():
    ids, logits = hf_golden(TINY_LLAMA)
    golden = json.loads((TINY_LLAMA / "golden.json").read_text())
    assert ids == golden["token_ids"] and logits.shape == (len(ids), 128) and logits.dtype == np.float32
    assert hf_golden(None) is None and hf_golden(TINY_LLAMA.parent) is None
