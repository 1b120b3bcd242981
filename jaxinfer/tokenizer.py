"""Tokenizers for jaxinfer: text <-> token ids, chat templates, streaming detokenization.

One public type, `Tokenizer`, wraps one of two backends:

* a `tokenizers.Tokenizer` (HF fast tokenizer): built from a `tokenizer.json`, or from the
  vocabulary and merges stored in a GGUF file whose `tokenizer.ggml.model` is `"gpt2"`
  (byte-level BPE);
* a `sentencepiece.SentencePieceProcessor`: loaded from a `tokenizer.model`, or built from the
  pieces, scores and token types stored in a GGUF file whose `tokenizer.ggml.model` is `"llama"`.

Special tokens. `Tokenizer.encode` treats its input as *plain text*: a user who types
`<|im_start|>` gets the ids of those characters, never the control id. Only text rendered from
the model's own chat template is encoded with special tokens recognised, and even there the
message contents stay plain text (see `Tokenizer.apply_chat_template`). Non-special added tokens
(GGUF "user defined" tokens, HF added tokens with `special=False`) are ordinary vocabulary and
are matched in any text, as HF and llama.cpp do.

Chat templates are untrusted Jinja2 and render inside `jinja2.sandbox.ImmutableSandboxedEnvironment`.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas without emitting
half-finished UTF-8 characters.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders as tk_decoders
from tokenizers import models as tk_models
from tokenizers import pre_tokenizers as tk_pre

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

logger = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.token_type` values (same numbering as sentencepiece's ModelProto piece types).
_TT_NORMAL = 1
_TT_UNKNOWN = 2
_TT_CONTROL = 3
_TT_USER_DEFINED = 4
_TT_UNUSED = 5
_TT_BYTE = 6

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

_DETOK_CONTEXT = 6  # prompt ids kept as left context by IncrementalDetokenizer


# --------------------------------------------------------------------------------------------
# Backends


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


# --------------------------------------------------------------------------------------------
# Chat-template rendering


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` markers and renders their body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Immutable sandbox in which any unsafe attribute access is an error, not a silent Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _make_jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Errors a broken (or hostile) template can raise while rendering; all become ValueError.
_TEMPLATE_ERRORS = (
    jinja2.TemplateError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    ValueError,
    ZeroDivisionError,
    OverflowError,
    RecursionError,
)


# --------------------------------------------------------------------------------------------
# Tokenizer


@dataclasses.dataclass(frozen=True)
class _SpecialConfig:
    """Metadata that sits beside the vocabulary: BOS/EOS, BOS policy, chat template."""

    bos_id: int | None
    eos_id: int | None
    extra_eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Build one with `from_gguf`, `from_gguf_metadata`, `from_hf_dir` or `from_sentencepiece`.
    Instances are immutable and safe to share between threads.

    Attributes (read-only properties):
      vocab_size: number of ids, V; valid ids are `0 <= id < V`.
      bos_id / eos_id: begin/end-of-sequence ids, or None when the vocabulary has none.
      eos_ids: frozenset of every id that ends generation (EOS plus end-of-turn ids).
      special_ids: frozenset of control-token ids (never produced from plain text).
      bos_token / eos_token: the text of the BOS/EOS tokens, or None.
      add_bos_token: whether `encode` prepends BOS by default (from the model's metadata).
      chat_template: the Jinja2 chat template source, or None.
    """

    def __init__(self, backend: _Backend, config: _SpecialConfig) -> None:
        """Internal; use the `from_*` constructors."""
        self._backend = backend
        self._config = config
        for name, tid in (("bos", config.bos_id), ("eos", config.eos_id)):
            if tid is not None and not 0 <= tid < backend.vocab_size:
                raise ValueError(f"{name} token id {tid} is outside the vocabulary (size {backend.vocab_size})")
        eos = {config.eos_id} if config.eos_id is not None else set()
        eos.update(i for i in config.extra_eos_ids if 0 <= i < backend.vocab_size)
        self._eos_ids = frozenset(eos)
        self._special_texts = backend.special_token_texts()
        self._special_re = _alternation(self._special_texts)
        self._jinja_template: jinja2.Template | None = None

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Builds the tokenizer stored in a GGUF file's metadata.

        Args:
          reader_or_path: a path (str or os.PathLike) to a `.gguf` file, or an open
            `gguf.GGUFReader`.

        Raises:
          ValueError: the file has no tokenizer, or its tokenizer type (`tokenizer.ggml.model`)
            or pre-tokenizer (`tokenizer.ggml.pre`) is not supported.
          FileNotFoundError: the path does not exist.
        """
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
        metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        return cls.from_gguf_metadata(metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Builds a tokenizer from GGUF `tokenizer.*` metadata already read into a mapping.

        Args:
          metadata: GGUF key -> Python value (strings, ints, bools, lists), e.g. from
            `GGUFReader.fields[key].contents()`.

        Raises:
          ValueError: missing tokens, an unsupported `tokenizer.ggml.model` or `tokenizer.ggml.pre`,
            or inconsistent array lengths.
        """
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
        return cls(backend, config)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads a Hugging Face tokenizer directory.

        Reads `tokenizer.json` (or, failing that, `tokenizer.model`), `tokenizer_config.json`
        (chat template, bos/eos tokens, `add_bos_token`), `chat_template.jinja` if present, and
        `generation_config.json` (extra EOS ids) if present.

        Raises:
          FileNotFoundError: the directory has neither `tokenizer.json` nor `tokenizer.model`.
          ValueError: a config file is not valid JSON, or names a token not in the vocabulary.
        """
        root = Path(path)
        config = _read_json(root / "tokenizer_config.json")
        if (root / "tokenizer.json").is_file():
            try:
                tk = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
            except Exception as e:  # the Rust loader raises plain Exception on bad files
                raise ValueError(f"cannot load {root / 'tokenizer.json'}: {e}") from e
            backend: _Backend = _HFBackend(tk)
        elif (root / "tokenizer.model").is_file():
            backend = _SPBackend((root / "tokenizer.model").read_bytes())
            tk = None
        else:
            raise FileNotFoundError(f"{root} has neither tokenizer.json nor tokenizer.model")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise ValueError(f"tokenizer_config.json: {key} must be a string, got {value!r}")
            tid = backend.token_to_id(value)
            if tid is None:
                raise ValueError(f"tokenizer_config.json: {key} {value!r} is not in the vocabulary")
            return tid

        bos_id = token_id("bos_token")
        eos_id = token_id("eos_token")
        if isinstance(backend, _SPBackend):
            sp = backend._sp
            bos_id = bos_id if bos_id is not None else (sp.bos_id() if sp.bos_id() >= 0 else None)
            eos_id = eos_id if eos_id is not None else (sp.eos_id() if sp.eos_id() >= 0 else None)

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            if tk is not None and bos_id is not None:
                # No explicit flag: infer it from what the tokenizer's post-processor does.
                with_special = tk.encode("a", add_special_tokens=True).ids
                add_bos = bool(with_special) and with_special[0] == bos_id
            else:
                add_bos = isinstance(backend, _SPBackend) and bos_id is not None

        template = _chat_template_from_config(config)
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")

        gen = _read_json(root / "generation_config.json")
        gen_eos = gen.get("eos_token_id")
        extra = tuple(int(i) for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if i is not None)
        special = _SpecialConfig(bos_id=bos_id, eos_id=eos_id, extra_eos_ids=extra, add_bos=bool(add_bos),
                                 chat_template=template)
        return cls(backend, special)

    @classmethod
    def from_sentencepiece(
        cls,
        path: str | os.PathLike[str],
        *,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Loads a SentencePiece `.model` file.

        Args:
          path: the serialized `ModelProto`.
          add_bos: default for `encode(add_bos=None)`; sentencepiece itself never adds BOS.
          chat_template: optional Jinja2 chat template.

        Raises:
          FileNotFoundError: `path` does not exist.
          ValueError: the file is not a sentencepiece model.
        """
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"sentencepiece model not found: {p}")
        try:
            backend = _SPBackend(p.read_bytes())
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{p} is not a sentencepiece model: {e}") from e
        sp = backend._sp
        config = _SpecialConfig(
            bos_id=sp.bos_id() if sp.bos_id() >= 0 else None,
            eos_id=sp.eos_id() if sp.eos_id() >= 0 else None,
            add_bos=add_bos,
            chat_template=chat_template,
        )
        return cls(backend, config)

    # ---- properties ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._config.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._config.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        return self._backend.special_ids

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self._backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self._backend.id_to_token(self.eos_id)

    @property
    def add_bos_token(self) -> bool:
        return self._config.add_bos

    @property
    def chat_template(self) -> str | None:
        return self._config.chat_template

    def __repr__(self) -> str:
        kind = "sentencepiece" if isinstance(self._backend, _SPBackend) else "tokenizers"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)})"

    # ---- saving -------------------------------------------------------------------------

    def save_pretrained(self, path: str | os.PathLike[str]) -> Path:
        """Writes this tokenizer as an HF tokenizer folder that `from_hf_dir` loads back identically.

        Files: `tokenizer.json` (written by the `tokenizers` library) or, for a SentencePiece
        backend, `tokenizer.model` (the serialized `ModelProto`); `tokenizer_config.json` with
        `bos_token`, `eos_token`, `add_bos_token` and `chat_template`; and, when end-of-turn ids
        end generation besides EOS, `generation_config.json` with the `eos_token_id` list.

        Args:
          path: the folder; created if missing. Files of the same names are overwritten.

        Returns:
          The folder as a `Path`.

        Raises:
          ValueError: the BOS/EOS token text maps back to a different id (a vocabulary that
            repeats the token), so `from_hf_dir` could not restore it.
          OSError: the folder cannot be written.
        """
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        if isinstance(self._backend, _SPBackend):
            (root / "tokenizer.model").write_bytes(self._backend._sp.serialized_model_proto())
        else:
            assert isinstance(self._backend, _HFBackend)
            self._backend._special.save(str(root / "tokenizer.json"))
        config: dict[str, Any] = {"add_bos_token": self.add_bos_token}
        for key, tid, text in (("bos_token", self.bos_id, self.bos_token), ("eos_token", self.eos_id, self.eos_token)):
            if tid is None:
                continue
            if text is None or self._backend.token_to_id(text) != tid:
                raise ValueError(f"cannot save {key} id {tid}: its text {text!r} maps back to id "
                                 f"{None if text is None else self._backend.token_to_id(text)}")
            config[key] = text
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
        extra = self.eos_ids - ({self.eos_id} if self.eos_id is not None else set())
        if extra:
            generation = {"eos_token_id": sorted(self.eos_ids)}
            (root / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
        return root

    # ---- vocabulary ---------------------------------------------------------------------

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id (raw form, e.g. `"Ġhello"` or `"▁hello"`).

        Raises:
          ValueError: `token_id` is outside `[0, vocab_size)`.
        """
        tid = self._check_id(token_id)
        token = self._backend.id_to_token(tid)
        if token is None:
            raise ValueError(f"token id {tid} has no vocabulary entry")
        return token

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string (raw form), or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    # ---- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`.

        Args:
          text: the text. By default it is plain text: special-token strings in it (e.g. a
            user typing `<|im_start|>`) are encoded as ordinary characters.
          add_bos: prepend `bos_id`; None means the model's own default (`add_bos_token`).
            BOS is never doubled: it is not prepended when the ids already start with it.
          allow_special: recognise special-token strings as control ids. Only for text produced
            by the model's own chat template or by trusted code, never for user input.

        Returns:
          list[int] of length T (T may be 0 for empty text without BOS).

        Raises:
          ValueError: `text` is not a str, or BOS was requested but the vocabulary has none.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self._backend.encode(text, allow_special)
        return self._maybe_add_bos(ids, add_bos)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of a sequence of token ids.

        Args:
          ids: token ids (any iterable of ints, e.g. a list or a 1-D integer array).
          skip_special_tokens: drop control tokens (BOS, EOS, chat markers) from the output.

        Returns:
          The text; byte sequences that are not valid UTF-8 come out as U+FFFD.

        Raises:
          ValueError: an id is not an integer in `[0, vocab_size)`.
        """
        return self._backend.decode([self._check_id(i) for i in ids], skip_special_tokens)

    def _check_id(self, token_id: Any) -> int:
        try:
            tid = int(token_id)
        except (TypeError, ValueError) as e:
            raise ValueError(f"token id must be an integer, got {token_id!r}") from e
        if tid != token_id or not 0 <= tid < self.vocab_size:
            raise ValueError(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        return tid

    def _maybe_add_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if add_bos is None:
            add_bos = self._config.add_bos
        if not add_bos:
            return ids
        if self.bos_id is None:
            raise ValueError("add_bos=True but this tokenizer has no BOS token")
        if ids and ids[0] == self.bos_id:
            return ids
        return [self.bos_id, *ids]

    # ---- chat templates -----------------------------------------------------------------

    def render_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Renders `messages` with the model's chat template, for display or logging.

        Args:
          messages: list of dicts with a str `role` and a str (or None) `content`; other keys
            are passed to the template unchanged.
          add_generation_prompt: append the header that starts the assistant's turn.
          **template_kwargs: extra template variables (e.g. `tools`).

        Returns:
          The rendered prompt text. Encode it with `apply_chat_template`, not with
          `encode(..., allow_special=True)`, so that message contents stay plain text.

        Raises:
          ValueError: no chat template, malformed messages, or the template failed (syntax
            error, sandbox violation, `raise_exception(...)`).
        """
        _check_messages(messages)
        return self._render([dict(m) for m in messages], add_generation_prompt, template_kwargs)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template.

        Special-token strings written by the template itself become control ids; special-token
        strings inside message contents stay plain text. BOS is prepended when the model's
        metadata asks for it, unless the rendered prompt already starts with it.

        Args:
          messages, add_generation_prompt, template_kwargs: as in `render_chat_template`.

        Returns:
          list[int], the prompt ids.

        Raises:
          ValueError: as `render_chat_template`; also when a template rewrites message contents
            so that they cannot be located in its output *and* a content holds special-token text.
        """
        _check_messages(messages)
        msgs = [dict(m) for m in messages]
        rendered = self._render(msgs, add_generation_prompt, template_kwargs)
        contents = [m.get("content") for m in msgs]
        spans = self._content_spans(msgs, contents, rendered, add_generation_prompt, template_kwargs)
        ids = self._encode_rendered(rendered, spans)
        return self._maybe_add_bos(ids, None)

    def _template(self) -> jinja2.Template:
        if self._jinja_template is None:
            if not self.chat_template:
                raise ValueError("this tokenizer has no chat template")
            try:
                self._jinja_template = _make_jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"invalid chat template: {e}") from e
        return self._jinja_template

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
        template = self._template()
        variables = dict(kwargs)
        variables.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            return template.render(**variables)
        except _TEMPLATE_ERRORS as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e

    def _content_spans(
        self,
        messages: list[dict[str, Any]],
        contents: list[Any],
        rendered: str,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> list[tuple[int, int]]:
        """Character spans of `rendered` that came from message contents (user text)."""
        texts = [c for c in contents if isinstance(c, str) and c]
        if not texts:
            return []
        # Render once more with a unique placeholder for each content; if substituting the real
        # contents back reproduces `rendered`, the placeholders mark exactly where contents went.
        nonce = secrets.token_hex(8)
        while any(nonce in t for t in texts):
            nonce = secrets.token_hex(8)
        marker = re.compile("\ue000" + nonce + r"_(\d+)\ue001")
        ph_messages = []
        for i, m in enumerate(messages):
            m = dict(m)
            if isinstance(m.get("content"), str) and m["content"]:
                m["content"] = f"\ue000{nonce}_{i}\ue001"
            ph_messages.append(m)
        try:
            ph_rendered = self._render(ph_messages, add_generation_prompt, kwargs)
        except ValueError:
            ph_rendered = None  # the template inspects contents; use the fallback below
        if ph_rendered is not None:
            spans: list[tuple[int, int]] = []
            out: list[str] = []
            pos = 0
            last = 0
            for m in marker.finditer(ph_rendered):
                piece = ph_rendered[last : m.start()]
                out.append(piece)
                pos += len(piece)
                content = contents[int(m.group(1))]
                out.append(content)
                spans.append((pos, pos + len(content)))
                pos += len(content)
                last = m.end()
            out.append(ph_rendered[last:])
            if "".join(out) == rendered:
                return spans
        # Fallback: the template transforms or inspects contents. Find each content (or its
        # stripped form) in order; refuse if one holding special-token text cannot be found.
        logger.debug("chat template rewrites message contents; locating them by search")
        spans = []
        cursor = 0
        for text in texts:
            found = False
            for candidate in (text, text.strip()):
                idx = rendered.find(candidate, cursor) if candidate else -1
                if idx >= 0:
                    spans.append((idx, idx + len(candidate)))
                    cursor = idx + len(candidate)
                    found = True
                    break
            if not found and self._special_re is not None and self._special_re.search(text):
                raise ValueError(
                    "a message content contains special-token text and the chat template rewrites it, "
                    "so it cannot be kept as plain text"
                )
        return spans

    def _encode_rendered(self, rendered: str, content_spans: list[tuple[int, int]]) -> list[int]:
        """Encodes template output: specials allowed outside `content_spans`, plain inside."""
        if self._special_re is None:
            return self._backend.encode(rendered, False)
        all_matches = [(m.start(), m.end()) for m in self._special_re.finditer(rendered)]
        # Special tokens found in the template's own text only (each template segment scanned alone).
        bounds = [0]
        for s, e in content_spans:
            bounds += [s, e]
        bounds.append(len(rendered))
        kept: list[tuple[int, int]] = []
        for seg_start, seg_end in zip(bounds[0::2], bounds[1::2]):
            for m in self._special_re.finditer(rendered, seg_start, seg_end):
                kept.append((m.start(), m.end()))
        if kept == all_matches:
            # No special-token text in user content: one native encode, identical to HF's.
            return self._backend.encode(rendered, True)
        ids: list[int] = []
        pos = 0
        for s, e in kept:
            if s > pos:
                ids.extend(self._backend.encode(rendered[pos:s], False))
            ids.append(self._special_texts[rendered[s:e]])
            pos = e
        if pos < len(rendered):
            ids.extend(self._backend.encode(rendered[pos:], False))
        return ids


# --------------------------------------------------------------------------------------------
# Streaming detokenization


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas.

    Each `step` decodes a short window (the previously emitted tokens plus the new ones) and
    returns what the new tokens added. Text is held back while it ends in an incomplete UTF-8
    sequence (an emoji or CJK character split across byte tokens), so deltas never carry a
    half character. `"".join(deltas) + flush()` equals `tokenizer.decode(all_ids)` (without
    `prompt_ids`), leading spaces included.

    Args:
      tokenizer: the `Tokenizer`.
      skip_special_tokens: as in `Tokenizer.decode`.
      prompt_ids: optional prompt ids; the last few are used as left context so the first
        generated token decodes as it would mid-text (matters for SentencePiece, which drops
        the leading space of the first token of a sequence). They produce no output.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Window of ids being decoded: [0, read_offset) produced the last emitted text (or are
        # prompt context) and decode to `prefix_text`; [read_offset, len) are not yet emitted.
        self._ids = [tokenizer._check_id(i) for i in list(prompt_ids)[-_DETOK_CONTEXT:]]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (by `step` and `flush`)."""
        return "".join(self._emitted)

    def _decode(self, ids: list[int]) -> str:
        return self._tok._backend.decode(ids, self._skip)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        # The next window starts at the ids that produced this delta; older ids are dropped.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._emitted.append(delta)
        return delta

    def step(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes (possibly "").

        Raises:
          ValueError: `token_id` is outside the vocabulary.
        """
        self._ids.append(self._tok._check_id(token_id))
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an unfinished UTF-8 sequence: wait for more tokens
        return self._emit(new_text)

    def flush(self) -> str:
        """Returns any held-back text (it may end in U+FFFD if generation stopped mid-character)."""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)


# --------------------------------------------------------------------------------------------
# Helpers


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a str 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str or None, got {type(content).__name__}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _chat_template_from_config(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"tokenizer_config.json: chat_template list has no 'default' entry (names: {sorted(named)})")
    raise ValueError(f"tokenizer_config.json: chat_template must be a string or list, got {type(template).__name__}")


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
