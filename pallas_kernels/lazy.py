"""Lazy exports: a package names its TPU (Mosaic) and GPU (Triton) kernels without importing them, because
importing `jax.experimental.pallas.tpu` / `.triton` costs about 0.25 s of every start on CPU, where they never run.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` (PEP 562) for `package` that imports module `where[name]` the first time `name` is read
    from the package, keeps the attribute on the package and returns it.

    Args:
      package: the package's `__name__`.
      where: exported name -> the module that defines it.

    Returns:
      The `__getattr__` to assign in the package's namespace.

    Raises (from the returned function):
      AttributeError: a name the package does not export.
    """

    def __getattr__(name: str) -> object:  # noqa: N807 - PEP 562's name
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
