"""Frozen dataclasses that are JAX pytrees: the weight, metadata and sampling structs.

`dataclass` makes a frozen `dataclasses.dataclass`, registers it with `jax.tree_util.register_dataclass` (array
fields are leaves; fields made with `field(static=True)` are static, part of the jit cache key) and gives it a
`replace(**changes)` method. It stands in for `flax.struct.dataclass`, whose import (flax.linen with it) cost
0.3 s of every start.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field; `static=True` makes it metadata (hashable, not traced) instead of a pytree leaf."""
    metadata = dict(kwargs.pop("metadata", None) or {}, static=static)
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self, **changes: Any):
    """A copy with the named fields changed (`dataclasses.replace`)."""
    return dataclasses.replace(self, **changes)


def dataclass(cls: type) -> type:
    """Makes `cls` a frozen dataclass registered as a JAX pytree, with a `replace` method (module docstring)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = _replace
    return jax.tree_util.register_dataclass(cls)
