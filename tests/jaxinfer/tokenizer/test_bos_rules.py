"""Each family's BOS rule comes from its tokenizer files (issue 21): a Gemma-style folder (`add_bos_token: true`,
`<bos>`, a post-processor that prepends it, a chat template that writes `{{ bos_token }}` itself) gets BOS exactly
once on plain text and on chats; a Qwen-style folder (`bos_token: null`, `add_bos_token: false` or absent) never
gets one.

Oracle: the `tokenizers` library on the same tokenizer.json (`encode(text).ids` runs the post-processor as
transformers does for plain text; `add_special_tokens=False` is how transformers encodes a rendered chat).
The folders are built here from a tiny byte-level BPE; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxinfer.tokenizer import Tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello model", "a user asks and a model answers"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Written here in each family's style: Gemma's turns open with {{ bos_token }}; Qwen's are ChatML without BOS.
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "hello world"}]
TEXTS = ["hello world", "the lazy dog", " a model"]


def _bpe(specials: list[str], prepend_bos: str | None) -> tokenizers.Tokenizer:
    """A byte-level BPE over CORPUS whose first ids are `specials`; a post-processor prepends `prepend_bos`."""
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if prepend_bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{prepend_bos} $A", pair=f"{prepend_bos} $A {prepend_bos} $B",
            special_tokens=[(prepend_bos, tk.token_to_id(prepend_bos))])
    return tk


def _folder(root: Path, tk: tokenizers.Tokenizer, config: dict) -> Path:
    root.mkdir()
    tk.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(folder, tokenizers oracle) in Gemma's style: add_bos_token true, and the post-processor adds <bos> too."""
    tk = _bpe(GEMMA_SPECIALS, "<bos>")
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "chat_template": GEMMA_TEMPLATE}
    return _folder(tmp_path_factory.mktemp("bos") / "gemma", tk, config), tk


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, tokenizers oracle) in Qwen3's style: no BOS token, add_bos_token false, no post-processor."""
    tk = _bpe(QWEN_SPECIALS, None)
    config = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": QWEN_TEMPLATE}
    return _folder(tmp_path_factory.mktemp("bos") / "qwen", tk, config), tk


def test_gemma_style_prepends_bos_once_to_plain_text(gemma):
    folder, tk = gemma
    tok = Tokenizer.from_hf_dir(folder)
    bos = tk.token_to_id("<bos>")
    assert (tok.bos_id, tok.add_bos_token) == (bos, True)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == tk.encode(text).ids and ids[0] == bos and ids.count(bos) == 1
        assert tok.encode(text, add_bos=False) == tk.encode(text, add_special_tokens=False).ids
        # trusted text that already starts with <bos> keeps one
        assert tok.encode("<bos>" + text, allow_special=True) == ids


def test_gemma_style_chat_has_one_bos_when_the_template_writes_it(gemma):
    folder, tk = gemma
    tok = Tokenizer.from_hf_dir(folder)
    bos = tk.token_to_id("<bos>")
    rendered = tok.render_chat_template(CHAT)
    assert rendered == "<bos><start_of_turn>user\nhello world<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.apply_chat_template(CHAT)
    assert ids == tk.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == bos and ids.count(bos) == 1


def test_gemma_style_bos_follows_the_config_not_the_post_processor(gemma, tmp_path):
    # The flag decides: with add_bos_token true, a template without {{ bos_token }} and a tokenizer.json without
    # a post-processor still get one BOS; with it false, the post-processor's BOS is not added.
    _, tk = gemma
    bare = _bpe(GEMMA_SPECIALS, None)
    config = {"add_bos_token": True, "bos_token": "<bos>", "eos_token": "<eos>",
              "chat_template": GEMMA_TEMPLATE.removeprefix("{{ bos_token }}")}
    tok = Tokenizer.from_hf_dir(_folder(tmp_path / "on", bare, config))
    bos = tk.token_to_id("<bos>")
    assert tok.encode("hello world") == tk.encode("hello world").ids
    ids = tok.apply_chat_template(CHAT)
    assert ids[0] == bos and ids.count(bos) == 1
    off = Tokenizer.from_hf_dir(_folder(tmp_path / "off", tk, {**config, "add_bos_token": False}))
    assert not off.add_bos_token and bos not in off.encode("hello world") + off.apply_chat_template(CHAT)


@pytest.mark.parametrize("flag", ["false", "absent"])
def test_qwen_style_never_gets_a_bos(qwen, tmp_path, flag):
    folder, tk = qwen
    if flag == "absent":  # Qwen2's tokenizer_config.json does not say; no bos_token means none
        config = json.loads((folder / "tokenizer_config.json").read_text())
        del config["add_bos_token"]
        folder = _folder(tmp_path / "qwen", tk, config)
    tok = Tokenizer.from_hf_dir(folder)
    assert (tok.bos_id, tok.add_bos_token) == (None, False)
    for text in TEXTS:
        assert tok.encode(text) == tk.encode(text).ids == tk.encode(text, add_special_tokens=False).ids
    rendered = tok.render_chat_template(CHAT)
    assert rendered == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(CHAT)
    assert ids == tk.encode(rendered, add_special_tokens=False).ids and ids[0] == tk.token_to_id("<|im_start|>")
    with pytest.raises(ValueError, match="no BOS token"):
        tok.encode("hello", add_bos=True)
