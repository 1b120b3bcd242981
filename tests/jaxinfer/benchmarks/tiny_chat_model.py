"""A tiny random Llama (tests/data/tiny_llama3) that the chat workloads can drive: a character-level tokenizer
(different English text gives different ids) or a word-level one (every word is <unk>: short prompts), ChatML
special tokens and template, and a context of 4096 positions (the weights do not care; RoPE works at any
position)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers

from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA

SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_POSITIONS = 4096


def make_tiny_chat_model(folder: Path, chars: bool = True) -> Path:
    """Writes the model folder (config, weights, tokenizer.json, tokenizer_config.json) and returns it; `chars`:
    one id per character, else one <unk> per whitespace-separated word."""
    shutil.copytree(TINY_LLAMA, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = MAX_POSITIONS
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    if chars:
        for ch in "\n" + "".join(chr(c) for c in range(32, 127)):
            if len(vocab) < config["vocab_size"]:
                vocab[ch] = len(vocab)
        tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    else:
        tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIALS])
    tk.save(str(folder / "tokenizer.json"))
    # The word-level model's replies would end at once on <|im_end|> (it follows every prompt's <unk>s); "</s>" it
    # does not emit in the smoke tests' few tokens.
    eos = "<|im_end|>" if chars else "</s>"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": eos, "add_bos_token": False, "chat_template": CHATML}))
    return folder
