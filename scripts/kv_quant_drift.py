"""How far a prefix-cache hit moves the logits with a quantized KV cache, against a float cache.

For each of `--windows` windows of the GPL-3 text (`tests/data/GPL-3.txt`, 1,200 characters each), SmolLM2 generates
`--max-tokens` greedy tokens twice on one engine: cold, then again with the prompt's whole pages taken from the
prefix cache. It prints, per KV cache dtype, how many windows' greedy tokens differ and the largest difference of
a generated token's logprob before the first differing token. A float cache shows the rounding of recomputing the
uncached tail with other matmul shapes; an int8 / fp8 cache adds the int8 / fp8 rounding flips that rounding causes
in the tail's K/V (README, "KV cache quantization").

    .venv/bin/python scripts/kv_quant_drift.py --kv-dtypes auto,int8,fp8
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxinfer import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "GPL-3.txt"


def drift(kv_dtype: str, windows: int, max_tokens: int) -> tuple[int, float]:
    """(windows whose greedy tokens differ, max |logprob difference| before the first differing token)."""
    text = TEXT.read_text()
    llm = LLM(kv_cache_dtype=kv_dtype, max_model_len=1024, warmup=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
    differ, worst = 0, 0.0
    for i in range(windows):
        prompt = text[i * 900: i * 900 + 1200]
        cold, hit = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for _ in range(2))
        same = 0
        while same < len(cold.token_ids) and cold.token_ids[same] == hit.token_ids[same]:
            same += 1
        differ += same < len(cold.token_ids)
        for j in range(same):
            t = cold.token_ids[j]
            worst = max(worst, abs(cold.logprobs[j][t].logprob - hit.logprobs[j][t].logprob))
    return differ, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--kv-dtypes", default="auto,int8")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    for kv in args.kv_dtypes.split(","):
        differ, worst = drift(kv, args.windows, args.max_tokens)
        print(f"kv_cache_dtype={kv}: greedy tokens differ in {differ} of {args.windows} windows; "
              f"max |logprob difference| before that {worst:.2g}")


if __name__ == "__main__":
    main()
