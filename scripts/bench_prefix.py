"""Prefix-caching workload of `scripts/benchmark.py --workload prefix` (issue 7), SmolLM2-135M-Instruct in float32.

Two engines in one process, with the same shapes: prefix caching on (with a 128-page host tier) and off.

1. **TTFT, cold vs warm.** A 1,000-token shared prefix (the first 1,000 tokens of the GPL-3 text, as raw token
   ids) plus a 20-token question (other 20-token windows of that text). Cold: `reset_prefix_cache()`, then the
   request. Warm: right after a cold one, the same prefix with a different question (992 of its tokens are
   cached: 62 full pages). `--prefix-reps` cold/warm pairs, interleaved; TTFT is the request's own
   (`RequestOutput.metrics.ttft_s`: from `add_request` to its first token), medians reported. One untimed pair runs
   first, so the step shapes are compiled (the persistent compilation cache is off in benchmark runs).
2. **Multi-turn chat.** `--chat-convs` conversations x `--chat-turns` turns through the ChatML template (one shared
   ~250-token system message, a ~30-token user message per turn), greedy, `max_tokens` 32. Turn t+1's prompt is
   turn t's prompt + its reply's token ids + `<|im_end|>\\n<|im_start|>user\\n...<|im_start|>assistant\\n` (what the
   template renders, without re-tokenizing the reply). Each conversation sends its next turn as soon as its
   previous reply finished (the engine is stepped by hand), so turns of different conversations overlap. The whole
   workload runs once untimed per engine (compiles), then timed passes alternate on / off / on / off; reported:
   wall time, (prompt + output) tokens/s and output tokens/s over the wall time, mean TTFT, the prefix-cache hit
   rate of the pass (`stats()` deltas), and a check that both engines produced the same tokens.
3. **Host tier break-even.** For k in {1, 4, 16, 64} pages: a prompt of a k-page prefix plus a 20-token question,
   TTFT when the prefix is (a) not cached (recomputed), (b) in the host tier (evicted there by allocating every
   free page, offloads settled to numpy before the request; the step then loads the k pages back), (c) on the
   device. Also the raw calls: `runner.kv.load_pages` of k real host pages vs a standalone prefill step of k*16
   tokens (`runner.execute`). Host-tier loading pays off from the smallest k where (b) < (a); that k is what
   `DEFAULT_OFFLOAD_MIN_PAGES["cpu"]` in engine.py should be.

Expectations, written before measuring (2 shared cores, f32; earlier runs here: ~1,000-1,500 prefill tokens/s and
~30-90 ms per small step):

- Cold TTFT ~0.8-1.2 s (1,020 tokens in two 512-token chunks); warm ~50-100 ms (one step of 28 new tokens
  attending to 1,020, about a decode step's cost plus a wider page table). Ratio ~5-10%: the <= 15% goal is met.
- Multi-turn: hit rate ~75-85% of prompt tokens; prefill work drops ~5x, so (prompt + output) tokens/s rises
  ~1.5-2x, output tokens/s ~1.3-1.6x (decode steps are the same on both), mean TTFT drops ~3-5x.
- Loading k pages: ~1 ms fixed + well under 1 ms per 720 KiB page (host memcpy + a scatter); recomputing a page
  costs ~10-15 ms of prefill. Loading wins at every k, so min pages 1 (the current default) is supported.
"""

from __future__ import annotations


import dataclasses
import logging
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
import md_sections  # noqa: E402  (scripts/ is on sys.path when these run)

logger = logging.getLogger("benchmark.prefix")

SECTION_BEGIN = "<!-- prefix-caching: begin -->"
SECTION_END = "<!-- prefix-caching: end -->"

