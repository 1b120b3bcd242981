"""`jaxinfer bench quality --matrix`: every weight format x KV cache dtype against the unquantized model, as
llama.cpp's `llama-perplexity --kl-divergence` measures a quantization (tools/perplexity/README.md there), over
several texts.

1. The baseline (no quantization, `--dtype` weights and KV cache, bf16 by default) runs once per text: prefill
   in `--chunk`-token pieces; each piece's next-token log-probabilities (f32, `quality_metrics.log_softmax`) go to
   a numpy memmap in a temporary folder, [tokens - 1, V] f32 per text (400 MB for SmolLM2's 49,152 ids x 2,048
   tokens: on disk, not in memory), with its NLL, argmax tokens, and the greedy continuations of the flip prompts.
2. Each other configuration runs the same tokens piece by piece; a piece's log-probabilities are compared with
   the baseline's rows read back from the memmap (KL divergence, argmax), then dropped: memory stays one piece.
3. Flips: from `--flips` evenly spaced points of the text (`quality_runs.flip_prompts`), `--flip-tokens` greedy
   tokens of the baseline and of the configuration; a flip is a continuation that differs anywhere.
A configuration that the model cannot take (a `ValueError` when the engine is built) is reported as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxinfer.benchmarks import quality_runs as runs
from jaxinfer.benchmarks.model_setup import describe
from jaxinfer.benchmarks.quality_metrics import (count_flips, kl_divergence, log_softmax, percentile, token_nll,
                                                 top1_agreement)
from jaxinfer.benchmarks.report import machine_line, table
from jaxinfer.llm import LLM

logger = logging.getLogger(__name__)

SHORT_DTYPE = {"bfloat16": "bf16", "float32": "f32"}


@dataclasses.dataclass
class Baseline:
    """The unquantized model's run over one text.

    Attributes:
      text: the text's label ("GPL-3", "textwrap.py", or its file name).
      ids: the evaluated token ids (n of them).
      logp: f32[n - 1, V] memmap: log-probabilities of the next token at positions 0 .. n - 2.
      nll: f64[n - 1] negative log-likelihood of ids[1:], nats.
      top1: i64[n - 1] argmax token per position.
      prompts: the flip prompts (`quality_runs.flip_prompts`).
      context: their longest length: --flip-context, or less where the model's context is shorter.
      continuations: i32[len(prompts), flip tokens] greedy tokens after each prompt.
    """

    text: str
    ids: list[int]
    logp: np.ndarray
    nll: np.ndarray
    top1: np.ndarray
    prompts: list[list[int]]
    context: int
    continuations: np.ndarray


def score(llm: LLM, ids: list[int], chunk: int, *, write_to: np.ndarray | None = None,
          baseline: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Next-token NLL (f64[n - 1], nats), argmax tokens ([n - 1]) and, against `baseline` (f32[n - 1, V]
    log-probs), the KL divergence per position (f64[n - 1]; None without a baseline) of `ids` under `llm`, one
    `chunk`-token piece at a time. `write_to` (f32[n - 1, V]), when given, receives the log-probs."""
    nlls, top1s, klds, start = [], [], [], 0
    for logits in runs.chunk_logits(llm, ids, chunk):
        rows = logits[: max(0, min(len(logits), len(ids) - 1 - start))]  # the last position predicts nothing
        logp = log_softmax(rows)  # [rows, V]
        nlls.append(token_nll(logp, np.asarray(ids[start + 1 : start + 1 + len(rows)])))
        top1s.append(rows.argmax(-1))
        if write_to is not None:
            write_to[start : start + len(rows)] = logp
        if baseline is not None:
            klds.append(kl_divergence(np.asarray(baseline[start : start + len(rows)]), logp))
        start += len(logits)
    return np.concatenate(nlls), np.concatenate(top1s), np.concatenate(klds) if baseline is not None else None


def text_label(path: Path, named: dict[str, Path]) -> str:
    """A text's label in the table: its name in `named` (label -> path), else its file name."""
    return next((label for label, p in named.items() if p.resolve() == path.resolve()), path.name)


