"""A tiny random Llama-3 checkpoint (tests/data/tiny_llama3) made loadable by `Engine`: an HF folder plus a
word-level tokenizer over its 128 ids ("<unk>", "<s>", "</s>", then "w3" ... "w127")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import models, pre_tokenizers

DATA = Path(__file__).resolve().parents[2] / "data" / "tiny_llama3"
VOCAB_SIZE = 128
FIRST_WORD_ID = 3  # ids below are <unk>, <s>, </s>


def make_tiny_model_dir(root: Path) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(DATA / name, root / name)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    tk.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "add_bos_token": False}))
    return root


def random_prompts(n: int, seed: int, min_len: int = 5, max_len: int = 40, exclude: frozenset[int] = frozenset()
                   ) -> list[list[int]]:
    """n prompts of word ids (no special ids, none in `exclude`), lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(FIRST_WORD_ID, VOCAB_SIZE) if i not in exclude])
    return [rng.choice(allowed, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]
