"""Peer measurements for `jaxinfer bench step` and `serving`: HF transformers on torch CPU, same model and same
quantities.

Runs in the separate venv that has torch + transformers (`.venv-golden`, see `scripts/make_golden.py`); it imports
nothing from jaxinfer. It loads the same GGUF file (transformers dequantizes it to the requested dtype) or HF
folder, then, per dtype:

* prefill: one forward over the 512-token prompt with a fresh KV cache and `logits_to_keep=1` (only the last
  position's logits, as jaxinfer computes them), timed after one warm-up; median over `--prefill-reps`;
* decode: prefill the first 64 prompt tokens, then greedy single-token forwards reusing the KV cache; each step
  (forward + argmax) timed; median over `--decode-steps` after `--warmup-steps` untimed steps;
* decode at each `--batches` size b: the first b rows of `--batch-prompts` (equal lengths, so no padding or
  attention mask) prefilled into one `DynamicCache`, then steps of one token per row (forward + argmax of every
  row); aggregate tok/s = b / median step time over `--batch-steps`.

With `--serving-prompts FILE` (a JSON list of prompts, each a list of token ids) it runs the serving workload of
`jaxinfer bench serving` instead: per dtype, one batched `generate` over all the prompts (left
padding, greedy, exactly `--serving-output-len` new tokens each: `max_new_tokens = min_new_tokens`), timed end to
end; a streamer records when each generated token reaches the host (the first arrives after the batch's prefill,
so it gives the time to first token of every request in the batch). An untimed 2-token `generate` of the same batch
runs first (warm-up).

Prints one JSON object to stdout; logs go to stderr.

    .venv-golden/bin/python scripts/peer_transformers.py --gguf PATH --prompt-file ids.json
    .venv-golden/bin/python scripts/peer_transformers.py --gguf PATH --serving-prompts prompts.json \
        --serving-output-len 128
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
        step_s = _timed_steps(model, cache, token, decode_steps, warmup_steps)
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


def _timed_steps(model, cache, tokens, decode_steps: int, warmup_steps: int) -> list[float]:
    """Greedy decode steps (forward + argmax of every row, the tokens brought to the host as a server would) from
    `tokens` [B, 1] over `cache`; the seconds of the last `decode_steps`."""
    step_s = []
    for step in range(warmup_steps + decode_steps):
        t0 = time.perf_counter()
        out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.tolist()
        if step >= warmup_steps:
            step_s.append(time.perf_counter() - t0)
    return step_s


def measure_batch(model, torch, prompts: list[list[int]], decode_steps: int, warmup_steps: int) -> dict:
    """Aggregate greedy decode of equal-length `prompts` in one batch: the median step (forward + argmax)."""
    from transformers import DynamicCache

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("batch decode prompts must all have one length (no padding here)")
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=torch.tensor(prompts, dtype=torch.long), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        step_s = _timed_steps(model, cache, tokens, decode_steps, warmup_steps)
    step_ms, n, first = _median_ms(step_s), len(prompts), len(prompts[0]) + warmup_steps + 1
    log.info("decode batch %d: %.2f ms/step, %.1f tok/s", n, step_ms, n * 1e3 / step_ms)
    return {"batch": n, "step_ms": step_ms, "tok_s": n * 1e3 / step_ms, "context": [first, first + decode_steps - 1]}


def measure_serving(model, torch, prompts: list[list[int]], output_len: int) -> dict:
    """One batched greedy `generate` of all prompts (left padding), exactly `output_len` new tokens each.

    Returns wall seconds, the time of the first generated token (prefill of the whole batch + first sampling) and
    the throughputs derived from them.
    """
    from transformers.generation.streamers import BaseStreamer

    cfg = model.generation_config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    pad = 0 if pad is None else int(pad)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1

    class Clock(BaseStreamer):
        """Records when each put reaches the host (the first put is the prompt, then one per new token)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(new_tokens: int, streamer=None):
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=pad, streamer=streamer, top_p=None,
                              top_k=None, temperature=None)

    with torch.inference_mode():
        t0 = time.perf_counter()
        generate(2)
        log.info("serving warm-up (2 new tokens, batch %d): %.1f s", len(prompts), time.perf_counter() - t0)
        clock = Clock()
        t0 = time.perf_counter()
        out = generate(output_len, clock)
        total = time.perf_counter() - t0
    new = out.shape[1] - width
    if new != output_len:
        raise RuntimeError(f"generate returned {new} new tokens per sequence, expected {output_len}")
    ttft = clock.times[1] - t0  # times[0]: the prompt's put, before any forward
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    n = len(prompts)
    log.info("serving: batch %d, %d+%d tokens: %.1f s, first token after %.2f s", n, width, output_len, total, ttft)
    return {
        "batch": n, "input_len": width, "output_len": output_len, "total_s": total, "ttft_s": ttft,
        "output_tok_s": n * output_len / total,
        "decode_tok_s": n * (output_len - 1) / (total - ttft) if output_len > 1 else None,
        "step_ms_median": 1e3 * statistics.median(steps) if steps else None,
        "tpot_s": (total - ttft) / (output_len - 1) if output_len > 1 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--gguf", required=True, type=Path,
                    help="GGUF file or HF folder (the same one jaxinfer benchmarks)")
    ap.add_argument("--prompt-file", type=Path, help="JSON list of prompt token ids (prefill/decode mode)")
    ap.add_argument("--serving-prompts", type=Path, help="JSON list of prompts (lists of token ids): serving mode")
    ap.add_argument("--serving-output-len", type=int, default=128, help="new tokens per prompt (serving mode)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--batches", default="", help="decode batch sizes besides 1 (prefill/decode mode), e.g. 8,32")
    ap.add_argument("--batch-prompts", type=Path, help="JSON list of equal-length prompts for --batches")
    ap.add_argument("--batch-steps", type=int, help="timed decode steps at the --batches sizes (default: "
                    "--decode-steps)")
    args = ap.parse_args()
    if (args.prompt_file is None) == (args.serving_prompts is None):
        ap.error("give exactly one of --prompt-file and --serving-prompts")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches {args.batches!r} is not a list of integers")
    if batches and args.batch_prompts is None:
        ap.error("--batches needs --batch-prompts")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[peer] %(asctime)s %(message)s")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    prompt = json.loads((args.prompt_file or args.serving_prompts).read_text())
    rows = json.loads(args.batch_prompts.read_text()) if batches else []
    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads(), "results": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        t0 = time.perf_counter()
        if args.gguf.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(args.gguf), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name, dtype=dtype)
        model.eval()
        load_s = time.perf_counter() - t0
        log.info("loaded %s in %.1f s", name, load_s)
        if args.serving_prompts is not None:
            r = measure_serving(model, torch, prompt, args.serving_output_len)
        else:
            r = measure(model, torch, prompt, args.decode_prompt_len, args.prefill_reps, args.decode_steps,
                        args.warmup_steps)
            r["batch_decodes"] = [measure_batch(model, torch, rows[:b], args.batch_steps or args.decode_steps,
                                                args.warmup_steps) for b in batches]
        r["load_s"] = load_s
        result["results"][name] = r
        del model
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