def cut_ids(llm: LLM, text: Path, tokens: int) -> list[int]:
    """The first `tokens` ids of `text` under the model's tokenizer, no more than the model's context (a warning
    when fewer)."""
    ids = llm.tokenizer.encode(text.read_text(encoding="utf-8"))[: min(tokens, llm.max_model_len)]
    if len(ids) < tokens:
        logger.warning("%s: evaluating %d tokens (the text's length or the model's context), not %d", text.name,
                       len(ids), tokens)
    return ids


def make_baseline(llm: LLM, label: str, ids: list[int], args: argparse.Namespace, folder: Path) -> Baseline:
    """Runs the baseline over `ids` and stores its log-probs in a memmap under `folder`."""
    vocab = llm.runner.output_vocab
    store = np.lib.format.open_memmap(folder / f"baseline-{len(list(folder.iterdir()))}.npy", mode="w+",
                                      dtype=np.float32, shape=(len(ids) - 1, vocab))
    nll, top1, _ = score(llm, ids, args.chunk, write_to=store)
    context = min(args.flip_context, llm.max_model_len - args.flip_tokens)
    prompts = runs.flip_prompts(ids, min(args.flips, len(ids)), context)
    continuations = runs.greedy_continuations(llm, prompts, args.flip_tokens)
    return Baseline(label, ids, store, nll, top1, prompts, context, continuations)


def row(label: str, kv: str, base: Baseline, llm: LLM, nll: np.ndarray, top1: np.ndarray, kld: np.ndarray,
        flips: int, seconds: float) -> dict:
    """One table row's data."""
    wb = llm.engine.weight_bytes
    return {"format": label, "kv_cache": kv, "text": base.text, "model": llm.model_config.name,
            "tokens": len(base.ids), "mean_nll": float(nll.mean()), "perplexity": math.exp(nll.mean()),
            "delta_ppl": math.exp(nll.mean() - base.nll.mean()) - 1, "kld_mean": float(kld.mean()),
            "kld_p99": percentile(kld, 99), "kld_max": float(kld.max()),
            "top1_agreement": top1_agreement(base.top1, top1), "flips": flips, "flip_prompts": len(base.prompts),
            "weight_bytes": wb["bytes"], "quantized_share": wb["quantized_share"], "seconds": seconds}


def evaluate(llm: LLM, label: str, kv: str, base: Baseline, args: argparse.Namespace) -> dict:
    """One configuration on one text against its baseline."""
    t0 = time.perf_counter()
    nll, top1, kld = score(llm, base.ids, args.chunk, baseline=base.logp)
    flips = count_flips(base.continuations, runs.greedy_continuations(llm, base.prompts, args.flip_tokens))
    return row(label, kv, base, llm, nll, top1, kld, flips, time.perf_counter() - t0)


def golden_check(llm: LLM, model: str | None) -> dict | None:
    """The baseline `llm` against HF transformers' f32 logits in the model folder's golden.json, if it has one:
    KL(HF || ours) mean and max, top-1 agreement, over the golden's tokens."""
    golden = runs.hf_golden(model)
    if golden is None:
        return None
    ids, hf_logits = golden
    ours = runs.eval_logits(llm, ids, len(ids))
    kld = kl_divergence(log_softmax(hf_logits), log_softmax(ours[:, : hf_logits.shape[1]]))
    return {"tokens": len(ids), "kld_mean": float(kld.mean()), "kld_max": float(kld.max()),
            "top1_agreement": top1_agreement(hf_logits.argmax(-1), ours.argmax(-1))}


