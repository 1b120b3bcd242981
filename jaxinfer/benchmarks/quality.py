"""Quality workload: perplexity of a model on real English text through the engine's own runner (issue 9).

The text is tokenized with the model's tokenizer (no BOS, as HF's tokenizer does for SmolLM2), cut to the first
`--tokens` ids, and run through `ModelRunner.compute_logits` in prefill chunks of `--chunk` tokens over the paged
KV cache (later chunks attend to the cached earlier ones, as chunked prefill does). The mean negative
log-likelihood is over the `--tokens - 1` next-token predictions (position i predicts token i + 1), HF's
`model(ids, labels=ids).loss` convention; perplexity = exp(mean NLL).

Reference (issue 9): SmolLM2-135M-Instruct in f32 on the first 2,048 tokens of /usr/share/common-licenses/GPL-3
(copied verbatim to tests/data/GPL-3.txt) scores perplexity 19.66 (mean NLL 2.9786) in HF transformers; ours must
agree within 0.5%.

Quantization (issue 9): `--quantization int8|fp8|JSON` and `--kv-cache-dtype int8|fp8` evaluate one
configuration; `--matrix` evaluates every weight format x KV cache dtype (`--formats`, `--kv-dtypes`) with bf16
activations and reports, beside perplexity, the greedy top-1 agreement with the bf16 model (the share of
positions whose argmax matches) and the share of parameters stored quantized; `--write BENCHMARKS.md` records
that table (only with `--matrix`).

    .venv/bin/jaxinfer bench quality [--model PATH] [--dtype float32] [--tokens 2048] [--chunk 512]
        [--quantization int8] [--kv-cache-dtype int8]
    .venv/bin/jaxinfer bench quality --matrix --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from jaxinfer.benchmarks import corpus
from jaxinfer.benchmarks.report import Report, table
from jaxinfer.llm import LLM
from jaxinfer.scheduler.chunk import ScheduledChunk

logger = logging.getLogger(__name__)

SECTION = ("<!-- quant-quality:begin -->", "<!-- quant-quality:end -->")
GPL3 = corpus.TEXT_FILE  # the GPL-3 licence text, a verbatim copy in tests/data
REFERENCE_PPL = 19.66  # HF transformers, SmolLM2-135M-Instruct f32, first 2,048 GPL-3 tokens (issue 9)

# The formats of the issue-9 table: bf16 is the baseline; int8 is the CPU/TPU format (w8a8); fp8 the GPU format.
# Defaults: int8 quantizes the embedding and LM head too, fp8 keeps them in bf16; the other setting of each is a row.
HEAD_BF16 = {"quantize_lm_head": False, "quantize_embedding": False}
HEAD_QUANTIZED = {"quantize_lm_head": True, "quantize_embedding": True}
W8A8 = {"format": "int8", "quantize_activations": True}
MATRIX_WEIGHTS = {"bf16": None, "int8 (w8a8)": W8A8, "int8 weight-only": "int8",
                  "int8 (w8a8), embedding + LM head bf16": {**W8A8, **HEAD_BF16},
                  "fp8 (embedding + LM head bf16)": "fp8",
                  "fp8, embedding + LM head fp8": {"format": "fp8", **HEAD_QUANTIZED},
                  "fp8 g128": {"format": "fp8", "group_size": 128}}
MATRIX_KV = ("auto", "int8", "fp8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quality workload's options."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default=None,
                        help="weight quantization: int8, fp8, int4, gguf (a GGUF kept as stored) or a JSON object")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype: auto, int8 or fp8")
    parser.add_argument("--text", type=Path, default=GPL3, help="a UTF-8 text file (default: the GPL-3 licence)")
    parser.add_argument("--tokens", type=int, default=2048, help="ids of the text evaluated (from its start)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens")
    parser.add_argument("--matrix", action="store_true",
                        help="every weight format x KV cache dtype in bf16, with top-1 agreement against bf16")
    parser.add_argument("--formats", default=";".join(MATRIX_WEIGHTS),
                        help="with --matrix: ';'-separated weight formats, the first the baseline (default: all)")
    parser.add_argument("--kv-dtypes", default=",".join(MATRIX_KV), help="with --matrix: KV cache dtypes")


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError naming the problem: bad sizes, a missing text file, options --matrix does not take, an
    unknown matrix format, or --write without --matrix."""
    if args.tokens < 2 or args.chunk < 1:
        raise ValueError("--tokens must be >= 2 and --chunk >= 1")
    if not args.text.is_file():
        raise ValueError(f"--text {str(args.text)!r} is not a file")
    if args.matrix:
        if args.quantization or args.kv_cache_dtype != "auto" or args.dtype != "float32":
            raise ValueError("--matrix runs its own formats in bfloat16; leave out --quantization, --kv-cache-dtype "
                             "and --dtype")
        unknown = [f for f in matrix_formats(args) if f not in MATRIX_WEIGHTS]
        if unknown or not matrix_formats(args) or not matrix_kv(args):
            raise ValueError(f"--formats / --kv-dtypes: unknown or empty {unknown}; known formats: "
                             f"{'; '.join(MATRIX_WEIGHTS)}")
    elif args.write is not None:
        raise ValueError("--write records the --matrix table; add --matrix")


