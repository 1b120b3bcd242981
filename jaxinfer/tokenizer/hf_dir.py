"""Hugging Face tokenizer folders -> tokenizer backend and special-token config.

`_load_hf_dir(path)` reads `tokenizer.json` (an `_HFBackend`) or, failing that, `tokenizer.model`
(an `_SPBackend`); `tokenizer_config.json` (bos/eos tokens, `add_bos_token`, chat template);
`chat_template.jinja` (overrides the config's template); and the `eos_token_id` (an id or a list: Gemma 3 and
Phi-3 have several) of `generation_config.json` and of the model's `config.json` (extra EOS ids, as transformers'
`generate` stops on them). It returns `(_Backend, _SpecialConfig)`. Missing config files count as empty.

Errors: `FileNotFoundError` when the folder has neither `tokenizer.json` nor `tokenizer.model`;
`ValueError` when `tokenizer.json` cannot be loaded, a config file is not a JSON object, or a
bos/eos token is not a string in the vocabulary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from jaxinfer.tokenizer.backends import _Backend, _HFBackend, _SpecialConfig, _SPBackend
from jaxinfer.tokenizer.chat_template import _chat_template_from_config


def _load_hf_dir(path: str | os.PathLike[str]) -> tuple[_Backend, _SpecialConfig]:
    """The backend and special-token config of the HF tokenizer folder at `path`."""
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

    extra = _eos_ids(root / "generation_config.json") + _eos_ids(root / "config.json")
    special = _SpecialConfig(bos_id=bos_id, eos_id=eos_id, extra_eos_ids=extra, add_bos=bool(add_bos),
                             chat_template=template)
    return backend, special


def _eos_ids(path: Path) -> tuple[int, ...]:
    """The `eos_token_id` of a JSON config file (an int, a list of ints, or absent / null).

    Raises:
      ValueError: naming the file, for a value that is neither.
    """
    value = _read_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    if not all(i is None or (isinstance(i, int) and not isinstance(i, bool)) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(i for i in ids if i is not None)


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
