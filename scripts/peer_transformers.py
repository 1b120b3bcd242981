"""Peer measurements for `scripts/benchmark.py`: HF transformers on torch CPU, same model and same quantities.

Runs in the separate venv that has torch + transformers (`.venv-golden`, see `scripts/make_golden.py`); it imports
nothing from jaxinfer. It loads the same GGUF file (transformers dequantizes it to the requested dtype), then, per
dtype:

* prefill: one forward over the 512-token prompt with a fresh KV cache and `logits_to_keep=1` (only the last
  position's logits, as jaxinfer computes them), timed after one warm-up; median over `--prefill-reps`;
* decode: prefill the first 64 prompt tokens, then greedy single-token forwards reusing the KV cache; each step
  (forward + argmax) timed; median over `--decode-steps` after `--warmup-steps` untimed steps.

Prints one JSON object to stdout; logs go to stderr.

    .venv-golden/bin/python scripts/peer_transformers.py --gguf PATH --prompt-file ids.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

log = logging.getLogger("peer_transformers")


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def measure(model, torch, prompt: list[int], decode_prompt_len: int, prefill_reps: int, decode_steps: int,
            warmup_steps: int) -> dict:
    """Prefill and batch-1 decode timings of one loaded model."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt], dtype=torch.long)
    prefill_s = []
    with torch.inference_mode():
        for rep in range(prefill_reps + 1):
            t0 = time.perf_counter()
            out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            dt = time.perf_counter() - t0
            log.info("prefill %d tokens: %.3f s%s", len(prompt), dt, " (warm-up)" if rep == 0 else "")
            if rep:
                prefill_s.append(dt)

        cache = DynamicCache()
        out = model(input_ids=ids[:, :decode_prompt_len], past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        step_s = []
        for step in range(warmup_steps + decode_steps):
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            int(token[0, 0])
            if step >= warmup_steps:
                step_s.append(time.perf_counter() - t0)
    decode_ms = _median_ms(step_s)
    prefill_ms = _median_ms(prefill_s)
    log.info("decode median %.2f ms/token, prefill median %.1f ms", decode_ms, prefill_ms)
    return {
        "prefill_ms": prefill_ms,
        "prefill_tok_s": len(prompt) / (prefill_ms / 1e3),
        "decode_ms": decode_ms,
        "decode_tok_s": 1e3 / decode_ms,
        "decode_context": [decode_prompt_len + warmup_steps + 1, decode_prompt_len + warmup_steps + decode_steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path, help="GGUF file (the same one jaxinfer benchmarks)")
    ap.add_argument("--prompt-file", required=True, type=Path, help="JSON list of prompt token ids")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[peer] %(asctime)s %(message)s")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    prompt = json.loads(args.prompt_file.read_text())
    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads(), "results": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name, dtype=dtype)
        model.eval()
        load_s = time.perf_counter() - t0
        log.info("loaded %s in %.1f s", name, load_s)
        r = measure(model, torch, prompt, args.decode_prompt_len, args.prefill_reps, args.decode_steps,
                    args.warmup_steps)
        r["load_s"] = load_s
        result["results"][name] = r
        del model
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
