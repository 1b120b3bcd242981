"""The command line's shared options: the `EngineConfig` fields as flags, the multi-host flags, the checks of values
every command that starts an engine takes (`engine_options`, `join_job`, `check_host`), and the start of an `LLM`
(`start_llm`).

`--config FILE` (a JSON object of engine options, `jaxinfer.engine.config_file`) gives options the flags did not:
a flag typed on the command line wins over the file, and the file wins over the flag's default. The engine flags
record which of them were typed (`given`), since a typed value may equal the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from jaxinfer.engine.config import EngineConfig  # no jax: the flags are built before jax loads
from jaxinfer.engine.config_file import load_config_file

if TYPE_CHECKING:
    from jaxinfer.llm import LLM

# Command-line value types of the fields' annotations; fields with a normaliser take their text as typed.
FLAG_TYPES = {"int": int, "int | None": int, "float | None": float, "str": str, "str | None": str, "bool": bool}


def flag_name(field_name: str) -> str:
    """The command-line flag of an `EngineConfig` field: `max_model_len` -> `--max-model-len`."""
    return "--" + field_name.replace("_", "-")


def engine_fields(command: str, exclude: Collection[str] = ()) -> list[dataclasses.Field]:
    """The `EngineConfig` fields that `command` takes as flags, in declaration order, less those in `exclude`."""
    return [f for f in dataclasses.fields(EngineConfig)
            if command in f.metadata["flag"].commands and f.name not in exclude]


def add_engine_options(parser: argparse.ArgumentParser, command: str,
                       title: str = "engine options (EngineConfig fields; LLM takes the same keywords)",
                       exclude: Collection[str] = (), config_file: bool = True) -> None:
    """Adds a flag per `EngineConfig` field that `command` takes, from the field's metadata (help, `Flag`), and
    (with `config_file`) `--config FILE`.

    Args:
      exclude: fields to leave out (a command that takes them its own way, as `tune` takes lists of values).
    """
    group = parser.add_argument_group(title)
    if config_file:
        group.add_argument("--config", default=None, metavar="FILE",
                           help="a JSON object of engine options (EngineConfig field names, as LLM's keywords), e.g. "
                                "the best configuration `jaxinfer tune` wrote; flags typed on the command line win "
                                "over it")
    for field in engine_fields(command, exclude):
        flag = field.metadata["flag"]
        default = flag.command_defaults.get(command, field.default)
        text = flag.command_help.get(command, field.metadata["help"]).replace("%", "%%")  # argparse %-formats help
        if default is not None:
            text += " (default: %(default)s)"
        names = (flag_name(field.name), *flag.aliases)
        if field.metadata["normalize"] is not None:  # the text as typed: EngineConfig.normalize parses it
            kind = str
        elif field.type in FLAG_TYPES:
            kind = FLAG_TYPES[field.type]
        else:
            raise TypeError(f"EngineConfig.{field.name}: no command-line type for {field.type!r}; add it to "
                            f"jaxinfer.commands.options.FLAG_TYPES or give the field a normaliser")
        if kind is bool:
            group.add_argument(*names, dest=field.name, action=_Switch, default=default, help=text)
        else:
            group.add_argument(*names, dest=field.name, action=_Store, type=kind, default=default,
                               choices=flag.choices, metavar=flag.metavar, help=text)


_GIVEN = "engine_flags_given"  # the namespace's set of the fields whose flags the command line gave
_FROM_FILE = "engine_options_from_file"  # the namespace's set of the fields the --config file gave


def given(args: argparse.Namespace, field_name: str) -> bool:
    """Whether the user gave `EngineConfig` field `field_name`: its flag on the command line, or (once
    `engine_options` has read it) the --config file; else the option holds its flag's default."""
    return field_name in getattr(args, _GIVEN, ()) or field_name in getattr(args, _FROM_FILE, ())


def _mark_given(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, _GIVEN, getattr(namespace, _GIVEN, frozenset()) | {dest})


