"""The two tokenizer backends behind `Tokenizer`, and the metadata that sits beside them.

* `_HFBackend`: a `tokenizers.Tokenizer` (HF fast tokenizer), kept twice so that one copy
  encodes with special-token parsing off (plain text) and one with it on (template output).
* `_SPBackend`: a `sentencepiece.SentencePieceProcessor` built from serialized `ModelProto`
  bytes; its control and unknown pieces are the special tokens.
* `_SpecialConfig`: BOS/EOS ids, the BOS policy and the chat template (frozen dataclass).

Both backends follow the `_Backend` protocol: ids are Python `int`s in `[0, vocab_size)`,
`encode` returns `list[int]`, `decode` takes `list[int]` and returns `str` (invalid UTF-8 comes
out as U+FFFD). They do not validate ids; `Tokenizer` does. `_SPBackend` lets the errors of `sentencepiece`
and protobuf on bytes that are not a model propagate (`Tokenizer.from_sentencepiece` turns
`RuntimeError` and `OSError` into `ValueError`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Protocol

import tokenizers

# GGUF `tokenizer.ggml.token_type` values (same numbering as sentencepiece's ModelProto piece types).
_TT_NORMAL = 1
_TT_UNKNOWN = 2
_TT_CONTROL = 3
_TT_USER_DEFINED = 4
_TT_UNUSED = 5
_TT_BYTE = 6


class _Backend(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str, allow_special: bool) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def token_to_id(self, token: str) -> int | None: ...

    def special_token_texts(self) -> dict[str, int]: ...


class _HFBackend:
    """A `tokenizers.Tokenizer`, kept twice: one copy with special-token parsing off."""

    def __init__(self, tk: tokenizers.Tokenizer) -> None:
        tk.no_truncation()
        tk.no_padding()
        tk.encode_special_tokens = False
        self._special = tk
        # A second instance rather than toggling a flag on one: keeps encode thread-safe.
        self._plain = tokenizers.Tokenizer.from_str(tk.to_str())
        self._plain.encode_special_tokens = True
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        added = tk.get_added_tokens_decoder()
        self._special_texts = {tok.content: i for i, tok in added.items() if tok.special and tok.content}
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        tk = self._special if allow_special else self._plain
        return list(tk.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._special.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._special.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._special.token_to_id(token)

    def special_token_texts(self) -> dict[str, int]:
        return dict(self._special_texts)

    def to_json(self) -> str:
        return self._special.to_str()


class _SPBackend:
    """A sentencepiece model; control (and unknown) pieces are the special tokens."""

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as spm_pb2

        proto = spm_pb2.ModelProto()
        proto.ParseFromString(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.get_piece_size()
        self._pieces = [p.piece for p in proto.pieces]
        special = [i for i, p in enumerate(proto.pieces) if p.type in (_TT_CONTROL, _TT_UNKNOWN)]
        self.special_ids = frozenset(special)
        self._special_texts = {self._pieces[i]: i for i in special if self._pieces[i]}
        self._piece_to_id = {}
        for i, piece in enumerate(self._pieces):
            self._piece_to_id.setdefault(piece, i)
        self._special_re = _alternation(self._special_texts)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        if not allow_special or self._special_re is None:
            return list(self._sp.encode(text, out_type=int))
        # Each text chunk between special tokens is encoded on its own, so it gets the dummy
        # prefix (when the model uses one) exactly as llama.cpp and HF's Llama tokenizer do.
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids.extend(self._sp.encode(text[pos : m.start()], out_type=int))
            ids.append(self._special_texts[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids.extend(self._sp.encode(text[pos:], out_type=int))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if i not in self.special_ids])
        # Inverse of `encode(allow_special=True)`: runs between specials are decoded separately.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_ids:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(self._pieces[i])
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str | None:
        return self._pieces[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._piece_to_id.get(token)

    def special_token_texts(self) -> dict[str, int]:
        return dict(self._special_texts)


def _alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    """Regex matching any of `texts`, leftmost then longest; None when `texts` is empty."""
    ordered = sorted(set(t for t in texts if t), key=len, reverse=True)
    if not ordered:
        return None
    return re.compile("|".join(re.escape(t) for t in ordered))



@dataclasses.dataclass(frozen=True)
class _SpecialConfig:
    """Metadata that sits beside the vocabulary: BOS/EOS, BOS policy, chat template."""

    bos_id: int | None
    eos_id: int | None
    extra_eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None

