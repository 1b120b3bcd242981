"""Native matmul kernels at a decode layer's shapes, at every ISA level this CPU runs: each call site of a SmolLM2
layer (q/k/v in one call, o, gate/up in one call, down; one activation row) inside a jitted `lax.scan` over 30
stacked layers that passes the stack and the layer index, as the engine's layer scan does. Levels are timed in
alternating rounds (the shared VM's slow spells hit all alike); prints the median over rounds of each round's
median, in microseconds a layer. Weights are random (codes and scales), so only the time means anything.

    .venv/bin/python scripts/kernel_layers.py w4a8 --rounds 5      # or int4, int8, q8_0, w8a8, bf16

`--baseline LIB` times an earlier build of the kernels beside this checkout's, in the same rounds and process: a
library file from the build cache (`~/.cache/jaxinfer/native/jaxinfer_gemv_<level>_<hash>.so`, built by an older
checkout; its level is in its name and only that level runs). `--rows M`: M activation rows (1 to `cpu_gemv.MAX_ROWS`).
The thread pool (`threads.h`) is one per library: two libraries' workers share the CPUs between rounds.

Weights total 30 x ~3.3 MB (int4) to ~6.4 MB (int8) per kind: on a CPU with a large last-level cache they stay
in it, as a lone engine's weights do; the time then is the kernels' compute and hand-offs, not DRAM.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_features, cpu_gemv
from pallas_kernels.cpu_gemv import build

LAYERS = 30
SITES = {"q/k/v": [(576, 576), (192, 576), (192, 576)], "o": [(576, 576)], "gate/up": [(1536, 576), (1536, 576)],
         "down": [(576, 1536)]}  # [N, K] of each weight a call takes


def _weights(kind: str, n: int, k: int, rng: np.random.Generator) -> tuple:
    if kind == "bf16":  # the model's plain layout, input-major [K, N]
        return (jnp.asarray(rng.standard_normal((LAYERS, k, n), dtype=np.float32), jnp.bfloat16), None, None)
    if kind in ("w4a8", "int4"):
        return (jnp.asarray(rng.integers(0, 256, (LAYERS, n, k // 2), dtype=np.uint8)),
                jnp.asarray(rng.random((LAYERS, n, k // 32), dtype=np.float32) * 0.01), None)
    groups = k // 32 if kind == "q8_0" else 1  # GGUF Q8_0: a scale a block of 32 inputs
    return (jnp.asarray(rng.integers(-127, 128, (LAYERS, n, k), dtype=np.int8)),
            jnp.asarray(rng.random((LAYERS, n, groups), dtype=np.float32) * 0.01), None)


def scan_of(kind: str, site: str, rng: np.random.Generator, rows: int = 1):
    """A jitted scan of `LAYERS` calls of the kind's kernel at the site's shapes (traced under the current ISA)."""
    ws = [_weights(kind, n, k, rng) for n, k in SITES[site]]
    x = jnp.asarray(rng.standard_normal((rows, SITES[site][0][1]), dtype=np.float32)).astype(jnp.bfloat16)

    def body(carry, layer):
        if kind == "bf16":
            ys = cpu_gemv.float_matmuls(x + carry.astype(x.dtype), [w[0] for w in ws], input_major=True, layer=layer)
        elif kind == "w8a8":
            xq = jnp.clip(jnp.round(x.astype(jnp.float32) * 10), -127, 127).astype(jnp.int8) + carry.astype(jnp.int8)
            ys = cpu_gemv.i8i8_matmuls(xq, [w[0] for w in ws], layer=layer)
        else:
            ys = cpu_gemv.weight_only_matmuls(x + carry.astype(x.dtype), ws, layer=layer,
                                              int8_activations=kind == "w4a8")
        return carry + 0 * ys[0][0, 0].astype(jnp.float32), None  # a dependence: the calls run in order

    return jax.jit(lambda: jax.lax.scan(body, jnp.float32(0), jnp.arange(LAYERS, dtype=jnp.int32))[0])


def register_baseline(path: Path, kernels: list[str]) -> str:
    """Registers `kernels` (`build.TARGETS` names) of an earlier library under "baseline_" target names; returns the
    library's ISA level. Exits with a one-line message for a missing file, a name without a level this CPU runs,
    or a file that is no kernels library (older builds lack later kernels; only the timed ones must be there)."""
    if not path.is_file():
        raise SystemExit(f"--baseline {path}: no such file")
    match = re.fullmatch(r"jaxinfer_gemv_(\w+?)_[0-9a-f]+\.so", path.name)
    if match is None or match.group(1) not in cpu_features.supported_levels():
        raise SystemExit(f"--baseline {path}: not a kernels library of a level this CPU runs "
                         f"(jaxinfer_gemv_<level>_<hash>.so; levels here: {cpu_features.supported_levels()})")
    for kernel in kernels:
        try:
            symbol = getattr(ctypes.cdll.LoadLibrary(str(path)), f"jaxinfer_{kernel}")
        except (OSError, AttributeError) as e:
            raise SystemExit(f"--baseline {path}: not a kernels library with jaxinfer_{kernel} ({e})") from None
        jax.ffi.register_ffi_target("baseline_" + build.target_name(kernel, match.group(1)),
                                    jax.ffi.pycapsule(symbol), platform="cpu")
    return match.group(1)


@contextlib.contextmanager
def baseline_targets() -> Iterator[None]:
    """Inside the block, calls traced name the "baseline_" targets of `register_baseline` (jax's caches are
    cleared on the way in and out: a jitted wrapper traced before would keep the other name). Compile what is
    traced inside ahead of time (`.lower().compile()`): a jitted function called later would trace again, outside."""
    target_name = build.target_name
    build.target_name = lambda *a: "baseline_" + target_name(*a)
    jax.clear_caches()
    try:
        yield
    finally:
        build.target_name = target_name
        jax.clear_caches()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("w4a8", "int4", "int8", "q8_0", "w8a8", "bf16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="timed scans a site and level each round")
    parser.add_argument("--rows", type=int, default=1, help="activation rows, 1 to cpu_gemv.MAX_ROWS (default 1)")
    parser.add_argument("--baseline", type=Path, help="an earlier kernels library to time beside this one")
    args = parser.parse_args()
    if min(args.rounds, args.calls) < 1:
        parser.error("--rounds and --calls must be >= 1")
    if not 1 <= args.rows <= cpu_gemv.MAX_ROWS:
        parser.error(f"--rows must be in [1, {cpu_gemv.MAX_ROWS}]")
    try:
        cpu_features.check_environment()
    except ValueError as e:
        parser.error(str(e))
    if not cpu_gemv.active():
        raise SystemExit("the native CPU kernels are not available here (turned off by JAXINFER_NATIVE_KERNELS=0, "
                         "no compiler, or a CPU without AVX2 + FMA)")
    rng = np.random.default_rng(0)
    levels = cpu_features.supported_levels()
    builds = ["this"]
    if args.baseline is not None:
        kernel = {"w8a8": "i8i8_matmul", "bf16": "float_matmul"}.get(args.kind, "weight_only_matmul")
        levels, builds = [register_baseline(args.baseline, [kernel])], ["this", "baseline"]
    scans = {}
    for level in levels:
        os.environ["JAXINFER_NATIVE_ISA"] = level
        for which in builds:
            with baseline_targets() if which == "baseline" else contextlib.nullcontext():
                for site in SITES:
                    fn = scan_of(args.kind, site, rng, args.rows).lower().compile()  # under this level (and build)
                    fn().block_until_ready()
                    scans[(f"{level}{'' if which == 'this' else ' (baseline)'}", site)] = fn
    rounds: dict = {key: [] for key in scans}
    for _ in range(args.rounds):
        for key, fn in scans.items():
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn().block_until_ready()
                times.append(time.perf_counter() - t0)
            rounds[key].append(statistics.median(times) / LAYERS * 1e6)
    for (level, site), us in rounds.items():
        line = (f"{args.kind:5s} {args.rows} row{'s' if args.rows > 1 else ' '} {level:23s} {site:8s} "
                f"{statistics.median(us):7.1f} us a layer "
                f"(best round {min(us):.1f})")
        if level.endswith("(baseline)"):
            this = rounds[(level.removesuffix(" (baseline)"), site)]
            line += f"; baseline / this, median of the rounds: {statistics.median(b / t for b, t in zip(us, this)):.2f}x"
        print(line)


if __name__ == "__main__":
    main()
