"""Quantization workload: decode speed of each weight format beside the memory roofline of its bytes, and XLA's
memory analysis of the compiled step.

Weight formats (all in one process, each engine with `warmup=False` and the same KV budget): f32 and bf16
(unquantized), int8 (w8a8: dynamic per-token int8 activations, int8 x int8 -> int32 dots, norm gains folded; embedding
and LM head int8), int8 weight-only, int8 with the embedding and LM head left in bf16, fp8 (e4m3, weight-only;
embedding and LM head bf16, its default), fp8 with them quantized too, fp8 with groups of 128 input channels (where
they divide), int4 with groups of 32 (weight-only; with an int8 embedding and LM head, llama.cpp Q4_0's layout; and
that as w4a8, int8 activation blocks of 32), and a GGUF model's Q8_0 / Q4_0 / Q4_1 tensors kept as stored
(`--quantization gguf`; only for a GGUF model, such as the default), and the microscaling formats (mxfp8 weight-only
and w8a8, mxfp4, nvfp4; `models.mxfp`). Quantized formats run with bf16 activations.

1. **Decode step time** at each `--batches` size (batch 1 runs one row with the native kernels, two without them,
   as the runner does): one decode token per sequence at context 128 (distinct pages per sequence), greedy, the
   steps chained as the engine's decode loop runs them (`decode_timing.ChainedSteps`; `--no-async-scheduling`:
   each alone, `ModelRunner.execute`; a chain's sample is a round's mean call); a call compiles, then `--reps`
   timed calls, formats interleaved round by round so slow spells of the shared VM hit all alike (`--burst B`: B
   calls of an engine in a row a round, the first untimed, as the peers time their steps). Tokens/s = batch /
   median step time. `--isa`: each native engine once per ISA level.
2. **Roofline**: bytes a decode step must read = every weight byte except the embedding rows not gathered (a tied
   table is read whole by the LM head anyway) + the KV cache of the batch's context; roofline tokens/s = batch x
   bandwidth / bytes, with the roofline probe (`jaxinfer.benchmarks.probe`) measured at the start and at the end
   of the same run (the better reading).
3. **Memory analysis** of the compiled batch-1 decode step (`compiled.memory_analysis()`): temporary bytes, the
   full-precision copies of quantized weights among its buffers, and the native kernel call sites in it
   (`jaxinfer.benchmarks.hlo`).
4. **Native kernels on and off** (`--native both`): each format's engine twice, once with the native CPU matmul
   kernels where they apply (`pallas_kernels.cpu_gemv`, the engine's default on CPU) and once with XLA's dots only
   (`JAXINFER_NATIVE_KERNELS=0` around the engine's compile and every call), in the same interleaved rounds.
5. **Peers** (`--peer-python`, `--llamacpp-python`; `jaxinfer.benchmarks.peers`), after the engines' rounds (or
   `--peer-rounds N` times between them, each peer's median run kept), at batch 1 on the same GGUF file and one
   random prompt of `CONTEXT` tokens (decode from it, `--peer-steps` timed steps):
   llama.cpp re-quantized to each `--llamacpp-types` type (default Q4_0, Q8_0, BF16), HF transformers in bf16; each
   beside the roofline of its own bytes (llama.cpp: its tensors + an f16 KV cache of the decode context; HF: the
   bf16 row's weights + KV) at the same probe bandwidth.
6. **Kernel micro-benchmark** (`--gemv`, `jaxinfer.benchmarks.gemv_stream`): GB/s of one native kernel call
   streaming a `--gemv-mib` MiB weight (bf16, int8 weight-only, int8 w8a8, int4 g32) at `--gemv-rows` rows, beside
   XLA's dot on the same weight and the roofline probe.

Expected for SmolLM2-135M-Instruct on XLA's dots, written before the first measurement (2 shared cores): batch 1
bf16 ~ int8 (~45-55 tok/s; XLA's int8 dot at 2 rows is compute-bound), f32 ~30, weight-only int8 and fp8 slower
than bf16 (each dot converts its weight first); batch 32 w8a8 ~1.3-2x bf16; no full-precision copy for w8a8.

Expected with the native kernels (`--native both`), written before the first such run (AMD EPYC, AVX2
only, 2 cores shared with other jobs, probe ~40 GB/s; a 4 MiB trial of the micro-benchmark under load: native
1-row 9-18 GB/s, XLA 0.1-2.7 GB/s):
- micro-benchmark at 256 MiB: native bf16, int8 and w8a8 stream 15-25 GB/s at 1 row (40-60% of the probe; 2
  threads, AVX2 loads and converts), less at 8 rows where the FMAs per byte grow; int4 g32 ~8-15 GB/s of packed
  bytes (nibble unpacking and per-block scales are compute on AVX2). XLA: bf16 2-5 GB/s at 1 row, up to ~10 at 8;
  weight-only int8 and int4 under 1 GB/s (they write the dequantized weight first).
- decode batch 1: native over XLA bf16 ~1.2-1.5x (~35-45 tok/s), w8a8 ~1.5x, weight-only int8 5-10x, int4 g32 and
  gguf 3-5x, all ~45-60 tok/s: the ~10 ms of each step that is not a dense matmul (attention, sampling, host,
  small ops; `bench breakdown`) then dominate, so every format stays at 15-30% of its weight-read roofline, far
  from the goal of 70% of it. Batch 8: smaller gains (the kernels' FMAs per byte grow 8x).
- peers at batch 1: llama.cpp Q4_0 ~100-150 tok/s, Q8_0 ~80-120, BF16 ~40-60 (no native bf16 on this CPU); int4
  g32 through the native kernels below Q4_0 (the goal "int4 >= llama.cpp Q4_0" not met). HF transformers bf16
  ~10-20 tok/s.

    .venv/bin/jaxinfer bench quant --write BENCHMARKS.md
    .venv/bin/jaxinfer bench quant --formats "bf16;int8 (w8a8);int4 g32 (embedding + LM head bf16)" \
        --batches 1,8 --native both --gemv \
        --peer-python /work/venv-hf/bin/python --llamacpp-python /work/venv-llamacpp/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import statistics
import os
import time
from collections.abc import Callable, Iterator

import numpy as np

from jaxinfer import SamplingParams
from jaxinfer.benchmarks import gemv_stream, hlo, model_setup, peers, quant_report
from jaxinfer.benchmarks.decode_timing import ChainedSteps, timed_calls
from jaxinfer.benchmarks.probe import measure_bandwidth, roofline_gb_s
from jaxinfer.benchmarks.report import Report, int_list, name_list
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.scheduler.chunk import ScheduledChunk
from models import quant
from models.config import ModelConfig
from models.llama import KVCache
from pallas_kernels import cpu_features, cpu_gemv

logger = logging.getLogger(__name__)

SECTION = ("<!-- quant-speed:begin -->", "<!-- quant-speed:end -->")
FORMATS = {  # name -> (dtype, quantization)
    "f32": ("float32", None), "bf16": ("bfloat16", None),
    "int8 (w8a8)": ("bfloat16", {"format": "int8", "quantize_activations": True}),
    "int8 weight-only": ("bfloat16", "int8"),
    "int8 (w8a8), embedding + LM head bf16": ("bfloat16", {"format": "int8", "quantize_activations": True,
                                                           "quantize_embedding": False, "quantize_lm_head": False}),
    "fp8 (embedding + LM head bf16)": ("bfloat16", "fp8"),
    "fp8, embedding + LM head fp8": ("bfloat16", {"format": "fp8", "quantize_embedding": True,
                                                  "quantize_lm_head": True}),
    "fp8 g128": ("bfloat16", {"format": "fp8", "group_size": 128}),
    "int4 g32 (embedding + LM head bf16)": ("bfloat16", "int4"),
    "int4 g32, embedding + LM head int8 (llama.cpp Q4_0's layout)": ("bfloat16", {"format": "int4",
                                                                                  "embedding_format": "int8"}),
    "int4 g32 w4a8, embedding + LM head int8 (llama.cpp Q4_0's layout and arithmetic)": (
        "bfloat16", {"format": "int4", "embedding_format": "int8", "quantize_activations": True}),
    "gguf (Q4_1 / Q8_0 kept as stored)": ("bfloat16", "gguf"),
    "mxfp8 (embedding + LM head bf16)": ("bfloat16", "mxfp8"),
    "mxfp8 (w8a8)": ("bfloat16", {"format": "mxfp8", "quantize_activations": True}),
    "mxfp4 (embedding + LM head bf16)": ("bfloat16", "mxfp4"),
    "nvfp4 (embedding + LM head bf16)": ("bfloat16", "nvfp4"),
}
CONTEXT = 128  # cached tokens of every sequence in the timed decode step
KV_BYTES = 256 << 20  # each engine's KV cache budget
NATIVE = {"on": (True,), "off": (False,), "both": (True, False)}  # --native -> kernels allowed, per engine
NATIVE_VARIABLE = "JAXINFER_NATIVE_KERNELS"  # "0" turns the native CPU kernels off (`pallas_kernels.cpu_gemv`)
ISA_VARIABLE = "JAXINFER_NATIVE_ISA"  # the kernels' ISA level (`pallas_kernels.cpu_features`)
PEER_WARMUP_STEPS = 2  # the peers' untimed decode steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quant workload's options."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--formats", default=";".join(FORMATS),
                        help="';'-separated weight formats (default: all: " + "; ".join(FORMATS) + ")")
    parser.add_argument("--batches", default="1,32", help="decode batch sizes")
    parser.add_argument("--reps", type=int, default=15, help="rounds: timed calls per format and batch")
    parser.add_argument("--burst", type=int, default=1, help="calls of each engine in a row a round: 1 (default) "
                        "times each call after the other engines' calls, its weights as far out of the caches as they "
                        "left them; B > 1 runs one untimed call, then times B - 1 calls in a row (as the peers time "
                        "their steps), on a CPU whose last-level cache holds the weights a lone engine's speed")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="time each step alone, not chained as the engine's decode loop runs them (ChainedSteps)")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="each engine's context limit (sets the page-table width of the step)")
    parser.add_argument("--bw-gib", type=float, default=1.0, help="GiB the roofline probe reads")
    parser.add_argument("--bw-reps", type=int, default=7, help="timed calls of the roofline probe")
    parser.add_argument("--native", choices=list(NATIVE), default="on",
                        help="the native CPU matmul kernels: on (the engine's default: where they apply), off (XLA "
                             "only), both (each format twice) (default: %(default)s)")
    parser.add_argument("--isa", default="",
                        help="comma-separated ISA levels of the native kernels, each format's native engine once "
                             "per level (" + ", ".join(cpu_features.ISA_LEVELS) + ", or 'all' this CPU runs; "
                             "default: the highest it runs)")
    parser.add_argument("--gemv", action="store_true",
                        help="also the kernel micro-benchmark: GB/s of one native call over a large weight vs XLA")
    parser.add_argument("--gemv-mib", type=float, default=256, help="MiB of the micro-benchmark's weight values")
    parser.add_argument("--gemv-rows", default="1,2,4,8",
                        help=f"activation rows of the micro-benchmark's calls, each 1 to {cpu_gemv.MAX_ROWS} "
                             "(default 1,2,4,8)")
    parser.add_argument("--gemv-reps", type=int, default=5, help="timed calls per micro-benchmark cell (median)")
    parser.add_argument("--peer-steps", type=int, default=20, help="the peers' timed batch-1 decode steps (median)")
    parser.add_argument("--peer-rounds", type=int, default=1, help="runs of the peers spread evenly over the rounds "
                        "(each peer's tok/s: its median run), timing engines and peers in the same minutes of a "
                        "shared machine's load (default: one run, after the rounds)")
    peers.add_peer_arguments(parser)
    peers.add_llamacpp_arguments(parser)
    parser.set_defaults(llamacpp_types="Q4_0,Q8_0,BF16")


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[int], list[int], list[str | None]]:
    """(formats, batch sizes, micro-benchmark rows, ISA levels of the native engines: [None] for the default) of
    the options.

    Raises:
      ValueError: naming the option: an unknown format or llama.cpp type, a count below 1, --peer-rounds outside
        [1, --reps] or above 1 without a peer, a context limit below 129 tokens, micro-benchmark rows outside [1,
        `cpu_gemv.MAX_ROWS`] or --gemv-mib <= 0, `--native both` without the native kernels, an --isa level this
        CPU cannot run, --isa with --native off, an empty item in --formats or --isa.
    """
    formats = name_list("--formats", args.formats, ";")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--formats: unknown {unknown}; known: {'; '.join(FORMATS)}")
    low = [f"--{o.replace('_', '-')} {getattr(args, o)}" for o in ("reps", "burst", "peer_steps", "gemv_reps",
                                                                    "bw_reps") if getattr(args, o) < 1]
    if low:
        raise ValueError(f"{', '.join(low)}: must be >= 1")
    if not args.bw_gib > 0:
        raise ValueError(f"--bw-gib {args.bw_gib} must be > 0 (GiB the roofline probe reads)")
    batches = int_list("--batches", args.batches)
    gemv_rows = int_list("--gemv-rows", args.gemv_rows, 1, cpu_gemv.MAX_ROWS)  # checked with or without --gemv
    if not 1 <= args.peer_rounds <= (args.reps if args.peer_python or args.llamacpp_python else 1):
        raise ValueError(f"--peer-rounds {args.peer_rounds} must be in [1, --reps {args.reps}] (1 without a peer)")
    if args.max_model_len <= CONTEXT:
        raise ValueError(f"--max-model-len {args.max_model_len} must exceed the timed context ({CONTEXT} tokens)")
    if args.gemv and args.gemv_mib <= 0:
        raise ValueError(f"--gemv-mib must be > 0 (got {args.gemv_mib})")
    peers.check_llamacpp_types(args.llamacpp_types)
    if args.isa.strip() and args.native == "off":
        raise ValueError(f"--isa {args.isa!r} picks the native engines' ISA levels; --native off runs none")
    if args.native == "both" and not cpu_gemv.active():
        raise ValueError("--native both: the native CPU matmul kernels are not available here (JAXINFER_NATIVE_"
                         "KERNELS=0, a backend other than CPU, or a CPU without AVX2 + FMA); use --native off")
    return formats, batches, gemv_rows, isa_levels(args.isa)


def isa_levels(text: str) -> list[str | None]:
    """The `--isa` levels, lowest first: [None] (the default level) for ""; every level this CPU runs for "all".

    Raises:
      ValueError: a level that is unknown or that this CPU cannot run, an empty item (`avx2,,avx512_vnni`).
    """
    supported = cpu_features.supported_levels()
    wanted = (supported if text.strip().lower() == "all" else
              [t.lower() for t in name_list("--isa", text)] if text.strip() else [])
    bad = [t for t in wanted if t not in supported]
    if bad:
        raise ValueError(f"--isa: {bad} not among the levels this CPU runs ({', '.join(supported) or 'none'}; "
                         f"known: {', '.join(cpu_features.ISA_LEVELS)})")
    return [t for t in supported if t in wanted] or [None]


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


def decode_step(name: str, batch: int, *, model: str | None = None, max_model_len: int = 512, **config):
    """(engine, its decode step) of format `name`: one greedy decode token for each of `batch` sequences at context
    `CONTEXT` (`_chunks`), `ModelRunner.execute` with no arguments; `config`: more `EngineConfig.create` options.
    The step compiles at its first call, under the environment of that moment (`JAXINFER_NATIVE_*`)."""
    engine = _engine(name, model, max_model_len, **config)
    pages_per_seq = -(-(CONTEXT + 1) // engine.page_size)
    pages = engine.page_allocator.allocate(batch * pages_per_seq)
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=i) for i in range(batch)]
    return engine, functools.partial(engine.runner.execute,
                                     _chunks(batch, pages, pages_per_seq, engine.runner.cfg.vocab_size), rows)


def _engine(name: str, model: str | None, max_model_len: int, **config) -> Engine:
    """Format `name`'s engine as the workload times it: no warm-up, `KV_BYTES` of KV cache, no prefix cache."""
    dtype, quantization = FORMATS[name]
    return Engine(EngineConfig.create(model=model, dtype=dtype, quantization=quantization, warmup=False,
                                      max_model_len=max_model_len, kv_cache_memory_bytes=KV_BYTES,
                                      enable_prefix_caching=False, **config))


