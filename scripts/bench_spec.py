"""Speculative-decoding workload of `scripts/benchmark.py --workload spec`, SmolLM2-135M-Instruct in float32, greedy.

Engines in one process, identical except for `speculative_config` (none; ngram k = 2, 4, 8; self_draft with 28 of
the 30 layers at k = 2), each with `warmup=False`, `max_model_len` 1024 and the same KV budget. Every measured
shape runs once untimed first (with a fresh, empty persistent compilation cache, so the engines compile the
shapes they share once), and greedy decoding repeats the same tokens, so the timed runs meet only compiled
shapes. The prefix cache is reset before every run, so every run of a prompt does the same work.

1. **Batch-1 decode.** Two chat-template prompts (`Tokenizer.apply_chat_template`, as `jaxinfer generate --chat`
   renders them), one request at a time:
   - copy-heavy: a 159-word paragraph and the instruction to repeat it with one word changed (`max_tokens` 256);
   - free-form chat: a question (`max_tokens` 64).
   Decode tokens/s = (output tokens - 1) / (finish - first token), from the request's own metrics. One untimed round,
   then `reps` rounds; each round runs every (task, config) once, configs interleaved, so slow spells of the shared
   VM hit all configs alike. Reported: median and min-max, speed-up of the medians over "off", acceptance rate and
   mean accepted length (tokens per verifying sequence-step, accepted + 1) from `Engine.stats()` deltas over the
   timed runs, and whether every run's output tokens equal those of "off" (they must: greedy speculation is
   lossless).
2. **Throughput at 32 concurrent requests.** 16 copy-heavy prompts (distinct 60-100-word paragraphs of the GPL-3
   text, each with a one-word change) and 16 chat questions, alternating, all added at t=0, `max_tokens` 64,
   greedy; the engine's default `max_num_seqs` 32 and `max_num_batched_tokens` 512. Speculation on = the default config
   (`{"method": "ngram"}`: k = 4, automatic policy with the backend's `max_step_tokens`) vs off. One untimed run
   each, then `tput_reps` timed runs each, alternating on/off (ABBA order). End-to-end output tokens/s = output
   tokens / (last finish - first add). The on runs' spec_* stats show how many steps the policy let speculate.
3. **Cost of a verify-shaped step vs token rows** (calibrates `policy.DEFAULT_MAX_STEP_TOKENS`). On the "off"
   engine's `ModelRunner`, with sequences at context 240 (+ the step's tokens; every shape lands in the 32-page =
   512-token page-table bucket), distinct pages per sequence: `execute` decode steps of B = 1 ... 32 sequences
   (q_len 1; rows = the padded token count, at least 2) and `execute_verify` steps of B sequences x (k + 1) tokens:
   batch 1 with k + 1 = 2 ... 32 rows, and B = 4 ... 32 with k = 1 and 3 (the k the policy gives those batches at
   max_step_tokens 8 ... 128), 8 ... 128 rows. Every shape is called once untimed (compiles), then `step_reps`
   rounds time one call of every shape each (interleaved); medians reported. Each verify step is compared with the
   2-row step (is the step still flat?) and with the decode step of the same batch (what the drafts add at that
   batch); the policy's `max_step_tokens` should be the largest row count whose verify steps cost at most
   `FREE_RATIO` (1.5) x the decode step of their batch.

Expected, written before the first measurement (2 shared cores; earlier runs here: batch-1 f32 decode ~45-50 ms a
step, ~20 tok/s; a decode step of batch 32 ~150-220 ms):

- Copy-heavy, ngram: the model copies the paragraph nearly verbatim, so most drafts match (acceptance ~0.7-0.9);
  a verify step of <= 9 rows costs ~1.1-1.3x a decode step. Speed-up ~ tokens per step / step cost: k=2 ~1.8-2.4x,
  k=4 ~2.2-3.2x, k=8 ~2.3-3.5x (longer drafts fail more often and the step grows). The >= 1.8x goal is met at k=4.
- Chat, ngram: few repeats, acceptance ~0.1-0.3, the policy stops drafting for low-acceptance sequences except
  probes: ~0.85-1.05x.
- self_draft, 28 of 30 layers, k=2: each step runs 2 draft forwards of ~0.93 of the model plus the verify, ~3 decode
  steps' work for at most 3 tokens, acceptance maybe ~0.6-0.8: ~0.5-0.8x on both tasks. Reported as measured.
- 32 concurrent requests: with `max_step_tokens` 32 the policy gives k = 32 // B - 1, so speculation is off once
  more than 16 sequences decode and only the ramp-up steps speculate: on / off ~0.95-1.05x, i.e. no change beyond
  run-to-run noise.
- Step cost: about flat (within ~20% of the 2-row step) up to 16 rows, ~1.3-1.6x at 32, then roughly proportional
  to the rows (64 rows ~2-3x, 128 rows ~4-6x): the knee near 32 rows, supporting DEFAULT_MAX_STEP_TOKENS["cpu"] = 32.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.spec_decode import policy as spec_policy
import md_sections  # noqa: E402  (scripts/ is on sys.path when these run)

logger = logging.getLogger("benchmark.spec")

SECTION_BEGIN = "<!-- spec-decode: begin -->"
SECTION_END = "<!-- spec-decode: end -->"

TEXT = Path("/usr/share/common-licenses/GPL-3")  # distinct English paragraphs for the 32-request batch
MAX_MODEL_LEN = 1024
KV_BYTES = 640 * 2**20  # ~910 f32 pages of 16 tokens: 32 sequences x 23 pages fit
COPY_MAX_TOKENS = 256
CHAT_MAX_TOKENS = 64
TPUT_REQUESTS = 32
TPUT_MAX_TOKENS = 64
STEP_CONTEXT = 240
STEP_ROWS = (2, 4, 8, 16, 32, 64, 128)
STEP_BATCHES = (1, 2, 4, 8, 16, 32)
STEP_BATCH1_ROWS = (2, 4, 8, 16, 32)  # batch-1 verify blocks, k = rows - 1
STEP_VERIFY_BATCHES = (4, 8, 16, 32)  # with k = 1 and 3: the k the policy gives these batches at 16 ... 128 rows
MAX_K = 16  # SpeculativeConfig's upper bound on num_speculative_tokens
FREE_RATIO = 1.5  # a verify step costing at most this many decode steps of its batch counts as "drafts ~free"

CONFIGS: list[tuple[str, dict | None]] = [
    ("off", None),
    ("ngram k=2", {"method": "ngram", "num_speculative_tokens": 2}),
    ("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4}),
    ("ngram k=8", {"method": "ngram", "num_speculative_tokens": 8}),
    ("self_draft 28 layers k=2", {"method": "self_draft", "num_speculative_tokens": 2, "num_draft_layers": 28}),
]
TPUT_ON = "ngram k=4"  # = the default SpeculativeConfig of method "ngram"

PARAGRAPH = (
    "The old lighthouse stood at the edge of the northern cliffs for more than two hundred years. Every night its "
    "keeper climbed the narrow spiral staircase, carrying a small brass lantern and a notebook in which he recorded "
    "the weather, the passing ships, and the strange lights that sometimes appeared far out over the water. "
    "Fishermen in the village below trusted the beam more than any map, and children grew up believing that the "
    "keeper never slept. When the storms of winter arrived, waves crashed against the rocks with such force that "
    "the whole tower trembled, yet the light never failed. In the spring, seabirds nested in the cracks of the stone "
    "walls, and the keeper would sit on the steps in the morning sun, mending nets and telling stories to anyone who "
    "cared to listen. Years later, when an automatic lamp replaced him, the villagers said the sea itself seemed "
    "quieter, as if it missed the old man.")
COPY_INSTRUCTION = "Repeat the following paragraph exactly, word for word, but change the word \"{old}\" to \"{new}\":"
CHAT_QUESTION = "What are the main differences between a lake and a sea? Explain in a few sentences."
CHAT_QUESTIONS = [
    CHAT_QUESTION,
    "Why is the sky blue during the day and red at sunset?",
    "Give me three tips for learning a new language as an adult.",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain what photosynthesis is to a ten-year-old.",
    "Why do cats purr?",
    "What are some healthy breakfast ideas that take less than ten minutes?",
    "How do airplanes stay in the air?",
    "What is the best way to prepare for a job interview?",
    "Why do leaves change color in autumn?",
    "How can I improve my sleep?",
    "What causes earthquakes?",
    "Describe the water cycle in a few sentences.",
    "What are the benefits of reading books regularly?",
]
REPLACEMENTS = ["agreement", "program", "document", "product", "system", "person", "method", "object"]


LOADS: list[float] = []  # 1-minute load average after every timed run (other jobs on the shared VM)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _sample_load() -> None:
    LOADS.append(os.getloadavg()[0])


def _spec_counters(engine: Engine) -> dict[str, int]:
    s = engine.stats()
    return {k: v for k, v in s.items() if k.startswith("spec_") and isinstance(v, int)}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b}


def _derived(c: dict[str, int]) -> dict[str, float]:
    """Acceptance rate, mean accepted length and tokens per decode step of a delta of spec_* counters."""
    return {
        "acceptance": c["spec_accepted_tokens"] / c["spec_draft_tokens"] if c.get("spec_draft_tokens") else 0.0,
        "mean_len": c["spec_emitted_tokens"] / c["spec_verify_rows"] if c.get("spec_verify_rows") else 0.0,
        "per_step": c["spec_decode_tokens"] / c["spec_decode_rows"] if c.get("spec_decode_rows") else 0.0,
    }


def make_engine(spec: dict | None) -> Engine:
    return Engine(EngineConfig(dtype="float32", warmup=False, max_model_len=MAX_MODEL_LEN,
                               kv_cache_memory_bytes=KV_BYTES, speculative_config=spec))


# --- 1. batch-1 decode ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Single:
    tokens: list[int]
    decode_tok_s: float
    finish_reason: str


def run_single(engine: Engine, prompt: list[int], max_tokens: int) -> Single:
    engine.reset_prefix_cache()
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    comp, m = out.outputs[0], out.metrics
    n = len(comp.token_ids)
    return Single(list(comp.token_ids), (n - 1) / (m.finish_time - m.first_token_time), comp.finish_reason)


def bench_single(engines: dict[str, Engine], prompts: dict[str, tuple[list[int], int]], reps: int) -> dict:
    names = list(engines)
    res = {t: {n: {"tok_s": [], "tokens": None, "same": True, "spec": {}, "finish": None} for n in names}
           for t in prompts}
    for rep in range(reps + 1):  # round 0 compiles every shape and is not reported
        for task, (prompt, max_tokens) in prompts.items():
            for name in names:
                eng = engines[name]
                before = _spec_counters(eng)
                r = run_single(eng, prompt, max_tokens)
                cell = res[task][name]
                if cell["tokens"] is None:
                    cell["tokens"], cell["finish"] = r.tokens, r.finish_reason
                cell["same"] &= r.tokens == cell["tokens"]
                if rep:
                    _sample_load()
                    cell["tok_s"].append(r.decode_tok_s)
                    for k, v in _delta(before, _spec_counters(eng)).items():
                        cell["spec"][k] = cell["spec"].get(k, 0) + v
                logger.info("single %s %s round %d: %d tokens, %.1f decode tok/s", task, name, rep, len(r.tokens),
                            r.decode_tok_s)
    for task in prompts:
        ref = res[task]["off"]["tokens"]
        for name in names:
            cell = res[task][name]
            cell["same_as_off"] = cell["same"] and cell["tokens"] == ref
            print(f"[spec] {task} {name}: {len(cell['tokens'])} tokens, identical to off in every run: "
                  f"{cell['same_as_off']}", flush=True)
    return res


# --- 2. throughput at 32 concurrent requests ------------------------------------------------------------------------


def tput_prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", TEXT.read_text())]
    paras = [p for p in paras if 60 <= len(p.split()) <= 100][: TPUT_REQUESTS // 2]
    if len(paras) < TPUT_REQUESTS // 2:
        raise SystemExit(f"{TEXT} has too few paragraphs of 60-100 words")
    out = []
    for i in range(TPUT_REQUESTS // 2):
        words = [w for w in re.findall(r"[A-Za-z]+", paras[i]) if len(w) >= 5]
        old = max(set(words), key=lambda w: (words.count(w), w))
        instr = COPY_INSTRUCTION.format(old=old, new=REPLACEMENTS[i % len(REPLACEMENTS)])
        out.append(tok.apply_chat_template([{"role": "user", "content": f"{instr}\n\n{paras[i]}"}]))
        out.append(tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i]}]))
    return out


@dataclasses.dataclass
class Batch:
    wall_s: float
    output_tokens: int
    tokens: list[list[int]]
    spec: dict[str, int]


def run_batch(engine: Engine, prompts: list[list[int]]) -> Batch:
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=TPUT_MAX_TOKENS)
    before = _spec_counters(engine)
    t0 = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    tokens = [done[i] for i in ids]
    return Batch(wall, sum(map(len, tokens)), tokens, _delta(before, _spec_counters(engine)))


def bench_tput(on: Engine, off: Engine, reps: int) -> dict:
    prompts = tput_prompts(off)
    runs: dict[str, list[Batch]] = {"on": [], "off": []}
    ref = None
    same = True
    for rep in range(reps + 1):  # rep 0: untimed (compiles)
        order = (("on", on), ("off", off)) if rep % 2 == 0 else (("off", off), ("on", on))
        for name, eng in order:
            b = run_batch(eng, prompts)
            ref = ref or b.tokens
            same &= b.tokens == ref
            if rep:
                _sample_load()
                runs[name].append(b)
            logger.info("batch %s rep %d: %.1f s, %d output tokens, %.1f tok/s", name, rep, b.wall_s,
                        b.output_tokens, b.output_tokens / b.wall_s)
    if not same:
        diff = [i for i, (a, b) in enumerate(zip(runs["on"][0].tokens, runs["off"][0].tokens)) if a != b]
        logger.error("32-request batch: outputs differ on/off in requests %s", diff)
    print(f"[spec] 32-request batch: identical tokens on/off in every run: {same}", flush=True)
    return {"runs": runs, "same": same, "prompt_tokens": [len(p) for p in prompts], "reps": reps}


# --- 3. verify-shaped step cost vs token rows -----------------------------------------------------------------------


def step_shapes() -> list[tuple[str, int, int]]:
    """(kind, batch, k) of every measured step: decode at each batch, batch-1 verify blocks, and verify of larger
    batches at k = 1 and 3."""
    shapes = [("decode", b, 0) for b in STEP_BATCHES]
    shapes += [("verify", 1, rows - 1) for rows in STEP_BATCH1_ROWS]
    shapes += [("verify", b, k) for b in STEP_VERIFY_BATCHES for k in (1, 3)]
    return shapes


def bench_steps(engine: Engine, reps: int) -> list[dict]:
    runner, alloc = engine.runner, engine.page_allocator
    ps = engine.page_size
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0)
    shapes = step_shapes()
    max_b = max(b for _, b, _ in shapes)
    pages_per_seq = -(-(STEP_CONTEXT + max(STEP_ROWS)) // ps)
    pages = alloc.allocate(max_b * pages_per_seq)
    calls = []
    try:
        seq_pages = [pages[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(max_b)]
        for kind, batch, k in shapes:
            q = 1 if kind == "decode" else k + 1
            chunks = [ScheduledChunk(rng.integers(100, 40000, q).tolist(), STEP_CONTEXT, seq_pages[i])
                      for i in range(batch)]
            rows = [SamplingRow(greedy, seed=i) for i in range(batch)]
            if kind == "decode":
                fn = functools.partial(runner.execute, chunks, rows)
                token_rows = max(2, 1 << (batch - 1).bit_length())
            else:
                fn = functools.partial(runner.execute_verify, chunks, rows, [c.token_ids[1:] for c in chunks], k)
                token_rows = batch * q
            t0 = time.perf_counter()
            fn()  # compiles
            calls.append(({"kind": kind, "batch": batch, "k": k, "rows": token_rows,
                           "first_s": time.perf_counter() - t0}, fn, []))
        for _ in range(reps):  # shapes interleaved, in a new order every round: slow spells and the first call
            for i in rng.permutation(len(calls)):  # after a big step hit every shape alike
                _, fn, times = calls[i]
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
    finally:
        alloc.free(pages)
    out = []
    for row, _, times in calls:
        row.update(ms=1e3 * _median(times), min_ms=1e3 * min(times), max_ms=1e3 * max(times))
        logger.info("step %s", row)
        out.append(row)
    decode = {s["batch"]: s["ms"] for s in out if s["kind"] == "decode"}
    for s in out:
        s["vs_decode"] = s["ms"] / decode[s["batch"]]
    return out


def break_even_acceptance(cost_ratio: float, k: int) -> float | None:
    """The per-draft acceptance a at which a verify step of k drafts, costing `cost_ratio` decode steps, pays for
    itself: expected tokens per step (1 - a^(k+1)) / (1 - a) (drafts accepted independently with probability a,
    up to the first rejection, plus the target's own token) equal to cost_ratio. None: not even a = 1 pays."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < cost_ratio:
            lo = mid
        else:
            hi = mid
    return hi


# --- the run and its section ----------------------------------------------------------------------------------------


def run(reps: int, tput_reps: int, step_reps: int) -> dict:
    if not TEXT.is_file():
        raise SystemExit(f"{TEXT} is missing: the spec workload takes its batch paragraphs from it")
    if not os.environ.get("JAXINFER_COMPILATION_CACHE"):
        # A fresh, empty persistent cache: the engines share the shapes they have in common (compiled once, not
        # once per engine), and nothing comes from earlier runs. Nothing timed compiles either way.
        cache_dir = tempfile.mkdtemp(prefix="jaxinfer-spec-xla-")
        os.environ["JAXINFER_COMPILATION_CACHE"] = cache_dir
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    t0 = time.perf_counter()
    engines = {name: make_engine(spec) for name, spec in CONFIGS}
    logger.info("%d engines ready in %.1f s", len(engines), time.perf_counter() - t0)
    off = engines["off"]
    tok = off.tokenizer
    copy = tok.apply_chat_template([{"role": "user", "content": COPY_INSTRUCTION.format(old="lighthouse", new="tower")
                                     + "\n\n" + PARAGRAPH}])
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}])
    r = {"kv_pages": off.page_allocator.num_usable_pages, "backend": jax.default_backend(),
         "max_step_tokens": engines[TPUT_ON].spec_policy.max_step_tokens,
         "default_max_step_tokens": dict(spec_policy.DEFAULT_MAX_STEP_TOKENS),
         "prompt_lens": {"copy-heavy": len(copy), "chat": len(chat)}}
    t = time.perf_counter()
    r["single"] = bench_single(engines, {"copy-heavy": (copy, COPY_MAX_TOKENS), "chat": (chat, CHAT_MAX_TOKENS)},
                               reps)
    r["single_s"] = time.perf_counter() - t
    r["single_text"] = {task: tok.decode(r["single"][task]["off"]["tokens"], skip_special_tokens=True)
                        for task in r["single"]}
    t = time.perf_counter()
    r["tput"] = bench_tput(engines[TPUT_ON], off, tput_reps)
    r["tput_s"] = time.perf_counter() - t
    t = time.perf_counter()
    r["steps"] = bench_steps(off, step_reps)
    r["steps_s"] = time.perf_counter() - t
    r["reps"], r["step_reps"] = reps, step_reps
    r["loads"] = list(LOADS)
    return r


