"""Decode step time of SmolLM2 sharded over 1, 2, 4 and 8 fake CPU devices (tensor parallelism).

    .venv/bin/python scripts/bench_sharding.py --write BENCHMARKS.md

On this machine the 8 "devices" are XLA CPU devices sharing 2 cores and one memory: sharding cannot make a step
faster here; the numbers measure what TP costs (per-layer all-reduces, padded heads, smaller per-device matmuls,
partitioner overheads), which is what must stay small for TP to pay off on real accelerators. The script sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` for its own process; run it as a script, not imported.

Each row: a `ModelRunner` built by the engine (`LLM(tensor_parallel_size=tp)`), steps of `batch` decodes at a
context of `--context` tokens, timed after 3 warm-up steps; median of `--reps` steps (ms per step).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

CHILD = os.environ.get("BENCH_SHARDING_ONE_DEVICE") == "1"  # the tp=1 baseline in a plain one-device process
if not CHILD:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import md_sections  # noqa: E402

import jax  # noqa: E402

from jaxinfer.scheduler.chunk import ScheduledChunk  # noqa: E402
from jaxinfer.engine.sampling import SamplingRow  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("bench_sharding")
BEGIN, END = md_sections.SHARDING_MARKERS


def time_decode(tp: int, batch: int, context: int, reps: int, dtype: str) -> dict:
    llm = LLM(tensor_parallel_size=tp, dtype=dtype, warmup=False, max_num_seqs=batch,
              kv_cache_memory_bytes=1 << 30)
    runner, ps = llm.runner, llm.page_size
    pages_per_seq = -(-(context + 1) // ps)
    chunks = [ScheduledChunk([11], context, llm.page_allocator.allocate(pages_per_seq)) for _ in range(batch)]
    rows = [SamplingRow(SamplingParams(temperature=0), seed=0)] * batch
    for _ in range(3):
        runner.execute(chunks, rows)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute(chunks, rows)  # returns after the sampled tokens reached the host
        times.append(time.perf_counter() - t0)
    cfg = runner.cfg
    return {"tp": tp, "batch": batch, "context": context, "dtype": dtype, "ms": 1e3 * statistics.median(times),
            "heads": f"{cfg.num_heads}/{cfg.num_kv_heads}"}


def render(rows: list[dict], command: str, elapsed: float) -> str:
    base = {(r["batch"], r["dtype"]): r["ms"] for r in rows if r["tp"] == 1 and not r.get("one_device")}
    lines = [BEGIN, "## Tensor parallelism on 8 fake CPU devices (overhead, not speed-up)\n",
             "SmolLM2-135M decode steps through the engine's `ModelRunner` with `tensor_parallel_size` = tp, "
             "f32 unless noted. The 8 devices are XLA CPU devices sharing this machine's 2 cores and memory, so "
             "tp > 1 cannot be faster here: the ratio to tp=1 is the cost of the 61 all-reduces per step (2 per "
             "layer + the embedding), the padded heads (9/3 heads become 12/4 at tp 2 and 4, 16/8 at tp 8) and "
             "partitioner overheads. On accelerators each device would read 1/tp of the weights. The first rows "
             "(\"1 (plain)\") are tp=1 in a process with one CPU device: splitting the CPU into 8 XLA devices "
             "slows even tp=1 (XLA gives each fake device a share of the thread pool), so compare the tp rows with "
             "the tp=1 row of the 8-device process. Command:\n",
             f"```\n{command}\n```\n",
             f"- date: {date.today()}; jax {jax.__version__}; nproc {os.cpu_count()}; run time {elapsed:.0f} s; "
             "a shared, noisy VM (20% run to run)\n",
             "| tp | padded heads (q/kv) | dtype | batch | context | ms per step (median) | vs tp=1 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["ms"] / base[(r["batch"], r["dtype"])]
        tp = f"{r['tp']} (plain)" if r.get("one_device") else str(r["tp"])
        lines.append(f"| {tp} | {r['heads']} | {r['dtype']} | {r['batch']} | {r['context']} | "
                     f"{r['ms']:.1f} | {ratio:.2f}x |")
    lines.append("\n" + END)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tps", default="1,2,4,8")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--write", type=Path, default=None, help="splice the section into this markdown file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    batches = [int(b) for b in args.batches.split(",")]
    if CHILD:
        print(json.dumps([time_decode(1, b, args.context, args.reps, args.dtype) for b in batches]))
        return
    t0 = time.perf_counter()
    child = subprocess.run([sys.executable, __file__, "--batches", args.batches, "--context", str(args.context),
                            "--reps", str(args.reps), "--dtype", args.dtype], capture_output=True, text=True,
                           env={**os.environ, "BENCH_SHARDING_ONE_DEVICE": "1", "XLA_FLAGS": ""}, check=True)
    rows = [dict(r, one_device=True) for r in json.loads(child.stdout.strip().splitlines()[-1])]
    for tp in (int(t) for t in args.tps.split(",")):
        for batch in batches:
            rows.append(time_decode(tp, batch, args.context, args.reps, args.dtype))
            logger.info("%s", rows[-1])
    command = "python scripts/bench_sharding.py " + " ".join(sys.argv[1:])
    section = render(rows, command.strip(), time.perf_counter() - t0)
    print(section)
    if args.write is not None:
        old = args.write.read_text() if args.write.is_file() else "# Benchmarks\n"
        args.write.write_text(md_sections.splice(old, section, BEGIN, END))


if __name__ == "__main__":
    main()
