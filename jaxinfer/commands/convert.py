"""`jaxinfer convert`: a GGUF file or HF folder into an orbax checkpoint folder."""

from __future__ import annotations

import argparse
import logging
import os
import time

from jaxinfer.commands.options import add_engine_options, engine_options



def add_parser(sub) -> None:
    """Adds the `convert` subcommand to the subparsers `sub`."""
    conv = sub.add_parser("convert", help="convert a GGUF file or HF folder into an orbax checkpoint folder",
                          description="Convert a GGUF file or HF folder into a jaxinfer orbax checkpoint folder "
                                      "(weights, config, tokenizer) that --model accepts and that restores "
                                      "straight onto a device mesh. Prints the folder on stdout.")
    conv.add_argument("--output", required=True, help="the checkpoint folder to create (must not exist or be empty)")
    conv.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    add_engine_options(conv, "convert", title="model options (EngineConfig fields)", config_file=False)


def run(args: argparse.Namespace) -> int:
    """Runs `jaxinfer convert`: prints the checkpoint folder; returns the exit status."""
    options = engine_options(args)
    from jaxinfer.loading import convert

    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(f"--model {args.model}: no such file or folder")
    t0 = time.perf_counter()
    from jaxinfer.engine.auto_dtype import resolve_dtype

    # auto: the dtype an engine on this machine would run the source in, so that the checkpoint runs the same
    dtype = resolve_dtype(options["dtype"], args.model)
    out = convert(args.model, args.output, dtype=dtype, quantization=options["quantization"])
    logging.getLogger("jaxinfer").info("converted in %.1f s", time.perf_counter() - t0)
    print(out)
    return 0
