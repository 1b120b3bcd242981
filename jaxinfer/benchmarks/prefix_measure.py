"""The three measurements of `jaxinfer bench prefix` (see `jaxinfer.benchmarks.prefix`): TTFT of a shared prefix
cold vs warm, a multi-turn chat with caching on and off, and the host tier's load-vs-recompute break-even."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import jax

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.scheduler.chunk import ScheduledChunk

logger = logging.getLogger(__name__)

PS = 16  # page size
PREFIX_TOKENS = 1000
QUESTION_TOKENS = 20
HOST_PAGES = 128
BREAK_EVEN_PAGES = (1, 4, 16, 64)
CHAT_MAX_TOKENS = 32
CHAT_SYSTEM_TOKENS = 250
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def median(xs: list[float]) -> float:
    """The median of a non-empty list."""
    return statistics.median(xs)


# --- 1. TTFT cold vs warm -----------------------------------------------------------------------------------------


def bench_ttft(llm: LLM, text_ids: list[int], reps: int, prefix_tokens: int = PREFIX_TOKENS) -> dict:
    """`reps` interleaved cold / warm pairs (after an untimed one) of the shared prefix (the first `prefix_tokens`
    tokens of the text, at most 2000: the questions come after) + a question.

    Returns:
      {"cold", "warm": TTFT seconds per pair, "cold_wall", "warm_wall": `generate` seconds, "cached": tokens the
      warm request found cached, "prefix_tokens", "prompt_tokens", "reps"}.
    """
    prefix = text_ids[:prefix_tokens]
    questions = [text_ids[2000 + QUESTION_TOKENS * i: 2000 + QUESTION_TOKENS * (i + 1)] for i in range(2 * reps + 2)]
    cold, warm, cold_wall, warm_wall, cached = [], [], [], [], []
    for i in range(reps + 1):  # pair 0 compiles the shapes and is not reported
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        (c,) = llm.generate([{"prompt_token_ids": prefix + questions[2 * i]}], ONE_TOKEN, use_tqdm=False)
        t1 = time.perf_counter()
        (w,) = llm.generate([{"prompt_token_ids": prefix + questions[2 * i + 1]}], ONE_TOKEN, use_tqdm=False)
        t2 = time.perf_counter()
        assert c.num_cached_tokens == 0 and w.num_cached_tokens == prefix_tokens // PS * PS, (c, w)
        if i:
            cold.append(c.metrics.ttft_s)
            warm.append(w.metrics.ttft_s)
            cold_wall.append(t1 - t0)
            warm_wall.append(t2 - t1)
            cached.append(w.num_cached_tokens)
        logger.info("ttft pair %d: cold %.3f s, warm %.3f s", i, c.metrics.ttft_s, w.metrics.ttft_s)
    return {"cold": cold, "warm": warm, "cold_wall": cold_wall, "warm_wall": warm_wall, "cached": cached[0],
            "prefix_tokens": prefix_tokens, "prompt_tokens": prefix_tokens + QUESTION_TOKENS, "reps": reps}


# --- 2. multi-turn chat --------------------------------------------------------------------------------------------


def chat_script(llm: LLM, text_ids: list[int], convs: int, turns: int, system_tokens: int = CHAT_SYSTEM_TOKENS
                ) -> tuple[str, list[list[str]]]:
    """The shared system message (`system_tokens` tokens of the text, decoded) and each conversation's user messages,
    one per turn."""
    tok = llm.tokenizer
    system = tok.decode(text_ids[3000:3000 + system_tokens], skip_special_tokens=True)
    messages = []
    for c in range(convs):
        conv = []
        for t in range(turns):
            start = 4000 + 30 * (turns * c + t)
            excerpt = tok.decode(text_ids[start: start + 24], skip_special_tokens=True).strip()
            conv.append(f"Question {t + 1}: explain this part in plain words: \"{excerpt}\"")
        messages.append(conv)
    return system, messages


@dataclasses.dataclass
class ChatPass:
    """One pass of the chat workload: wall seconds, token counts, per-request TTFT seconds, the pass's prefix-cache
    hit rate, cached tokens, and every conversation's replies (token ids per turn)."""

    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]
    hit_rate: float
    cached_tokens: int
    replies: list[list[list[int]]]


