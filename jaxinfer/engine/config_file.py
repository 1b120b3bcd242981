"""Config files: a JSON object of engine options, read by `jaxinfer serve --config FILE` (and `generate`), by
`LLM(config=FILE)`, and written by `jaxinfer tune`.

The keys are `EngineConfig` field names (the same names as `LLM` keywords; the flags are their dashed forms) and the
values are what those keywords take: numbers, booleans, strings, null, and for `speculative_config` and
`quantization` a format name or a JSON object of their fields. Keys that start with "_" are notes for people (e.g.
`"_tuned"`: what `jaxinfer tune` measured) and are skipped. Like `config.py`, this module imports no jax.

    {"max_num_seqs": 16, "max_num_batched_tokens": 256, "quantization": "int8",
     "_tuned": {"output_tok_s": 312.5, "ttft_p99_s": 1.8}}
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxinfer.engine.config import EngineConfig

NOTE_PREFIX = "_"  # keys starting with it are notes, not options


def config_options(options: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """The engine options of a config object (notes dropped), checked for unknown names; values as written.

    Args:
      options: {EngineConfig field name: value as `EngineConfig.create` takes it}, plus "_" notes.
      source: what the options came from, for error messages (a file name).

    Returns:
      {field name: value}, in the object's order, without the notes.

    Raises:
      ValueError: naming `source`: not a mapping, a key that is not a string, or unknown option names (with the
        close field names).
    """
    if not isinstance(options, Mapping):
        raise ValueError(f"{source}: must be a JSON object of engine options, got {type(options).__name__}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = {}
    unknown = []
    for key, value in options.items():
        if not isinstance(key, str):
            raise ValueError(f"{source}: option names must be strings, got {key!r}")
        if key.startswith(NOTE_PREFIX):
            continue
        if key not in fields:
            unknown.append(key)
        out[key] = value
    if unknown:
        from jaxinfer.request_limits import name_hint  # numpy: only on this error (the command line reads this early)

        hints = ", ".join(name_hint(name, fields) for name in unknown)
        raise ValueError(f"{source}: unknown engine option(s) {hints}; the options are the EngineConfig fields "
                         f"(keys starting with {NOTE_PREFIX!r} are notes)")
    return out


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a config file (see the module docstring).

    Returns:
      {EngineConfig field name: value as written}; `EngineConfig.create(**options)` normalises and checks the
      values.

    Raises:
      ValueError: naming the file: it cannot be read, is not JSON (with the line and column), is not an object, or
        has unknown option names.
    """
    name = os.fspath(path)
    try:
        text = Path(name).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {name}: cannot be read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {name}: not valid JSON: {e}") from None
    return config_options(data, f"config file {name}")


def json_value(value: Any) -> Any:
    """An option value as a config file holds it: a `SpeculativeConfig` / `QuantizationConfig` (any dataclass)
    becomes the object of its first field (what kind it is: `method`, `format`) and every other field that differs
    from its default; other values stay as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return {f.name: getattr(value, f.name) for i, f in enumerate(fields)
                if i == 0 or f.default is dataclasses.MISSING or getattr(value, f.name) != f.default}
    return value


def write_config_file(path: str | os.PathLike, options: Mapping[str, Any],
                      notes: Mapping[str, Any] | None = None) -> Path:
    """Writes `options` as a config file that `load_config_file` reads back to the same config.

    Args:
      options: {EngineConfig field name: value}, raw or normalised (configs become JSON objects, `json_value`).
      notes: {name: JSON-able value} written as "_name" notes after the options (e.g. what was measured).

    Returns:
      The path written.

    Raises:
      ValueError: an unknown option name, or a value JSON cannot hold.
    """
    body = {name: json_value(value) for name, value in config_options(options, os.fspath(path)).items()}
    for key, value in (notes or {}).items():
        body[NOTE_PREFIX + key.removeprefix(NOTE_PREFIX)] = value
    try:
        text = json.dumps(body, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.fspath(path)}: an option or note JSON cannot hold: {e}") from None
    out = Path(path)
    out.write_text(text + "\n")
    return out
