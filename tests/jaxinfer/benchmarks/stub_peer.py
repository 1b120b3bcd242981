"""A stand-in for `scripts/peer_transformers.py` and `scripts/peer_llamacpp.py` in smoke tests: the same arguments
and peer protocol (`jaxinfer.benchmarks.peers`), no torch, no llama.cpp. It prints one JSON object with the fields
the benchmarks read, with plausible made-up numbers (a "[peer]" progress line goes to stderr, as the real peers'
logs do). With `--types` it answers as the llama.cpp peer; then, if the environment sets
`STUB_PEER_SEGFAULT_WITH_EXTRA_BUFTS=1`, it kills itself with SIGSEGV unless `--no-extra-bufts` is given (the crash
`peers.run_llamacpp_peer` recovers from).

    python stub_peer.py --gguf PATH --prompt-file ids.json [--dtypes float32,bfloat16] [--batches 8 ...] ...
    python stub_peer.py --gguf PATH --prompt-file ids.json --types Q4_0,BF16 --cache-dir DIR ...
    python stub_peer.py --gguf PATH --serving-prompts prompts.json --serving-output-len 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def prefill_decode(prompt: list[int], args: argparse.Namespace) -> dict:
    """The prefill / decode fields of `peer_transformers.measure` (and of each type of `peer_llamacpp`): 2 ms per
    prompt token, 50 ms per decode step, 50 + 5 x batch ms per step at each `--batches` size."""
    prefill_ms, decode_ms = 2.0 * len(prompt), 50.0
    first = args.decode_prompt_len + args.warmup_steps + 1
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    return {"prefill_ms": prefill_ms, "prefill_tok_s": len(prompt) / (prefill_ms / 1e3), "decode_ms": decode_ms,
            "decode_tok_s": 1e3 / decode_ms, "decode_context": [first, first + args.decode_steps - 1],
            "batch_decodes": [{"batch": b, "step_ms": 50.0 + 5 * b, "tok_s": b * 1e3 / (50.0 + 5 * b),
                               "context": [first, first + args.decode_steps - 1]} for b in batches]}


def llamacpp(prompt: list[int], args: argparse.Namespace) -> dict:
    """The fields of `peer_llamacpp.main`: per type, `prefill_decode`'s numbers and a 70 MB model."""
    results = {t: {**prefill_decode(prompt, args), "desc": f"stub {t}", "ftype": 0, "model_bytes": 70_000_000,
                   "file": str(args.cache_dir / f"stub.{t}.gguf"), "load_s": 0.1, "quantize_s": None}
               for t in args.types.split(",")}
    return {"llama_cpp": "stub", "threads": args.threads, "flash_attn": False, "n_ctx": 1024, "kv_type": "f16",
            "extra_bufts": not args.no_extra_bufts, "system_info": "stub", "results": results}


def serving(prompts: list[list[int]], output_len: int) -> dict:
    """The fields of `peer_transformers.measure_serving`: a 0.5 s batch prefill, then 40 ms per decode step."""
    n, ttft, step_s = len(prompts), 0.5, 0.04
    total = ttft + step_s * (output_len - 1)
    return {"batch": n, "input_len": max(map(len, prompts)), "output_len": output_len, "total_s": total,
            "ttft_s": ttft, "output_tok_s": n * output_len / total,
            "decode_tok_s": n * (output_len - 1) / (total - ttft) if output_len > 1 else None,
            "step_ms_median": 1e3 * step_s if output_len > 1 else None,
            "tpot_s": step_s if output_len > 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--prompt-file", type=Path)
    ap.add_argument("--serving-prompts", type=Path)
    ap.add_argument("--serving-output-len", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--batches", default="")
    ap.add_argument("--batch-prompts", type=Path)
    ap.add_argument("--batch-steps", type=int)
    ap.add_argument("--types", help="answer as the llama.cpp peer, for these weight types")
    ap.add_argument("--cache-dir", type=Path, default=Path("."))
    ap.add_argument("--no-extra-bufts", action="store_true")
    args = ap.parse_args()
    if (args.prompt_file is None) == (args.serving_prompts is None):
        ap.error("give exactly one of --prompt-file and --serving-prompts")
    if not args.gguf.exists():
        ap.error(f"--gguf {args.gguf} does not exist")
    prompts = json.loads((args.prompt_file or args.serving_prompts).read_text())
    if args.batches and (args.batch_prompts is None or not args.batch_prompts.is_file()):
        ap.error("--batches needs an existing --batch-prompts file")
    print(f"[peer] stub peer: {args.types or args.dtypes} on {args.gguf.name}", file=sys.stderr)
    if args.types:
        if os.environ.get("STUB_PEER_SEGFAULT_WITH_EXTRA_BUFTS") == "1" and not args.no_extra_bufts:
            os.kill(os.getpid(), signal.SIGSEGV)
        json.dump(llamacpp(prompts, args), sys.stdout)
        sys.stdout.write("\n")
        return
    result = {"torch": "stub", "transformers": "stub", "threads": args.threads, "results": {}}
    for name in args.dtypes.split(","):
        r = (serving(prompts, args.serving_output_len) if args.serving_prompts is not None
             else prefill_decode(prompts, args))
        result["results"][name] = {**r, "load_s": 0.1}
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
