"""Checkpoint workload of `scripts/benchmark.py --workload checkpoint`: SmolLM2 load time from orbax vs from GGUF.

For each dtype (float32, bfloat16) the GGUF file is converted once (`jaxinfer.loading.convert`, timed) into
a checkpoint stored in that dtype, then every way of loading is timed `reps` times in turn, in this process, with
`jaxinfer.loading.load_model` (config, weights and tokenizer, as the engine loads them):

* GGUF -> host numpy: read, dequantize (Q4_1 / Q8_0 -> f32), undo the rotary row permutation, cast;
* GGUF -> default device: the same, then `jax.device_put` of every array, blocked until ready;
* orbax -> host numpy: restore every array as numpy;
* orbax -> default device: restore straight into `NamedSharding`s on a one-device mesh (`load_model(mesh=...)`),
  blocked until ready.

The first call of each kind is reported on its own (cold caches in this process: imports, the tokenizer's first
build), then the median and minimum of the following calls. All files stay in the OS page cache between calls
(they were just written or read), so these are warm-cache times: the cost of decoding, not of the disk.
"""

from __future__ import annotations


import gc
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxinfer.loading import convert, load_model
from jaxinfer.loading.orbax_format import DTYPES, WEIGHTS_DIR
from sharding.mesh import make_mesh
import md_sections  # noqa: E402  (scripts/ is on sys.path when these run)

logger = logging.getLogger("benchmark.checkpoint")

SECTION_BEGIN = "<!-- checkpoint-load: begin -->"
SECTION_END = "<!-- checkpoint-load: end -->"


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


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
    return {"first": times[0], "median": statistics.median(times[1:]), "min": min(times[1:]), "reps": reps}


def run(model_path: Path, dtypes: list[str], reps: int) -> dict:
    """Converts `model_path` once per dtype and times the four ways of loading it (see the module docstring)."""
    mesh = make_mesh()
    rows, sizes = [], {"gguf": model_path.stat().st_size}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        for dtype in dtypes:
            np_dtype = DTYPES[dtype]
            t0 = time.perf_counter()
            ckpt = convert(model_path, Path(tmp) / dtype, dtype=dtype)
            convert_s = time.perf_counter() - t0
            sizes[dtype] = _folder_bytes(ckpt / WEIGHTS_DIR)
            logger.info("converted to %s in %.1f s (%.1f MiB of weights)", dtype, convert_s, sizes[dtype] / 2**20)

            def gguf_to_device() -> object:
                _, weights, _ = load_model(model_path, np_dtype)
                return jax.device_put(weights)

            kinds = [
                ("GGUF", "host numpy", lambda: load_model(model_path, np_dtype)[1]),
                ("GGUF", "default device (device_put)", gguf_to_device),
                ("orbax", "host numpy", lambda: load_model(ckpt, np_dtype)[1]),
                ("orbax", "default device (restored sharded)", lambda: load_model(ckpt, np_dtype, mesh=mesh)[1]),
            ]
            for source, target, fn in kinds:
                result = _timed(fn, reps)
                logger.info("%s %s -> %s: %s", dtype, source, target, result)
                rows.append({"dtype": dtype, "source": source, "target": target, "convert_s": convert_s, **result})
    return {"rows": rows, "sizes": sizes, "model": model_path.name, "reps": reps}


def render(r: dict, command: str, date: str, machine: str, elapsed_s: float, load: tuple[float, float]) -> str:
    """The markdown section of `--workload checkpoint`, between its begin/end markers."""
    out = [SECTION_BEGIN, "## Checkpoint load: orbax vs GGUF (SmolLM2-135M-Instruct)\n"]
    out.append(
        f"`load_model` of {r['model']} (config, weights, tokenizer) from the GGUF file and from orbax checkpoints "
        "converted from it (`jaxinfer convert`, stored in the dtype loaded), to host numpy arrays and to the "
        "default device. Orbax restores to the device straight into each array's sharding (a one-device mesh here); "
        "the GGUF path dequantizes on the host and then copies. First call on its own, then median and minimum of "
        f"{r['reps']} more; files in the OS page cache (warm). Command:\n")
    out.append(f"```\n{command}\n```\n")
    out.append(f"- date: {date}; jax {jax.__version__}, backend {jax.default_backend()}; {machine}; run time "
               f"{elapsed_s:.0f} s; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
               "(2 cores: above 2, other jobs competed); a shared, noisy VM\n")
    sizes = r["sizes"]
    out.append(f"- on disk: GGUF (Q4_1, Q8_0 embedding) {sizes['gguf'] / 2**20:.0f} MiB; orbax weights "
               + ", ".join(f"{d} {sizes[d] / 2**20:.0f} MiB" for d in sizes if d != "gguf") + "\n")
    rows = [[x["dtype"], x["source"], x["target"], f"{x['first']:.2f}", f"{x['median']:.2f}", f"{x['min']:.2f}"]
            for x in r["rows"]]
    out.append(md_sections.table(["dtype", "from", "to", "first call s", "median s", "min s"], rows) + "\n")
    converts = {x["dtype"]: x["convert_s"] for x in r["rows"]}
    out.append("- conversion (GGUF load + orbax save + tokenizer), once per dtype: "
               + ", ".join(f"{d} {s:.1f} s" for d, s in converts.items()) + "\n")
    by = {(x["dtype"], x["source"], x["target"].split(" (")[0]): x["median"] for x in r["rows"]}
    notes = []
    for d in converts:
        gguf, orbax = by.get((d, "GGUF", "host numpy")), by.get((d, "orbax", "host numpy"))
        dev_g, dev_o = by.get((d, "GGUF", "default device")), by.get((d, "orbax", "default device"))
        if gguf and orbax and dev_g and dev_o:
            notes.append(f"{d}: orbax is {gguf / orbax:.1f}x faster to host numpy ({orbax:.2f} s vs {gguf:.2f} s) "
                         f"and {dev_g / dev_o:.1f}x faster onto the device ({dev_o:.2f} s vs {dev_g:.2f} s)")
    out += [f"- {n}" for n in notes]
    ratios = ", ".join(f"{d} {sizes[d] / sizes['gguf']:.1f}x" for d in sizes if d != "gguf")
    out.append("- both include the tokenizer (orbax: `tokenizer.json`; GGUF: built from its metadata). Orbax stores "
               f"arrays zstd-compressed (its default), so it reads more bytes than the 4-bit GGUF ({ratios}) and "
               "decompresses them, but does no dequantization\n")
    out.append(SECTION_END)
    return "\n".join(out)
