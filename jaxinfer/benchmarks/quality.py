"""Quality workload: perplexity of a model on real English text through the engine's own runner.

The text is tokenized with the model's tokenizer (no BOS, as HF's tokenizer does for SmolLM2), cut to the first
`--tokens` ids, and run through `ModelRunner.compute_logits` in prefill chunks of `--chunk` tokens over the paged
KV cache (later chunks attend to the cached earlier ones, as chunked prefill does). The mean negative
log-likelihood is over the `--tokens - 1` next-token predictions (position i predicts token i + 1), HF's
`model(ids, labels=ids).loss` convention; perplexity = exp(mean NLL).

Reference: SmolLM2-135M-Instruct in f32 on the first 2,048 tokens of /usr/share/common-licenses/GPL-3
(copied verbatim to tests/data/GPL-3.txt) scores perplexity 19.66 (mean NLL 2.9786) in HF transformers; ours must
agree within 0.5%.

Quantization: `--quantization` (a `models.quant.FORMATS` name, gguf, or JSON) and `--kv-cache-dtype int8|fp8` evaluate one
configuration; `--matrix` evaluates every weight format x KV cache dtype (`--formats`, `--kv-dtypes`) against the
unquantized model (`--dtype`, default bf16) on the same tokens of each `--text` (default: the GPL-3 text and
CPython 3.12.1's textwrap.py), as llama.cpp's `llama-perplexity --kl-divergence` does: perplexity, mean and p99 KL
divergence of the next-token distribution, top-1 agreement, and the share of greedy continuations that change
within `--flip-tokens` tokens (`jaxinfer.benchmarks.quality_matrix`). `--write BENCHMARKS.md` records that table
(only with `--matrix`). `--model` may be a tiny HF golden folder of tests/data (no tokenizer: a character
tokenizer is made for it, and the baseline is checked against the folder's HF logits).

    .venv/bin/jaxinfer bench quality [--model PATH] [--dtype float32] [--tokens 2048] [--chunk 512]
        [--quantization int8] [--kv-cache-dtype int8]
    .venv/bin/jaxinfer bench quality --matrix [--formats "int8;int4"] [--kv-dtypes auto] --write BENCHMARKS.md
    .venv/bin/jaxinfer bench quality --matrix --model tests/data/tiny_llama3 --dtype float32
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from jaxinfer.benchmarks import corpus, quality_matrix
from jaxinfer.benchmarks.quality_metrics import log_softmax, token_nll
from jaxinfer.benchmarks.quality_runs import eval_logits, loadable, make_llm
from jaxinfer.benchmarks.report import Report, name_list, table
from jaxinfer.engine.config import KV_CACHE_DTYPE_NAMES
from jaxinfer.llm import LLM
from models import quant

__all__ = ["eval_logits", "make_llm", "mean_nll", "nll_of_logits", "GPL3", "REFERENCE_PPL"]

SECTION = ("<!-- quant-quality:begin -->", "<!-- quant-quality:end -->")
GPL3 = corpus.TEXT_FILE  # the GPL-3 licence text, a verbatim copy in tests/data
TEXTS = {"GPL-3": GPL3, "textwrap.py": corpus.CODE_FILE}  # label -> file; the --matrix default
TEXT_NOTES = {"GPL-3": "the GPL-3 licence, English", "textwrap.py": "CPython 3.12.1's Lib/textwrap.py, Python code"}
REFERENCE_PPL = 19.66  # HF transformers, SmolLM2-135M-Instruct f32, first 2,048 GPL-3 tokens (issue 9)

# Named variants beside the plain format names of models.quant.FORMATS (which --formats also takes, as any
# `QuantizationConfig.from_value` value): the issue-9 rows. int8 quantizes the embedding and LM head by default,
# fp8 keeps them in bf16; the other setting of each is a variant.
HEAD_BF16 = {"quantize_lm_head": False, "quantize_embedding": False}
HEAD_QUANTIZED = {"quantize_lm_head": True, "quantize_embedding": True}
W8A8 = {"format": "int8", "quantize_activations": True}
NAMED_FORMATS = {"int8 (w8a8)": W8A8, "int8 (w8a8), embedding + LM head bf16": {**W8A8, **HEAD_BF16},
                 "fp8, embedding + LM head fp8": {"format": "fp8", **HEAD_QUANTIZED},
                 "fp8 g128": {"format": "fp8", "group_size": 128},
                 "mxfp8 (w8a8)": {"format": "mxfp8", "quantize_activations": True},
                 "int4 (w4a8)": {"format": "int4", "quantize_activations": True}}
UNQUANTIZED = ("none", "bf16", "f32", "bfloat16", "float32")  # --formats entries meaning the baseline's weights
KV_DTYPES = ("auto", *KV_CACHE_DTYPE_NAMES)
FLIP_DEFAULTS = {"flips": 16, "flip_tokens": 32, "flip_context": 256}  # --matrix only (check_arguments)


def default_formats() -> str:
    """--formats' default: the unquantized weights, every format `models.quant.FORMATS` knows at run time, then
    int8 and mxfp8 w8a8 and int4 w4a8."""
    return ";".join(["none", *quant.FORMATS, "int8 (w8a8)", "mxfp8 (w8a8)", "int4 (w4a8)"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quality workload's options."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct); an HF folder "
                        "without a tokenizer (tests/data/tiny_*) gets a character tokenizer")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="weights and activations (default: float32; with --matrix the baseline's, bfloat16)")
    parser.add_argument("--quantization", default=None,
                        help="weight quantization: a models.quant.FORMATS name (int8, fp8, int4, mxfp8, mxfp4, "
                             "nvfp4), gguf (a GGUF kept as stored) or a JSON object")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype: auto, int8 or fp8")
    parser.add_argument("--text", type=Path, action="append", default=None,
                        help="a UTF-8 text file; repeat for several with --matrix (default: the GPL-3 licence; with "
                             "--matrix, it and CPython 3.12.1's textwrap.py)")
    parser.add_argument("--tokens", type=int, default=2048, help="ids of each text evaluated (from its start)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens")
    parser.add_argument("--matrix", action="store_true",
                        help="every weight format x KV cache dtype against the unquantized model (KLD, flips...)")
    parser.add_argument("--formats", default=None,
                        help="with --matrix: ';'-separated weight formats: none, a models.quant.FORMATS name, a JSON "
                             f"object of QuantizationConfig fields, or one of {'; '.join(NAMED_FORMATS)} "
                             "(default: none, every format known, int8 (w8a8))")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="with --matrix: KV cache dtypes")
    parser.add_argument("--flips", type=int,
                        default=FLIP_DEFAULTS["flips"], help="with --matrix: points of each text greedy "
                        "continuations start from")
    parser.add_argument("--flip-tokens", type=int, default=FLIP_DEFAULTS["flip_tokens"],
                        help="with --matrix: greedy tokens per continuation")
    parser.add_argument("--flip-context", type=int, default=FLIP_DEFAULTS["flip_context"],
                        help="with --matrix: prompt tokens before each point")


def check_arguments(args: argparse.Namespace) -> None:
    """Fills in the defaults that depend on --matrix (dtype, texts) and raises ValueError naming the problem: bad
    sizes, a missing or repeated text file, several texts without --matrix, options --matrix does not take, an unknown format
    or KV dtype, or --write without --matrix."""
    if args.tokens < 2 or args.chunk < 1:
        raise ValueError("--tokens must be >= 2 and --chunk >= 1")
    args.dtype = args.dtype or ("bfloat16" if args.matrix else "float32")
    args.text = args.text or (list(TEXTS.values()) if args.matrix else [GPL3])
    for t in args.text:
        if not t.is_file():
            raise ValueError(f"--text {str(t)!r} is not a file")
    if len({t.resolve() for t in args.text}) < len(args.text):
        raise ValueError("--text names the same file twice")
    if args.matrix:
        if args.quantization or args.kv_cache_dtype != "auto":
            raise ValueError("--matrix runs its own formats; leave out --quantization and --kv-cache-dtype")
        if min(args.flips, args.flip_tokens, args.flip_context) < 1:
            raise ValueError("--flips, --flip-tokens and --flip-context must be >= 1")
        matrix_formats(args)
        unknown = [k for k in matrix_kv(args) if k not in KV_DTYPES]
        if unknown or not matrix_kv(args):
            raise ValueError(f"--kv-dtypes: unknown or empty {unknown}; known: {', '.join(KV_DTYPES)}")
    else:
        if len(args.text) > 1:
            raise ValueError("several --text files need --matrix")
        matrix_only = {"--formats": args.formats is not None, "--kv-dtypes": args.kv_dtypes != ",".join(KV_DTYPES),
                       **{"--" + k.replace("_", "-"): getattr(args, k) != v for k, v in FLIP_DEFAULTS.items()}}
        if any(matrix_only.values()):
            raise ValueError(f"{', '.join(k for k, v in matrix_only.items() if v)} only apply with --matrix; add "
                             "--matrix, or use --quantization / --kv-cache-dtype for one configuration")
        if args.write is not None:
            raise ValueError("--write records the --matrix table; add --matrix")


def matrix_formats(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(label, quantization or None) of each --formats entry, in order.

    Raises:
      ValueError: an empty list or an entry that is neither unquantized, named, nor a valid quantization.
    """
    entries = name_list("--formats", default_formats() if args.formats is None else args.formats, ";")
    out = []
    for e in entries:
        if e in UNQUANTIZED or e in NAMED_FORMATS:
            out.append((e, NAMED_FORMATS.get(e)))
            continue
        try:
            quant.QuantizationConfig.from_value(e)
        except ValueError as err:
            raise ValueError(f"--formats entry {e!r}: {err} (named variants: {'; '.join(NAMED_FORMATS)})") from None
        out.append((e, e))
    return out


