"""GGUF `tokenizer.*` metadata -> tokenizer backend and special-token config.

* `_gguf_tokenizer_metadata`: reads the `tokenizer.*` keys of a `.gguf` file (path or open
  `gguf.GGUFReader`) into a dict of Python values.
* `_from_gguf_metadata`: metadata -> `(_Backend, _SpecialConfig)`. `tokenizer.ggml.model` picks
  the backend: `"gpt2"` (byte-level BPE) becomes a `tokenizers.Tokenizer` (`_bpe_from_gguf`,
  pre-tokenizer from `tokenizer.ggml.pre`); `"llama"` becomes SentencePiece `ModelProto` bytes
  (`_sp_proto_from_gguf`: pieces, scores and token types).

Errors: `ValueError` for a missing tokenizer or tokens, an unsupported `tokenizer.ggml.model` or
`tokenizer.ggml.pre`, inconsistent array lengths, malformed merges, or a `llama` vocabulary
without an unknown token; `FileNotFoundError` for a path that does not exist.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders as tk_decoders
from tokenizers import models as tk_models
from tokenizers import pre_tokenizers as tk_pre

from jaxinfer.tokenizer.backends import (
    _TT_BYTE,
    _TT_CONTROL,
    _TT_NORMAL,
    _TT_UNKNOWN,
    _TT_USER_DEFINED,
    _Backend,
    _HFBackend,
    _SpecialConfig,
    _SPBackend,
)

logger = logging.getLogger(__name__)

# Pre-tokenizer split patterns for byte-level BPE vocabularies, keyed by the family names that
# llama.cpp writes into `tokenizer.ggml.pre`.
_LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre name -> (kind, ignore_merges). kinds: "gpt2" = GPT-2 split regex; "digits+gpt2" = every
# digit isolated, then the GPT-2 regex; "llama3"/"qwen2" = the patterns above.
_BPE_PRE_TYPES: dict[str, tuple[str, bool]] = {
    "default": ("gpt2", False),
    "gpt2": ("gpt2", False),
    "smollm": ("digits+gpt2", False),
    "starcoder": ("digits+gpt2", False),
    "refact": ("digits+gpt2", False),
    "llama3": ("llama3", True),
    "llama-bpe": ("llama3", True),
    "smaug-bpe": ("llama3", False),
    "qwen2": ("qwen2", False),
}


def _gguf_tokenizer_metadata(reader_or_path: Any) -> dict[str, Any]:
    """The `tokenizer.*` keys of a GGUF file (a path or an open `gguf.GGUFReader`) as Python values."""
    import gguf

    if isinstance(reader_or_path, (str, os.PathLike)):
        path = Path(reader_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        reader = gguf.GGUFReader(path, "r")
    elif hasattr(reader_or_path, "fields"):
        reader = reader_or_path
    else:
        raise ValueError(f"expected a GGUF path or gguf.GGUFReader, got {type(reader_or_path).__name__}")
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _from_gguf_metadata(metadata: Mapping[str, Any]) -> tuple[_Backend, _SpecialConfig]:
    """The backend and special-token config that GGUF `tokenizer.*` metadata describes."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    tokens = [str(t) for t in tokens]
    types = list(metadata.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    if model == "gpt2":
        backend: _Backend = _HFBackend(_bpe_from_gguf(metadata, tokens, types))
        default_add_bos = False
    elif model == "llama":
        backend = _SPBackend(_sp_proto_from_gguf(metadata, tokens, types))
        default_add_bos = True
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer type tokenizer.ggml.model={model!r} (supported: 'gpt2', 'llama')"
        )

    def opt_id(key: str) -> int | None:
        value = metadata.get(key)
        return None if value is None else int(value)

    extra = tuple(
        i for i in (opt_id("tokenizer.ggml.eot_token_id"), opt_id("tokenizer.ggml.eom_token_id")) if i is not None
    )
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    config = _SpecialConfig(
        bos_id=opt_id("tokenizer.ggml.bos_token_id"),
        eos_id=opt_id("tokenizer.ggml.eos_token_id"),
        extra_eos_ids=extra,
        add_bos=default_add_bos if add_bos is None else bool(add_bos),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    return backend, config


def _bpe_from_gguf(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) as a `tokenizers.Tokenizer`."""
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    if pre not in _BPE_PRE_TYPES:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} (supported: {sorted(_BPE_PRE_TYPES)})"
        )
    kind, ignore_merges = _BPE_PRE_TYPES[pre]
    merges_raw = metadata.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ValueError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    merges = []
    for m in merges_raw:
        left, sep, right = str(m).partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            logger.warning("GGUF vocabulary repeats token %r (ids %d and %d); keeping the first", t, vocab[t], i)
            continue
        vocab[t] = i
    tk = tokenizers.Tokenizer(tk_models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if kind == "gpt2":
        tk.pre_tokenizer = tk_pre.ByteLevel(add_prefix_space=False, use_regex=True)
    elif kind == "digits+gpt2":
        tk.pre_tokenizer = tk_pre.Sequence(
            [tk_pre.Digits(individual_digits=True), tk_pre.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        pattern = _LLAMA3_PATTERN if kind == "llama3" else _QWEN2_PATTERN
        tk.pre_tokenizer = tk_pre.Sequence(
            [
                tk_pre.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
                tk_pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tk.decoder = tk_decoders.ByteLevel()
    special = [
        tokenizers.AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TT_CONTROL, _TT_UNKNOWN) and t
    ]
    user = [
        tokenizers.AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types)
        if ty == _TT_USER_DEFINED and t
    ]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)
    return tk


def _sp_proto_from_gguf(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> bytes:
    """SentencePiece BPE `ModelProto` bytes from GGUF `llama` tokenizer metadata."""
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    if len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    proto = spm_pb2.ModelProto()
    for token, score, ty in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece = token
        piece.score = float(score)
        piece.type = int(ty) if int(ty) in (1, 2, 3, 4, 5, 6) else _TT_NORMAL
    if not any(t == _TT_UNKNOWN for t in types):
        raise ValueError("GGUF llama tokenizer has no unknown token (token_type 2); sentencepiece requires one")
    ts = proto.trainer_spec
    ts.model_type = spm_pb2.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = any(t == _TT_BYTE for t in types)
    ts.unk_id = types.index(_TT_UNKNOWN)
    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return proto.SerializeToString()
