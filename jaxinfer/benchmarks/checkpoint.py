"""Checkpoint workload: model load time from orbax checkpoints against the source file (GGUF or HF folder).

For each dtype the source is converted once (`jaxinfer.loading.convert`, timed) into a checkpoint stored in that
dtype, then every way of loading is timed `--reps` times in turn, in this process, with
`jaxinfer.loading.load_model` (config, weights and tokenizer, as the engine loads them):

* source -> host numpy: read (GGUF: dequantize Q4_1 / Q8_0 -> f32, undo the rotary row permutation), cast;
* source -> default device: the same, then `jax.device_put` of every array, blocked until ready;
* orbax -> host numpy: restore every array as numpy;
* orbax -> default device: restore straight into `NamedSharding`s on a one-device mesh (`load_model(mesh=...)`),
  blocked until ready.

The first call of each kind is reported on its own (cold caches in this process: imports, the tokenizer's first
build), then the median and minimum of the following calls. All files stay in the OS page cache between calls
(they were just written or read), so these are warm-cache times: the cost of decoding, not of the disk.
About 3 minutes on 2 cores for SmolLM2-135M-Instruct:

    .venv/bin/jaxinfer bench checkpoint --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxinfer.benchmarks import model_setup
from jaxinfer.benchmarks.report import Report, machine_line, table
from jaxinfer.loading import convert, load_model
from jaxinfer.loading.orbax_format import DTYPES, WEIGHTS_DIR
from sharding.mesh import make_mesh

logger = logging.getLogger(__name__)

SECTION = ("<!-- checkpoint-load: begin -->", "<!-- checkpoint-load: end -->")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint workload's options."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF folder with a tokenizer (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=5, help="timed loads per kind (after the first)")


def _bytes_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(fn: Callable[[], object], reps: int) -> dict:
    """First call, then median and min of `reps` more calls (seconds); the result is dropped before the next."""
    times = []
    for _ in range(reps + 1):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        del out
    return {"first_s": times[0], "median_s": statistics.median(times[1:]), "min_s": min(times[1:]), "reps": reps}


def source_kind(path: Path) -> str:
    """How the report names the source: "GGUF" for a .gguf file, else "HF safetensors" (or "checkpoint")."""
    if path.is_file():
        return "GGUF"
    return "HF safetensors" if (path / "config.json").is_file() else "checkpoint"


def measure(path: Path, dtypes: list[str], reps: int) -> dict:
    """Converts `path` once per dtype and times the four ways of loading it (see the module docstring)."""
    mesh = make_mesh()
    kind = source_kind(path)
    rows, sizes = [], {"source": _bytes_on_disk(path)}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        for dtype in dtypes:
            np_dtype = DTYPES[dtype]
            t0 = time.perf_counter()
            ckpt = convert(path, Path(tmp) / dtype, dtype=dtype)
            convert_s = time.perf_counter() - t0
            sizes[dtype] = _bytes_on_disk(ckpt / WEIGHTS_DIR)
            logger.info("converted to %s in %.1f s (%.1f MiB of weights)", dtype, convert_s, sizes[dtype] / 2**20)

            def source_to_device() -> object:
                _, weights, _ = load_model(path, np_dtype)
                return jax.device_put(weights)

            kinds = [
                (kind, "host numpy", lambda: load_model(path, np_dtype)[1]),
                (kind, "default device (device_put)", source_to_device),
                ("orbax", "host numpy", lambda: load_model(ckpt, np_dtype)[1]),
                ("orbax", "default device (restored sharded)", lambda: load_model(ckpt, np_dtype, mesh=mesh)[1]),
            ]
            for source, target, fn in kinds:
                result = _timed(fn, reps)
                logger.info("%s %s -> %s: %s", dtype, source, target, result)
                rows.append({"dtype": dtype, "source": source, "target": target, "convert_s": convert_s, **result})
    return {"rows": rows, "bytes_on_disk": sizes, "model": path.name, "source_kind": kind, "reps": reps}


def _notes(r: dict) -> list[str]:
    kind, sizes = r["source_kind"], r["bytes_on_disk"]
    converts = {x["dtype"]: x["convert_s"] for x in r["rows"]}
    by = {(x["dtype"], x["source"], x["target"].split(" (")[0]): x["median_s"] for x in r["rows"]}
    notes = []
    for d in converts:
        src, orbax = by.get((d, kind, "host numpy")), by.get((d, "orbax", "host numpy"))
        dev_s, dev_o = by.get((d, kind, "default device")), by.get((d, "orbax", "default device"))
        if src and orbax and dev_s and dev_o:
            notes.append(f"{d}: orbax is {src / orbax:.1f}x faster to host numpy ({orbax:.2f} s vs {src:.2f} s) "
                         f"and {dev_s / dev_o:.1f}x faster onto the device ({dev_o:.2f} s vs {dev_s:.2f} s)")
    ratios = ", ".join(f"{d} {sizes[d] / sizes['source']:.1f}x" for d in sizes if d != "source")
    notes.append(f"both include the tokenizer. Orbax stores arrays zstd-compressed (its default) and reads "
                 f"{ratios} the source's bytes; it does no dequantization")
    return notes


def render(r: dict, args: argparse.Namespace, elapsed_s: float, load: tuple[float, float]) -> str:
    """The section's markdown (without its markers)."""
    kind, sizes = r["source_kind"], r["bytes_on_disk"]
    out = [f"## Checkpoint load: orbax vs {kind} ({r['model']})\n"]
    out.append(
        f"`load_model` of {r['model']} (config, weights, tokenizer) from the {kind} source and from orbax "
        "checkpoints converted from it (`jaxinfer convert`, stored in the dtype loaded), to host numpy arrays and "
        "to the default device. Orbax restores to the device straight into each array's sharding (a one-device "
        f"mesh here); the {kind} path decodes on the host and then copies. First call on its own, then median and "
        f"minimum of {r['reps']} more; files in the OS page cache (warm). Command:\n")
    out.append(f"```\n{args.command}\n```\n")
    out.append(f"- date: {args.date}; backend {jax.default_backend()}; {machine_line()}; run "
               f"time {elapsed_s:.0f} s; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
               f"({os.cpu_count()} cores: above that, other jobs competed); a shared, noisy VM\n")
    out.append(f"- on disk: {kind} source {sizes['source'] / 2**20:.1f} MiB; orbax weights "
               + ", ".join(f"{d} {sizes[d] / 2**20:.1f} MiB" for d in sizes if d != "source") + "\n")
    rows = [[x["dtype"], x["source"], x["target"], f"{x['first_s']:.2f}", f"{x['median_s']:.2f}",
             f"{x['min_s']:.2f}"] for x in r["rows"]]
    out.append(table(["dtype", "from", "to", "first call s", "median s", "min s"], rows) + "\n")
    converts = {x["dtype"]: x["convert_s"] for x in r["rows"]}
    out.append(f"- conversion ({kind} load + orbax save + tokenizer), once per dtype: "
               + ", ".join(f"{d} {s:.1f} s" for d, s in converts.items()) + "\n")
    out += [f"- {n}" for n in _notes(r)]
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> Report:
    """Converts the model once per dtype and times its loads."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    dtypes = model_setup.parse_dtypes(args.dtypes)
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps} must be >= 1")
    path = model_setup.model_path(args.model)
    if not path.exists():
        raise ValueError(f"--model {str(path)!r} does not exist")
    r = measure(path, dtypes, args.reps)
    load = (load0, os.getloadavg()[0])
    r["load_avg"] = list(load)
    return Report("checkpoint", render(r, args, time.perf_counter() - t0, load), r)