def run_chat(llm: LLM, system: str, messages: list[list[str]], max_tokens: int = CHAT_MAX_TOKENS) -> ChatPass:
    """All conversations, greedy replies of at most `max_tokens` tokens; each conversation sends its next turn as
    soon as its previous reply finished."""
    tok, engine = llm.tokenizer, llm.engine
    eos = tok.eos_ids
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.reset_prefix_cache()
    s0 = engine.stats()
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": m[0]}],
                                       add_generation_prompt=True) for m in messages]
    turn = [0] * len(messages)
    replies: list[list[list[int]]] = [[] for _ in messages]
    owner: dict[str, int] = {}
    prompt_tokens = output_tokens = cached = 0
    ttft = []
    t0 = time.perf_counter()
    for c, p in enumerate(prompts):
        owner[engine.add_request({"prompt_token_ids": p}, params)] = c
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            c = owner.pop(out.request_id)
            reply = [t for t in out.outputs[0].token_ids if t not in eos]
            replies[c].append(reply)
            prompt_tokens += len(out.prompt_token_ids)
            output_tokens += len(out.outputs[0].token_ids)
            cached += out.num_cached_tokens
            ttft.append(out.metrics.ttft_s)
            turn[c] += 1
            if turn[c] < len(messages[c]):
                nxt = tok.encode(f"<|im_end|>\n<|im_start|>user\n{messages[c][turn[c]]}<|im_end|>\n"
                                 "<|im_start|>assistant\n", allow_special=True)
                prompts[c] = prompts[c] + reply + nxt
                owner[engine.add_request({"prompt_token_ids": prompts[c]}, params)] = c
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    q = s1.get("prefix_cache_queried_tokens", 0) - s0.get("prefix_cache_queried_tokens", 0)
    h = s1.get("prefix_cache_hit_tokens", 0) - s0.get("prefix_cache_hit_tokens", 0)
    return ChatPass(wall, prompt_tokens, output_tokens, ttft, h / q if q else 0.0, cached, replies)


def bench_chat(on: LLM, off: LLM, text_ids: list[int], convs: int, turns: int, passes: int,
               max_tokens: int = CHAT_MAX_TOKENS, system_tokens: int = CHAT_SYSTEM_TOKENS) -> dict:
    """The chat workload (replies of at most `max_tokens` tokens, a system message of `system_tokens` tokens) once
    untimed per engine, then `passes` timed passes alternating on / off.

    Returns:
      {"runs": {"on" | "off": [ChatPass]}, "same_tokens", "convs", "turns", "passes", "max_tokens",
      "first_prompt_tokens"}.
    """
    system, messages = chat_script(on, text_ids, convs, turns, system_tokens)
    runs: dict[str, list[ChatPass]] = {"on": [], "off": []}
    for name, llm in (("on", on), ("off", off)):
        warm = run_chat(llm, system, messages, max_tokens)  # compiles the shapes this workload meets
        logger.info("chat %s untimed pass: %.1f s", name, warm.wall_s)
    for _ in range(passes):
        for name, llm in (("on", on), ("off", off)):
            r = run_chat(llm, system, messages, max_tokens)
            runs[name].append(r)
            logger.info("chat %s: %.1f s, %d prompt + %d output tokens, hit rate %.2f", name, r.wall_s,
                        r.prompt_tokens, r.output_tokens, r.hit_rate)
    same = all(a.replies == b.replies for a in runs["on"] for b in runs["off"])
    first_prompt = len(on.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": messages[0][0]}],
        add_generation_prompt=True))
    return {"runs": runs, "same_tokens": same, "convs": convs, "turns": turns, "passes": passes,
            "max_tokens": max_tokens, "first_prompt_tokens": first_prompt}


