"""Quantization workload of `scripts/benchmark.py --workload quant`: decode speed of each weight format of
SmolLM2-135M-Instruct on this CPU, beside the memory roofline of its bytes, and XLA's memory analysis of the step.

Weight formats (all in one process, each with `warmup=False` and the same KV budget): f32 and bf16 (unquantized),
int8 (w8a8: dynamic per-token int8 activations, int8 x int8 -> int32 dots, norm gains folded; embedding and LM head
int8), int8 weight-only, int8 with the embedding and LM head left in bf16, fp8 (e4m3, weight-only; embedding and
LM head bf16, its default), fp8 with them quantized too, fp8 with groups of 128 input channels (where they
divide). Quantized formats run with bf16 activations.

1. **Decode step time** at batch 1 (padded to 2 rows, as the runner does) and batch 32: `ModelRunner.execute` of
   one decode token per sequence at context 128 (distinct pages per sequence), greedy; one untimed call (compiles),
   then `reps` timed calls, formats interleaved round by round so slow spells of the shared VM hit all alike.
   Tokens/s = batch / median step time.
2. **Roofline**: bytes a decode step must read = every weight byte except the embedding rows not gathered (the
   tied table is read whole by the LM head anyway) + the KV cache of the batch's context; roofline tokens/s =
   batch x bandwidth / bytes, with the bandwidth `benchmark.py` measured in the same run.
3. **Memory analysis** of the compiled batch-1 decode step (`compiled.memory_analysis()`): temporary bytes, and
   the full-precision copies of quantized weights among its buffers (`jaxinfer.benchmarks.hlo.materialized_weight_copies`).

Expected, written before the first measurement (2 shared cores, ~45 GB/s; earlier measurement of the forward at
2 rows with random weights: f32 ~30 ms, bf16 ~19 ms, int8 w8a8 ~20 ms):
- batch 1: bf16 and int8 about equal (~45-55 tok/s): XLA:CPU's int8 dot at 2 rows runs at ~12 GB/s of int8,
  compute-bound, so halving the bytes again does not pay; f32 ~30 tok/s; int8 weight-only and fp8 slower than
  bf16 (each dot first converts its weight to f32 in memory: ~1.5-4x the bf16 step). Far below llama.cpp's 217 tok/s
  (Q4_0) and below the int8 roofline (~330 tok/s): the step is not bandwidth-bound at batch 1 on this backend.
- batch 32: int8 w8a8 fastest (int8 GEMM ~1.5-3x bf16 per weight), ~1.3-2x bf16 tokens/s.
- memory analysis: int8 w8a8 no full-precision copy; weight-only int8 and fp8 copies (one weight at a time for
  int8; XLA:CPU upcasts fp8 arrays whole, before the loop).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time

import jax
import numpy as np

import md_sections  # noqa: E402  (scripts/ is on sys.path when these run)
from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.benchmarks import hlo
from models import quant
from models.llama import KVCache

logger = logging.getLogger("bench_quant")
SECTION_BEGIN, SECTION_END = "<!-- quant-speed:begin -->", "<!-- quant-speed:end -->"
FORMATS = {  # name -> (dtype, quantization)
    "f32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8 (w8a8)": ("bfloat16", {"format": "int8", "quantize_activations": True}),
    "int8 weight-only": ("bfloat16", "int8"),
    "int8 (w8a8), embedding + LM head bf16": ("bfloat16", {"format": "int8", "quantize_activations": True,
                                                           "quantize_embedding": False, "quantize_lm_head": False}),
    "fp8 (embedding + LM head bf16)": ("bfloat16", "fp8"),
    "fp8, embedding + LM head fp8": ("bfloat16", {"format": "fp8", "quantize_embedding": True,
                                                  "quantize_lm_head": True}),
    "fp8 g128": ("bfloat16", {"format": "fp8", "group_size": 128}),
}
BATCHES = (1, 32)
CONTEXT = 128
KV_BYTES = 256 << 20
LLAMA_CPP_Q4_0_B1 = 217.0  # tok/s, shared/JAX_ON_CPU.md (llama-cpp-python 0.3.36, not installed in this venv)


def step_bytes(engine: Engine, batch: int) -> float:
    """Bytes one decode step must read: all weights but the embedding rows not gathered, plus the batch's KV."""
    wb = engine.weight_bytes["bytes"]
    w = engine.runner.weights
    embed = w.embed
    if w.lm_head is not None:  # untied (or a separate head copy): the gather reads only `batch` rows of the table
        row = embed.nbytes / embed.shape[0] if not isinstance(embed, quant.QuantizedWeight) else \
            embed.nbytes / embed.values.shape[0]
        wb -= embed.nbytes - batch * row
    kv = KVCache.bytes_per_page(engine.runner.cfg, 1, engine.runner.kv_cache.k.dtype) * CONTEXT * batch
    return wb + kv


def _chunks(engine: Engine, batch: int, pages: list[int], pages_per_seq: int) -> list[ScheduledChunk]:
    rng = np.random.default_rng(batch)
    return [ScheduledChunk([int(rng.integers(100, 40000))], CONTEXT, pages[i * pages_per_seq:(i + 1) * pages_per_seq])
            for i in range(batch)]