def matrix_kv(args: argparse.Namespace) -> list[str]:
    """The KV cache dtypes of --matrix."""
    return [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]


def nll_of_logits(logits, ids: list[int]) -> float:
    """Mean next-token NLL (nats): row i of `logits` [n, V] predicts ids[i + 1]."""
    return float(token_nll(log_softmax(logits[:-1]), ids[1:]).mean())


def mean_nll(llm: LLM, ids: list[int], chunk: int) -> float:
    """Mean next-token NLL (nats) of `ids` under the engine's model (see `eval_logits`)."""
    return nll_of_logits(eval_logits(llm, ids, chunk), ids)


def text_ids(llm: LLM, args: argparse.Namespace) -> list[int]:
    """The first --tokens ids of the (one) --text, within the model's context."""
    return quality_matrix.cut_ids(llm, args.text[0], args.tokens)


def run_one(args: argparse.Namespace, model: str | None) -> dict:
    """Perplexity of one configuration (--dtype, --quantization, --kv-cache-dtype) of `model`."""
    llm = make_llm(model, args.dtype, args.chunk, args.quantization, args.kv_cache_dtype)
    ids = text_ids(llm, args)
    t0 = time.perf_counter()
    nll = mean_nll(llm, ids, args.chunk)
    result = {"model": llm.model_config.name, "dtype": args.dtype, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "text": str(args.text[0]), "tokens": len(ids),
              "mean_nll": nll, "perplexity": math.exp(nll), "weight_bytes": llm.engine.weight_bytes["bytes"],
              "quantized_share": llm.engine.weight_bytes["quantized_share"], "seconds": time.perf_counter() - t0}
    if (args.text[0] == GPL3 and args.tokens == 2048 and args.model is None and args.dtype == "float32"
            and args.quantization is None and args.kv_cache_dtype == "auto"):
        result["reference_perplexity"] = REFERENCE_PPL
        result["relative_difference"] = math.exp(nll) / REFERENCE_PPL - 1
    return result


def run(args: argparse.Namespace) -> Report:
    """The matrix (with --matrix) or one configuration's perplexity."""
    check_arguments(args)
    if args.matrix:
        data = quality_matrix.run_matrix(args, args.text, TEXTS, matrix_formats(args), matrix_kv(args))
        return Report("quality", quality_matrix.matrix_markdown(data, args, TEXT_NOTES), data)
    with tempfile.TemporaryDirectory(prefix="jaxinfer-quality-") as tmp:
        r = run_one(args, loadable(args.model, Path(tmp) / Path(args.model or "default").name))
    lines = ["## Perplexity\n", f"`{args.command}` ({args.date})\n",
             table(["model", "dtype", "quantization", "KV cache", "tokens", "mean NLL", "perplexity"],
                   [[r["model"], r["dtype"], str(r["quantization"]), r["kv_cache_dtype"], str(r["tokens"]),
                     f"{r['mean_nll']:.5f}", f"{r['perplexity']:.3f}"]])]
    if "reference_perplexity" in r:
        lines.append(f"\nHF transformers: {REFERENCE_PPL}; relative difference {r['relative_difference']:+.3%}.")
    return Report("quality", "\n".join(lines), r)
