"""The argument parser of every `jaxinfer` command line (`jaxinfer.cli` and its `bench` workloads): options must be
spelled out (no abbreviations), and every error, a usage error or a bad value, is one line `jaxinfer: error: ...`
on stderr with exit status 2."""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2


def error_line(message: str) -> str:
    """The one line every bad input of the `jaxinfer` command prints on stderr."""
    return f"jaxinfer: error: {message}\n"


def print_error(message: str) -> int:
    """Prints `error_line(message)` on stderr; returns the exit status of bad input."""
    sys.stderr.write(error_line(message))
    return EXIT_BAD_INPUT


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without abbreviated options whose usage errors are `error_line`s (exit status 2)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        self.exit(EXIT_BAD_INPUT, error_line(f"{message} (see {self.prog} --help)"))
