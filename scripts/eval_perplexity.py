"""Perplexity of a model on real English text through the engine's own runner (the first piece of issue 9).

The text is tokenized with the model's tokenizer (no BOS, as HF's tokenizer does for SmolLM2), cut to the first
`--tokens` ids, and run through `ModelRunner.compute_logits` in prefill chunks of `--chunk` tokens over the paged
KV cache (later chunks attend to the cached earlier ones, as chunked prefill does). The mean negative
log-likelihood is over the `--tokens - 1` next-token predictions (position i predicts token i + 1), HF's
`model(ids, labels=ids).loss` convention; perplexity = exp(mean NLL).

Reference (issue 9): SmolLM2-135M-Instruct in f32 on the first 2,048 tokens of /usr/share/common-licenses/GPL-3
(copied verbatim to tests/data/GPL-3.txt)
scores perplexity 19.66 (mean NLL 2.9786) in HF transformers; ours must agree within 0.5%.

Quantization (issue 9): `--quantization int8|fp8|JSON` and `--kv-cache-dtype int8|fp8` evaluate one configuration;
`--matrix` evaluates every weight format x KV cache dtype with bf16 activations and reports, beside perplexity,
the greedy top-1 agreement with the bf16 model (the share of positions whose argmax matches) and the share of
parameters stored quantized; `--write BENCHMARKS.md` records that table.

    .venv/bin/python scripts/eval_perplexity.py [--model PATH] [--dtype float32] [--tokens 2048] [--chunk 512]
        [--quantization int8] [--kv-cache-dtype int8] [--matrix [--write BENCHMARKS.md]]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import md_sections  # noqa: E402  (scripts/ is on sys.path when these run)

# A verbatim copy of Debian's /usr/share/common-licenses/GPL-3 (its licence allows verbatim copies; source and hash
# in tests/data/GPL-3.README.md), so the evaluation does not depend on the system's files.
GPL3 = Path(__file__).resolve().parents[1] / "tests" / "data" / "GPL-3.txt"
REFERENCE_PPL = 19.66  # HF transformers, SmolLM2-135M-Instruct f32, first 2,048 GPL-3 tokens (issue 9)


def eval_logits(llm, ids: list[int], chunk: int) -> np.ndarray:
    """f32 logits [len(ids), V] of every position of `ids`, prefilling `chunk` tokens per step over the paged cache.

    Raises:
      ValueError: if ids has fewer than 2 tokens or more than the KV cache can hold.
    """
    from jaxinfer.scheduler.chunk import ScheduledChunk

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
    """Mean next-token NLL (nats): row i of `logits` predicts ids[i + 1]."""
    logits = logits[:-1].astype(np.float64)  # [n - 1, V]
    top = logits.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return float(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]]))


def mean_nll(llm, ids: list[int], chunk: int) -> float:
    """Mean next-token NLL (nats) of `ids` under the engine's model (see `eval_logits`)."""
    return nll_of_logits(eval_logits(llm, ids, chunk), ids)


def make_llm(model: str | None, dtype: str, chunk: int, quantization=None, kv_cache_dtype: str | None = None):
    """An engine sized for one long evaluation sequence (no prefix caching, no warm-up)."""
    from jaxinfer.llm import LLM

    extra = {} if kv_cache_dtype in (None, "auto") else {"kv_cache_dtype": kv_cache_dtype}
    return LLM(model, dtype=dtype, warmup=False, enable_prefix_caching=False, quantization=quantization,
               max_num_batched_tokens=max(chunk, 16), kv_cache_memory_bytes=256 << 20, **extra)


# The formats of the issue-9 table: bf16 is the baseline; int8 is the CPU/TPU format (w8a8); fp8 the GPU format.
# Defaults: int8 quantizes the embedding and LM head too, fp8 keeps them in bf16; the other setting of each is a row.
HEAD_BF16 = {"quantize_lm_head": False, "quantize_embedding": False}
HEAD_QUANTIZED = {"quantize_lm_head": True, "quantize_embedding": True}
W8A8 = {"format": "int8", "quantize_activations": True}
MATRIX_WEIGHTS = {"bf16": None, "int8 (w8a8)": W8A8, "int8 weight-only": "int8",
                  "int8 (w8a8), embedding + LM head bf16": {**W8A8, **HEAD_BF16},
                  "fp8 (embedding + LM head bf16)": "fp8", "fp8, embedding + LM head fp8": {"format": "fp8", **HEAD_QUANTIZED},
                  "fp8 g128": {"format": "fp8", "group_size": 128}}
MATRIX_KV = ("auto", "int8", "fp8")
MARKERS = ("<!-- quant-quality:begin -->", "<!-- quant-quality:end -->")


