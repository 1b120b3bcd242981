"""`jaxinfer --version`: the versions of jaxinfer, jax and jaxlib, the folders of the XLA compilation cache and
the prepared-model cache, and the native CPU kernels' ISA level, read from the installed packages' metadata and
/proc/cpuinfo without importing jax (it takes milliseconds)."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from jaxinfer.cache_dirs import (COMPILATION_CACHE_VARIABLE, MODEL_CACHE_VARIABLE, compilation_cache_dir,
                                 model_cache_dir)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        if package == "jaxinfer":  # run from a source tree that is not installed
            import jaxinfer

            return f"{jaxinfer.__version__} (not installed)"
        return "not installed"


def version_text() -> str:
    """The lines `jaxinfer --version` prints: jaxinfer's version, jax's and jaxlib's, and the persistent XLA
    compilation cache's folder (`jaxinfer.cache_dirs`, or off), the prepared-model cache's, and the ISA level the
    native CPU kernels would run at (`pallas_kernels.cpu_features`)."""
    folder = compilation_cache_dir()
    cache = (f"{folder} (${COMPILATION_CACHE_VARIABLE} or --compilation-cache-dir move it; empty turns it off)"
             if folder is not None else f"off (${COMPILATION_CACHE_VARIABLE} is empty)")
    return (f"jaxinfer {_version('jaxinfer')}\n"
            f"jax {_version('jax')}, jaxlib {_version('jaxlib')}\n"
            f"XLA compilation cache: {cache}\n"
            f"prepared-model cache: {_model_cache()}\n"
            f"native CPU kernels: {_native_kernels()}\n")


def _model_cache() -> str:
    folder = model_cache_dir()
    if folder is None:
        return f"off (${MODEL_CACHE_VARIABLE} is empty)"
    return f"{folder} (GGUF files dequantized once; ${MODEL_CACHE_VARIABLE} moves it; empty turns it off)"


def _native_kernels() -> str:
    from pallas_kernels import cpu_features

    levels = cpu_features.supported_levels()
    try:
        level = cpu_features.isa_level()
    except ValueError as e:  # a JAXINFER_NATIVE_ISA this CPU cannot run
        return f"refused: {e}"
    if not levels:
        return "none (they need x86 with AVX2 and FMA; matmuls run on XLA)"
    if level is None:
        return "off ($JAXINFER_NATIVE_KERNELS)"
    return f"ISA level {level} (this CPU runs {', '.join(levels)}; $JAXINFER_NATIVE_ISA picks one)"


class VersionAction(argparse.Action):
    """`--version`: prints `version_text()` to stdout and exits 0, before any subcommand is required."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        sys.stdout.write(version_text())
        parser.exit(0)