def run_matrix(args: argparse.Namespace, texts: list[Path], named_texts: dict[str, Path],
               configs: list[tuple[str, object]], kv_dtypes: list[str]) -> dict:
    """Every (format, KV dtype) of `configs` (label, quantization or None) x `kv_dtypes`, on every text.

    Returns:
      {"rows": [row dicts, grouped by text, baseline first], "skipped": [{"format", "kv_cache", "reason"}],
      "golden": `golden_check` or None, "model": name, "model_shape": `describe`, "dtype": the baseline's,
      "flip_context": the flip prompts' longest length}.
    """
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="jaxinfer-quality-") as tmp:
        model = runs.loadable(args.model, Path(tmp) / Path(args.model or "default").name)
        llm = runs.make_llm(model, args.dtype, args.chunk, max_num_seqs=args.flips)
        base_label = SHORT_DTYPE[args.dtype]
        t0 = time.perf_counter()
        baselines = [make_baseline(llm, text_label(t, named_texts), cut_ids(llm, t, args.tokens), args, Path(tmp))
                     for t in texts]
        seconds = (time.perf_counter() - t0) / len(texts)
        for b in baselines:
            rows.append(row(base_label, base_label, b, llm, b.nll, b.top1, np.zeros(len(b.nll)), 0, seconds))
        info = {"golden": golden_check(llm, args.model), "model": llm.model_config.name,
                "model_shape": describe(llm.model_config), "dtype": args.dtype,
                "flip_context": min(b.context for b in baselines)}
        del llm
        for label, quantization in configs:
            name = base_label if quantization is None else label
            for kv in kv_dtypes:
                if quantization is None and kv == "auto":
                    continue  # the baseline
                kv_label = base_label if kv == "auto" else kv
                try:
                    llm = runs.make_llm(model, args.dtype, args.chunk, quantization, kv, args.flips)
                except ValueError as e:
                    logger.warning("skipping %s with a %s KV cache: %s", name, kv_label, e)
                    skipped.append({"format": name, "kv_cache": kv_label, "reason": str(e)})
                    continue
                for b in baselines:
                    rows.append(evaluate(llm, name, kv_label, b, args))
                    logger.info("%s", json.dumps(rows[-1]))
                del llm
    order = {b.text: i for i, b in enumerate(baselines)}
    return {"rows": sorted(rows, key=lambda r: order[r["text"]]), "skipped": skipped, **info}


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def matrix_markdown(data: dict, args: argparse.Namespace, text_notes: dict[str, str]) -> str:
    """The --matrix section's markdown (without its markers). `text_notes`: text label -> what it is."""
    rows = data["rows"]
    base = SHORT_DTYPE[data["dtype"]]
    texts = "; ".join(f"{r['text']} ({text_notes.get(r['text'], 'a text file')}): the first {r['tokens']} tokens"
                      for r in rows if r["format"] == base and r["kv_cache"] == base)
    body = [[r["format"], r["kv_cache"], r["text"], f"{r['perplexity']:.3f}", f"{r['delta_ppl'] * 100:+.2f}%",
             f"{r['kld_mean']:.5f}", f"{r['kld_p99']:.4f}", f"{r['top1_agreement'] * 100:.1f}%",
             f"{r['flips']}/{r['flip_prompts']}", f"{r['quantized_share'] * 100:.1f}%", _bytes(r["weight_bytes"])]
            for r in rows]
    lines = [
        f"## Quantization: quality (perplexity, KL divergence, top-1 agreement and greedy flips against {base})",
        "",
        f"`{args.command}` ({args.date}): {data['model']} ({data['model_shape']}), activations {base}. Texts: "
        f"{texts}; prefilled in {args.chunk}-token chunks. {machine_line()}.",
        "",
        f"Against the {base} model ({base} weights and KV cache) on the same tokens, as llama.cpp's "
        "`llama-perplexity --kl-divergence`: KLD is KL(P_base || Q) of the next-token distribution over the whole "
        "vocabulary per position (f64 sums of f32 log-softmax), its mean and 99th percentile over the positions; "
        "top-1 is the share of positions whose argmax equals the baseline's; flips: of "
        f"{args.flips} evenly spaced points of each text, the prompts (the up to {data['flip_context']} tokens "
        f"before the point) whose {args.flip_tokens} greedy tokens differ anywhere from the baseline's. Weights: "
        "resident bytes and share of parameters stored quantized (`models.quant.weight_bytes`).",
        "",
        table(["format", "KV cache", "text", "PPL", "vs base", "mean KLD", "p99 KLD", "top-1", "flips",
               "quantized", "weights"], body),
    ]
    if data.get("golden"):
        g = data["golden"]
        lines += ["", f"Baseline against HF transformers (f32, the folder's golden.json, {g['tokens']} tokens): mean "
                      f"KLD {g['kld_mean']:.2e}, max {g['kld_max']:.2e}, top-1 {g['top1_agreement'] * 100:.1f}%."]
    for s in data["skipped"]:
        lines += ["", f"Skipped {s['format']} with a {s['kv_cache']} KV cache: {s['reason']}"]
    return "\n".join(lines)
