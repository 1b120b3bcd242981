"""`jaxinfer bench spec`: speculative decoding in float32, greedy (measurements in `spec_measure`, prompts in
`spec_prompts`, the section in `spec_report`).

Engines in one process, identical except for `speculative_config` (none; ngram k = 2, 4, 8 (`--ngram-ks`); self_draft
with all but 2 of the model's layers at k = 2, unless `--no-self-draft`), each with `warmup=False`, `--max-model-len`
(1024) and the same KV budget. Every measured shape runs once untimed first (with a fresh, empty persistent
compilation cache, so the engines compile the shapes they share once), and greedy decoding repeats the same tokens,
so the timed runs meet only compiled shapes. The prefix cache is reset before every run, so every run of a prompt
does the same work.

1. **Batch-1 decode.** Two chat-template prompts (`Tokenizer.apply_chat_template`, as `jaxinfer generate --chat`
   renders them), one request at a time:
   - copy-heavy: a 159-word paragraph and the instruction to repeat it with one word changed (`max_tokens` 256);
   - free-form chat: a question (`max_tokens` 64).
   Decode tokens/s = (output tokens - 1) / (finish - first token), from the request's own metrics. One untimed round,
   then `--reps` rounds; each round runs every (task, config) once, configs interleaved, so slow spells of the shared
   VM hit all configs alike. Reported: median and min-max, speed-up of the medians over "off", acceptance rate and
   mean accepted length (tokens per verifying sequence-step, accepted + 1) from `Engine.stats()` deltas over the
   timed runs, and whether every run's output tokens equal those of "off" (they must: greedy speculation is
   lossless).
2. **Throughput at 32 concurrent requests.** 16 copy-heavy prompts (distinct 60-100-word paragraphs of the GPL-3
   text, each with a one-word change) and 16 chat questions, alternating, all added at t=0, `max_tokens` 64,
   greedy; the engine's default `max_num_seqs` 32 and `max_num_batched_tokens` 512. Speculation on = the default config
   (`{"method": "ngram"}`: k = 4, automatic policy with the backend's `max_step_tokens`) vs off. One untimed run
   each, then `--tput-reps` timed runs each, alternating on/off (ABBA order). End-to-end output tokens/s = output
   tokens / (last finish - first add). The on runs' spec_* stats show how many steps the policy let speculate.
3. **Cost of a verify-shaped step vs token rows** (calibrates `policy.DEFAULT_MAX_STEP_TOKENS`). On the "off"
   engine's `ModelRunner`, with sequences at context 240 (+ the step's tokens; every shape lands in the 32-page =
   512-token page-table bucket), distinct pages per sequence: `execute` decode steps of B = 1 ... 32 sequences
   (q_len 1; rows = the padded token count, at least 2) and `execute_verify` steps of B sequences x (k + 1) tokens:
   batch 1 with k + 1 = 2 ... 32 rows, and B = 4 ... 32 with k = 1 and 3 (the k the policy gives those batches at
   max_step_tokens 8 ... 128), 8 ... 128 rows. Every shape is called once untimed (compiles), then `--step-reps`
   rounds time one call of every shape each (interleaved); medians reported. Each verify step is compared with the
   2-row step (is the step still flat?) and with the decode step of the same batch (what the drafts add at that
   batch); the policy's `max_step_tokens` should be the largest row count whose verify steps cost at most
   `FREE_RATIO` (1.5) x the decode step of their batch.

Expected for SmolLM2-135M-Instruct, written before the first measurement (2 shared cores; earlier runs here: batch-1
f32 decode ~45-50 ms a step, ~20 tok/s; a decode step of batch 32 ~150-220 ms):

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

    .venv/bin/jaxinfer bench spec --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import tempfile
import time

import jax

from jaxinfer.benchmarks import corpus
from jaxinfer.benchmarks.report import Report, int_list
from jaxinfer.benchmarks.spec_measure import bench_single, bench_steps, bench_tput, step_shapes
from jaxinfer.benchmarks.spec_prompts import CHAT_QUESTION, chat_prompt, copy_prompt, tput_prompts
from jaxinfer.benchmarks.spec_report import render, suggest_max_step_tokens
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.spec_decode import policy as spec_policy

logger = logging.getLogger(__name__)

SECTION = ("<!-- spec-decode: begin -->", "<!-- spec-decode: end -->")
KV_BYTES = 640 * 2**20  # SmolLM2: ~910 f32 pages of 16 tokens, so 32 sequences x 23 pages fit
STEP_BATCHES = (1, 2, 4, 8, 16, 32)
STEP_BATCH1_ROWS = (2, 4, 8, 16, 32)  # batch-1 verify blocks, k = rows - 1
STEP_VERIFY_BATCHES = (4, 8, 16, 32)  # with k = 1 and 3: the k the policy gives these batches at 16 ... 128 rows
NGRAM_KS = (2, 4, 8)
TPUT_K = 4  # the k of the default SpeculativeConfig of method "ngram": the throughput part's "on" engine
TPUT_ON = f"ngram k={TPUT_K}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The spec workload's options: model, repetitions, request sizes, the engines' limits, the step shapes."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder with a chat template (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--reps", type=int, default=3, help="timed batch-1 rounds")
    parser.add_argument("--tput-reps", type=int, default=5, help="timed concurrent-batch runs per setting (on / off)")
    parser.add_argument("--step-reps", type=int, default=5, help="timed calls per step shape")
    parser.add_argument("--copy-max-tokens", type=int, default=256, help="max_tokens of the batch-1 copy task")
    parser.add_argument("--chat-max-tokens", type=int, default=64, help="max_tokens of the batch-1 chat task")
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests of the throughput part (even)")
    parser.add_argument("--tput-max-tokens", type=int, default=64, help="max_tokens of each concurrent request")
    parser.add_argument("--max-model-len", type=int, default=1024, help="every engine's max_model_len")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=KV_BYTES, help="every engine's KV budget")
    parser.add_argument("--ngram-ks", default=",".join(map(str, NGRAM_KS)),
                        help=f"k of the ngram engines (must hold {TPUT_K}: the throughput part's 'on' engine)")
    parser.add_argument("--no-self-draft", action="store_true",
                        help="leave out the self_draft engine (fewer compiles, e.g. in smoke tests)")
    for name, default, what in (("--step-batches", STEP_BATCHES, "decode step batches"),
                                ("--step-batch1-rows", STEP_BATCH1_ROWS, "rows (k + 1) of the batch-1 verify steps"),
                                ("--step-verify-batches", STEP_VERIFY_BATCHES,
                                 "batches of the k = 1 and 3 verify steps (each also in --step-batches; '' for "
                                 "none)")):
        parser.add_argument(name, default=",".join(map(str, default)), help=what)


def configs(num_layers: int, ngram_ks: tuple[int, ...] = NGRAM_KS, self_draft: bool = True
            ) -> list[tuple[str, dict | None]]:
    """(name, speculative_config) of every engine: off, ngram at each k of `ngram_ks` (default 2 / 4 / 8), and
    (unless `self_draft` is False) self_draft with all but 2 layers at k = 2."""
    draft_layers = max(1, num_layers - 2)
    out: list[tuple[str, dict | None]] = [("off", None)]
    out += [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k}) for k in ngram_ks]
    if self_draft:
        out.append((f"self_draft {draft_layers} layers k=2",
                    {"method": "self_draft", "num_speculative_tokens": 2, "num_draft_layers": draft_layers}))
    return out


def _ints(args: argparse.Namespace, name: str, allow_empty: bool = False) -> tuple[int, ...]:
    return tuple(int_list(f"--{name.replace('_', '-')}", getattr(args, name), allow_empty=allow_empty))


def _shapes(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """The step shapes, after checking every option. Raises ValueError naming a bad option."""
    if min(args.reps, args.tput_reps, args.step_reps, args.copy_max_tokens, args.chat_max_tokens,
           args.tput_max_tokens, args.max_model_len, args.kv_cache_memory_bytes) < 1:
        raise ValueError("--reps, --tput-reps, --step-reps, the max tokens, --max-model-len and "
                         "--kv-cache-memory-bytes must be >= 1")
    if args.requests < 2 or args.requests % 2:
        raise ValueError(f"--requests {args.requests}: expected an even number >= 2")
    if TPUT_K not in _ints(args, "ngram_ks"):
        raise ValueError(f"--ngram-ks {args.ngram_ks!r} must hold {TPUT_K} (the throughput part's 'on' engine)")
    batches, verify = _ints(args, "step_batches"), _ints(args, "step_verify_batches", allow_empty=True)
    if not set(verify) <= set(batches) or 1 not in batches:
        raise ValueError("--step-batches must hold 1 and every --step-verify-batches batch")
    return step_shapes(batches, _ints(args, "step_batch1_rows"), verify)


def _fresh_compilation_cache() -> None:
    """A fresh, empty persistent cache unless one is set: the engines share the shapes they have in common
    (compiled once, not once per engine), and nothing comes from earlier runs. Nothing timed compiles either way."""
    if not os.environ.get("JAXINFER_COMPILATION_CACHE"):
        cache_dir = tempfile.mkdtemp(prefix="jaxinfer-spec-xla-")
        os.environ["JAXINFER_COMPILATION_CACHE"] = cache_dir
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)


def all_identical(r: dict) -> bool:
    """Whether speculation left every greedy output as it was without it (it must: greedy speculation is
    lossless)."""
    return r["tput"]["same"] and all(c["same_as_off"] for t in r["single"].values() for c in t.values())


def _data(r: dict) -> dict:
    """The results as JSON-able data: the concurrent runs as (wall_s, output_tokens, spec) without their tokens."""
    tput = dict(r["tput"], runs={name: [{"wall_s": b.wall_s, "output_tokens": b.output_tokens, "spec": b.spec}
                                        for b in runs] for name, runs in r["tput"]["runs"].items()})
    return {**r, "tput": tput, "suggested_max_step_tokens": suggest_max_step_tokens(r["steps"])}


def run(args: argparse.Namespace) -> Report:
    """The three measurements; the report. `Report.data["exit_status"]` is 1 when speculation changed a greedy
    output.

    `Report.data`: kv_pages, backend, max_step_tokens, model, settings, prompt_lens, single ({task: {config: tok_s
    [...], tokens, spec counters, same_as_off}}), single_text, tput (runs per setting, same, prompt_tokens), steps
    (one row per shape: ms...), suggested_max_step_tokens, loads, the parts' seconds, exit_status.

    Raises:
      ValueError: a bad option, a model that cannot be loaded, or no GPL-3 text.
    """
    shapes = _shapes(args)
    text = corpus.read_text("spec")
    _fresh_compilation_cache()
    t0, load0 = time.perf_counter(), os.getloadavg()[0]

    def make_engine(spec: dict | None) -> Engine:
        """An engine of the shared settings with this `speculative_config` (None: off)."""
        return Engine(EngineConfig.create(model=args.model, dtype="float32", warmup=False,
                                          max_model_len=args.max_model_len,
                                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, speculative_config=spec))

    off = make_engine(None)
    cfg, tok = off.model_config, off.tokenizer
    engines = {name: off if spec is None else make_engine(spec)
               for name, spec in configs(cfg.num_layers, _ints(args, "ngram_ks"), not args.no_self_draft)}
    logger.info("%d engines ready in %.1f s", len(engines), time.perf_counter() - t0)
    copy, chat = copy_prompt(tok), chat_prompt(tok)
    batch = tput_prompts(tok, text, args.requests)
    drafts = [name for name in engines if name.startswith("self_draft")]
    settings = {"configs": list(engines), "self_draft": drafts[0] if drafts else None,
                "max_model_len": args.max_model_len,
                "copy_max_tokens": args.copy_max_tokens, "chat_max_tokens": args.chat_max_tokens,
                "chat_question": CHAT_QUESTION, "requests": args.requests, "tput_max_tokens": args.tput_max_tokens}
    r = {"kv_pages": off.page_allocator.num_usable_pages, "backend": jax.default_backend(),
         "max_step_tokens": engines[TPUT_ON].spec_policy.max_step_tokens,
         "default_max_step_tokens": dict(spec_policy.DEFAULT_MAX_STEP_TOKENS),
         "model": {"name": cfg.name, "num_layers": cfg.num_layers}, "settings": settings,
         "prompt_lens": {"copy-heavy": len(copy), "chat": len(chat)}}
    loads: list[float] = []
    t = time.perf_counter()
    r["single"] = bench_single(engines, {"copy-heavy": (copy, args.copy_max_tokens),
                                         "chat": (chat, args.chat_max_tokens)}, args.reps, loads)
    r["single_s"] = time.perf_counter() - t
    r["single_text"] = {task: tok.decode(r["single"][task]["off"]["tokens"], skip_special_tokens=True)
                        for task in r["single"]}
    t = time.perf_counter()
    r["tput"] = bench_tput(engines[TPUT_ON], off, batch, args.tput_reps, args.tput_max_tokens, loads)
    r["tput_s"] = time.perf_counter() - t
    t = time.perf_counter()
    r["steps"] = bench_steps(off, args.step_reps, shapes)
    r["steps_s"] = time.perf_counter() - t
    r["reps"], r["step_reps"], r["loads"] = args.reps, args.step_reps, loads
    markdown = render(r, args.command, args.date, time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    data = _data(r)
    data["exit_status"] = 0 if all_identical(r) else 1
    if data["exit_status"]:
        logger.error("speculation changed greedy outputs (see the section's 'identical' columns)")
    return Report("spec", markdown, data)
