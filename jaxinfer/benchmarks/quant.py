"""Quantization workload: decode speed of each weight format beside the memory roofline of its bytes, and XLA's
memory analysis of the compiled step.

Weight formats (all in one process, each engine with `warmup=False` and the same KV budget): f32 and bf16
(unquantized), int8 (w8a8: dynamic per-token int8 activations, int8 x int8 -> int32 dots, norm gains folded;
embedding and LM head int8), int8 weight-only, int8 with the embedding and LM head left in bf16, fp8 (e4m3,
weight-only; embedding and LM head bf16, its default), fp8 with them quantized too, fp8 with groups of 128 input
channels (where they divide), int4 with groups of 32 (weight-only), and a GGUF model's Q8_0 / Q4_0 / Q4_1 tensors kept
as stored (`--quantization gguf`; only for a GGUF model, such as the default), and the microscaling formats
(mxfp8 weight-only and w8a8, mxfp4, nvfp4; `models.mxfp`). Quantized formats run with bf16 activations.

1. **Decode step time** at each `--batches` size (batch 1 is padded to 2 rows, as the runner does):
   `ModelRunner.execute` of one decode token per sequence at context 128 (distinct pages per sequence), greedy;
   one untimed call (compiles), then `--reps` timed calls, formats interleaved round by round so slow spells of
   the shared VM hit all alike. Tokens/s = batch / median step time.
2. **Roofline**: bytes a decode step must read = every weight byte except the embedding rows not gathered (a tied
   table is read whole by the LM head anyway) + the KV cache of the batch's context; roofline tokens/s = batch x
   bandwidth / bytes, with the roofline probe (`jaxinfer.benchmarks.probe`) measured first in the same run.
3. **Memory analysis** of the compiled batch-1 decode step (`compiled.memory_analysis()`): temporary bytes, and
   the full-precision copies of quantized weights among its buffers (`jaxinfer.benchmarks.hlo`).

Expected for SmolLM2-135M-Instruct, written before the first measurement (2 shared cores, ~45 GB/s; earlier
measurement of the forward at 2 rows with random weights: f32 ~30 ms, bf16 ~19 ms, int8 w8a8 ~20 ms):
- batch 1: bf16 and int8 about equal (~45-55 tok/s): XLA:CPU's int8 dot at 2 rows runs at ~12 GB/s of int8,
  compute-bound, so halving the bytes again does not pay; f32 ~30 tok/s; int8 weight-only and fp8 slower than
  bf16 (each dot first converts its weight to f32 in memory: ~1.5-4x the bf16 step). Far below llama.cpp's 217
  tok/s (Q4_0) and below the int8 roofline (~330 tok/s): the step is not bandwidth-bound at batch 1 here.
- batch 32: int8 w8a8 fastest (int8 GEMM ~1.5-3x bf16 per weight), ~1.3-2x bf16 tokens/s.
- memory analysis: int8 w8a8 no full-precision copy; weight-only int8 and fp8 copies (one weight at a time for
  int8; XLA:CPU upcasts fp8 arrays whole, before the loop).

    .venv/bin/jaxinfer bench quant --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time

import numpy as np

from jaxinfer import SamplingParams
from jaxinfer.benchmarks import hlo
from jaxinfer.benchmarks.probe import measure_bandwidth, roofline_gb_s
from jaxinfer.benchmarks.report import Report, machine_line, table
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.scheduler.chunk import ScheduledChunk
from models import quant
from models.llama import KVCache

logger = logging.getLogger(__name__)

SECTION = ("<!-- quant-speed:begin -->", "<!-- quant-speed:end -->")
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
    "int4 g32 (embedding + LM head bf16)": ("bfloat16", "int4"),
    "gguf (Q4_1 / Q8_0 kept as stored)": ("bfloat16", "gguf"),
    "mxfp8 (embedding + LM head bf16)": ("bfloat16", "mxfp8"),
    "mxfp8 (w8a8)": ("bfloat16", {"format": "mxfp8", "quantize_activations": True}),
    "mxfp4 (embedding + LM head bf16)": ("bfloat16", "mxfp4"),
    "nvfp4 (embedding + LM head bf16)": ("bfloat16", "nvfp4"),
}
CONTEXT = 128  # cached tokens of every sequence in the timed decode step
KV_BYTES = 256 << 20  # each engine's KV cache budget
LLAMA_CPP_Q4_0_B1 = 217.0  # SmolLM2 tok/s, shared/JAX_ON_CPU.md (llama-cpp-python 0.3.36, not installed here)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quant workload's options."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--formats", default=";".join(FORMATS),
                        help="';'-separated weight formats (default: all: " + "; ".join(FORMATS) + ")")
    parser.add_argument("--batches", default="1,32", help="decode batch sizes")
    parser.add_argument("--reps", type=int, default=15, help="timed calls per format and batch")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="each engine's context limit (sets the page-table width of the step)")
    parser.add_argument("--bw-gib", type=float, default=1.0, help="GiB the roofline probe reads")
    parser.add_argument("--bw-reps", type=int, default=7, help="timed calls of the roofline probe")


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """(formats, batch sizes) of the options.

    Raises:
      ValueError: an unknown format, a batch below 1, --reps below 1 or a context limit below 129 tokens.
    """
    formats = [f.strip() for f in args.formats.split(";") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise ValueError(f"--formats: unknown {unknown or 'empty list'}; known: {'; '.join(FORMATS)}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batches {args.batches!r} is not a list of integers") from None
    if not batches or min(batches) < 1 or args.reps < 1:
        raise ValueError("--batches needs integers >= 1 and --reps must be >= 1")
    if args.max_model_len <= CONTEXT:
        raise ValueError(f"--max-model-len {args.max_model_len} must exceed the timed context ({CONTEXT} tokens)")
    return formats, batches


def step_bytes(engine: Engine, batch: int) -> float:
    """Bytes one decode step must read: all weights but the embedding rows not gathered, plus the batch's KV."""
    wb = engine.weight_bytes["bytes"]
    w = engine.runner.weights
    embed = w.embed
    if w.lm_head is not None:  # untied (or a separate head copy): the gather reads only `batch` rows of the table
        rows = embed.values.shape[0] if isinstance(embed, quant.QuantizedWeight) else embed.shape[0]
        wb -= embed.nbytes - batch * embed.nbytes / rows
    return wb + KVCache.bytes_per_page(engine.runner.cfg, 1, engine.runner.kv_cache.k.dtype) * CONTEXT * batch