def run_matrix(args) -> list[dict]:
    """Perplexity and top-1 agreement with the bf16 model for every weight format x KV cache dtype."""
    ids, baseline_top1, rows = None, None, []
    for wname, quantization in MATRIX_WEIGHTS.items():
        for kv in MATRIX_KV:
            llm = make_llm(args.model, "bfloat16", args.chunk, quantization, kv)
            if ids is None:
                ids = llm.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.tokens]
            t0 = time.perf_counter()
            logits = eval_logits(llm, ids, args.chunk)
            top1 = logits[:-1].argmax(-1)
            if baseline_top1 is None:
                baseline_top1 = top1  # bf16 weights, bf16 KV: the first configuration
            nll = nll_of_logits(logits, ids)
            wb = llm.engine.weight_bytes
            rows.append({"weights": wname, "kv_cache": "bf16" if kv == "auto" else kv, "perplexity": math.exp(nll),
                         "top1_agreement": float((top1 == baseline_top1).mean()),
                         "weight_mib": wb["bytes"] / 2**20, "quantized_share": wb["quantized_share"],
                         "seconds": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
            del llm
    return rows


def matrix_markdown(rows: list[dict], command: str, tokens: int) -> str:
    base = rows[0]["perplexity"]
    body = [[r["weights"], r["kv_cache"], f"{r['perplexity']:.3f}", f"{(r['perplexity'] / base - 1) * 100:+.2f}%",
             f"{r['top1_agreement'] * 100:.1f}%", f"{r['weight_mib']:.0f}", f"{r['quantized_share'] * 100:.1f}%"]
            for r in rows]
    return "\n".join([
        MARKERS[0],
        "## Quantization: quality (perplexity, top-1 agreement with bf16)",
        "",
        f"`{command}`: SmolLM2-135M-Instruct, activations bf16, the first {tokens} tokens of the GPL-3 licence "
        "text, prefilled in 512-token chunks. Top-1 agreement: share of the positions whose argmax next token "
        "equals the bf16 model's (bf16 weights, bf16 KV cache). Quality bar (issue 9): perplexity within 1% of bf16 "
        "for int8 weights, 2% for fp8.",
        "",
        md_sections.table(["weights", "KV cache", "perplexity", "vs bf16", "top-1 agreement", "weight MiB",
                           "params quantized"], body),
        MARKERS[1],
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default=None, help="weight quantization: int8, fp8 or a JSON object")
    ap.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype: auto, int8 or fp8")
    ap.add_argument("--text", type=Path, default=GPL3, help="a UTF-8 text file (default: the GPL-3 licence)")
    ap.add_argument("--tokens", type=int, default=2048, help="ids of the text evaluated (from its start)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens")
    ap.add_argument("--matrix", action="store_true",
                    help="every weight format x KV cache dtype in bf16, with top-1 agreement against bf16")
    ap.add_argument("--write", type=Path, default=None, help="with --matrix: update this BENCHMARKS.md section")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.chunk < 1:
        ap.error("--tokens must be >= 2 and --chunk >= 1")
    if not args.text.is_file():
        ap.error(f"--text {str(args.text)!r} is not a file")
    if args.matrix and (args.quantization or args.kv_cache_dtype != "auto" or args.dtype != "float32"):
        ap.error("--matrix runs its own formats in bfloat16; leave out --quantization, --kv-cache-dtype and --dtype")
    if args.write and not args.matrix:
        ap.error("--write records the --matrix table; add --matrix")
    try:
        return _run(args)
    except ValueError as e:  # a bad --quantization / --kv-cache-dtype value, named by the engine
        ap.error(str(e))


def _run(args) -> int:
    if args.matrix:
        rows = run_matrix(args)
        if args.write:
            command = ".venv/bin/python scripts/eval_perplexity.py --matrix --write BENCHMARKS.md"
            old = args.write.read_text() if args.write.exists() else ""
            args.write.write_text(md_sections.splice(old, matrix_markdown(rows, command, args.tokens), *MARKERS))
        return 0
    llm = make_llm(args.model, args.dtype, args.chunk, args.quantization, args.kv_cache_dtype)
    ids = llm.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.tokens]
    if len(ids) < args.tokens:
        print(f"warning: the text has only {len(ids)} tokens", file=sys.stderr)
    t0 = time.perf_counter()
    nll = mean_nll(llm, ids, args.chunk)
    result = {"model": llm.model_config.name, "dtype": args.dtype, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "text": str(args.text), "tokens": len(ids),
              "mean_nll": round(nll, 5), "perplexity": round(math.exp(nll), 3),
              "weight_bytes": llm.engine.weight_bytes["bytes"],
              "quantized_share": round(llm.engine.weight_bytes["quantized_share"], 4),
              "seconds": round(time.perf_counter() - t0, 1)}
    if (args.text == GPL3 and args.tokens == 2048 and args.model is None and args.dtype == "float32"
            and args.quantization is None and args.kv_cache_dtype == "auto"):
        result["reference_perplexity"] = REFERENCE_PPL
        result["relative_difference"] = round(math.exp(nll) / REFERENCE_PPL - 1, 5)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
