"""Step workload: prefill, decode, the decode roofline, the step breakdown, KV layout, HF and llama.cpp peers.

What one run measures (all in the same process and on the same machine, so the numbers are comparable):

1. Memory read bandwidth (`jaxinfer.benchmarks.probe`): the roofline probe (a jitted f32 sum over `--bw-gib`
   GiB) and the 2-row matrix-vector probes beside it, at the start and again at the end of the run.
2. For each dtype and layer mode (`lax.scan` over layers, unrolled): prefill tokens/s of a `--prefill-len`-token
   prompt in one chunk and batch-1 greedy decode tokens/s after a `--decode-prompt-len`-token prompt and (scan
   mode) near context `--prefill-len`, through `ModelRunner.execute` (host-side padding, transfer, jitted step, sampling,
   sync). Each shape is warmed up first; compile seconds (first call minus the steady median) are reported
   separately. Then aggregate decode tokens/s at the `--batches` sizes in scan mode, every batch b decoding the
   first b of one list of `--decode-prompt-len`-token prompts. Unless `--no-int8`: the same in scan mode with
   int8 weights (w8a8, bf16 activations and KV cache), as `quantization={"format": "int8",
   "quantize_activations": true}` runs them.
3. A decode roofline: bytes one step must read (all weights, plus the KV cache of the real context) divided by
   the roofline probe's bandwidth, against the measured tokens/s.
4. Where a batch-1 decode step's time goes (scan mode; `step_breakdown`).
5. KV layout micro-benchmark (`kv_layout`): one layer's decode attention on our layout and the alternative.
6. Peers, on the same model file and the same prompt ids (prefill prompt, batch prompts), in their own venvs:
   HF transformers on torch CPU (`--peer-python`, `scripts/peer_transformers.py`) in each dtype, and llama.cpp
   through llama-cpp-python (`--llamacpp-python`, `scripts/peer_llamacpp.py`) with the GGUF re-quantized to each
   `--llamacpp-types` type: prefill, decode at batch 1 and at the `--batches` sizes.

About 5-7 minutes on 2 cores for SmolLM2-135M-Instruct (the peers need ~3 more):

    .venv/bin/jaxinfer bench step --peer-python .venv-golden/bin/python \
        --llamacpp-python /work/venv-llamacpp/bin/python --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks import model_setup, peers, step_report
from jaxinfer.benchmarks.decode_timing import PAGE_SIZE, Failure, PageIds, first_line, pages_for, run_step, time_decode
from jaxinfer.benchmarks.kv_layout import bench_kv_layout
from jaxinfer.benchmarks.probe import measure_bandwidth, median, roofline_gb_s
from jaxinfer.benchmarks.report import Report
from jaxinfer.benchmarks.step_breakdown import breakdown
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk
from models import quant
from models.config import ModelConfig
from models.llama import Weights

logger = logging.getLogger(__name__)

SECTION = ("<!-- step: begin -->", "<!-- step: end -->")
MODES = {"scan": True, "unrolled": False}
INT8 = quant.QuantizationConfig(format="int8", quantize_activations=True)  # w8a8: the fast int8 path on CPU
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.bfloat16}  # by jaxinfer format


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The step workload's options (see the module docstring)."""
    parser.add_argument("--model", default=None,
                        help="GGUF file, HF folder or checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="scan,unrolled", help="layer modes: scan, unrolled")
    parser.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill prompt")
    parser.add_argument("--prefill-reps", type=int, default=3, help="timed prefills (median)")
    parser.add_argument("--decode-prompt-len", type=int, default=64, help="prompt before the short-context decode")
    parser.add_argument("--decode-steps", type=int, default=20, help="timed decode steps (median)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps (the first compiles)")
    parser.add_argument("--batches", default="8,32", help="aggregate decode batch sizes (scan mode); '' skips")
    parser.add_argument("--bw-gib", type=float, default=1.0, help="GiB each bandwidth probe reads")
    parser.add_argument("--bw-reps", type=int, default=7, help="timed calls per bandwidth probe")
    parser.add_argument("--kv-batch", type=int, default=8, help="KV layout test: sequences")
    parser.add_argument("--kv-context", type=int, default=512, help="KV layout test: tokens per sequence")
    parser.add_argument("--kv-reps", type=int, default=10, help="calls per round (10 rounds) in the KV layout test")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the decode-step breakdown")
    parser.add_argument("--no-int8", action="store_true", help="skip jaxinfer with int8 (w8a8) weights")
    parser.add_argument("--peer-batch-steps", type=int, default=5,
                        help="the peers' timed decode steps at the --batches sizes (median; HF's batch-32 steps "
                             "take seconds each on 2 cores)")
    peers.add_peer_arguments(parser)
    peers.add_llamacpp_arguments(parser)


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[str], list[int]]:
    """(dtypes, layer modes, batch sizes) of the options.

    Raises:
      ValueError: an unknown dtype, mode or llama.cpp type, a batch below 2, bad counts, or a prefill too short
        for the decode runs.
    """
    dtypes = model_setup.parse_dtypes(args.dtypes)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes {args.modes!r}: give scan and/or unrolled")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batches {args.batches!r} is not a list of integers") from None
    if any(b < 2 for b in batches):
        raise ValueError(f"--batches {args.batches!r}: aggregate batches must be >= 2 (batch 1 is always run)")
    if (min(args.prefill_reps, args.decode_steps, args.bw_reps, args.peer_batch_steps) < 1 or args.warmup_steps < 0
            or args.bw_gib <= 0):
        raise ValueError("--prefill-reps, --decode-steps, --bw-reps, --peer-batch-steps must be >= 1, "
                         "--warmup-steps >= 0, --bw-gib > 0")
    peers.check_llamacpp_types(args.llamacpp_types)
    if args.prefill_len < args.decode_prompt_len + 16 + args.warmup_steps + args.decode_steps:
        raise ValueError(f"--prefill-len {args.prefill_len} is too short for the decode runs: it needs at least "
                         "--decode-prompt-len + 16 + --warmup-steps + --decode-steps tokens")
    return dtypes, modes, batches