def memory_analysis(engine: Engine, chunks: list[ScheduledChunk], rows: list[SamplingRow]) -> dict:
    """Temp bytes, full-precision weight copies and native kernel call sites of the engine's compiled step for this
    batch (traced under the caller's `native_matmuls` setting)."""
    compiled = engine.runner.compile_step(chunks, rows)
    text = compiled.as_text()
    return {"temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "copies": hlo.materialized_weight_copies(text, engine.runner.weights),
            "native_calls": dict(hlo.native_kernel_calls(text))}


def _setup(args: argparse.Namespace, name: str, native: bool, batches: list[int]) -> tuple[list, ModelConfig]:
    """One format's engine with the native kernels allowed or not: [(timed call, row)] per batch, its config."""
    greedy = SamplingParams(temperature=0.0)
    engine = _engine(name, args.model, args.max_model_len)
    pages_per_seq = -(-(CONTEXT + 1) // engine.page_size)
    if (need := max(batches) * pages_per_seq) > (free := engine.page_allocator.num_free_pages):
        raise ValueError(f"--batches {max(batches)}: needs {need} KV pages (context {CONTEXT}); the cache holds {free}")
    pages = engine.page_allocator.allocate(need)
    kv_per_token = KVCache.bytes_per_page(engine.runner.cfg, 1, engine.runner.kv_cache.k.dtype)
    out = []
    for batch in batches:
        chunks = _chunks(batch, pages, pages_per_seq, engine.runner.cfg.vocab_size)
        sampling = [SamplingRow(greedy, seed=i) for i in range(batch)]
        fn = (ChainedSteps(engine.runner, chunks, sampling) if args.async_scheduling
              else functools.partial(engine.runner.execute, chunks, sampling))
        fn(), fn()  # compiles (a chain's second step: its token feed too)
        getattr(fn, "flush", lambda: None)()
        row = {"format": name, "batch": batch, "model": engine.runner.cfg.name,
               "matmuls": "native" if native and cpu_gemv.active() else "XLA",
               "isa": cpu_gemv.isa_level() if native and cpu_gemv.active() else None,
               "weight_bytes": engine.weight_bytes["bytes"], "weight_mib": engine.weight_bytes["bytes"] / 2**20,
               "quantized_share": engine.weight_bytes["quantized_share"], "kv_bytes": kv_per_token * CONTEXT * batch,
               "step_bytes": step_bytes(engine, batch), "times": []}
        if batch == 1:
            row.update(memory_analysis(engine, chunks, sampling))
        out.append((fn, row))
    return out, engine.runner.cfg


@contextlib.contextmanager
def native_kernels(allowed: bool, isa: str | None = None) -> Iterator[None]:
    """Inside the block, `JAXINFER_NATIVE_KERNELS` is "0" when not `allowed` and `JAXINFER_NATIVE_ISA` is `isa`
    when given; otherwise each is as the user set it (kernels turned off by the user stay off: those rows say XLA).
    Both put back afterwards. The user's switches, read where the step is traced and where the runner pads a
    batch (`pallas_kernels.cpu_gemv.active()`), unlike `models.quant_matmul.native_matmuls`, which only the
    model's trace reads."""
    saved = {v: os.environ.get(v) for v in (NATIVE_VARIABLE, ISA_VARIABLE)}
    if not allowed:
        os.environ[NATIVE_VARIABLE] = "0"
    if isa is not None:
        os.environ[ISA_VARIABLE] = isa
    try:
        yield
    finally:
        for variable, value in saved.items():
            os.environ.pop(variable, None)
            if value is not None:
                os.environ[variable] = value


def measure(args: argparse.Namespace, formats: list[str], batches: list[int], isas: list[str | None] = (None,),
            after_round: Callable[[int, ModelConfig], None] | None = None) -> tuple[list[dict], ModelConfig]:
    """Decode step times of every format, native setting (`--native`; native engines once per ISA level of `isas`)
    and batch, interleaved over `--reps` rounds (`--burst` calls of an engine in a row a round); each engine
    stays alive (weights ~0.1-0.5 GB each for SmolLM2), since building one per call is too
    slow to interleave. Every call of an engine built without the native kernels, its compile included, runs
    with `JAXINFER_NATIVE_KERNELS=0` (`native_kernels`), as a user turns them off.

    `after_round(r, config)`, when given, runs after round r (0-based).

    Returns:
      (one row per format, native setting, ISA level and batch, the model's config).
    """
    setups = []
    for name in formats:
        for native, isa in [(n, i) for n in NATIVE[args.native] for i in (isas if n else [None])]:
            t0 = time.perf_counter()
            with native_kernels(native, isa):
                calls, cfg = _setup(args, name, native, batches)
            setups += [(fn, native, isa, row) for fn, row in calls]
            logger.info("%s (%s %s) ready in %.1f s", name, calls[0][1]["matmuls"], calls[0][1]["isa"] or "",
                        time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    for r in range(args.reps):
        for i in rng.permutation(len(setups)):
            fn, native, isa, row = setups[i]
            with native_kernels(native, isa):
                if args.burst > 1 or args.async_scheduling:
                    for _ in range(2 if args.burst > 1 and isinstance(fn, ChainedSteps) else 1):
                        fn()  # back into the caches (a chain's first call only dispatches: read that step untimed)
                row["times"] += timed_calls(fn, max(1, args.burst - 1))
        if after_round is not None:
            after_round(r, cfg)
    rows = [row for *_, row in setups]
    for row in rows:
        times = row.pop("times")
        ms = 1e3 * statistics.median(times)
        row.update(ms=ms, min_ms=1e3 * min(times), max_ms=1e3 * max(times), tok_s=row["batch"] * 1e3 / ms)
        logger.info("%s", row)
    return rows, cfg


def add_rooflines(rows: list[dict], bandwidth_gb_s: float) -> None:
    """Sets each row's "roofline_tok_s" (batch x bandwidth / step bytes) and "of_roofline" (tok/s over it)."""
    for row in rows:
        row["roofline_tok_s"] = row["batch"] * bandwidth_gb_s * 1e9 / row["step_bytes"]
        row["of_roofline"] = row["tok_s"] / row["roofline_tok_s"]


def run_peers(args: argparse.Namespace, vocab_size: int) -> tuple[dict | None, dict | None]:
    """The peers the options name (`peers.run_peers`) at batch 1: one random prompt of `CONTEXT` tokens, decode
    from it (`--peer-steps` timed steps after `PEER_WARMUP_STEPS`), HF in bf16."""
    if args.peer_python is None and args.llamacpp_python is None:
        return None, None
    prompt = np.random.default_rng(0).integers(1, min(40000, vocab_size), CONTEXT).tolist()
    timing = argparse.Namespace(**vars(args), decode_prompt_len=CONTEXT, prefill_reps=1,
                                decode_steps=args.peer_steps, warmup_steps=PEER_WARMUP_STEPS, peer_batch_steps=1)
    return peers.run_peers(timing, model_setup.model_path(args.model), prompt, [], ["bfloat16"], [])


def run(args: argparse.Namespace) -> Report:
    """Checks the options and the peers' paths, measures the roofline probe, every format's decode steps, the
    peers and (`--gemv`) the kernel micro-benchmark."""
    t0 = time.perf_counter()
    formats, batches, gemv_rows, isas = check_arguments(args)
    peers.check_peer_paths(args, model_setup.model_path(args.model))
    bandwidth = measure_bandwidth(args.bw_gib, args.bw_reps, others=False)
    runs = []  # the peers' (HF, llama.cpp) results, one pair per run: after rounds spread evenly over --reps
    rows, cfg = measure(args, formats, batches, isas, lambda r, cfg: runs.append(run_peers(args, cfg.vocab_size))
                        if (r + 1) * args.peer_rounds // args.reps > r * args.peer_rounds // args.reps else None)
    data = {"bandwidth": bandwidth, "context": CONTEXT, "native": args.native, "rows": rows,
            "kv_bytes_per_token_f16": model_setup.kv_bytes_per_token(cfg, 2), "peer_runs": len(runs)}
    data["peer"], data["llamacpp"] = (peers.merge_runs([run[i] for run in runs]) for i in (0, 1))
    if args.gemv:
        data["gemv"] = []
        for isa in isas:
            with native_kernels(True, isa):
                cells = gemv_stream.measure(list(gemv_stream.KINDS), gemv_rows, args.gemv_mib, args.gemv_reps)
                data["gemv"] += [{**g, "isa": cpu_gemv.isa_level()} for g in cells]
    # Other jobs on the shared VM pull the probe down for minutes at a time: it runs again at the end, and the
    # better reading is the bandwidth every roofline divides by (as `jaxinfer bench step` does).
    data["bandwidth_end"] = measure_bandwidth(args.bw_gib, args.bw_reps, others=False)
    data["roofline_gb_s"] = gb_s = max(roofline_gb_s(bandwidth), roofline_gb_s(data["bandwidth_end"]))
    add_rooflines(rows, gb_s)
    data["peer_rows"] = quant_report.peer_rows(data)
    return Report("quant", quant_report.render(data, args, time.perf_counter() - t0), data)
