"""The argument parser of every `jaxinfer` command line (`jaxinfer.cli` and its `bench` workloads): options must be
spelled out (no abbreviations), and every error, a usage error or a bad value, is one line `jaxinfer: error: ...`
on stderr with exit status 2."""

from __future__ import annotations

import argparse
import difflib
import re
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
        if message.startswith(UNRECOGNIZED):
            message += self.suggestions(message[len(UNRECOGNIZED):].split())
        elif choice := _INVALID_CHOICE.search(message):  # a misspelt command or workload: argparse lists them all
            near = difflib.get_close_matches(choice[1], [c.strip("'") for c in choice[2].split(", ")], n=1,
                                             cutoff=0.75)
            message += f", did you mean {near[0]}?" if near else ""
        self.exit(EXIT_BAD_INPUT, error_line(f"{message} (see {self.prog} --help)"))

    def suggestions(self, given: list[str]) -> str:
        """", did you mean --x?" for the given options that are near misses of this parser's (difflib's ratio >=
        0.75, as `--temprature` for `--temperature`); "" when none is."""
        known = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        near = []
        for option in (g.split("=", 1)[0] for g in given if g.startswith("--")):
            near += difflib.get_close_matches(option, known, n=1, cutoff=0.75)
        return f", did you mean {' or '.join(dict.fromkeys(near))}?" if near else ""


UNRECOGNIZED = "unrecognized arguments: "
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)` for a parser with subcommands, where options the chosen subcommand does not know
    are that subcommand's usage error (its --help and its near misses), not the top-level parser's."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        commands.get(getattr(args, "command", None), parser).error(UNRECOGNIZED + " ".join(extra))
    return args