def _chunks(batch: int, pages: list[int], pages_per_seq: int, vocab_size: int) -> list[ScheduledChunk]:
    """One decode token per sequence (a random id, below 40000) at context `CONTEXT`, `pages_per_seq` pages each."""
    rng = np.random.default_rng(batch)
    return [ScheduledChunk([int(rng.integers(1, min(40000, vocab_size)))], CONTEXT,
                           pages[i * pages_per_seq:(i + 1) * pages_per_seq]) for i in range(batch)]


def memory_analysis(engine: Engine, chunks: list[ScheduledChunk], rows: list[SamplingRow]) -> dict:
    """Temp bytes and full-precision weight copies of the engine's compiled step for this batch."""
    compiled = engine.runner.compile_step(chunks, rows)
    return {"temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "copies": hlo.materialized_weight_copies(compiled.as_text(), engine.runner.weights)}


def measure(args: argparse.Namespace, formats: list[str], batches: list[int], bandwidth_gb_s: float) -> list[dict]:
    """Decode step times of every format and batch, interleaved over `--reps` rounds; each format's engine stays
    alive (weights ~0.1-0.5 GB each for SmolLM2), since building one per call is too slow to interleave."""
    greedy = SamplingParams(temperature=0.0)
    setups, rows = [], []
    for name in formats:
        dtype, quantization = FORMATS[name]
        t0 = time.perf_counter()
        engine = Engine(EngineConfig.create(model=args.model, dtype=dtype, quantization=quantization, warmup=False,
                                            max_model_len=args.max_model_len, kv_cache_memory_bytes=KV_BYTES,
                                            enable_prefix_caching=False))
        pages_per_seq = -(-(CONTEXT + 1) // engine.page_size)
        pages = engine.page_allocator.allocate(max(batches) * pages_per_seq)
        for batch in batches:
            chunks = _chunks(batch, pages, pages_per_seq, engine.runner.cfg.vocab_size)
            sampling = [SamplingRow(greedy, seed=i) for i in range(batch)]
            fn = functools.partial(engine.runner.execute, chunks, sampling)
            fn()  # compiles
            row = {"format": name, "batch": batch, "model": engine.runner.cfg.name,
                   "weight_bytes": engine.weight_bytes["bytes"], "weight_mib": engine.weight_bytes["bytes"] / 2**20,
                   "quantized_share": engine.weight_bytes["quantized_share"],
                   "step_bytes": step_bytes(engine, batch), "times": []}
            if batch == 1:
                row.update(memory_analysis(engine, chunks, sampling))
            setups.append((fn, row))
            rows.append(row)
        logger.info("%s ready in %.1f s", name, time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    for _ in range(args.reps):
        for i in rng.permutation(len(setups)):
            fn, row = setups[i]
            t0 = time.perf_counter()
            fn()
            row["times"].append(time.perf_counter() - t0)
    for row in rows:
        times = row.pop("times")
        ms = 1e3 * statistics.median(times)
        row.update(ms=ms, min_ms=1e3 * min(times), max_ms=1e3 * max(times), tok_s=row["batch"] * 1e3 / ms,
                   roofline_tok_s=row["batch"] * bandwidth_gb_s * 1e9 / row["step_bytes"])
        row["of_roofline"] = row["tok_s"] / row["roofline_tok_s"]
        logger.info("%s", row)
    return rows


def _summary(rows: list[dict], default_model: bool) -> list[str]:
    """The int8 (w8a8) vs bf16 lines, per measured batch, when both ran."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        tok = {r["format"]: r["tok_s"] for r in rows if r["batch"] == batch}
        if "int8 (w8a8)" not in tok or "bf16" not in tok:
            continue
        line = (f"- Batch {batch}: int8 (w8a8) {tok['int8 (w8a8)']:.1f} tok/s vs bf16 {tok['bf16']:.1f} "
                f"({tok['int8 (w8a8)'] / tok['bf16']:.2f}x)")
        if batch == 1 and default_model:
            line += (f"; the goal, llama.cpp's best on this machine ({LLAMA_CPP_Q4_0_B1:.0f} tok/s, Q4_0, from "
                     "shared/JAX_ON_CPU.md, not re-run: llama-cpp-python is not installed here), is "
                     f"{'met' if tok['int8 (w8a8)'] > LLAMA_CPP_Q4_0_B1 else 'not met'}")
        out.append(line + ".")
    return out


def render(rows: list[dict], args: argparse.Namespace, bandwidth_gb_s: float, elapsed_s: float) -> str:
    """The section's markdown (without its markers)."""
    body = []
    for r in rows:
        copies = r.get("copies")
        body.append([r["format"], str(r["batch"]), f"{r['weight_mib']:.0f}", f"{r['quantized_share'] * 100:.1f}%",
                     f"{r['ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})", f"{r['tok_s']:.1f}",
                     f"{r['roofline_tok_s']:.0f}", f"{r['of_roofline'] * 100:.0f}%",
                     "" if copies is None else f"{r['temp_mib']:.1f} MiB, {len(copies)} copies"])
    return "\n".join([
        "## Quantization: decode speed and memory roofline",
        "",
        f"`{args.command}` ({args.date}; {machine_line()}; {elapsed_s:.0f} s). {rows[0]['model']}, one decode token "
        f"per sequence at context {CONTEXT}, `ModelRunner.execute` (device step + sampling + host), median of the "
        f"timed calls (min-max). Roofline: batch x {bandwidth_gb_s:.1f} GB/s (the roofline probe, measured in this "
        "run) / bytes the step must read (weights, minus embedding rows not gathered, plus the batch's KV). Last "
        "column: XLA's memory analysis of the compiled batch-1 step (temporary bytes) and the buffers in it that are "
        "full-precision copies of quantized weights (`jaxinfer.benchmarks.hlo.materialized_weight_copies`).",
        "",
        table(["weights", "batch", "weight MiB", "params quantized", "step ms", "tok/s", "roofline tok/s",
               "of roofline", "step temp, weight copies"], body),
        "",
        *_summary(rows, args.model is None),
    ])


def run(args: argparse.Namespace) -> Report:
    """Measures the roofline probe, then every format's decode steps."""
    t0 = time.perf_counter()
    formats, batches = check_arguments(args)
    bandwidth = measure_bandwidth(args.bw_gib, args.bw_reps, others=False)
    gb_s = roofline_gb_s(bandwidth)
    rows = measure(args, formats, batches, gb_s)
    data = {"bandwidth": bandwidth, "roofline_gb_s": gb_s, "context": CONTEXT, "rows": rows}
    return Report("quant", render(rows, args, gb_s, time.perf_counter() - t0), data)
