"""The measuring half of `jaxinfer bench sharding`, run by it in a child process whose `XLA_FLAGS` set the number
of fake CPU devices before jax starts (`python -m jaxinfer.benchmarks.sharding_worker --tps 1,2 ...`).

Each row: a `ModelRunner` built by the engine (`LLM(tensor_parallel_size=tp)`), steps of `batch` decodes at a
context of `context` tokens, timed after 3 warm-up steps; median of `reps` steps (ms per step). Prints one JSON
object as its last stdout line: {"rows": [...], "model": {...}, "devices": N}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk

WARMUP_STEPS = 3


def time_decode(model: str | None, tp: int, batch: int, context: int, reps: int, dtype: str,
                kv_bytes: int) -> tuple[dict, dict]:
    """(the row: tp, batch, context, dtype, ms per step (median), padded q/kv heads; the unpadded model's shapes).

    Raises:
      ValueError: from the engine, e.g. a tp the model's heads or the device count do not allow.
    """
    llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, warmup=False, max_num_seqs=batch,
              kv_cache_memory_bytes=kv_bytes)
    runner, ps = llm.runner, llm.page_size
    pages_per_seq = -(-(context + 1) // ps)
    chunks = [ScheduledChunk([11], context, llm.page_allocator.allocate(pages_per_seq)) for _ in range(batch)]
    rows = [SamplingRow(SamplingParams(temperature=0), seed=0)] * batch
    for _ in range(WARMUP_STEPS):
        runner.execute(chunks, rows)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute(chunks, rows)  # returns after the sampled tokens reached the host
        times.append(time.perf_counter() - t0)
    padded, cfg = runner.cfg, llm.engine.model_config
    row = {"tp": tp, "batch": batch, "context": context, "dtype": dtype, "ms": 1e3 * statistics.median(times),
           "heads": f"{padded.num_heads}/{padded.num_kv_heads}"}
    model_info = {"name": cfg.name, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                  "num_kv_heads": cfg.num_kv_heads}
    return row, model_info


def main() -> None:
    """Parses the options, times every (tp, batch) row, prints the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tps", required=True, help="comma-separated tensor-parallel sizes")
    ap.add_argument("--batches", required=True, help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--kv-cache-memory-bytes", type=int, required=True)
    args = ap.parse_args()
    rows, model_info = [], {}
    for tp in (int(t) for t in args.tps.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            row, model_info = time_decode(args.model, tp, batch, args.context, args.reps, args.dtype,
                                          args.kv_cache_memory_bytes)
            rows.append(row)
    print(json.dumps({"rows": rows, "model": model_info, "devices": jax.device_count()}))


if __name__ == "__main__":
    main()