def matrix_formats(args: argparse.Namespace) -> list[str]:
    """The weight formats of --matrix, baseline first."""
    return [f.strip() for f in args.formats.split(";") if f.strip()]


def matrix_kv(args: argparse.Namespace) -> list[str]:
    """The KV cache dtypes of --matrix."""
    return [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]


def eval_logits(llm: LLM, ids: list[int], chunk: int) -> np.ndarray:
    """f32 logits [len(ids), V] of every position of `ids`, prefilling `chunk` tokens per step over the paged cache.

    Raises:
      ValueError: if ids has fewer than 2 tokens or more than the KV cache can hold.
    """
    if len(ids) < 2:
        raise ValueError("need at least 2 tokens")
    runner, ps = llm.runner, llm.engine.page_size
    pages = llm.engine.page_allocator.allocate(-(-len(ids) // ps))
    try:
        logits = []
        for start in range(0, len(ids), chunk):
            new = ids[start : start + chunk]
            used = -(-(start + len(new)) // ps)
            logits.append(runner.compute_logits([ScheduledChunk(new, start, pages[:used])]))
    finally:
        llm.engine.page_allocator.free(pages)
    return np.concatenate(logits)


def nll_of_logits(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token NLL (nats): row i of `logits` [n, V] predicts ids[i + 1]."""
    logits = logits[:-1].astype(np.float64)  # [n - 1, V]
    top = logits.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return float(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]]))


def mean_nll(llm: LLM, ids: list[int], chunk: int) -> float:
    """Mean next-token NLL (nats) of `ids` under the engine's model (see `eval_logits`)."""
    return nll_of_logits(eval_logits(llm, ids, chunk), ids)


def make_llm(model: str | None, dtype: str, chunk: int, quantization=None, kv_cache_dtype: str | None = None) -> LLM:
    """An engine sized for one long evaluation sequence (no prefix caching, no warm-up)."""
    extra = {} if kv_cache_dtype in (None, "auto") else {"kv_cache_dtype": kv_cache_dtype}
    return LLM(model, dtype=dtype, warmup=False, enable_prefix_caching=False, quantization=quantization,
               max_num_batched_tokens=max(chunk, 16), kv_cache_memory_bytes=256 << 20, **extra)


def text_ids(llm: LLM, args: argparse.Namespace) -> list[int]:
    """The first --tokens ids of --text (a warning when the text is shorter)."""
    ids = llm.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.tokens]
    if len(ids) < args.tokens:
        logger.warning("the text has only %d tokens", len(ids))
    return ids


def run_matrix(args: argparse.Namespace) -> list[dict]:
    """Perplexity and top-1 agreement with the first format (bf16) for every weight format x KV cache dtype."""
    ids, baseline_top1, rows = None, None, []
    for wname in matrix_formats(args):
        for kv in matrix_kv(args):
            llm = make_llm(args.model, "bfloat16", args.chunk, MATRIX_WEIGHTS[wname], kv)
            if ids is None:
                ids = text_ids(llm, args)
            t0 = time.perf_counter()
            logits = eval_logits(llm, ids, args.chunk)
            top1 = logits[:-1].argmax(-1)
            if baseline_top1 is None:
                baseline_top1 = top1  # the first configuration: bf16 weights, bf16 KV
            nll = nll_of_logits(logits, ids)
            wb = llm.engine.weight_bytes
            rows.append({"weights": wname, "kv_cache": "bf16" if kv == "auto" else kv, "mean_nll": nll,
                         "perplexity": math.exp(nll), "top1_agreement": float((top1 == baseline_top1).mean()),
                         "model": llm.model_config.name, "tokens": len(ids), "weight_bytes": wb["bytes"],
                         "weight_mib": wb["bytes"] / 2**20, "quantized_share": wb["quantized_share"],
                         "seconds": time.perf_counter() - t0})
            logger.info("%s", json.dumps(rows[-1]))
            del llm
    return rows


def matrix_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """The --matrix section's markdown (without its markers)."""
    base = rows[0]["perplexity"]
    body = [[r["weights"], r["kv_cache"], f"{r['perplexity']:.3f}", f"{(r['perplexity'] / base - 1) * 100:+.2f}%",
             f"{r['top1_agreement'] * 100:.1f}%", f"{r['weight_mib']:.0f}", f"{r['quantized_share'] * 100:.1f}%"]
            for r in rows]
    text = "the GPL-3 licence text" if args.text == GPL3 else f"`{args.text.name}`"
    return "\n".join([
        "## Quantization: quality (perplexity, top-1 agreement with bf16)",
        "",
        f"`{args.command}` ({args.date}): {rows[0]['model']}, activations bf16, the first {rows[0]['tokens']} tokens "
        f"of {text}, prefilled in {args.chunk}-token chunks. Top-1 agreement: share of the positions whose argmax "
        f"next token equals the {rows[0]['weights']} model's ({rows[0]['weights']} weights, {rows[0]['kv_cache']} "
        "KV cache). Quality bar (issue 9): perplexity within 1% of bf16 for int8 weights, 2% for fp8.",
        "",
        table(["weights", "KV cache", "perplexity", "vs bf16", "top-1 agreement", "weight MiB", "params quantized"],
              body),
    ])


def run_one(args: argparse.Namespace) -> dict:
    """Perplexity of one configuration (--dtype, --quantization, --kv-cache-dtype)."""
    llm = make_llm(args.model, args.dtype, args.chunk, args.quantization, args.kv_cache_dtype)
    ids = text_ids(llm, args)
    t0 = time.perf_counter()
    nll = mean_nll(llm, ids, args.chunk)
    result = {"model": llm.model_config.name, "dtype": args.dtype, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "text": str(args.text), "tokens": len(ids),
              "mean_nll": nll, "perplexity": math.exp(nll), "weight_bytes": llm.engine.weight_bytes["bytes"],
              "quantized_share": llm.engine.weight_bytes["quantized_share"], "seconds": time.perf_counter() - t0}
    if (args.text == GPL3 and args.tokens == 2048 and args.model is None and args.dtype == "float32"
            and args.quantization is None and args.kv_cache_dtype == "auto"):
        result["reference_perplexity"] = REFERENCE_PPL
        result["relative_difference"] = math.exp(nll) / REFERENCE_PPL - 1
    return result


def run(args: argparse.Namespace) -> Report:
    """The matrix (with --matrix) or one configuration's perplexity."""
    check_arguments(args)
    if args.matrix:
        rows = run_matrix(args)
        return Report("quality", matrix_markdown(rows, args), {"rows": rows})
    r = run_one(args)
    lines = ["## Perplexity\n", f"`{args.command}` ({args.date})\n",
             table(["model", "dtype", "quantization", "KV cache", "tokens", "mean NLL", "perplexity"],
                   [[r["model"], r["dtype"], str(r["quantization"]), r["kv_cache_dtype"], str(r["tokens"]),
                     f"{r['mean_nll']:.5f}", f"{r['perplexity']:.3f}"]])]
    if "reference_perplexity" in r:
        lines.append(f"\nHF transformers: {REFERENCE_PPL}; relative difference {r['relative_difference']:+.3%}.")
    return Report("quality", "\n".join(lines), r)
