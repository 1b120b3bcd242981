"""`Tokenizer`: text <-> token ids for one model, plus its chat template.

A `Tokenizer` wraps one backend (`jaxinfer.tokenizer.backends`: a `tokenizers.Tokenizer` or a
SentencePiece model) and a `_SpecialConfig` (BOS/EOS ids, BOS policy, chat template). Build one
with `from_gguf` / `from_gguf_metadata` (`gguf_convert`), `from_hf_dir` (`hf_dir`) or
`from_sentencepiece`; `save_pretrained` writes an HF tokenizer folder.

Ids are Python `int`s in `[0, vocab_size)`; `encode` and `apply_chat_template` return
`list[int]`; `decode` takes any iterable of ints. Errors: `ValueError` for bad input (a non-str
text, an id outside the vocabulary, BOS requested without one, a chat-template failure) and for
unsupported or inconsistent files; `FileNotFoundError` for a missing file or folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from jaxinfer.tokenizer.backends import _alternation, _Backend, _HFBackend, _SpecialConfig, _SPBackend
from jaxinfer.tokenizer.chat_template import _chat_prompt, _compile_template, _encode_rendered, _render
from jaxinfer.tokenizer.gguf_convert import _from_gguf_metadata, _gguf_tokenizer_metadata
from jaxinfer.tokenizer.hf_dir import _load_hf_dir


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
        return cls.from_gguf_metadata(_gguf_tokenizer_metadata(reader_or_path))

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
        return cls(*_from_gguf_metadata(metadata))

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
        return cls(*_load_hf_dir(path))

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

    @property
    def hf_json(self) -> str | None:
        """The HF `tokenizers` JSON of this tokenizer (what llguidance builds its token table from); None for a
        sentencepiece one."""
        return self._backend.to_json() if isinstance(self._backend, _HFBackend) else None

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
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Renders `messages` with the model's chat template, for display or logging.

        Args:
          messages: list of dicts with a str `role` and a str (or None) `content`; other keys
            are passed to the template unchanged.
          add_generation_prompt: append the header that starts the assistant's turn. None (the
            default) means True, or False when `continue_final_message` is set.
          continue_final_message: render without a generation prompt and end the text right
            after the final message's content, so that the model continues that message (a
            partial assistant reply, say): nothing the template writes after it, such as the
            end-of-turn token, is kept. As in HF transformers, the cut follows the last place the
            content went; a content the template trims ends where its stripped text ends.
          **template_kwargs: extra template variables (e.g. `tools`).

        Returns:
          The rendered prompt text. Encode it with `apply_chat_template`, not with
          `encode(..., allow_special=True)`, so that message contents stay plain text.

        Raises:
          ValueError: no chat template, malformed messages, or the template failed (syntax
            error, sandbox violation, `raise_exception(...)`); `add_generation_prompt` and
            `continue_final_message` both True; with `continue_final_message`, no messages, a
            final message with None or empty content, or a template whose output does not
            contain that content.
        """
        return self._chat_prompt(messages, add_generation_prompt, continue_final_message, template_kwargs, False)[0]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template.

        Special-token strings written by the template itself become control ids; special-token
        strings inside message contents stay plain text. BOS is prepended when the model's
        metadata asks for it, unless the rendered prompt already starts with it.

        Args:
          messages, add_generation_prompt, continue_final_message, template_kwargs: as in
            `render_chat_template`. With `continue_final_message` the ids end with the final
            content's tokens: a prefix of the ids with `add_generation_prompt=False` when the
            template follows the content with a special token (as ChatML's `<|im_end|>`).

        Returns:
          list[int], the prompt ids.

        Raises:
          ValueError: as `render_chat_template`; also when a template rewrites message contents
            so that they cannot be located in its output *and* a content holds special-token text.
        """
        rendered, spans = self._chat_prompt(messages, add_generation_prompt, continue_final_message, template_kwargs,
                                            True)
        ids = _encode_rendered(self._backend, self._special_texts, self._special_re, rendered, spans)
        return self._maybe_add_bos(ids, None)

    def _chat_prompt(self, messages: Any, add_generation_prompt: bool | None, continue_final_message: bool,
                     kwargs: Mapping[str, Any], locate: bool) -> tuple[str, list[tuple[int, int, int]]]:
        return _chat_prompt(lambda ms, gen: self._render(ms, gen, kwargs), self._special_re, messages,
                            add_generation_prompt, continue_final_message, locate)

    def __getstate__(self) -> dict[str, Any]:
        """Pickles without the compiled chat template (rebuilt at first use): tokenizers travel between processes."""
        return {**self.__dict__, "_jinja_template": None}

    def _template(self) -> jinja2.Template:
        if self._jinja_template is None:
            self._jinja_template = _compile_template(self.chat_template)
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
        return _render(template, variables)