TEXT = Path("/usr/share/common-licenses/GPL-3")  # a real English text on every Debian machine (JAX_ON_CPU.md)
PS = 16
PREFIX_TOKENS = 1000
QUESTION_TOKENS = 20
HOST_PAGES = 128
BREAK_EVEN_PAGES = (1, 4, 16, 64)
CHAT_MAX_TOKENS = 32
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def make_engines(max_num_seqs: int = 8, kv_pages: int = 512) -> tuple[LLM, LLM]:
    """(caching on with a host tier, caching off): float32, `kv_pages` pages each, no warm-up (untimed passes
    compile what each part needs)."""
    import jax.numpy as jnp

    from jaxinfer.loading import default_model_path
    from jaxinfer.loading.gguf import load_gguf_weights, read_gguf
    from models.llama import KVCache

    cfg, _ = load_gguf_weights(read_gguf(default_model_path()), np.float32)
    page_bytes = KVCache.bytes_per_page(cfg, PS, jnp.float32)
    engines = []
    for caching in (True, False):
        extra = {"kv_offload_bytes": HOST_PAGES * page_bytes} if caching else {}
        engines.append(LLM(dtype="float32", warmup=False, max_num_seqs=max_num_seqs, max_model_len=2048,
                           kv_cache_memory_bytes=kv_pages * page_bytes, enable_prefix_caching=caching, **extra))
    on, off = engines
    assert on.engine.prefix_cache.host_capacity_pages == HOST_PAGES
    assert on.page_allocator.num_usable_pages == off.page_allocator.num_usable_pages == kv_pages
    return on, off


# --- 1. TTFT cold vs warm -----------------------------------------------------------------------------------------


def bench_ttft(llm: LLM, text_ids: list[int], reps: int) -> dict:
    prefix = text_ids[:PREFIX_TOKENS]
    questions = [text_ids[2000 + QUESTION_TOKENS * i: 2000 + QUESTION_TOKENS * (i + 1)] for i in range(2 * reps + 2)]
    cold, warm, cold_wall, warm_wall, cached = [], [], [], [], []
    for i in range(reps + 1):  # pair 0 compiles the shapes and is not reported
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        (c,) = llm.generate([{"prompt_token_ids": prefix + questions[2 * i]}], ONE_TOKEN)
        t1 = time.perf_counter()
        (w,) = llm.generate([{"prompt_token_ids": prefix + questions[2 * i + 1]}], ONE_TOKEN)
        t2 = time.perf_counter()
        assert c.num_cached_tokens == 0 and w.num_cached_tokens == PREFIX_TOKENS // PS * PS, (c, w)
        if i:
            cold.append(c.metrics.ttft_s)
            warm.append(w.metrics.ttft_s)
            cold_wall.append(t1 - t0)
            warm_wall.append(t2 - t1)
            cached.append(w.num_cached_tokens)
        logger.info("ttft pair %d: cold %.3f s, warm %.3f s", i, c.metrics.ttft_s, w.metrics.ttft_s)
    return {"cold": cold, "warm": warm, "cold_wall": cold_wall, "warm_wall": warm_wall, "cached": cached[0],
            "prompt_tokens": PREFIX_TOKENS + QUESTION_TOKENS, "reps": reps}


# --- 2. multi-turn chat --------------------------------------------------------------------------------------------


def chat_script(llm: LLM, text_ids: list[int], convs: int, turns: int) -> tuple[str, list[list[str]]]:
    """The shared system message (~250 tokens of the text) and each conversation's user messages, one per turn."""
    tok = llm.tokenizer
    system = tok.decode(text_ids[3000:3250], skip_special_tokens=True)
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
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]
    hit_rate: float
    cached_tokens: int
    replies: list[list[list[int]]]


def run_chat(llm: LLM, system: str, messages: list[list[str]]) -> ChatPass:
    """All conversations; each sends its next turn as soon as its previous reply finished."""
    tok, engine = llm.tokenizer, llm.engine
    eos = tok.eos_ids
    params = SamplingParams(temperature=0, max_tokens=CHAT_MAX_TOKENS)
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