def all_identical(r: dict) -> bool:
    return r["tput"]["same"] and all(c["same_as_off"] for t in r["single"].values() for c in t.values())


def suggest_max_step_tokens(steps: list[dict]) -> int:
    """The largest row count T (of STEP_ROWS) such that every measured verify step of at most T rows costs at most
    FREE_RATIO x the decode step of the same batch: the policy's max_step_tokens that keeps drafts nearly free.
    Shapes the policy never makes (k > 16, the most `num_speculative_tokens` allows) do not count."""
    best = 0
    for rows in STEP_ROWS:
        if all(s["vs_decode"] <= FREE_RATIO for s in steps
               if s["kind"] == "verify" and s["rows"] <= rows and s["k"] <= MAX_K):
            best = rows
        else:
            break
    return best


def render(r: dict, command: str, date: str, machine: str, elapsed_s: float, load: tuple[float, float]) -> str:
    """The markdown section of `--workload spec`, between its begin/end markers."""
    out = [SECTION_BEGIN, "## Speculative decoding (SmolLM2-135M-Instruct, float32, greedy)\n"]
    out.append(f"One process, {len(CONFIGS)} engines that differ only in `speculative_config`, `warmup=False`, "
               f"`max_model_len` {MAX_MODEL_LEN}, {r['kv_pages']} KV pages of 16 tokens, prefix cache reset before "
               "every run. Every measured shape runs untimed first (with a fresh, empty persistent compilation "
               f"cache shared by the engines), so no compile is timed. Backend {r['backend']}: the policy's "
               f"`max_step_tokens` is {r['max_step_tokens']} "
               f"(`DEFAULT_MAX_STEP_TOKENS` = {r['default_max_step_tokens']}). Method, prompts and the expectations "
               "written before the first run: `scripts/bench_spec.py`. Command:\n")
    out.append(f"```\n{command}\n```\n")
    loads = r.get("loads") or [load[1]]
    out.append(f"- date: {date}; jax {jax.__version__}; {machine}; run time {elapsed_s:.0f} s (batch-1 "
               f"{r['single_s']:.0f} s, 32 requests {r['tput_s']:.0f} s, step costs {r['steps_s']:.0f} s); 1-minute "
               f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, {min(loads):.1f}-{max(loads):.1f} "
               "after the timed runs (this process alone keeps it near 2 on the 2 cores; well above 2, other jobs "
               "competed); a shared, noisy VM\n")
    out.append("Expected (written before measuring): copy-heavy ngram k=2 1.8-2.4x, k=4 2.2-3.2x, k=8 2.3-3.5x "
               "(acceptance 0.7-0.9, a verify step of <= 9 rows ~1.1-1.3x a decode step); chat ngram 0.85-1.05x "
               "(acceptance 0.1-0.3, drafts mostly switched off); self_draft 28/30 layers k=2 0.5-0.8x (two draft "
               "forwards of 93% of the model per step); 32 concurrent requests on/off 0.95-1.05x (the policy turns "
               "drafts off above 16 decoding sequences with max_step_tokens 32; after the step-cost table below "
               "moved the CPU default to 8, above 4); step cost flat to ~16 rows, 1.3-1.6x at 32, roughly "
               "proportional beyond (knee ~32 rows).\n")

    single = r["single"]
    out.append(f"### Batch-1 decode tokens/s (median of {r['reps']} runs, min-max)\n")
    out.append(f"Copy-heavy: {r['prompt_lens']['copy-heavy']}-token chat prompt, a 159-word paragraph to repeat "
               f"with \"lighthouse\" changed to \"tower\" (`max_tokens` {COPY_MAX_TOKENS}); chat: "
               f"{r['prompt_lens']['chat']}-token prompt, \"{CHAT_QUESTION}\" (`max_tokens` {CHAT_MAX_TOKENS}). "
               "Decode tok/s = (output tokens - 1) / (finish - first token). Acceptance = accepted / drafted; "
               "mean accepted length = tokens per verifying sequence-step (accepted + 1); tokens per step = over all "
               "decode steps, drafting or not (stats deltas over the timed runs); time per decode step vs off = "
               "tokens per step / speed-up: what a step with drafting (proposing + the wider verify step) costs; "
               "same round = each run against the off run of its round (runs a minute apart or less), which cancels "
               "slow drifts of the machine's load.\n")
    rows = []
    for task, cells in single.items():
        base = _median(cells["off"]["tok_s"])
        for name, c in cells.items():
            med = _median(c["tok_s"])
            d = _derived(c["spec"]) if c["spec"] else None
            per_step = d["per_step"] if d else 1.0
            paired = [x / y for x, y in zip(c["tok_s"], cells["off"]["tok_s"])]
            rows.append([task, name, f"{med:.1f}", f"{min(c['tok_s']):.1f}-{max(c['tok_s']):.1f}",
                         f"**{med / base:.2f}x**" if name != "off" else "1.00x",
                         f"{_median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})" if name != "off" else "-",
                         f"{d['acceptance']:.2f}" if d else "-", f"{d['mean_len']:.2f}" if d else "-",
                         f"{per_step:.2f}", f"{per_step / (med / base):.2f}",
                         str(len(c["tokens"])), "yes" if c["same_as_off"] else "**NO**"])
    out.append(md_sections.table(["task", "speculation", "decode tok/s", "min-max", "vs off (medians)",
                       "vs off, same round (median, min-max)", "acceptance",
                       "mean accepted length", "tokens per decode step", "time per decode step vs off",
                       "output tokens",
                       "tokens identical to off (every run)"], rows) + "\n")
    copy_best = max((n for n in single["copy-heavy"] if n.startswith("ngram")),
                    key=lambda n: _median(single["copy-heavy"][n]["tok_s"]))
    copy_speedup = _median(single["copy-heavy"][copy_best]["tok_s"]) / _median(single["copy-heavy"]["off"]["tok_s"])
    out.append(f"- at batch 1 the policy lets a sequence draft min(k, max_step_tokens - 1) = "
               f"min(k, {r['max_step_tokens'] - 1}) tokens per step (a verify step of at most max_step_tokens rows), "
               "so a config's k above that runs as that.\n")
    out.append(f"- goal >= 1.8x on the copy-heavy task: best ngram ({copy_best}) **{copy_speedup:.2f}x**, goal "
               f"**{'met' if copy_speedup >= 1.8 else 'not met'}**.\n")
    lines = []
    for task, ranges in (("copy-heavy", {"ngram k=2": (1.8, 2.4), "ngram k=4": (2.2, 3.2), "ngram k=8": (2.3, 3.5),
                                         "self_draft 28 layers k=2": (0.5, 0.8)}),
                         ("chat", {"ngram k=2": (0.85, 1.05), "ngram k=4": (0.85, 1.05), "ngram k=8": (0.85, 1.05),
                                   "self_draft 28 layers k=2": (0.5, 0.8)})):
        base = _median(single[task]["off"]["tok_s"])
        parts = []
        for name, (lo, hi) in ranges.items():
            x = _median(single[task][name]["tok_s"]) / base
            parts.append(f"{name} {lo}-{hi}x, measured {x:.2f}x ({md_sections.vs_range(x, lo, hi)})")
        lines.append(f"{task}: " + "; ".join(parts))
    out.append("- against the expectations: " + ". ".join(lines) + "\n")
    text = r["single_text"]["copy-heavy"]
    out.append(f"- the copy-heavy reply (same for every config) starts \"{text[:90]}...\" and is "
               f"{len(text.split())} words long; the chat reply is {len(r['single_text']['chat'].split())} words.\n")

    tp = r["tput"]
    out.append(f"### Throughput: {TPUT_REQUESTS} concurrent requests, max_tokens {TPUT_MAX_TOKENS}\n")
    pl = tp["prompt_tokens"]
    out.append(f"16 copy-heavy prompts ({min(pl[0::2])}-{max(pl[0::2])} tokens, distinct GPL-3 paragraphs, one word "
               f"changed) and 16 chat questions ({min(pl[1::2])}-{max(pl[1::2])} tokens), alternating, all added at "
               "t=0; default `max_num_seqs` 32, `max_num_batched_tokens` 512. On: `{\"method\": \"ngram\"}` (k=4, "
               f"automatic policy, `max_step_tokens` {r['max_step_tokens']}). {tp['reps']} timed runs each after one "
               "untimed, on/off interleaved (ABBA). Output tok/s = output tokens / wall time from the first "
               "`add_request` to the last finish.\n")
    rows, meds = [], {}
    for name in ("on", "off"):
        runs = tp["runs"][name]
        rates = [b.output_tokens / b.wall_s for b in runs]
        meds[name] = _median(rates)
        spec = {}
        for b in runs:
            for k, v in b.spec.items():
                spec[k] = spec.get(k, 0) + v
        if name == "on":
            d = _derived(spec)
            n = len(runs)
            spec_txt = (f"{spec['spec_verify_steps'] / n:.0f} verify steps / {spec['spec_off_steps'] / n:.0f} steps "
                        f"off by batch size per run; acceptance {d['acceptance']:.2f}, tokens per decode step "
                        f"{d['per_step']:.2f}")
        else:
            spec_txt = "-"
        rows.append([name, f"{meds[name]:.1f}", f"{min(rates):.1f}-{max(rates):.1f}",
                     f"{_median([b.wall_s for b in runs]):.1f}", str(runs[0].output_tokens), spec_txt])
    out.append(md_sections.table(["speculation", "output tok/s (median)", "min-max", "wall s (median)", "output tokens",
                       "policy (spec_* stats, per run)"], rows) + "\n")
    ratio = meds["on"] / meds["off"]
    pairs = [a.output_tokens / a.wall_s / (b.output_tokens / b.wall_s)
             for a, b in zip(tp["runs"]["on"], tp["runs"]["off"])]
    on_rates = [b.output_tokens / b.wall_s for b in tp["runs"]["on"]]
    off_rates = [b.output_tokens / b.wall_s for b in tp["runs"]["off"]]
    overlap = min(on_rates) <= max(off_rates) and min(off_rates) <= max(on_rates)
    out.append(f"- on / off = **{ratio:.2f}x** from the medians (the on and off min-max ranges "
               f"{'overlap' if overlap else 'do not overlap'}); from each run against the adjacent run of the other "
               f"setting (ABBA pairs): median **{_median(pairs):.2f}x**, min-max {min(pairs):.2f}-{max(pairs):.2f}; "
               "tokens identical on and off "
               f"in every run: {'yes' if tp['same'] else '**NO**'}; expected 0.95-1.05x ({md_sections.vs_range(ratio, 0.95, 1.05)})\n")

    steps = r["steps"]
    suggestion = suggest_max_step_tokens(steps)
    base = next(s["ms"] for s in steps if s["kind"] == "decode" and s["batch"] == 1)
    out.append("### Cost of a step vs token rows (policy calibration)\n")
    out.append(f"`ModelRunner.execute` (decode, q_len 1) and `execute_verify` (B sequences x (k + 1) tokens) on the "
               f"\"off\" engine's runner; every sequence at context {STEP_CONTEXT} on its own pages (page-table "
               f"bucket 32 pages = 512 tokens for all shapes), greedy rows. Rows = token rows the step computes "
               f"(a decode step pads to a power of two, at least 2). Median of {r['step_reps']} calls after an "
               f"untimed one. \"vs batch-1 decode\" = / the 2-row step ({base:.1f} ms); \"vs decode of batch B\" = / "
               "the plain decode step of the same batch: what the drafts add; break-even acceptance = the per-draft "
               "acceptance a at which (1 - a^(k+1)) / (1 - a) tokens per step equal that cost ratio.\n")
    rows = []
    for s in sorted(steps, key=lambda s: (s["rows"], s["batch"], s["kind"] != "decode")):
        label = (f"decode, batch {s['batch']}" if s["kind"] == "decode"
                 else f"verify, batch {s['batch']} x (k={s['k']} + 1)")
        if s["kind"] == "verify":
            a = break_even_acceptance(s["vs_decode"], s["k"])
            be = "never" if a is None else f"{a:.2f}"
        else:
            be = "-"
        rows.append([str(s["rows"]), label, f"{s['ms']:.1f}", f"{s['min_ms']:.1f}-{s['max_ms']:.1f}",
                     f"{s['ms'] / base:.2f}x", f"{s['vs_decode']:.2f}x" if s["kind"] == "verify" else "-", be])
    out.append(md_sections.table(["rows", "step", "ms (median)", "min-max", "vs batch-1 decode", "vs decode of batch B",
                       "break-even acceptance"], rows) + "\n")
    cpu = r["default_max_step_tokens"].get("cpu")
    out.append(f"- every measured verify step of up to **{suggestion} rows** costs at most {FREE_RATIO}x the decode "
               f"step of its batch (not counting batch 1 with k = 31, which no config can ask for); "
               f"`DEFAULT_MAX_STEP_TOKENS['cpu']` is {cpu}: "
               + ("the data supports it." if suggestion == cpu else f"the data suggests {suggestion}.") + "\n")
    out.append(SECTION_END)
    return "\n".join(out)