# --- 3. host tier break-even ---------------------------------------------------------------------------------------


def _evict_all_to_host(llm: LLM) -> None:
    """Evicts every cached device page (they go to the host tier) and settles the copies into host numpy arrays.

    The one place this module reaches into engine internals (`PagedKVCache.apply_ops`, `PrefixCache.take_ops`): the
    offloads must run now, outside the timing.
    """
    alloc, engine = llm.page_allocator, llm.engine
    held = alloc.allocate(alloc.num_free_pages)
    alloc.free(held)
    engine.runner.kv.apply_ops(engine.prefix_cache.take_ops())  # the OFFLOADs, now, outside the timing
    llm.runner.kv.settle_host_pages()


def bench_break_even(llm: LLM, text_ids: list[int], reps: int, pages: tuple[int, ...] = BREAK_EVEN_PAGES
                     ) -> list[dict]:
    """For each k in `pages`: TTFT of a k-page prefix + a question, recomputed / loaded from the host tier / on the
    device, and the raw `load_pages` vs prefill-step calls.

    Returns:
      One row per k: {"pages", "recompute", "host", "device", "load_call", "prefill_call" (median seconds), "reps"}.
    """
    engine, runner, alloc = llm.engine, llm.runner, llm.page_allocator
    rows = []
    greedy = SamplingRow(SamplingParams(temperature=0), seed=0)
    for k in pages:
        prefix = text_ids[5000: 5000 + k * PS] if k * PS <= len(text_ids) - 5000 else text_ids[: k * PS]
        qa = text_ids[100:100 + QUESTION_TOKENS]
        qb = text_ids[200:200 + QUESTION_TOKENS]
        times: dict[str, list[float]] = {"recompute": [], "host": [], "device": []}
        for rep in range(reps + 1):  # rep 0 compiles
            for mode in ("recompute", "host", "device"):
                llm.reset_prefix_cache()
                if mode != "recompute":
                    llm.generate([{"prompt_token_ids": prefix + qa}], ONE_TOKEN, use_tqdm=False)
                if mode == "host":
                    _evict_all_to_host(llm)
                hits0 = engine.prefix_cache.stats.host_hit_pages
                (out,) = llm.generate([{"prompt_token_ids": prefix + qb}], ONE_TOKEN, use_tqdm=False)
                expect = 0 if mode == "recompute" else k * PS
                assert out.num_cached_tokens == expect, (k, mode, out.num_cached_tokens)
                assert engine.prefix_cache.stats.host_hit_pages - hits0 == (k if mode == "host" else 0)
                if rep:
                    times[mode].append(out.metrics.ttft_s)
        # the raw calls: load k real host pages back vs a standalone prefill step of k * 16 tokens
        llm.reset_prefix_cache()
        page_ids = alloc.allocate(k)
        host_page_ids = [10**9 + i for i in range(k)]
        load, prefill = [], []
        try:
            for rep in range(reps + 1):
                runner.kv.offload_pages(page_ids, host_page_ids)
                runner.kv.settle_host_pages()
                jax.block_until_ready(runner.kv_cache)
                t0 = time.perf_counter()
                runner.kv.load_pages(host_page_ids, page_ids)
                jax.block_until_ready(runner.kv_cache)
                t1 = time.perf_counter()
                runner.execute([ScheduledChunk(prefix[: k * PS], 0, page_ids)], [greedy])
                t2 = time.perf_counter()
                if rep:
                    load.append(t1 - t0)
                    prefill.append(t2 - t1)
        finally:
            runner.kv.drop_host_pages(host_page_ids, broadcast=False)
            alloc.free(page_ids)
        row = {"pages": k, **{m: median(v) for m, v in times.items()}, "load_call": median(load),
               "prefill_call": median(prefill), "reps": reps}
        logger.info("break-even k=%d: %s", k, row)
        rows.append(row)
    llm.reset_prefix_cache()
    return rows

