"""A stand-in for `scripts/peer_transformers.py`'s serving mode in smoke tests: same arguments, same JSON shape
(peer protocol of `jaxinfer.benchmarks.peers`), made-up but plausible timings; needs no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--serving-prompts", type=Path, required=True)
    ap.add_argument("--serving-output-len", type=int, required=True)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args, _ = ap.parse_known_args()
    prompts = json.loads(args.serving_prompts.read_text())
    n, out_len = len(prompts), args.serving_output_len
    total, ttft = 0.5 + 0.01 * n * out_len, 0.2
    print("[peer] stub serving peer", file=sys.stderr)
    results = {dt: {"batch": n, "input_len": max(map(len, prompts)), "output_len": out_len, "total_s": total,
                    "ttft_s": ttft, "output_tok_s": n * out_len / total,
                    "decode_tok_s": n * (out_len - 1) / (total - ttft), "tpot_s": (total - ttft) / (out_len - 1)}
               for dt in args.dtypes.split(",")}
    print(json.dumps({"transformers": "stub", "torch": "stub", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
