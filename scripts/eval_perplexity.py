"""Perplexity of a model on real English text through the engine's own runner (the first piece of issue 9).

The text is tokenized with the model's tokenizer (no BOS, as HF's tokenizer does for SmolLM2), cut to the first
`--tokens` ids, and run through `ModelRunner.compute_logits` in prefill chunks of `--chunk` tokens over the paged
KV cache (later chunks attend to the cached earlier ones, as chunked prefill does). The mean negative
log-likelihood is over the `--tokens - 1` next-token predictions (position i predicts token i + 1), HF's
`model(ids, labels=ids).loss` convention; perplexity = exp(mean NLL).

Reference (issue 9): SmolLM2-135M-Instruct in f32 on the first 2,048 tokens of /usr/share/common-licenses/GPL-3
scores perplexity 19.66 (mean NLL 2.9786) in HF transformers; ours must agree within 0.5%.

    .venv/bin/python scripts/eval_perplexity.py [--model PATH] [--dtype float32] [--tokens 2048] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

GPL3 = Path("/usr/share/common-licenses/GPL-3")
REFERENCE_PPL = 19.66  # HF transformers, SmolLM2-135M-Instruct f32, first 2,048 GPL-3 tokens (issue 9)


def mean_nll(llm, ids: list[int], chunk: int) -> float:
    """Mean next-token NLL (nats) of `ids` under the engine's model, prefilling `chunk` tokens per step.

    Raises:
      ValueError: if ids has fewer than 2 tokens or more than the KV cache can hold.
    """
    from jaxinfer.engine.runner import SequenceChunk

    if len(ids) < 2:
        raise ValueError("need at least 2 tokens")
    runner, ps = llm.runner, llm.engine.page_size
    pages = llm.engine.page_allocator.allocate(-(-len(ids) // ps))
    try:
        logits = []
        for start in range(0, len(ids), chunk):
            new = ids[start : start + chunk]
            used = -(-(start + len(new)) // ps)
            logits.append(runner.compute_logits([SequenceChunk(new, start, pages[:used])]))
    finally:
        llm.engine.page_allocator.free(pages)
    logits = np.concatenate(logits)[:-1].astype(np.float64)  # [n - 1, V]: row i predicts ids[i + 1]
    top = logits.max(axis=-1, keepdims=True)
    log_z = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1)))
    target = logits[np.arange(len(ids) - 1), ids[1:]]
    return float(np.mean(log_z - target))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--text", type=Path, default=GPL3, help="a UTF-8 text file (default: the GPL-3 licence)")
    ap.add_argument("--tokens", type=int, default=2048, help="ids of the text evaluated (from its start)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.chunk < 1:
        ap.error("--tokens must be >= 2 and --chunk >= 1")
    if not args.text.is_file():
        ap.error(f"--text {str(args.text)!r} is not a file")
    from jaxinfer.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, warmup=False, enable_prefix_caching=False,
              max_num_batched_tokens=max(args.chunk, 16), kv_cache_memory_bytes=256 << 20)
    ids = llm.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.tokens]
    if len(ids) < args.tokens:
        print(f"warning: the text has only {len(ids)} tokens", file=sys.stderr)
    t0 = time.perf_counter()
    nll = mean_nll(llm, ids, args.chunk)
    result = {"model": llm.model_config.name, "dtype": args.dtype, "text": str(args.text), "tokens": len(ids),
              "mean_nll": round(nll, 5), "perplexity": round(math.exp(nll), 3), "seconds": round(time.perf_counter() - t0, 1)}
    if args.text == GPL3 and args.tokens == 2048 and args.model is None and args.dtype == "float32":
        result["reference_perplexity"] = REFERENCE_PPL
        result["relative_difference"] = round(math.exp(nll) / REFERENCE_PPL - 1, 5)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
