"""The `jaxinfer` console command.

    jaxinfer --version

    jaxinfer generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
                      [--min-p P] [--*-penalty X] [--seed S] [--stop STR ...] [--json] [engine options]
    jaxinfer generate --input-file PROMPTS.jsonl [--output-file OUT.jsonl] [--chat] [sampling flags] [engine options]

    jaxinfer chat [--system PROMPT] [sampling flags] [engine options]

    jaxinfer serve [--host 127.0.0.1] [--port 50051] [--metrics-port N] [--max-queued-requests N]
                   [--grace-seconds S] [engine options]
    jaxinfer serve --replicas N [--ray-address ADDR] [--replica-cpus C] [--replica-gpus G]
                   [--routing cache_aware|round_robin|least_load] [--routing-* knobs] [serve options]
    jaxinfer serve --prefill-replicas X --decode-replicas Y [--prefill-config F] [--decode-config F]
                   [--kv-wire-dtype float32|bfloat16|int8|fp8] [--disagg-* knobs] [replica options]

    jaxinfer convert --output DIR [--model PATH] [--dtype float32|bfloat16] [--quantization FORMAT_OR_JSON]

    jaxinfer tune --profile FILE [--ttft-p99-s S] [--tpot-p99-s S] [--budget N] [--max-num-seqs V,V...]
                  [--max-num-batched-tokens V,V...] [...] [--out DIR] [--write FILE] [engine options]

The engine options are the `EngineConfig` fields (`jaxinfer.engine.config`), as flags of their dashed names
(`--max-model-len N`, `--warmup` / `--no-warmup`, ...): each field's metadata gives its help text and which
subcommands take it; `generate`, `chat`, `serve` and `tune` also take `--config FILE`, a JSON object of them
(flags typed on the command line win). Generated text streams to stdout; progress (model load, compile) goes to
stderr. Bad input exits with status 2 and one line on stderr; a request the engine failed (finish_reason "error")
exits with status 1 and one line on stderr giving the engine's reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxinfer.benchmarks import cli as bench_cli
from jaxinfer.cli_parser import Parser, parse_command_line, print_error
from jaxinfer.commands import chat, convert, generate, serve, tune
from jaxinfer.commands.version import VersionAction

# The subcommands: each module adds its parser (`add_parser(sub)`) and runs it (`run(args)` -> exit status).
COMMANDS = {"generate": generate, "chat": chat, "serve": serve, "convert": convert, "tune": tune}


def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxinfer", description="LLM inference on JAX/XLA.")
    parser.add_argument("--version", action=VersionAction,
                        help="print the versions of jaxinfer, jax and jaxlib and the XLA compilation cache's folder")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxinfer` command; returns the exit status (2 for bad input, 1 for a failed request)."""
    parser = _build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    if given and given[0].startswith("-") and given[0] not in ("-h", "--help", "--version"):
        names = ", ".join([*COMMANDS, "bench"])
        parser.error(f"unknown option {given[0]}: the command comes first ({names}), then its options"
                     f"{parser.suggestions(given[:1])}")
    args = parse_command_line(parser, argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command].run(args)
        if args.command == "bench":
            return bench_cli.run(args.workload, args.options)
        parser.error(f"unknown command {args.command}")
    except ValueError as e:
        return print_error(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's exit flush quiet
        except OSError:
            pass
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