def bench_chat(on: LLM, off: LLM, text_ids: list[int], convs: int, turns: int, passes: int) -> dict:
    system, messages = chat_script(on, text_ids, convs, turns)
    runs: dict[str, list[ChatPass]] = {"on": [], "off": []}
    for name, llm in (("on", on), ("off", off)):
        warm = run_chat(llm, system, messages)  # compiles the shapes this workload meets
        logger.info("chat %s untimed pass: %.1f s", name, warm.wall_s)
    for _ in range(passes):
        for name, llm in (("on", on), ("off", off)):
            r = run_chat(llm, system, messages)
            runs[name].append(r)
            logger.info("chat %s: %.1f s, %d prompt + %d output tokens, hit rate %.2f", name, r.wall_s,
                        r.prompt_tokens, r.output_tokens, r.hit_rate)
    same = all(a.replies == b.replies for a in runs["on"] for b in runs["off"])
    first_prompt = len(on.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": messages[0][0]}],
        add_generation_prompt=True))
    return {"runs": runs, "same_tokens": same, "convs": convs, "turns": turns, "passes": passes,
            "first_prompt_tokens": first_prompt}


# --- 3. host tier break-even ---------------------------------------------------------------------------------------


def _evict_all_to_host(llm: LLM) -> None:
    """Evicts every cached device page (they go to the host tier) and settles the copies into host numpy arrays."""
    alloc, engine = llm.page_allocator, llm.engine
    held = alloc.allocate(alloc.num_free_pages)
    alloc.free(held)
    engine._apply_kv_ops(engine.prefix_cache.take_ops())  # noqa: SLF001 - the OFFLOADs, now, outside the timing
    llm.runner.kv.settle_host_pages()


def bench_break_even(llm: LLM, text_ids: list[int], reps: int) -> list[dict]:
    engine, runner, alloc = llm.engine, llm.runner, llm.page_allocator
    rows = []
    greedy = SamplingRow(SamplingParams(temperature=0), seed=0)
    for k in BREAK_EVEN_PAGES:
        prefix = text_ids[5000: 5000 + k * PS] if k * PS <= len(text_ids) - 5000 else text_ids[: k * PS]
        qa = text_ids[100:100 + QUESTION_TOKENS]
        qb = text_ids[200:200 + QUESTION_TOKENS]
        times: dict[str, list[float]] = {"recompute": [], "host": [], "device": []}
        for rep in range(reps + 1):  # rep 0 compiles
            for mode in ("recompute", "host", "device"):
                llm.reset_prefix_cache()
                if mode != "recompute":
                    llm.generate([{"prompt_token_ids": prefix + qa}], ONE_TOKEN)
                if mode == "host":
                    _evict_all_to_host(llm)
                hits0 = engine.prefix_cache.stats.host_hit_pages
                (out,) = llm.generate([{"prompt_token_ids": prefix + qb}], ONE_TOKEN)
                expect = 0 if mode == "recompute" else k * PS
                assert out.num_cached_tokens == expect, (k, mode, out.num_cached_tokens)
                assert engine.prefix_cache.stats.host_hit_pages - hits0 == (k if mode == "host" else 0)
                if rep:
                    times[mode].append(out.metrics.ttft_s)
        # the raw calls: load k real host pages back vs a standalone prefill step of k * 16 tokens
        llm.reset_prefix_cache()
        pages = alloc.allocate(k)
        host_page_ids = [10**9 + i for i in range(k)]
        load, prefill = [], []
        try:
            for rep in range(reps + 1):
                runner.kv.offload_pages(pages, host_page_ids)
                runner.kv.settle_host_pages()
                jax.block_until_ready(runner.kv_cache)
                t0 = time.perf_counter()
                runner.kv.load_pages(host_page_ids, pages)
                jax.block_until_ready(runner.kv_cache)
                t1 = time.perf_counter()
                runner.execute([ScheduledChunk(prefix[: k * PS], 0, pages)], [greedy])
                t2 = time.perf_counter()
                if rep:
                    load.append(t1 - t0)
                    prefill.append(t2 - t1)
        finally:
            runner.kv.drop_host_pages(host_page_ids, broadcast=False)
            alloc.free(pages)
        row = {"pages": k, **{m: _median(v) for m, v in times.items()}, "load_call": _median(load),
               "prefill_call": _median(prefill), "reps": reps}
        logger.info("break-even k=%d: %s", k, row)
        rows.append(row)
    llm.reset_prefix_cache()
    return rows


# --- the run and its section --------------------------------------------------------------------------------------


