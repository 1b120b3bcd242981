"""Where a decode step's time goes, by XLA op kind: a `jax.profiler` trace of a few `ModelRunner.execute` calls of
one weight format (a `jaxinfer bench quant` format name), aggregated from the trace's XLA thread events.

    .venv/bin/python scripts/profile_decode.py "int8 (w8a8)" --batch 1 [--unrolled] [--attention-backend reference]

Prints the median step time untraced, then ms per step of each op kind (ffi_call = the native kernels, then split
by kernel: matmuls, with the attention backend "auto" the native decode attention, and the sampler's row
reductions;
while = loops, including the layer scan itself, so nested times add up to more than the step; copy / ynn fusions
inside the attention loop are its page gathers and dots). Tracing slows the step; compare kinds, not totals.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile
import time

import jax
from jax._src.lib import _profile_data

from jaxinfer.benchmarks.quant import FORMATS, decode_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=list(FORMATS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--unrolled", action="store_true", help="scan_layers=False")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "reference"),
                        help="auto: on CPU the native decode attention (an ffi_call per layer); reference: jnp")
    args = parser.parse_args()
    engine, step = decode_step(args.format, args.batch, scan_layers=not args.unrolled,
                          attention_backend=args.attention_backend)
    for _ in range(5):
        step()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"{args.format}, batch {args.batch}: median step {1e3 * statistics.median(times):.2f} ms (untraced)")
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(args.steps):
            step()
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = _profile_data.ProfileData.from_file(path)
    # each ffi_call instruction's kernel (its custom_call_target, less the jaxinfer_ prefix and the ISA suffix)
    hlo = engine.runner.compile_step(*step.args).as_text()
    target = {name: re.sub(r"^jaxinfer_|_(avx2|avx512_vnni)$", "", kernel) for name, kernel in
              re.findall(r"%(ffi_call[.\w]*) = .*?custom_call_target=\"(\w+)\"", hlo)}
    total, count = collections.Counter(), collections.Counter()
    by_kernel, kernels = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                if not event.name.startswith("ThunkExecutor"):
                    kind = event.name.split(".")[0]
                    total[kind] += event.duration_ns
                    count[kind] += 1
                    if event.name in target:
                        by_kernel[target[event.name]] += event.duration_ns
                        kernels[target[event.name]] += 1
    for kind, ns in total.most_common(12):
        print(f"{ns / args.steps / 1e6:8.3f} ms/step  {count[kind] // args.steps:5d} per step  {kind}")
    for kernel, ns in by_kernel.most_common():
        print(f"{ns / args.steps / 1e6:8.3f} ms/step  {kernels[kernel] // args.steps:5d} per step  ffi_call {kernel}")


if __name__ == "__main__":
    main()