def bench_mode(runner: ModelRunner, dtype: str, mode: str, prompt: list[int], args: argparse.Namespace,
               long_context: bool = True) -> dict:
    """Prefill of the whole prompt and batch-1 decode at a short and (with `long_context`) a long context, for one
    dtype and layer mode (`runner`: one sequence of `len(prompt) + 1` tokens fits on its pages)."""
    ctx_max = len(prompt)
    seq_pages = PageIds().take(pages_for(ctx_max + 1))
    chunk = [ScheduledChunk(prompt, 0, seq_pages)]
    times = [run_step(runner, chunk)[1] for _ in range(1 + args.prefill_reps)]
    prefill = median(times[1:])
    logger.info("%s %s: prefill %d tokens %.0f ms (first call %.1f s)", dtype, mode, ctx_max, 1e3 * prefill,
                times[0])
    short = time_decode(runner, [prompt[: args.decode_prompt_len]], [seq_pages], args.warmup_steps,
                        args.decode_steps)
    # Long context: start so that the last timed step's context is exactly len(prompt); its prefill reuses the
    # compiled prefill shape of the whole prompt.
    start = ctx_max - args.warmup_steps - args.decode_steps
    decodes = {"short": short}
    if long_context:
        decodes["long"] = time_decode(runner, [prompt[:start]], [seq_pages], args.warmup_steps, args.decode_steps)
    for name, d in decodes.items():
        logger.info("%s %s: decode %s context %.2f ms/step, %.1f tok/s, compile %.1f s", dtype, mode, name,
                    d.step_ms, d.tok_s, d.compile_s)
    return {"dtype": dtype, "layers": mode, "prefill_tokens": ctx_max, "prefill_ms": 1e3 * prefill,
            "prefill_tok_s": ctx_max / prefill, "prefill_compile_s": max(times[0] - prefill, 0.0),
            **{f"decode_{name}": decode_data(d) for name, d in decodes.items()}}


def one_sequence_runner(cfg: ModelConfig, weights: Weights, dtype: str, mode: str, tokens: int) -> ModelRunner:
    """A runner in `mode` ("scan" or "unrolled") with pages for one sequence of `tokens` tokens (`dtype`: a
    `KV_DTYPES` format)."""
    return ModelRunner(cfg, weights, num_pages=1 + pages_for(tokens), page_size=PAGE_SIZE,
                       kv_dtype=KV_DTYPES[dtype], scan_layers=MODES[mode])


def run_breakdown(runner: ModelRunner, dtype: str, prompt: list[int], args: argparse.Namespace) -> dict:
    """The step breakdown at context --decode-prompt-len + 4 (`step_breakdown.breakdown`)."""
    return breakdown(runner, dtype, prompt, args.decode_prompt_len, args.decode_prompt_len + 4)


