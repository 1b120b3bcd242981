"""The measuring half of `jaxinfer bench longctx`: one context length of one model, in a process of its own, so that
its peak memory is that length's alone (`python -m jaxinfer.benchmarks.longctx_worker --model M --length N ...`).

1. An engine sized for one sequence of N tokens (`max_model_len` N, a KV cache of just the pages it needs, one
   sequence, prefix caching off, chunked prefill of `--chunk` tokens per step).
2. The step shapes such a prompt meets are compiled ahead (`jaxinfer.engine.warmup.compile_prompt`), so no timed
   run compiles; XLA's memory analysis of the last chunk's compiled step gives its temporary bytes.
3. The process's peak resident set is reset (`/proc/self/clear_refs`, Linux), then `--runs` requests of N - 1 prompt
   tokens and one output token (a context of N) run one after another; TTFT is each request's own
   (`RequestOutput.metrics.ttft_s`), and the peak resident set after them is the prefill's peak.

Prints one JSON object as its last stdout line (keys in `measure`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.step_inputs import NULL_PAGE
from jaxinfer.engine.warmup import compile_prompt
from jaxinfer.llm import LLM
from jaxinfer.loading import read_model_config
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.llama import KVCache

PAGE_SIZE = 16
FIRST_ID, LAST_ID = 3, 30000  # prompt ids are drawn from [FIRST_ID, LAST_ID): past the usual special ids


def _status_mib(key: str) -> float | None:
    """A `/proc/self/status` memory line (VmRSS, VmHWM) in MiB, or None where there is no such file."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else None


def _reset_peak() -> bool:
    """Resets the process's peak resident set (VmHWM) to its current one; False where Linux does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(model: str | None, length: int, runs: int, dtype: str, chunk: int) -> dict:
    """One length's figures.

    Returns:
      {"model", "length" (tokens of context), "prompt_tokens", "chunks", "ttft_s" (each run), "ttft_median_s",
      "compile_s", "kv_cache_bytes" (the engine's whole cache), "step_temp_bytes" (XLA temporaries of the last
      chunk's compiled step), "rss_before_mib" (resident set before the timed runs, cache and compiled steps
      included), "peak_rss_mib" (peak resident set during them; None without /proc), "peak_reset" (whether the peak
      could be reset after compiling: if not, it includes the compiles), "load_average" (the machine's 1-minute load
      average after the timed runs)}.

    Raises:
      ValueError: a length below 2 or past the model's context, or a bad engine option.
    """
    cfg = read_model_config(model)
    if not 2 <= length <= cfg.max_position_embeddings:
        raise ValueError(f"--length {length} must be in [2, {cfg.max_position_embeddings}] (the model's context)")
    pages = -(-length // PAGE_SIZE)  # the engine adds the null page
    kv_bytes = pages * KVCache.bytes_per_page(cfg, PAGE_SIZE, jnp.dtype(dtype))
    llm = LLM(model, dtype=dtype, max_model_len=length, kv_cache_memory_bytes=kv_bytes, page_size=PAGE_SIZE,
              max_num_seqs=1, max_num_batched_tokens=chunk, warmup=False, enable_prefix_caching=False)
    runner = llm.runner
    ids = np.random.default_rng(length).integers(FIRST_ID, min(runner.vocab_limit, LAST_ID), length - 1)
    prompt = ids.tolist()
    compile_s = compile_prompt(runner, len(prompt), chunk)
    last = (len(prompt) - 1) % chunk + 1
    greedy = SamplingRow(SamplingParams(temperature=0), seed=0)
    compiled = runner.compile_step([ScheduledChunk(prompt[-last:], len(prompt) - last, [NULL_PAGE] * pages)],
                                   [greedy])
    step_temp = compiled.memory_analysis().temp_size_in_bytes
    rss_before = _status_mib("VmRSS")
    reset = _reset_peak()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttft = []
    for _ in range(runs):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ttft.append(out.metrics.ttft_s)
    cache = runner.kv_cache
    return {"model": llm.model_config.name, "length": length, "prompt_tokens": len(prompt),
            "chunks": -(-len(prompt) // chunk), "ttft_s": ttft, "ttft_median_s": statistics.median(ttft),
            "compile_s": compile_s, "kv_cache_bytes": int(cache.k.nbytes + cache.v.nbytes),
            "step_temp_bytes": int(step_temp), "rss_before_mib": rss_before, "peak_rss_mib": _status_mib("VmHWM"),
            "peak_reset": reset, "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def main() -> None:
    """Parses the options, measures, prints the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, required=True, help="context in tokens (prompt + 1 output token)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: prefill tokens per step")
    args = ap.parse_args()
    print(json.dumps(measure(args.model, args.length, args.runs, args.dtype, args.chunk)), flush=True)


if __name__ == "__main__":
    main()
