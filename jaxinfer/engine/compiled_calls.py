"""`CompiledCalls`: a runner's ahead-of-time compiled executables, by call kind and argument shapes. Start-up's
warm-up fills it (`jaxinfer.engine.warmup`); a call of shapes it lacks compiles them first (`jitted.lower().compile()`)
and keeps the executable too. So each shape is one executable, whatever kind of array carries an argument: jit's own
cache keys a device array apart from a host one (a step fed its tokens on device by async scheduling), which loaded
the same program a second time."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


def shape_key(args: tuple) -> tuple:
    """Pytree structure plus every leaf's shape and dtype of the arguments after the first (the weights, the same
    for a runner's life; flattening them took ~0.1 ms a step): what a compiled call is specialised to."""
    leaves, treedef = jax.tree.flatten(args[1:])
    return treedef, tuple((np.shape(x), x.dtype if hasattr(x, "dtype") else np.result_type(x)) for x in leaves)


class CompiledCalls(dict):
    """{(kind, shape key, static arguments): compiled executable}."""

    @staticmethod
    def key(kind: str, args: tuple, static: dict) -> tuple:
        """The table's key of a `kind` call with these arguments."""
        return kind, shape_key(args), tuple(sorted(static.items()))

    def add(self, kind: str, jitted: Callable, args: tuple, **static) -> None:
        """Compiles `jitted` for these arguments' shapes (`lower().compile()`, nothing runs) and keeps it."""
        self[self.key(kind, args, static)] = jitted.lower(*args, **static).compile()

    def call(self, kind: str, jitted: Callable, args: tuple, before_compile: Callable[[], None] = lambda: None,
             **static):
        """Runs the `kind` call on its compiled executable for these shapes; a new shape first runs
        `before_compile()`, then is compiled (or loaded from the persistent cache) and kept."""
        key = self.key(kind, args, static)
        if key not in self:
            before_compile()
            self.add(kind, jitted, args, **static)
        return self[key](*args)
