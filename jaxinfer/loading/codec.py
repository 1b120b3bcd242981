"""The one dict <-> dataclass codec for configs: JSON-ready dicts from config dataclasses (`ModelConfig`,
`models.quant.QuantizationConfig`, ...) and back, typed by the class's annotations.

Encoding: enums by value, nested dataclasses as dicts, tuples as lists, everything else as is. Decoding rebuilds
dataclasses, enums, tuples and unions from those forms and widens an int to a float field. Errors are `ValueError`s
whose message starts with the caller's `where` (e.g. "checkpoint 'DIR': config.rope_scaling").
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any

from models.config import ModelConfig


def dataclass_to_dict(value: Any) -> Any:
    """A dataclass (or any value) as JSON-ready values; see the module docstring."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dataclass_to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [dataclass_to_dict(v) for v in value]
    return value


def _from_json(hint: Any, value: Any, where: str) -> Any:
    """Rebuilds a value of type `hint` (dataclass, enum, tuple, union, scalar) from its JSON form."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        for option in options:  # the member that fits the JSON shape of the value
            if isinstance(value, dict) and dataclasses.is_dataclass(option):
                return _from_json(option, value, where)
            if isinstance(option, type) and issubclass(option, enum.Enum):
                return _from_json(option, value, where)
        return _from_json(options[0], value, where) if len(options) == 1 else value
    if origin is tuple:
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_from_json(item, v, where) for v in value)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object for {hint.__name__}, got {value!r}")
        return dataclass_from_dict(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a {hint.__name__} "
                             f"({', '.join(repr(m.value) for m in hint)})") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Every `ModelConfig` field as JSON-ready values (enums by value, nested dataclasses as dicts, tuples as lists).

    Generic over `dataclasses.fields`, so fields added to `ModelConfig` are saved without changes here.
    """
    return dataclass_to_dict(cfg)


def dataclass_from_dict(cls: type, data: Mapping[str, Any], where: str = "config") -> Any:
    """Inverse of `config_to_dict` for `cls` (e.g. `ModelConfig`), typed by the class's annotations.

    Fields missing from `data` take their defaults (a checkpoint written before a field existed).

    Raises:
      ValueError: a key that is not a field of `cls`, a required field that is missing, or a value that the
        class refuses; the message starts with `where`.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} field(s) {', '.join(unknown)}")
    kwargs = {k: _from_json(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def config_from_dict(data: Mapping[str, Any], where: str = "config") -> ModelConfig:
    """`ModelConfig` from `config_to_dict`'s output; see `dataclass_from_dict`."""
    return dataclass_from_dict(ModelConfig, data, where)