def run(reps: int, convs: int, turns: int, chat_passes: int) -> dict:
    if not TEXT.is_file():
        raise SystemExit(f"{TEXT} is missing: the prefix workload uses it as its English text")
    t0 = time.perf_counter()
    on, off = make_engines()
    logger.info("engines ready in %.1f s", time.perf_counter() - t0)
    text_ids = on.tokenizer.encode(TEXT.read_text(), allow_special=False)
    r = {"kv_pages": on.page_allocator.num_usable_pages, "host_pages": HOST_PAGES,
         "min_pages_default": on.engine.prefix_cache.host_min_pages}
    r["ttft"] = bench_ttft(on, text_ids, reps)
    r["chat"] = bench_chat(on, off, text_ids, convs, turns, chat_passes)
    r["break_even"] = bench_break_even(on, text_ids, reps)
    for llm in (on, off):
        assert llm.page_allocator.num_free_pages == llm.page_allocator.num_usable_pages
    return r


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.01 else f"{s * 1e3:.1f}"


def render(r: dict, command: str, date: str, machine: str, elapsed_s: float, load: tuple[float, float]) -> str:
    """The markdown section of `--workload prefix`, between its begin/end markers."""
    out = [SECTION_BEGIN, "## Prefix caching (SmolLM2-135M-Instruct, float32)\n"]
    out.append("Two engines in one process (prefix caching on, with a 128-page host tier; and off), same shapes, "
               f"{r['kv_pages']} KV pages of {PS} tokens each, default `max_num_batched_tokens` 512. Untimed runs of "
               "every measured request shape come first (the persistent compilation cache is off), so no compile is "
               "timed. TTFT is the request's own: from `add_request` to its first token. See "
               "`scripts/bench_prefix.py` for the method and the expectations written before the run. Command:\n")
    out.append(f"```\n{command}\n```\n")
    out.append(f"- date: {date}; jax {jax.__version__}, backend {jax.default_backend()}; {machine}; run time "
               f"{elapsed_s:.0f} s; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
               "(2 cores: above 2, other jobs competed); a shared, noisy VM\n")

    t = r["ttft"]
    cold, warm = _median(t["cold"]), _median(t["warm"])
    ratio = warm / cold
    out.append(f"### TTFT: {PREFIX_TOKENS}-token shared prefix + {QUESTION_TOKENS}-token question\n")
    out.append(md_sections.table(["", "median TTFT ms", "min ms", "max ms", "median wall of generate ms", "cached tokens"], [
        ["cold (cache reset)", _ms(cold), _ms(min(t["cold"])), _ms(max(t["cold"])), _ms(_median(t["cold_wall"])),
         "0"],
        ["warm (prefix cached, another question)", _ms(warm), _ms(min(t["warm"])), _ms(max(t["warm"])),
         _ms(_median(t["warm_wall"])), str(t["cached"])],
    ]) + "\n")
    out.append(f"- warm / cold = **{ratio:.1%}** (medians of {t['reps']} interleaved pairs, after one untimed pair); "
               f"the issue's goal, warm <= 15% of cold, is **{'met' if ratio <= 0.15 else 'not met'}**. "
               f"Warm computes {t['prompt_tokens'] - t['cached']} of {t['prompt_tokens']} tokens; cold prefills at "
               f"{t['prompt_tokens'] / cold:.0f} tokens/s.\n")
    out.append(f"- against the expectations written before the first run (docstring): cold 0.8-1.2 s, measured "
               f"{cold:.2f} s ({md_sections.vs_range(cold, 0.8, 1.2)}); warm 50-100 ms, measured {_ms(warm)} ms ({md_sections.vs_range(warm, 0.05, 0.1)}); "
               f"ratio 5-10%, measured {ratio:.1%} ({md_sections.vs_range(ratio, 0.05, 0.10)})\n")

    c = r["chat"]
    out.append(f"### Multi-turn chat: {c['convs']} conversations x {c['turns']} turns, greedy, max_tokens "
               f"{CHAT_MAX_TOKENS}\n")
    out.append(f"One shared system message, ChatML; first prompt {c['first_prompt_tokens']} tokens, each later turn "
               "= previous prompt + reply + a new user message; a conversation's next turn is sent when its reply "
               f"finishes. {c['passes']} timed passes per engine, alternating, after an untimed one each.\n")
    rows = []
    agg = {}
    for name in ("on", "off"):
        runs = c["runs"][name]
        wall = _median([x.wall_s for x in runs])
        pt, ot = runs[0].prompt_tokens, runs[0].output_tokens
        ttft = _median([statistics.fmean(x.ttft_s) for x in runs])
        p50 = _median([_median(x.ttft_s) for x in runs])
        agg[name] = (wall, ttft)
        rows.append([f"caching {name}", f"{wall:.1f}", " / ".join(f"{x.wall_s:.1f}" for x in runs), str(pt), str(ot),
                     f"{(pt + ot) / wall:.0f}", f"{ot / wall:.1f}", _ms(ttft), _ms(p50),
                     f"{runs[0].hit_rate:.1%}" if name == "on" else "-", str(runs[0].cached_tokens)])
    out.append(md_sections.table(["", "wall s (median)", "each pass s", "prompt tokens", "output tokens",
                       "(prompt+output) tok/s", "output tok/s", "mean TTFT ms", "median TTFT ms", "hit rate (stats)",
                       "cached tokens"], rows) + "\n")
    (w_on, t_on), (w_off, t_off) = agg["on"], agg["off"]
    out.append(f"- caching on: throughput **{w_off / w_on:.2f}x** (the same tokens in less wall time, so prompt+output "
               f"and output-only rates move together), mean TTFT **{t_off / t_on:.1f}x** lower; replies "
               f"token-identical on and off: {'yes' if c['same_tokens'] else 'NO'}\n")
    hit = c["runs"]["on"][0].hit_rate
    out.append(f"- against the expectations written before the first run (docstring): hit rate 75-85%, measured "
               f"{hit:.1%} ({md_sections.vs_range(hit, 0.75, 0.85)}); throughput 1.5-2x, measured {w_off / w_on:.2f}x "
               f"({md_sections.vs_range(w_off / w_on, 1.5, 2.0)}); mean TTFT 3-5x lower, measured {t_off / t_on:.1f}x "
               f"({md_sections.vs_range(t_off / t_on, 3, 5)})\n")

    out.append("### Host tier: load k pages back vs recompute them\n")
    out.append(f"A k-page prefix + a {QUESTION_TOKENS}-token question: TTFT with the prefix recomputed (cache reset), "
               "loaded from the host tier (the step runs the LOAD, then the question), or on the device. Then the raw "
               "calls: `runner.kv.load_pages` of k real host pages (host numpy -> device scatter) vs a standalone "
               f"prefill step of k x {PS} tokens (`runner.execute`). Medians of {r['break_even'][0]['reps']}.\n")
    rows = []
    for x in r["break_even"]:
        rows.append([str(x["pages"]), str(x["pages"] * PS), _ms(x["recompute"]), _ms(x["host"]), _ms(x["device"]),
                     _ms(x["host"] - x["device"]), _ms(x["recompute"] - x["device"]), _ms(x["load_call"]),
                     _ms(x["prefill_call"])])
    out.append(md_sections.table(["k pages", "tokens", "TTFT recompute ms", "TTFT host ms", "TTFT device ms",
                       "load cost (host - device) ms", "recompute cost (recompute - device) ms",
                       "load_pages call ms", f"prefill step of k x {PS} tokens ms"], rows) + "\n")
    wins = [x["pages"] for x in r["break_even"] if x["host"] < x["recompute"]]
    smallest = min(wins) if wins else None
    if smallest is not None and all(x["host"] < x["recompute"] for x in r["break_even"] if x["pages"] >= smallest):
        verdict = (f"loading beats recomputing from k = {smallest} on (and at every larger k measured)")
    else:
        verdict = "loading does not beat recomputing consistently at these k"
    supported = smallest == r["min_pages_default"] == 1
    out.append(f"- {verdict}. `DEFAULT_OFFLOAD_MIN_PAGES['cpu']` is {r['min_pages_default']}: "
               + ("the data supports it." if supported else
                  f"the data suggests {smallest if smallest is not None else 'a larger value (or no host tier)'}.")
               + "\n")
    out.append(SECTION_END)
    return "\n".join(out)
