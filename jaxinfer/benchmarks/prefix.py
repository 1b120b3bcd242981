"""`jaxinfer bench prefix`: prefix caching in float32.

Two engines in one process, with the same shapes: prefix caching on (with a host tier of `--host-pages` pages) and
off. Measurements in `prefix_measure`, the section in `prefix_report`.

1. **TTFT, cold vs warm.** A 1,000-token shared prefix (`--ttft-prefix-tokens`; the first 1,000 tokens of the GPL-3
   text, as raw token ids) plus a 20-token question (other 20-token windows of that text). Cold:
   `reset_prefix_cache()`, then the request. Warm: right after a cold one, the same prefix with a different question
   (992 of its tokens are cached: 62 full pages). `--reps` cold/warm pairs, interleaved; TTFT is the request's own
   (`RequestOutput.metrics.ttft_s`: from `add_request` to its first token), medians reported. One untimed pair runs
   first, so the step shapes are compiled (the persistent compilation cache is off in benchmark runs).
2. **Multi-turn chat.** `--chat-convs` conversations x `--chat-turns` turns through the model's chat template (one
   shared ~250-token system message (`--chat-system-tokens`), a ~30-token user message per turn), greedy,
   `max_tokens` 32 (`--chat-max-tokens`). Turn t+1's prompt is turn t's prompt + its reply's token ids +
   `<|im_end|>\\n<|im_start|>user\\n...<|im_start|>assistant\\n` (what a ChatML template renders, without
   re-tokenizing the reply). Each conversation sends its next turn as soon
   as its previous reply finished (the engine is stepped by hand), so turns of different conversations overlap.
   The whole workload runs once untimed per engine (compiles), then `--chat-passes` timed passes alternate on / off
   / on / off; reported: wall time, (prompt + output) tokens/s and output tokens/s over the wall time, mean TTFT,
   the prefix-cache hit rate of the pass (`stats()` deltas), and a check that both engines produced the same
   tokens.
3. **Host tier break-even.** For k in `--break-even-pages` (1, 4, 16, 64): a prompt of a k-page prefix plus a
   20-token question, TTFT when the prefix is (a) not cached (recomputed), (b) in the host tier (evicted there by
   allocating every free page, offloads settled to numpy before the request; the step then loads the k pages back),
   (c) on the device. Also the raw calls: `runner.kv.load_pages` of k real host pages vs a standalone prefill step of
   k*16 tokens (`runner.execute`). Host-tier loading pays off from the smallest k where (b) < (a); that k is what
   `DEFAULT_OFFLOAD_MIN_PAGES["cpu"]` in `jaxinfer/engine/config.py` should be.

Expectations, written before measuring SmolLM2-135M-Instruct (2 shared cores, f32; earlier runs here: ~1,000-1,500
prefill tokens/s and ~30-90 ms per small step):

- Cold TTFT ~0.8-1.2 s (1,020 tokens in two 512-token chunks); warm ~50-100 ms (one step of 28 new tokens
  attending to 1,020, about a decode step's cost plus a wider page table). Ratio ~5-10%: the <= 15% goal is met.
- Multi-turn: hit rate ~75-85% of prompt tokens; prefill work drops ~5x, so (prompt + output) tokens/s rises
  ~1.5-2x, output tokens/s ~1.3-1.6x (decode steps are the same on both), mean TTFT drops ~3-5x.
- Loading k pages: ~1 ms fixed + well under 1 ms per 720 KiB page (host memcpy + a scatter); recomputing a page
  costs ~10-15 ms of prefill. Loading wins at every k, so min pages 1 (the current default) is supported.

    .venv/bin/jaxinfer bench prefix --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM
from jaxinfer.benchmarks import corpus
from jaxinfer.benchmarks.prefix_measure import (BREAK_EVEN_PAGES, CHAT_MAX_TOKENS, CHAT_SYSTEM_TOKENS,
                                                HOST_PAGES, PREFIX_TOKENS, PS,
                                                bench_break_even, bench_chat, bench_ttft)
from jaxinfer.benchmarks.prefix_report import render
from jaxinfer.benchmarks.report import Report, int_list
from jaxinfer.loading import load_model
from models.llama import KVCache

logger = logging.getLogger(__name__)

SECTION = ("<!-- prefix-caching: begin -->", "<!-- prefix-caching: end -->")
KV_PAGES = 512
MAX_MODEL_LEN = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefix workload's options: model, repetitions, the chat workload's size, the break-even points."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder with a chat template (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--reps", type=int, default=5,
                        help="timed cold/warm TTFT pairs, and reps per break-even point")
    parser.add_argument("--ttft-prefix-tokens", type=int, default=PREFIX_TOKENS,
                        help="tokens of the TTFT part's shared prefix (16 ... 2000; shorter: fewer prefill chunks)")
    parser.add_argument("--chat-convs", type=int, default=8, help="conversations of the chat workload")
    parser.add_argument("--chat-turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--chat-passes", type=int, default=2, help="timed passes per engine")
    parser.add_argument("--chat-system-tokens", type=int, default=CHAT_SYSTEM_TOKENS,
                        help="tokens of the text in the shared system message (fewer: shorter prompts, fewer chunks)")
    parser.add_argument("--chat-max-tokens", type=int, default=CHAT_MAX_TOKENS,
                        help="max_tokens of every chat reply (fewer: fewer decode steps and shapes to compile)")
    parser.add_argument("--break-even-pages", default=",".join(map(str, BREAK_EVEN_PAGES)),
                        help="prefix sizes k (pages of 16 tokens) of the host-tier break-even")
    parser.add_argument("--host-pages", type=int, default=HOST_PAGES, help="pages of the host tier")


def make_engines(model: str | None, host_pages: int, max_num_seqs: int = 8, kv_pages: int = KV_PAGES
                 ) -> tuple[LLM, LLM, int]:
    """(caching on with a host tier, caching off, bytes of one KV page): float32, `kv_pages` pages each, no warm-up
    (untimed passes compile what each part needs)."""
    cfg, _, _ = load_model(model, np.float32)
    page_bytes = KVCache.bytes_per_page(cfg, PS, jnp.float32)
    engines = []
    for caching in (True, False):
        extra = {"kv_offload_bytes": host_pages * page_bytes} if caching else {}
        engines.append(LLM(model=model, dtype="float32", warmup=False, max_num_seqs=max_num_seqs,
                           max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=kv_pages * page_bytes,
                           enable_prefix_caching=caching, **extra))
    on, off = engines
    if on.engine.prefix_cache.host_capacity_pages != host_pages or not (
            on.page_allocator.num_usable_pages == off.page_allocator.num_usable_pages == kv_pages):
        raise RuntimeError("the engines did not get the KV pages asked for")
    return on, off, page_bytes


def _options(args: argparse.Namespace) -> tuple[int, ...]:
    """The break-even page counts. Raises ValueError naming a bad option."""
    if min(args.reps, args.chat_convs, args.chat_turns, args.chat_passes, args.chat_max_tokens, args.chat_system_tokens,
           args.host_pages) < 1:
        raise ValueError("--reps, --chat-convs, --chat-turns, --chat-passes, --chat-max-tokens, "
                         "--chat-system-tokens and --host-pages must be >= 1")
    return tuple(int_list("--break-even-pages", args.break_even_pages, 1, (MAX_MODEL_LEN - 21) // PS))


def _chat_data(chat: dict) -> dict:
    """The chat results as JSON-able data (the replies' token ids left out)."""
    runs = {name: [{k: v for k, v in dataclasses.asdict(p).items() if k != "replies"} for p in passes]
            for name, passes in chat["runs"].items()}
    return {**chat, "runs": runs}


def run(args: argparse.Namespace) -> Report:
    """The three measurements on two engines; the report.

    `Report.data`: kv_pages, host_pages, page_bytes (K and V bytes of one page), min_pages_default, model (the
    config's shapes), ttft (cold / warm seconds per pair...), chat (runs per engine: wall_s, prompt_tokens,
    output_tokens, ttft_s, hit_rate, cached_tokens; same_tokens...), break_even (one row per k, seconds).

    Raises:
      ValueError: a bad option, a model that cannot be loaded, or no GPL-3 text.
    """
    pages = _options(args)
    if not PS <= args.ttft_prefix_tokens <= 2000:
        raise ValueError(f"--ttft-prefix-tokens {args.ttft_prefix_tokens}: expected {PS} ... 2000 tokens")
    text = corpus.read_text("prefix")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    on, off, page_bytes = make_engines(args.model, args.host_pages)
    logger.info("engines ready in %.1f s", time.perf_counter() - t0)
    cfg = on.engine.model_config
    text_ids = on.tokenizer.encode(text, allow_special=False)
    r = {"kv_pages": on.page_allocator.num_usable_pages, "host_pages": args.host_pages, "page_bytes": page_bytes,
         "min_pages_default": on.engine.prefix_cache.host_min_pages,
         "model": {"name": cfg.name, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                   "head_dim": cfg.head_dim}}
    r["ttft"] = bench_ttft(on, text_ids, args.reps, args.ttft_prefix_tokens)
    r["chat"] = bench_chat(on, off, text_ids, args.chat_convs, args.chat_turns, args.chat_passes,
                           args.chat_max_tokens, args.chat_system_tokens)
    r["break_even"] = bench_break_even(on, text_ids, args.reps, pages)
    for llm in (on, off):
        if llm.page_allocator.num_free_pages != llm.page_allocator.num_usable_pages:
            raise RuntimeError("KV pages leaked: not every page is free after the workload")
    markdown = render(r, args.command, args.date, time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    return Report("prefix", markdown, {**r, "chat": _chat_data(r["chat"])})