def decode_data(d) -> dict:
    """A `DecodeResult` (or `Failure`) as JSON."""
    if isinstance(d, Failure):
        return {"batch": d.batch, "error": d.error}
    return {"batch": d.batch, "context": list(d.context), "mean_context": d.mean_context, "step_ms": d.step_ms,
            "tok_s": d.tok_s, "compile_s": d.compile_s}


def batch_prompts(cfg: ModelConfig, batches: list[int], prompt_len: int) -> list[list[int]]:
    """max(batches) random prompts of `prompt_len` tokens; batch b decodes the first b (here and in the peers)."""
    rng = np.random.default_rng(1)
    return rng.integers(0, cfg.vocab_size, (max(batches, default=0), prompt_len)).tolist()


def bench_batch(cfg: ModelConfig, weights: Weights, dtype: str, prompts: list[list[int]],
                args: argparse.Namespace) -> dict:
    """Aggregate decode throughput (scan mode) of one sequence per prompt (`dtype`: a `KV_DTYPES` format)."""
    batch = len(prompts)
    per_seq = pages_for(args.decode_prompt_len + args.warmup_steps + args.decode_steps + 1)
    runner = ModelRunner(cfg, weights, num_pages=1 + batch * per_seq, page_size=PAGE_SIZE,
                         kv_dtype=KV_DTYPES[dtype], scan_layers=True)
    alloc = PageIds()
    try:
        d = time_decode(runner, prompts, [alloc.take(per_seq) for _ in range(batch)], args.warmup_steps,
                        args.decode_steps)
    except jax.errors.JaxRuntimeError as e:
        logger.error("%s decode batch %d failed: %s", dtype, batch, e)
        return decode_data(Failure(batch=batch, error=first_line(e)))
    logger.info("%s scan: decode batch %d: %.2f ms/step, %.1f tok/s aggregate", dtype, batch, d.step_ms, d.tok_s)
    return decode_data(d)


def add_roofline(row: dict, weight_bytes: int, kv_bytes_per_token: int, gb_s: float) -> dict:
    """`row` (a decode measurement; one with an "error" is left alone) with its bytes per step (weights + the KV
    cache of the mean context of every sequence) and the roofline tokens/s at `gb_s` GB/s."""
    if "error" not in row:
        row["weight_bytes"] = weight_bytes
        row["kv_bytes"] = row["batch"] * kv_bytes_per_token * row["mean_context"]
        row["roofline_tok_s"] = row["batch"] * gb_s * 1e9 / (row["weight_bytes"] + row["kv_bytes"])
        row["of_roofline"] = row["tok_s"] / row["roofline_tok_s"]
    return row


def roofline_rows(data: dict) -> list[dict]:
    """One row per decode measurement: its bytes per step and roofline tokens/s at `data["roofline_gb_s"]`."""
    rows = []
    for m in data["modes"]:
        rows += [{"dtype": m["dtype"], "layers": m["layers"], **m[key]} for key in ("decode_short", "decode_long")
                 if key in m]
    rows += data["batch_decodes"]
    for r in rows:
        add_roofline(r, data["weight_bytes"][r["dtype"]], data["kv_bytes_per_token"][r["dtype"]],
                     data["roofline_gb_s"])
    order = {d: i for i, d in enumerate(data["dtypes"])}
    return sorted(rows, key=lambda r: order[r["dtype"]])


def bench_int8(cfg: ModelConfig, np_weights: Weights, prompt: list[int], rows: list[list[int]],
               batches: list[int], args: argparse.Namespace) -> dict:
    """jaxinfer with int8 (w8a8) weights, scan mode: prefill and batch-1 decode (`bench_mode`), the `batches`
    decodes (one per size, of the first b `rows`) and the weight bytes (values + scales)."""
    quantize = functools.partial(quant.quantize_weights, cfg=cfg, qcfg=INT8, dtype=jnp.bfloat16)
    weights = jax.jit(quantize)(jax.tree.map(jnp.asarray, np_weights))  # one compiled computation, as at load
    wb = quant.weight_bytes(weights)["bytes"]
    kv_per_token = model_setup.kv_bytes_per_token(cfg, jnp.dtype(KV_DTYPES["int8"]).itemsize)
    mode = bench_mode(one_sequence_runner(cfg, weights, "int8", "scan", len(prompt) + 1), "int8", "scan", prompt,
                      args)
    return {"format": "int8 (w8a8)", "weight_bytes": wb, "kv_bytes_per_token": kv_per_token, "mode": mode,
            "batch_decodes": [bench_batch(cfg, weights, "int8", rows[:b], args) for b in batches]}