class _Store(argparse.Action):
    """An engine flag's value, recorded as given (`given`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _mark_given(namespace, self.dest)


class _Switch(argparse.BooleanOptionalAction):
    """A bool engine flag (`--x` / `--no-x`), recorded as given (`given`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _mark_given(namespace, self.dest)


def add_multihost_options(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_argument_group("multi-host (one process per host; see jaxinfer.engine.multihost)")
    hosts.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0's jax.distributed coordinator (every process gives the same)")
    hosts.add_argument("--num-processes", type=int, default=1, help="processes in the job (default 1)")
    hosts.add_argument("--process-id", type=int, default=0,
                       help="this process's index; 0 takes the requests, the others follow its steps")


def engine_options(args: argparse.Namespace, exclude: Collection[str] = ()) -> dict:
    """The `EngineConfig` fields the command's flags and `--config` file give, normalised, checked before the slow
    imports.

    A flag typed on the command line wins over the file's value, which wins over the flag's default. The file's
    options that the command has no flag for (e.g. `seed` for `generate`) are taken as they are.

    Args:
      exclude: fields the command has no flag for (as in `add_engine_options`): only a config file's value of one
        is taken.

    Raises:
      ValueError: "--flag: ..." (or "config file F: name: ...") for a value its field's parser rejects (for
        --speculative-config and --quantization: JSON that does not parse or is not an object, unknown keys, bad
        values), a config file that cannot be read or names an unknown option, or a draft model path that does
        not exist.
    """
    path = getattr(args, "config", None)
    from_file = load_config_file(path) if path is not None else {}
    setattr(args, _FROM_FILE, frozenset(from_file))
    typed = getattr(args, _GIVEN, frozenset())
    raw = {name: (value, f"config file {path}: {name}") for name, value in from_file.items()}
    for field in engine_fields(args.command, exclude):
        if field.name in typed or field.name not in raw:
            raw[field.name] = (getattr(args, field.name), flag_name(field.name))
    options = {}
    for name, (value, source) in raw.items():
        try:
            options[name] = EngineConfig.normalize(name, value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {e}") from None
    spec = options.get("speculative_config")
    if spec is not None and spec.method == "draft_model" and not os.path.exists(spec.model):
        raise ValueError(f"{raw['speculative_config'][1]}: draft model {spec.model}: no such file or folder")
    return options


def join_job(args: argparse.Namespace) -> bool:
    """Joins a multi-process job when --num-processes > 1; returns True on a follower (process id > 0)."""
    if args.num_processes < 1:
        raise ValueError(f"--num-processes {args.num_processes} must be >= 1")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be in [0, {args.num_processes}) "
                         f"(--num-processes {args.num_processes})")
    if args.num_processes == 1 and args.coordinator_address is None:
        return False
    if args.coordinator_address is None:
        raise ValueError("--num-processes > 1 needs --coordinator-address host:port")
    from jaxinfer.engine import multihost

    # Gloo's C++ code prints connection lines to stdout: send the process's C-level stdout to stderr and keep
    # Python's stdout (generated text, --json) on the real one.
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1)
    logging.getLogger("jaxinfer").info(
        "process %d of %d: joining the job at %s (waits until every process has joined)", args.process_id,
        args.num_processes, args.coordinator_address)
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    return not multihost.is_leader()


def start_llm(args: argparse.Namespace, options: dict) -> LLM | None:
    """Joins the job (multi-host flags) and loads the model into an `LLM` with `options` (`engine_options`),
    logging the load on stderr. Returns None on a follower process, after it has replayed process 0's steps.

    Raises:
      ValueError: as `join_job` and `LLM`.
    """
    from jaxinfer.llm import LLM

    log = logging.getLogger("jaxinfer")
    log.info("loading model %s", options.get("model") or "(default SmolLM2-135M-Instruct)")
    t0 = time.perf_counter()
    follower = join_job(args)
    llm = LLM(**options)
    if follower:  # replays process 0's steps; process 0 prints the text
        llm.engine.follow_leader()
        return None
    log.info("model ready in %.1f s%s", time.perf_counter() - t0,
             "" if options.get("warmup") else " (the first steps compile; --warmup compiles at start-up instead)")
    return llm


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def check_host(host: str) -> None:
    """Raises ValueError naming --host unless it is an IP address (IPv6 with or without brackets) or a host name
    this machine resolves."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(name)
        return
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(name) or name.replace(".", "").isdigit():
        raise ValueError(f"--host {host!r} is not an IP address or a host name")
    try:
        socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e}") from None