def measure(reps: int, bandwidth_gb_s: float) -> list[dict]:
    """Decode step times of every format and batch, interleaved over `reps` rounds; one engine alive at a time is
    too slow to interleave, so each format's engine stays alive (weights ~0.1-0.5 GB each)."""
    greedy = SamplingParams(temperature=0.0)
    setups, rows = [], []
    for name, (dtype, quantization) in FORMATS.items():
        t0 = time.perf_counter()
        engine = Engine(EngineConfig.create(dtype=dtype, quantization=quantization, warmup=False, max_model_len=512,
                                     kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False))
        ps = engine.page_size
        pages_per_seq = -(-(CONTEXT + 1) // ps)
        pages = engine.page_allocator.allocate(max(BATCHES) * pages_per_seq)
        for batch in BATCHES:
            chunks = _chunks(engine, batch, pages, pages_per_seq)
            sampling = [SamplingRow(greedy, seed=i) for i in range(batch)]
            fn = functools.partial(engine.runner.execute, chunks, sampling)
            fn()  # compiles
            row = {"format": name, "batch": batch, "weight_mib": engine.weight_bytes["bytes"] / 2**20,
                   "quantized_share": engine.weight_bytes["quantized_share"], "step_bytes": step_bytes(engine, batch),
                   "times": []}
            if batch == 1:
                row.update(memory_analysis(engine, chunks, sampling))
            setups.append((fn, row))
            rows.append(row)
        logger.info("%s ready in %.1f s", name, time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    for _ in range(reps):
        for i in rng.permutation(len(setups)):
            fn, row = setups[i]
            t0 = time.perf_counter()
            fn()
            row["times"].append(time.perf_counter() - t0)
    for row in rows:
        ms = 1e3 * statistics.median(row["times"])
        row.update(ms=ms, min_ms=1e3 * min(row["times"]), max_ms=1e3 * max(row["times"]),
                   tok_s=row["batch"] * 1e3 / ms,
                   roofline_tok_s=row["batch"] * bandwidth_gb_s * 1e9 / row["step_bytes"])
        row["of_roofline"] = row["tok_s"] / row["roofline_tok_s"]
        del row["times"]
        logger.info("%s", row)
    return rows


def memory_analysis(engine: Engine, chunks: list[ScheduledChunk], rows: list[SamplingRow]) -> dict:
    """Temp bytes and full-precision weight copies of the engine's compiled step for this batch."""
    compiled = engine.runner.compile_step(chunks, rows)
    return {"temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "copies": hlo.materialized_weight_copies(compiled.as_text(), engine.runner.weights)}


def render(rows: list[dict], command: str, date: str, machine: str, bandwidth_gb_s: float, elapsed_s: float) -> str:
    body = []
    for r in rows:
        copies = r.get("copies")
        body.append([r["format"], str(r["batch"]), f"{r['weight_mib']:.0f}", f"{r['quantized_share'] * 100:.1f}%",
                     f"{r['ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})", f"{r['tok_s']:.1f}",
                     f"{r['roofline_tok_s']:.0f}", f"{r['of_roofline'] * 100:.0f}%",
                     "" if copies is None else f"{r['temp_mib']:.1f} MiB, {len(copies)} copies"])
    b1 = {r["format"]: r["tok_s"] for r in rows if r["batch"] == 1}
    b32 = {r["format"]: r["tok_s"] for r in rows if r["batch"] == 32}
    return "\n".join([
        SECTION_BEGIN,
        "## Quantization: decode speed and memory roofline",
        "",
        f"`{command}` ({date}; {machine}; {elapsed_s:.0f} s). SmolLM2-135M-Instruct, one decode token per sequence "
        f"at context {CONTEXT}, `ModelRunner.execute` (device step + sampling + host), median of the timed calls "
        f"(min-max). Roofline: batch x {bandwidth_gb_s:.1f} GB/s (the bandwidth measured in this run) / bytes the "
        "step must read (weights, minus embedding rows not gathered, plus the batch's KV). Last column: XLA's memory "
        "analysis of the compiled batch-1 step (temporary bytes) and the buffers in it that are full-precision "
        "copies of quantized weights (`jaxinfer.benchmarks.hlo.materialized_weight_copies`).",
        "",
        md_sections.table(["weights", "batch", "weight MiB", "params quantized", "step ms", "tok/s",
                           "roofline tok/s", "of roofline", "step temp, weight copies"], body),
        "",
        f"- Batch 1: int8 (w8a8) {b1.get('int8 (w8a8)', 0):.1f} tok/s vs bf16 {b1.get('bf16', 0):.1f} "
        f"({b1.get('int8 (w8a8)', 0) / max(b1.get('bf16', 1), 1e-9):.2f}x); the goal, llama.cpp's best on this "
        f"machine ({LLAMA_CPP_Q4_0_B1:.0f} tok/s, Q4_0, from shared/JAX_ON_CPU.md, not re-run: llama-cpp-python is "
        f"not installed here), is {'met' if b1.get('int8 (w8a8)', 0) > LLAMA_CPP_Q4_0_B1 else 'not met'}.",
        f"- Batch 32: int8 (w8a8) {b32.get('int8 (w8a8)', 0):.0f} tok/s vs bf16 {b32.get('bf16', 0):.0f} "
        f"({b32.get('int8 (w8a8)', 0) / max(b32.get('bf16', 1), 1e-9):.2f}x).",
        SECTION_END,
    ])