def int8_roofline_rows(q: dict, gb_s: float) -> list[dict]:
    """`bench_int8`'s decode measurements (batch 1 short and long context, then the batches) with their rooflines."""
    rows = [q["mode"]["decode_short"], q["mode"]["decode_long"], *q["batch_decodes"]]
    return [add_roofline({"dtype": "int8", "layers": "scan", **r}, q["weight_bytes"], q["kv_bytes_per_token"], gb_s)
            for r in rows]


def run(args: argparse.Namespace) -> Report:
    """Runs sections 1-6 of the module docstring; the report's data holds every number of the section."""
    t_start = time.perf_counter()
    dtypes, modes, batches = check_arguments(args)
    path = model_setup.model_path(args.model)
    peers.check_peer_paths(args, path)
    data: dict = {"dtypes": dtypes, "prefill_len": args.prefill_len, "decode_prompt_len": args.decode_prompt_len,
                  "prefill_reps": args.prefill_reps, "decode_steps": args.decode_steps, "bw_reps": args.bw_reps,
                  "kv_batch": args.kv_batch, "kv_context": args.kv_context, "kv_reps": args.kv_reps,
                  "page_size": PAGE_SIZE, "model_path": str(path)}
    data["bandwidth"] = measure_bandwidth(args.bw_gib, args.bw_reps)
    cfg, np_weights = model_setup.load_host_weights(path)
    if args.prefill_len + 1 > cfg.max_position_embeddings:
        raise ValueError(f"--prefill-len {args.prefill_len} exceeds the model's context "
                         f"({cfg.max_position_embeddings} tokens)")
    data["model"] = model_setup.config_data(cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prefill_len).tolist()
    rows = batch_prompts(cfg, batches, args.decode_prompt_len)
    data.update(modes=[], batch_decodes=[], weight_bytes={}, kv_bytes_per_token={}, breakdown={})
    for dt in dtypes:
        weights = model_setup.cast_weights(np_weights, dt)
        data["weight_bytes"][dt] = model_setup.weight_bytes(weights)
        data["kv_bytes_per_token"][dt] = model_setup.kv_bytes_per_token(cfg, jnp.dtype(model_setup.DTYPES[dt]).itemsize)
        for mode in modes:
            runner = one_sequence_runner(cfg, weights, dt, mode, len(prompt) + 1)
            # Unrolled is the slow, compile-heavy alternative: its long-context decode adds little but minutes.
            data["modes"].append(bench_mode(runner, dt, mode, prompt, args, long_context=mode == "scan"))
            if mode == "scan" and not args.no_breakdown:  # the same runner: its compiled shapes are reused
                data["breakdown"][dt] = run_breakdown(runner, dt, prompt, args)
            del runner
        if "scan" not in modes and not args.no_breakdown:
            data["breakdown"][dt] = run_breakdown(one_sequence_runner(cfg, weights, dt, "scan", len(prompt) + 1),
                                                  dt, prompt, args)
        data["batch_decodes"] += [{"dtype": dt, "layers": "scan", **bench_batch(cfg, weights, dt, rows[:b], args)}
                                  for b in batches]
        del weights
    data["int8"] = None if args.no_int8 else bench_int8(cfg, np_weights, prompt, rows, batches, args)
    del np_weights
    data["kv_layout"] = bench_kv_layout(cfg, dtypes, args.kv_batch, args.kv_context, args.kv_reps)
    data["bandwidth_end"] = measure_bandwidth(args.bw_gib, args.bw_reps)
    # The roofline probe ran twice; the better of its two readings is the bandwidth every roofline divides by.
    data["roofline_gb_s"] = max(roofline_gb_s(data["bandwidth"]), roofline_gb_s(data["bandwidth_end"]))
    data["decode_rows"] = roofline_rows(data)
    if data["int8"]:
        data["int8"]["decode_rows"] = int8_roofline_rows(data["int8"], data["roofline_gb_s"])
    data["batches"] = batches
    data["peer"], data["llamacpp"] = peers.run_peers(args, path, prompt, rows, dtypes, batches)
    data["elapsed_s"] = time.perf_counter() - t_start
    return Report("step", step_report.render(data, cfg, args.command, args.date), data)
