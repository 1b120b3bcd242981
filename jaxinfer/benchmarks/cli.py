"""`jaxinfer bench <workload> [options]`: runs one workload, prints its section, and writes it where asked.

Every workload module (`jaxinfer.benchmarks.<name>`) has `SECTION` (its begin / end markers in BENCHMARKS.md),
`add_arguments(parser)` (its own options) and `run(args) -> Report`. This runner adds the options every workload
takes (`--write FILE`: splice the section into that markdown file, other sections kept; `--json FILE`: the report's
data, the command, the date, the machine and the elapsed seconds as JSON), sets up logging on stderr, and prints
the section on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from jaxinfer.benchmarks import WORKLOADS
from jaxinfer.benchmarks.report import machine, write_section
from jaxinfer.cache_dirs import COMPILATION_CACHE_VARIABLE as CACHE_VARIABLE  # no jax
from jaxinfer.cli_parser import Parser

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    """Registers `bench` on the `jaxinfer` CLI's subparsers (the workload's own options are parsed later, so that
    `jaxinfer --help` imports no benchmark)."""
    p = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(WORKLOADS),
                              description="Runs one benchmark workload; `jaxinfer bench WORKLOAD --help` lists its "
                                          "options.", add_help=True)
    p.add_argument("workload", nargs="?", choices=WORKLOADS, help="one of " + ", ".join(WORKLOADS))
    p.add_argument("options", nargs=argparse.REMAINDER, help="the workload's options")
    p.set_defaults(verbose=False)


def workload_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """(the argument parser of `jaxinfer bench NAME`, the workload module)."""
    module = importlib.import_module(f"jaxinfer.benchmarks.{name}")
    parser = Parser(prog=f"jaxinfer bench {name}", description=module.__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, default=None,
                        help="splice this workload's section into this markdown file (e.g. BENCHMARKS.md)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report's data as JSON here")
    module.add_arguments(parser)
    return parser, module


def _check_writable(option: str, path: Path | None) -> None:
    """Raises ValueError naming `option` unless `path` is None or a file this process may create or replace."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file path")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise ValueError(f"{option} {path} is not writable")


def run(name: str | None, argv: list[str]) -> int:
    """Parses `argv` for workload `name`, runs it and reports; returns the exit status (argparse exits 2 on bad
    options).

    Raises:
      ValueError: no workload named (the message lists them), a `--write` / `--json` path that cannot be written
        (checked before the run), or the workload's own checks of its options.
    """
    if name is None:
        raise ValueError(f"jaxinfer bench needs a workload: one of {', '.join(WORKLOADS)} (`jaxinfer bench WORKLOAD "
                         "--help` lists its options)")
    parser, module = workload_parser(name)
    args = parser.parse_args(argv)
    for option, path in (("--write", args.write), ("--json", args.json)):
        _check_writable(option, path)  # before the run, not after minutes of it
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    command = shlex.join(["jaxinfer", "bench", name, *argv])
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    args.command, args.date = command, date  # for the section's header line
    # Cold compiles: the engine turns on JAX's persistent compilation cache unless this is set ("" = off). Put
    # back afterwards, so that a run inside another program (the smoke tests) leaves its environment as it was.
    saved = os.environ.get(CACHE_VARIABLE)
    os.environ.setdefault(CACHE_VARIABLE, "")
    t0 = time.perf_counter()
    try:
        report = module.run(args)
    finally:
        if saved is None:
            del os.environ[CACHE_VARIABLE]
    elapsed = time.perf_counter() - t0
    body = report.markdown
    if args.write is not None:
        write_section(args.write, body, module.SECTION)
        logger.info("wrote %s", args.write)
    sys.stdout.write(body.rstrip() + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"workload": name, "command": command, "date": date, "machine": machine(),
                                         "elapsed_s": elapsed, "data": report.data}, indent=1, default=str))
    return int(report.data.get("exit_status", 0))
