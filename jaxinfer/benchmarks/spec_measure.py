"""The three measurements of `jaxinfer bench spec` (see `jaxinfer.benchmarks.spec`): batch-1 decode with and
without speculation, throughput of concurrent requests with the automatic policy on vs off, and the cost of decode
and verify steps against their token rows."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import statistics
import time

import numpy as np

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.scheduler.chunk import ScheduledChunk

logger = logging.getLogger(__name__)

STEP_CONTEXT = 240
STEP_ROWS = (2, 4, 8, 16, 32, 64, 128)


def median(xs: list[float]) -> float:
    """The median of a non-empty list, as a float."""
    return float(statistics.median(xs))


def _spec_counters(engine: Engine) -> dict[str, int]:
    s = engine.stats()
    return {k: v for k, v in s.items() if k.startswith("spec_") and isinstance(v, int)}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b}


def derived(c: dict[str, int]) -> dict[str, float]:
    """Acceptance rate, mean accepted length and tokens per decode step of a delta of spec_* counters."""
    return {
        "acceptance": c["spec_accepted_tokens"] / c["spec_draft_tokens"] if c.get("spec_draft_tokens") else 0.0,
        "mean_len": c["spec_emitted_tokens"] / c["spec_verify_rows"] if c.get("spec_verify_rows") else 0.0,
        "per_step": c["spec_decode_tokens"] / c["spec_decode_rows"] if c.get("spec_decode_rows") else 0.0,
    }



# --- 1. batch-1 decode ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Single:
    """One batch-1 request: its output tokens, decode tokens/s and finish reason."""

    tokens: list[int]
    decode_tok_s: float
    finish_reason: str


def run_single(engine: Engine, prompt: list[int], max_tokens: int) -> Single:
    """One greedy request alone (prefix cache reset first); decode tok/s = (tokens - 1) / (finish - first token)."""
    engine.reset_prefix_cache()
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    comp, m = out.outputs[0], out.metrics
    n, decode_s = len(comp.token_ids), m.finish_time - m.first_token_time
    tok_s = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")  # one token: no decode to time
    return Single(list(comp.token_ids), tok_s, comp.finish_reason)


def bench_single(engines: dict[str, Engine], prompts: dict[str, tuple[list[int], int]], reps: int,
                 loads: list[float]) -> dict:
    """An untimed round, then `reps` rounds of every (task, config), configs interleaved; appends the 1-minute load
    average after each timed run to `loads`.

    Returns:
      {task: {config: {"tok_s": [...], "tokens", "same", "spec" (spec_* counter deltas), "finish", "same_as_off"}}}.
    """
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
                    loads.append(os.getloadavg()[0])
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
            logger.info("%s %s: %d tokens, identical to off in every run: %s", task, name, len(cell["tokens"]),
                        cell["same_as_off"])
    return res




# --- 2. throughput of concurrent requests ---------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    """One run of the concurrent batch: wall seconds, output tokens, every request's tokens, spec_* deltas."""

    wall_s: float
    output_tokens: int
    tokens: list[list[int]]
    spec: dict[str, int]


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> Batch:
    """Every prompt added at t=0 (greedy, `max_tokens` each), stepped until all finish."""
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
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


def bench_tput(on: Engine, off: Engine, prompts: list[list[int]], reps: int, max_tokens: int,
               loads: list[float]) -> dict:
    """One untimed run each, then `reps` timed runs each, on / off alternating (ABBA).

    Returns:
      {"runs": {"on" | "off": [Batch]}, "same": tokens identical in every run, "prompt_tokens", "reps"}.
    """
    runs: dict[str, list[Batch]] = {"on": [], "off": []}
    ref = None
    same = True
    for rep in range(reps + 1):  # rep 0: untimed (compiles)
        order = (("on", on), ("off", off)) if rep % 2 == 0 else (("off", off), ("on", on))
        for name, eng in order:
            b = run_batch(eng, prompts, max_tokens)
            ref = ref or b.tokens
            same &= b.tokens == ref
            if rep:
                loads.append(os.getloadavg()[0])
                runs[name].append(b)
            logger.info("batch %s rep %d: %.1f s, %d output tokens, %.1f tok/s", name, rep, b.wall_s,
                        b.output_tokens, b.output_tokens / b.wall_s)
    if not same:
        diff = [i for i, (a, b) in enumerate(zip(runs["on"][0].tokens, runs["off"][0].tokens)) if a != b]
        logger.error("concurrent batch: outputs differ on/off in requests %s", diff)
    logger.info("concurrent batch: identical tokens on/off in every run: %s", same)
    return {"runs": runs, "same": same, "prompt_tokens": [len(p) for p in prompts], "reps": reps}



# --- 3. verify-shaped step cost vs token rows -----------------------------------------------------------------------


def step_shapes(batches: tuple[int, ...], batch1_rows: tuple[int, ...], verify_batches: tuple[int, ...]
                ) -> list[tuple[str, int, int]]:
    """(kind, batch, k) of every measured step: decode at each of `batches`, batch-1 verify blocks of
    `batch1_rows` rows, and verify of `verify_batches` at k = 1 and 3."""
    shapes = [("decode", b, 0) for b in batches]
    shapes += [("verify", 1, rows - 1) for rows in batch1_rows]
    shapes += [("verify", b, k) for b in verify_batches for k in (1, 3)]
    return shapes


def bench_steps(engine: Engine, reps: int, shapes: list[tuple[str, int, int]]) -> list[dict]:
    """Every shape called once untimed, then `reps` rounds of one call each (shapes in a new order every round).

    Returns:
      One row per shape: kind, batch, k, rows (token rows computed), first_s, ms / min_ms / max_ms, vs_decode (ms
      over the decode step of the same batch; every verify batch must also be a decode batch).
    """
    runner, alloc = engine.runner, engine.page_allocator
    ps = engine.page_size
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0)
    vocab = engine.model_config.vocab_size
    max_b = max(b for _, b, _ in shapes)
    pages_per_seq = -(-(STEP_CONTEXT + max(STEP_ROWS)) // ps)
    pages = alloc.allocate(max_b * pages_per_seq)
    calls = []
    try:
        seq_pages = [pages[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(max_b)]
        for kind, batch, k in shapes:
            q = 1 if kind == "decode" else k + 1
            chunks = [ScheduledChunk(rng.integers(0, vocab, q).tolist(), STEP_CONTEXT, seq_pages[i])
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
        row.update(ms=1e3 * median(times), min_ms=1e3 * min(times), max_ms=1e3 * max(times))
        logger.info("step %s", row)
        out.append(row)
    decode = {s["batch"]: s["ms"] for s in out if s["kind"] == "decode"}
    for s in out:
        s["vs_decode"] = s["ms"] / decode[s["batch"]]
    return out

