"""Serving workload of `scripts/benchmark.py --workload serving`: requests through `Engine`, against HF `generate`.

A scenario is N requests with input / output lengths (fixed, or drawn uniformly from a range) arriving all at once
(offline) or as a Poisson process of a given rate (online). Prompts are consecutive slices of real text (the GPL-3
licence, tokenized with the model's tokenizer). Every request is greedy with `ignore_eos=True` and
`max_tokens = its output length`, so every request produces exactly that many tokens.

Our engine is driven directly: requests are added with `Engine.add_request` when their arrival time has come (checked
before every step; an idle engine sleeps until the next arrival) and `Engine.step` runs until all finish. Per engine
(one per dtype) `jaxinfer.engine.warmup.warmup` (what `EngineConfig(warmup=True)` runs at start-up) is timed on its
own, then the scenario first runs untimed with the same prompts and arrivals and outputs cut short (just long
enough to reach the same KV page buckets), which compiles the step shapes the timed run needs; the time of every
call that compiled is reported as compile seconds. The runner's `_prepare` and jitted `_step` are wrapped (in this
script, by instance attributes) to record each device call's padded shapes and its blocked device time.

Definitions (times on one `perf_counter` clock):

* end-to-end output tokens/s: all output tokens / (last request's finish - first arrival);
* TTFT: a request's first token time - its scheduled arrival time; TPOT: (finish - first token) / (output - 1);
  p50 and p99 over requests;
* decode-only tokens/s: tokens produced by steps that ran only decodes (no prefill chunk) / the wall time of those
  steps (each step timed around `Engine.step`, host work included);
* HF peer: one batched `generate` of all prompts; its first token arrives for every request at once after the
  batch prefill (TTFT), decode-only tokens/s = N x (output - 1) / (total - TTFT).
"""

from __future__ import annotations

import md_sections  # noqa: I001 (scripts/ is on sys.path when these run)

import dataclasses
import functools
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.step_inputs import NULL_PAGE, page_bucket
from jaxinfer.engine.warmup import warmup
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.sampling_params import SamplingParams
from pallas_kernels.paged_attention import paged_attention_reference

logger = logging.getLogger("benchmark.serving")

TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
PAGE_SIZE = 16
MIN_PAGES = 8  # the runner's smallest page-table width
MIN_WARM_OUTPUT = 16  # shortest output of the untimed compile run
SECTION_BEGIN = "<!-- serving-workload: begin -->"
SECTION_END = "<!-- serving-workload: end -->"


# --- scenarios ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """N requests; lengths are inclusive ranges (lo == hi: fixed); rate in requests/s, inf: all at once."""

    name: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    rate: float = math.inf
    seed: int = 0

    @property
    def fixed(self) -> bool:
        return self.input_len[0] == self.input_len[1] and self.output_len[0] == self.output_len[1]

    @property
    def offline(self) -> bool:
        return math.isinf(self.rate)

    def describe(self) -> str:
        def rng(r: tuple[int, int]) -> str:
            return str(r[0]) if r[0] == r[1] else f"U[{r[0]}, {r[1]}]"

        arrival = "all at once" if self.offline else f"Poisson {self.rate:g} req/s"
        return f"{self.num_requests} requests, input {rng(self.input_len)}, output {rng(self.output_len)}, {arrival}"


def parse_scenario(spec: str) -> Scenario:
    """`name:n=32,in=128,out=128[,rate=2][,seed=0]`; lengths may be ranges `64-256`; rate `inf` = all at once."""
    name, _, body = spec.partition(":")
    fields: dict[str, str] = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"scenario {spec!r}: expected key=value, got {item!r}")
        fields[key.strip()] = value.strip()

    def length(key: str) -> tuple[int, int]:
        lo, _, hi = fields[key].partition("-")
        r = (int(lo), int(hi or lo))
        if not 1 <= r[0] <= r[1]:
            raise ValueError(f"scenario {spec!r}: bad {key} range {fields[key]!r}")
        return r

    unknown = set(fields) - {"n", "in", "out", "rate", "seed"}
    if unknown or not name or not {"n", "in", "out"} <= set(fields):
        raise ValueError(f"scenario {spec!r}: need name:n=..,in=..,out=..[,rate=..][,seed=..]")
    return Scenario(name=name, num_requests=int(fields["n"]), input_len=length("in"), output_len=length("out"),
                    rate=float(fields.get("rate", "inf")), seed=int(fields.get("seed", "0")))


@dataclasses.dataclass(frozen=True)
class Request:
    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    output_len: int


def make_requests(sc: Scenario, text_ids: list[int]) -> list[Request]:
    """Prompts are consecutive slices of `text_ids` (wrapping around); arrivals Poisson or all at 0."""
    rng = np.random.default_rng(sc.seed)
    ins = rng.integers(sc.input_len[0], sc.input_len[1] + 1, sc.num_requests)
    outs = rng.integers(sc.output_len[0], sc.output_len[1] + 1, sc.num_requests)
    gaps = np.zeros(sc.num_requests) if sc.offline else rng.exponential(1 / sc.rate, sc.num_requests)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    reqs, cursor = [], 0
    for a, n, o in zip(arrivals, ins, outs):
        if cursor + n > len(text_ids):
            cursor = 0
        reqs.append(Request(float(a), text_ids[cursor: cursor + int(n)], int(o)))
        cursor += int(n)
    return reqs


def max_model_len(scenarios: list[Scenario]) -> int:
    """The longest context rounded up to its page-table bucket: the step shapes are those of the default (the
    model's 8192) for these contexts, and the engine's warm-up has fewer page-table widths to compile."""
    pages = -(-max(sc.input_len[1] + sc.output_len[1] for sc in scenarios) // PAGE_SIZE)
    return page_bucket(pages, 1 << 30) * PAGE_SIZE


def warm_output_len(input_len: int, output_len: int, max_pages_per_seq: int) -> int:
    """Shortest output >= MIN_WARM_OUTPUT whose final context needs the same page bucket as the full output."""
    target = page_bucket(-(-(input_len + output_len) // PAGE_SIZE), max_pages_per_seq)
    for o in range(min(MIN_WARM_OUTPUT, output_len), output_len + 1):
        if page_bucket(-(-(input_len + o) // PAGE_SIZE), max_pages_per_seq) == target:
            return o
    return output_len


# --- driving the engine --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """One device call (`ModelRunner.execute`) as the runner padded it."""

    decode: bool  # every chunk is one token (the engine's decode group)
    tokens: int
    tokens_pad: int
    seqs: int
    seqs_pad: int
    max_q_pad: int
    pages_pad: int
    kv_tokens: int  # sum of real context lengths
    attn_cells: int  # sum over sequences of new tokens x context (what unpadded attention computes)
    attn_cells_pad: int  # seqs_pad x max_q_pad x pages_pad x page_size (what the reference attention computes)
    device_s: float = 0.0  # the jitted step, blocked until its outputs are ready
    execute_s: float = 0.0  # the whole `execute` (host padding, transfer, jitted step, device_get)
    compiled: bool = False

    @property
    def shape(self) -> tuple:
        return (self.tokens_pad, self.seqs_pad, self.max_q_pad, self.pages_pad)


@dataclasses.dataclass
class Step:
    wall_s: float
    prefill_tokens: int
    decode_tokens: int
    calls: list[Call]


def num_executables(runner) -> int:
    """Step executables the runner holds: jit-cache entries plus ahead-of-time compiled ones (warm-up)."""
    return runner._step._cache_size() + len(getattr(runner, "_compiled", ()))


class Recorder:
    """Wraps a runner's `_prepare`, step call and `execute` (instance attributes) to record every call.

    The step call is `_call_step` (which dispatches to the warm-up's ahead-of-time executables) where the runner
    has one, else the jitted `_step`.
    """

    def __init__(self, runner) -> None:
        self.calls: list[Call] = []
        self.runner = runner
        step_attr = "_call_step" if hasattr(runner, "_call_step") else "_step"
        prepare, step, execute = runner._prepare, getattr(runner, step_attr), runner.execute

        @functools.wraps(prepare)
        def _prepare(chunks, all_rows):
            out = prepare(chunks, all_rows)
            tokens, md, b_pad = out
            q = [len(c.token_ids) for c in chunks]
            kv = [c.num_computed_tokens + n for c, n in zip(chunks, q)]
            self.calls.append(Call(
                decode=max(q) == 1, tokens=sum(q), tokens_pad=int(tokens.shape[0]), seqs=len(chunks),
                seqs_pad=b_pad, max_q_pad=int(md.max_q_len), pages_pad=int(md.page_table.shape[1]),
                kv_tokens=sum(kv), attn_cells=sum(a * b for a, b in zip(q, kv)),
                attn_cells_pad=b_pad * int(md.max_q_len) * int(md.page_table.shape[1]) * runner.page_size))
            return out

        def _step(*a, **k):
            t0 = time.perf_counter()
            out = jax.block_until_ready(step(*a, **k))
            self.calls[-1].device_s = time.perf_counter() - t0
            return out

        @functools.wraps(execute)
        def _execute(chunks, rows):
            before = num_executables(runner)
            t0 = time.perf_counter()
            out = execute(chunks, rows)
            self.calls[-1].execute_s = time.perf_counter() - t0
            self.calls[-1].compiled = num_executables(runner) > before
            return out

        runner._prepare, runner.execute = _prepare, _execute
        setattr(runner, step_attr, _step)


@dataclasses.dataclass
class RunResult:
    """One pass of a scenario through the engine."""

    wall_s: float  # first arrival to last finish
    ttft_s: list[float]
    tpot_s: list[float]
    output_tokens: int
    steps: list[Step]
    host_time_s: float  # EngineMetrics.host_time_s over this run
    step_time_s: float  # EngineMetrics.step_time_s over this run
    preemptions: int
    bad_lengths: int  # requests that did not produce exactly their output length

    @property
    def calls(self) -> list[Call]:
        return [c for s in self.steps for c in s.calls]


def run_scenario(engine: Engine, recorder: Recorder, reqs: list[Request]) -> RunResult:
    """Adds each request at its arrival time and steps the engine until every request finished."""
    m = engine.metrics
    host0, step0, pre0 = m.host_time_s, m.step_time_s, engine.scheduler.num_preemptions
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    ids: dict[str, int] = {}
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    produced: dict[int, int] = {}
    steps: list[Step] = []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and reqs[pending[0]].arrival_s <= now:
            i = pending.pop(0)
            r = reqs[i]
            rid = engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                              ignore_eos=True))
            ids[rid] = i
        if not engine.has_unfinished_requests():
            time.sleep(max(reqs[pending[0]].arrival_s - (time.perf_counter() - t0), 0.0))
            continue
        n_calls = len(recorder.calls)
        pf, dc = m.num_prefill_tokens, m.num_decode_tokens
        s0 = time.perf_counter()
        outs = engine.step()
        steps.append(Step(wall_s=time.perf_counter() - s0, prefill_tokens=m.num_prefill_tokens - pf,
                          decode_tokens=m.num_decode_tokens - dc, calls=recorder.calls[n_calls:]))
        for out in outs:
            if out.finished:
                i = ids[out.request_id]
                first[i], finish[i] = out.metrics.first_token_time, out.metrics.finish_time
                produced[i] = len(out.outputs[0].token_ids)
    arrival = {i: t0 + r.arrival_s for i, r in enumerate(reqs)}
    ttft = [first[i] - arrival[i] for i in range(len(reqs))]
    tpot = [(finish[i] - first[i]) / (produced[i] - 1) for i in range(len(reqs)) if produced[i] > 1]
    return RunResult(wall_s=max(finish.values()) - t0, ttft_s=ttft, tpot_s=tpot, output_tokens=sum(produced.values()),
                     steps=steps, host_time_s=m.host_time_s - host0, step_time_s=m.step_time_s - step0,
                     preemptions=engine.scheduler.num_preemptions - pre0,
                     bad_lengths=sum(produced[i] != r.output_len for i, r in enumerate(reqs)))


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summarize(run: RunResult, weight_bytes: int, kv_bytes_per_token: int, dense_flops_per_token: float,
              lm_head_flops_per_row: float) -> dict:
    """Throughput, latency, padding, host share and decode roofline of one timed run."""
    dec_steps = [s for s in run.steps if s.prefill_tokens == 0 and s.decode_tokens > 0]
    pf_steps = [s for s in run.steps if s.prefill_tokens > 0]
    dec_calls = [c for s in dec_steps for c in s.calls]
    all_calls = run.calls
    out: dict = {
        "wall_s": run.wall_s, "output_tokens": run.output_tokens, "output_tok_s": run.output_tokens / run.wall_s,
        "ttft_p50": percentile(run.ttft_s, 50), "ttft_p99": percentile(run.ttft_s, 99),
        "tpot_p50": percentile(run.tpot_s, 50), "tpot_p99": percentile(run.tpot_s, 99),
        "steps": len(run.steps), "decode_steps": len(dec_steps), "prefill_steps": len(pf_steps),
        "preemptions": run.preemptions, "bad_lengths": run.bad_lengths,
        "compiled_calls": sum(c.compiled for c in all_calls),
        "engine_host_share": run.host_time_s / run.step_time_s if run.step_time_s else float("nan"),
        "outside_device_share": 1 - sum(c.device_s for c in all_calls) / sum(s.wall_s for s in run.steps),
    }
    if dec_steps:
        t = sum(s.wall_s for s in dec_steps)
        out["decode_tok_s"] = sum(s.decode_tokens for s in dec_steps) / t
        out["decode_step_ms_median"] = 1e3 * statistics.median(s.wall_s for s in dec_steps)
        out["decode_mean_batch"] = sum(s.decode_tokens for s in dec_steps) / len(dec_steps)
        # Roofline: every decode step must read all weights once plus the K/V of each sequence's real context.
        need = sum(weight_bytes + c.kv_tokens * kv_bytes_per_token for c in dec_calls)
        out["decode_gb_s"] = need / t / 1e9
        dense = sum(c.tokens * dense_flops_per_token + c.seqs * lm_head_flops_per_row for c in dec_calls)
        out["decode_dense_gflop_s"] = dense / t / 1e9
        out["decode_outside_device_share"] = 1 - sum(c.device_s for c in dec_calls) / t
    if pf_steps:
        pf_calls = [c for s in pf_steps for c in s.calls if not c.decode]
        dense = sum(c.tokens * dense_flops_per_token + c.seqs * lm_head_flops_per_row for c in pf_calls)
        dev = sum(c.device_s for c in pf_calls)
        out["prefill_tok_s_device"] = sum(c.tokens for c in pf_calls) / dev if dev else float("nan")
        out["prefill_dense_gflop_s"] = dense / dev / 1e9 if dev else float("nan")
    for kind, calls in (("decode", [c for c in all_calls if c.decode]), ("prefill", [c for c in all_calls
                                                                                     if not c.decode])):
        if calls:
            out[f"{kind}_token_pad"] = sum(c.tokens_pad for c in calls) / sum(c.tokens for c in calls)
            out[f"{kind}_attn_pad"] = sum(c.attn_cells_pad for c in calls) / sum(c.attn_cells for c in calls)
            out[f"{kind}_calls"] = len(calls)
    return out


def compile_seconds(warm: RunResult, timed: RunResult) -> tuple[int, float]:
    """Calls that compiled in the warm run, and their time beyond the timed run's median for the same shape."""
    steady: dict[tuple, list[float]] = {}
    for c in timed.calls + warm.calls:
        if not c.compiled:
            steady.setdefault(c.shape, []).append(c.execute_s)
    compiled = [c for c in warm.calls if c.compiled]
    extra = sum(max(c.execute_s - (statistics.median(steady[c.shape]) if c.shape in steady else 0.0), 0.0)
                for c in compiled)
    return len(compiled), extra


# --- what bounds a decode step ---------------------------------------------------------------------------------------


def decode_probe(engine: Engine, batch: int, contexts: tuple[int, int], dense_matmuls: Callable, reps: int = 5
                 ) -> dict[str, float]:
    """Median ms of a batch decode step: `execute` at two contexts (two page buckets) and only its dense matmuls.

    Call it when no request is live: the dummy sequences get distinct real pages (so the attention gathers
    distinct memory, as in serving), whose contents are garbage; with too few pages they share the null page.
    """
    runner = engine.runner
    greedy = SamplingRow(SamplingParams(temperature=0.0), seed=0)
    out = {}
    for ctx in contexts:
        n = -(-ctx // runner.page_size)
        if engine.scheduler.has_unfinished() or 1 + batch * n > runner.num_pages:
            chunks = [ScheduledChunk([1], ctx - 1, [NULL_PAGE] * n)] * batch
        else:
            chunks = [ScheduledChunk([1], ctx - 1, list(range(1 + b * n, 1 + (b + 1) * n))) for b in range(batch)]
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            runner.execute(chunks, [greedy] * batch)
            ts.append(time.perf_counter() - t0)
        out[f"execute_ctx{ctx}"] = 1e3 * statistics.median(ts[1:])
    # The attention alone: `num_layers` calls of the runner's attention over the same page tables.
    cfg = engine.model_config
    rng = np.random.default_rng(0)
    for ctx in contexts:
        n = -(-ctx // runner.page_size)
        width = page_bucket(n, runner.max_pages_per_seq)
        table = np.zeros((batch, width), np.int32)
        table[:, :n] = 1 + np.arange(batch * n).reshape(batch, n)
        shape = (1 + batch * n, cfg.num_kv_heads, runner.page_size, cfg.head_dim)
        k_pages = jnp.asarray(rng.standard_normal(shape), engine.dtype)
        v_pages = jnp.asarray(rng.standard_normal(shape), engine.dtype)
        q = jnp.asarray(rng.standard_normal((batch, cfg.num_heads, cfg.head_dim)), engine.dtype)
        kv_lens, cu = np.full(batch, ctx, np.int32), np.arange(batch + 1, dtype=np.int32)

        def attn() -> None:
            paged_attention_reference(q, k_pages, v_pages, kv_lens, table, cu, max_q_len=1,
                                      sm_scale=cfg.head_dim ** -0.5).block_until_ready()

        attn()
        ts = []
        for _ in range(4 * reps):
            t0 = time.perf_counter()
            attn()
            ts.append(time.perf_counter() - t0)
        out[f"attention_ctx{ctx}"] = 1e3 * cfg.num_layers * statistics.median(ts)
        del k_pages, v_pages
    rows = max(2, 1 << (batch - 1).bit_length())
    x = jnp.ones((rows, engine.model_config.hidden_size), engine.dtype)
    fn = jax.jit(dense_matmuls)
    fn(x, runner.weights).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x, runner.weights).block_until_ready()
        ts.append(time.perf_counter() - t0)
    out["dense"] = 1e3 * statistics.median(ts)
    out["rows"] = rows
    return out


# --- whole workload --------------------------------------------------------------------------------------------------


def model_flops(cfg) -> tuple[float, float]:
    """Dense matmul FLOPs per token through the layers, and per logits row of the LM head."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    return 2.0 * cfg.num_layers * per_layer, 2.0 * cfg.vocab_size * d


def run_ours(scenarios: list[Scenario], dtypes: list[str], dense_matmuls: Callable,
             model: str | None, probe: bool = True) -> tuple[dict, dict[str, list[Request]]]:
    """Every scenario through one Engine per dtype; returns ({dtype: {...}}, {scenario: requests})."""
    results: dict = {}
    requests: dict[str, list[Request]] = {}
    for dt in dtypes:
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=model, dtype=dt, page_size=PAGE_SIZE, warmup=False,
                                     max_num_seqs=max(32, max(sc.num_requests for sc in scenarios)),
                                     max_model_len=max_model_len(scenarios)))
        load_s = time.perf_counter() - t0
        # What EngineConfig(warmup=True) runs at the end of Engine.__init__, timed on its own.
        shapes0 = num_executables(engine.runner)
        warmup_s = warmup(engine.runner, max_num_seqs=engine.config.max_num_seqs,
                          max_num_batched_tokens=engine.config.max_num_batched_tokens)
        warmup_shapes = num_executables(engine.runner) - shapes0
        logger.info("%s: engine warm-up compiled %d shapes in %.1f s", dt, warmup_shapes, warmup_s)
        recorder = Recorder(engine.runner)
        cfg = engine.model_config
        if not requests:
            text_ids = engine.tokenizer.encode(TEXT_FILE.read_text())
            requests = {sc.name: make_requests(sc, text_ids) for sc in scenarios}
        wb = sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(engine.runner.weights))
        itemsize = jnp.dtype(engine.dtype).itemsize
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        dense_tok, lm_row = model_flops(cfg)
        per_dt: dict = {"load_s": load_s, "warmup_s": warmup_s, "warmup_shapes": warmup_shapes,
                        "max_model_len": engine.max_model_len, "weight_bytes": wb, "scenarios": {}}
        for sc in scenarios:
            reqs = requests[sc.name]
            max_pages = engine.runner.max_pages_per_seq
            warm = [dataclasses.replace(r, output_len=warm_output_len(len(r.prompt), r.output_len, max_pages))
                    for r in reqs]
            logger.info("%s %s: compile run (outputs cut to %d-%d tokens)", dt, sc.name,
                        min(r.output_len for r in warm), max(r.output_len for r in warm))
            t0 = time.perf_counter()
            warm_run = run_scenario(engine, recorder, warm)
            warm_wall = time.perf_counter() - t0
            logger.info("%s %s: timed run", dt, sc.name)
            load0 = os.getloadavg()[0]
            run = run_scenario(engine, recorder, reqs)
            s = summarize(run, wb, kv_per_token, dense_tok, lm_row)
            s["load_avg"] = (load0, os.getloadavg()[0])
            s["compiled_shapes"], s["compile_s"] = compile_seconds(warm_run, run)
            s["warm_wall_s"] = warm_wall
            logger.info("%s %s: %s", dt, sc.name, {k: round(v, 4) if isinstance(v, float) else v
                                                   for k, v in s.items()})
            per_dt["scenarios"][sc.name] = s
        if probe:
            b = min(scenarios[0].num_requests, engine.config.max_num_seqs)
            first = scenarios[0]
            ctx_hi = first.input_len[1] + first.output_len[1]
            ctx_lo = min(ctx_hi, MIN_PAGES * PAGE_SIZE)
            per_dt["probe"] = decode_probe(engine, b, (ctx_lo, ctx_hi), dense_matmuls)
            per_dt["probe"]["batch"] = b
            per_dt["probe"]["contexts"] = (ctx_lo, ctx_hi)
            per_dt["probe"]["widths"] = tuple(page_bucket(-(-c // PAGE_SIZE), engine.runner.max_pages_per_seq)
                                              for c in (ctx_lo, ctx_hi))
            logger.info("%s decode probe: %s", dt, per_dt["probe"])
        results[dt] = per_dt
        del engine, recorder
    return results, requests




def run_peer_process(cmd: list[str], timeout: int, prompt_file: str) -> dict:
    """Runs a peer script (it prints JSON as its last stdout line); returns that, or {"error": why}.

    Deletes `prompt_file` afterwards; the peer's `[peer]` stderr lines go to the log.
    """
    logger.info("peer: %s", shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout} s"}
    finally:
        os.unlink(prompt_file)
    for line in proc.stderr.splitlines():
        if line.startswith("[peer]"):
            logger.info("%s", line)
    if proc.returncode != 0:
        return {"error": f"peer exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer(python: str, model_path: Path, reqs: list[Request], dtypes: list[str], threads: int,
             timeout: int) -> dict:
    """HF transformers batched `generate` on the same prompts (scripts/peer_transformers.py, serving mode)."""
    if not Path(python).is_file():
        return {"error": f"peer interpreter {python} not found"}
    outs = {r.output_len for r in reqs}
    if len(outs) != 1:
        return {"error": "the peer needs one output length for the whole batch"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([r.prompt for r in reqs], f)
        prompt_file = f.name
    cmd = [python, str(Path(__file__).resolve().parent / "peer_transformers.py"), "--gguf", str(model_path),
           "--serving-prompts", prompt_file, "--serving-output-len", str(outs.pop()), "--dtypes", ",".join(dtypes),
           "--threads", str(threads)]
    load0 = os.getloadavg()[0]
    result = run_peer_process(cmd, timeout, prompt_file)
    if "error" in result:
        return result
    result["load_avg"] = (load0, os.getloadavg()[0])
    return result


# --- report --------------------------------------------------------------------------------------------------------


def render(r: dict) -> str:
    """The serving section of BENCHMARKS.md (between markers, so that a serving-only run can replace it)."""
    scenarios: list[Scenario] = r["scenarios"]
    ours: dict = r["ours"]
    peer: dict | None = r.get("peer")
    roof_bw = r["roof_bw"]
    head = scenarios[0]
    out = [SECTION_BEGIN, "## Serving workload\n"]
    out.append(
        "Requests through `Engine` (continuous batching, default `EngineConfig`: page size 16, `max_num_seqs` 32, "
        "`max_num_batched_tokens` 512, scan over layers; `max_model_len` "
        f"{next(iter(ours.values()))['max_model_len']}, the longest context rounded up to its page-table bucket, "
        "which gives the same step shapes as the default 8192 with fewer to warm up), driven directly: each "
        "request is added with `add_request` at its arrival time and `step` runs until all finish. Prompts are "
        "consecutive slices of the GPL-3 text tokenized with the model's tokenizer; every request is greedy with "
        "`ignore_eos=True` and `max_tokens` = its output length, so it produces exactly that many tokens. Per "
        "dtype, the engine first compiles what `EngineConfig(warmup=True)` compiles at start-up (every decode "
        "bucket and single-sequence prefill bucket; timed on its own below), then each scenario runs untimed "
        "with the same prompts and arrivals and outputs cut short (just long enough to reach the same KV page "
        "buckets), which "
        "compiles the remaining shapes (steps that prefill several sequences at once); the time of the calls that "
        "compiled is the compile-run column. The XLA persistent compilation cache was "
        + ("on" if r.get("compilation_cache") else "off (cold compiles)") + ". The machine is a shared 2-core VM: "
        "numbers move by 20% or more between runs (much more when other jobs run), so compare rows of one run.\n")
    out.append(
        "Definitions: **end-to-end** output tok/s = all output tokens / (last finish - first arrival); **TTFT** = "
        "first token - scheduled arrival; **TPOT** = (finish - first token) / (output tokens - 1); p50/p99 over "
        "requests; **decode-only** tok/s = tokens produced by steps that ran only decodes / those steps' wall time "
        "(host work included). For HF transformers (one batched `generate` of all prompts, left padding, greedy, "
        "`max_new_tokens = min_new_tokens` = output length, torch threads = "
        f"{peer.get('threads', '?') if peer else '?'}): TTFT = when the batch's first tokens reach the streamer "
        "(the whole batch's prefill), the same for every request; decode-only = N x (output - 1) / (total - TTFT).\n")
    out.append(f"This section comes from one run of:\n\n```\n{r['command']}\n```\n")
    out.append(f"- date: {r['date']}; total run time of the command: {r['elapsed_s'] / 60:.1f} min\n"
               f"- bandwidth measured in the same run (best probe): {roof_bw / 1e9:.1f} GB/s\n"
               f"- 1-minute load average at the start and end of each timed run (2 cores; well above 2 means other "
               f"jobs competed for the CPU): "
               + ", ".join(f"{dt} `{name}` {s['load_avg'][0]:.1f}-{s['load_avg'][1]:.1f}"
                           for dt, o in ours.items() for name, s in o["scenarios"].items())
               + (f", HF peer {peer['load_avg'][0]:.1f}-{peer['load_avg'][1]:.1f}"
                  if peer and "load_avg" in peer else "") + "\n"
               + "".join(f"- scenario `{sc.name}`: {sc.describe()}, seed {sc.seed}\n" for sc in scenarios))

    # headline: ours vs peer
    pres = (peer or {}).get("results", {})
    out.append(f"### Headline: `{head.name}` ({head.describe()}), jaxinfer vs HF transformers\n")
    rows = []
    for dt, o in ours.items():
        s = o["scenarios"][head.name]
        p = pres.get(dt)

        def cell(v: float, fmt: str) -> str:
            return fmt.format(v) if v is not None and not math.isnan(v) else "-"

        def ratio(a, b, invert=False):
            if a is None or b is None or not b or not a:
                return "-"
            return f"{(b / a) if invert else (a / b):.2f}x"

        rows.append([dt, "end-to-end output tok/s", cell(s["output_tok_s"], "{:.1f}"),
                     cell(p["output_tok_s"], "{:.1f}") if p else "-",
                     ratio(s["output_tok_s"], p["output_tok_s"]) if p else "-"])
        rows.append([dt, "decode-only tok/s", cell(s.get("decode_tok_s"), "{:.1f}"),
                     cell(p["decode_tok_s"], "{:.1f}") if p else "-",
                     ratio(s.get("decode_tok_s"), p["decode_tok_s"]) if p else "-"])
        rows.append([dt, "TTFT p50 / p99 s", f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f}",
                     f"{p['ttft_s']:.2f} / {p['ttft_s']:.2f}" if p else "-",
                     ratio(s["ttft_p50"], p["ttft_s"], invert=True) + " (p50)" if p else "-"])
        rows.append([dt, "TPOT p50 / p99 ms", f"{1e3 * s['tpot_p50']:.0f} / {1e3 * s['tpot_p99']:.0f}",
                     f"{1e3 * p['tpot_s']:.0f} / {1e3 * p['tpot_s']:.0f}" if p else "-",
                     ratio(s["tpot_p50"], p["tpot_s"], invert=True) + " (p50)" if p else "-"])
        rows.append([dt, "wall s (first arrival to last finish)", f"{s['wall_s']:.1f}",
                     f"{p['total_s']:.1f}" if p else "-", "-"])
    out.append(md_sections.table(["dtype", "metric", "jaxinfer", "HF transformers", "jaxinfer / HF (higher is better)"],
                      rows))
    out.append("")
    if peer is None:
        out.append("HF transformers peer skipped (`--peer-python` not given).\n")
    elif "error" in peer:
        out.append(f"HF transformers peer not run: {peer['error']}.\n")
    else:
        out.append(f"HF transformers {peer['transformers']}, torch {peer['torch']}, same GGUF file dequantized to "
                   "the dtype, same prompt ids. llama.cpp (llama-cpp-python) is not compared: the package index "
                   "here offers only its source distribution, no prebuilt CPU wheel, and building llama.cpp from "
                   "source was out of this run's time budget.\n")

    # all scenarios, ours
    out.append("### jaxinfer, every scenario\n")
    rows = []
    for dt, o in ours.items():
        for sc in scenarios:
            s = o["scenarios"][sc.name]
            rows.append([sc.name, dt, f"{s['output_tok_s']:.1f}", f"{s.get('decode_tok_s', float('nan')):.1f}",
                         f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f}",
                         f"{1e3 * s['tpot_p50']:.0f} / {1e3 * s['tpot_p99']:.0f}", f"{s['wall_s']:.1f}",
                         f"{s['steps']} ({s['decode_steps']} decode-only)", str(s["preemptions"]),
                         f"{s['compiled_shapes']} / {s['compile_s']:.1f}", str(s["compiled_calls"])])
    out.append(md_sections.table(["scenario", "dtype", "e2e out tok/s", "decode-only tok/s", "TTFT p50 / p99 s",
                       "TPOT p50 / p99 ms", "wall s", "steps", "preemptions",
                       "compile run: shapes / s", "compiles in timed run"], rows))
    out.append("")
    out.append("Engine start-up: model load + KV cache allocation "
               + ", ".join(f"{dt} {o['load_s']:.1f} s" for dt, o in ours.items())
               + "; start-up compile (`EngineConfig(warmup=True)`) "
               + ", ".join(f"{dt} {o['warmup_shapes']} shapes in {o['warmup_s']:.1f} s" for dt, o in ours.items())
               + ".\n")

    # efficiency
    out.append(f"### Where the time goes (jaxinfer, `{head.name}`)\n")
    out.append(
        "Padding: rows the runner computes / real tokens (token buckets are powers of two, at least 2 for decode "
        "and 16 for prefill), and attention score cells the reference attention computes (padded sequences x "
        "padded query run x page-table width x 16) / the cells of the real (new tokens x context) pairs. Host share: "
        "`EngineMetrics.host_time_s / step_time_s` (scheduler and output bookkeeping; the engine counts the whole "
        "`execute` call, host padding included, as device time), and the share of step wall time outside the "
        "jitted step itself (blocked until ready; so host padding, transfers and sampling-array building are "
        "counted as host). Decode roofline: bytes a decode-only step must read (all weights + the K/V of every "
        "sequence's real context) per second of decode-only step time, as a share of the measured bandwidth. "
        "Dense GFLOP/s: the forward's matmul FLOPs (projections, MLP, LM head on the sampled rows) per second of "
        "decode-only step wall time, and per second of the prefill calls' device time.\n")
    rows = []
    for dt, o in ours.items():
        s = o["scenarios"][head.name]
        g = functools.partial(lambda d, k, fmt: fmt.format(d.get(k, float("nan"))), s)
        rows.append([dt, f"{g('decode_token_pad', '{:.2f}')} / {g('decode_attn_pad', '{:.2f}')}",
                     f"{g('prefill_token_pad', '{:.2f}')} / {g('prefill_attn_pad', '{:.2f}')}",
                     f"{100 * s['engine_host_share']:.1f}%", f"{100 * s['outside_device_share']:.1f}%",
                     f"{g('decode_step_ms_median', '{:.0f}')} (batch {g('decode_mean_batch', '{:.0f}')})",
                     f"{g('decode_gb_s', '{:.1f}')} GB/s = "
                     f"{100 * s.get('decode_gb_s', float('nan')) * 1e9 / roof_bw:.0f}%",
                     f"{g('decode_dense_gflop_s', '{:.0f}')} / {g('prefill_dense_gflop_s', '{:.0f}')}"])
    out.append(md_sections.table(["dtype", "decode padding: tokens / attention", "prefill padding: tokens / attention",
                       "engine host share", "outside jitted step", "decode-only step ms (median)",
                       "decode bytes rate = % of roofline", "dense GFLOP/s: decode / prefill calls"], rows))
    out.append("")
    probes = {dt: o["probe"] for dt, o in ours.items() if "probe" in o}
    if probes:
        pr0 = next(iter(probes.values()))
        lo, hi = pr0["contexts"]
        out.append(f"A decode step of batch {pr0['batch']} on its own (`ModelRunner.execute`, median of 5; dummy "
                   "sequences on distinct pages): at context "
                   f"{lo} ({-(-lo // PAGE_SIZE)} pages, page-table bucket {pr0['widths'][0]}) "
                   f"and {hi} ({-(-hi // PAGE_SIZE)} pages, bucket {pr0['widths'][1]} pages = "
                   f"{pr0['widths'][1] * PAGE_SIZE} tokens computed per sequence), and only "
                   f"the dense matmuls of the forward ({pr0['rows']} rows, 30 layers + LM head; "
                   "`_dense_matmuls` of the breakdown section), and only the attention (`paged_attention_reference`, "
                   "the runner's attention, on the same page tables, timed per call x 30 layers). The parts run "
                   "on their own, so they need not add up exactly to the step.\n")
        out.append(md_sections.table(["dtype", f"execute ctx {lo} ms", f"execute ctx {hi} ms", "dense matmuls only ms",
                           f"attention only ctx {lo} ms", f"attention only ctx {hi} ms",
                           f"rest at ctx {hi} ms (execute - dense - attention)"],
                          [[dt, f"{p[f'execute_ctx{lo}']:.0f}", f"{p[f'execute_ctx{hi}']:.0f}", f"{p['dense']:.0f}",
                            f"{p[f'attention_ctx{lo}']:.0f}", f"{p[f'attention_ctx{hi}']:.0f}",
                            f"{p[f'execute_ctx{hi}'] - p['dense'] - p[f'attention_ctx{hi}']:.0f}"]
                           for dt, p in probes.items()]))
        out.append("")
    notes = observations(r) + compile_notes(r)
    if notes:
        out.append("### Observations\n")
        out.append("\n".join(f"- {n}" for n in notes) + "\n")
    out.append(SECTION_END)
    return "\n".join(out)


def observations(r: dict) -> list[str]:
    """Findings computed from the numbers of this run."""
    notes = []
    head: Scenario = r["scenarios"][0]
    pres = (r.get("peer") or {}).get("results", {})
    parts = []
    for dt, o in r["ours"].items():
        s, p = o["scenarios"][head.name], pres.get(dt)
        if p:
            parts.append(f"{dt}: end-to-end {s['output_tok_s'] / p['output_tok_s']:.2f}x, decode-only "
                         f"{s['decode_tok_s'] / p['decode_tok_s']:.2f}x, TTFT p50 {s['ttft_p50']:.1f} s vs "
                         f"{p['ttft_s']:.1f} s")
    if parts:
        text = f"**Against HF transformers** at `{head.name}`: " + "; ".join(parts) + "."
        if head.offline:
            per_step = 512 // head.input_len[1] if head.input_len[1] <= 512 else 0
            text += (" HF prefills the whole batch in one forward, so every request waits for all of it; the engine "
                     f"admits prompts within its 512-token step budget ({per_step} x {head.input_len[1]} tokens per "
                     "step here), so early requests get their first token sooner and the last ones later (TTFT p99), "
                     "while the running ones keep decoding in between.")
        notes.append(text)
    for dt, o in r["ours"].items():
        s, p = o["scenarios"][head.name], o.get("probe")
        if "decode_tok_s" not in s:
            continue
        share = s["decode_gb_s"] * 1e9 / r["roof_bw"]
        verdict = "so memory bandwidth is not the limit" if share < 0.5 else "close to the memory-bandwidth limit"
        text = (f"**What bounds decode ({dt}).** Decode-only steps move {s['decode_gb_s']:.1f} GB/s of "
                f"weights + real KV, {100 * share:.0f}% of the measured bandwidth, {verdict} at batch "
                f"{s['decode_mean_batch']:.0f}; their dense matmuls run at "
                f"{s['decode_dense_gflop_s']:.0f} GFLOP/s against {s.get('prefill_dense_gflop_s', float('nan')):.0f} "
                "in the prefill calls of the same run.")
        if p:
            lo, hi = p["contexts"]
            step, at_hi, at_lo = p[f"execute_ctx{hi}"], p[f"attention_ctx{hi}"], p[f"attention_ctx{lo}"]
            text += (f" In the isolated batch-{p['batch']} step at context {hi} ({step:.0f} ms), the dense matmuls "
                     f"take {p['dense']:.0f} ms ({100 * p['dense'] / step:.0f}%) and the reference attention "
                     f"{at_hi:.0f} ms ({100 * at_hi / step:.0f}%): it computes every sequence over its whole page "
                     f"bucket ({p['widths'][1] * PAGE_SIZE} tokens at context {hi}; buckets grow 4x), against "
                     f"{at_lo:.0f} ms at context {lo}, where the whole step takes {p[f'execute_ctx{lo}']:.0f} ms.")
        text += (f" Host work is {100 * s['outside_device_share']:.0f}% of step time (engine bookkeeping alone "
                 f"{100 * s['engine_host_share']:.1f}%).")
        notes.append(text)
    return notes


def compile_notes(r: dict) -> list[str]:
    """A note on compiles that happened in timed runs (their time is inside the timed numbers)."""
    hits = [f"{dt} `{name}` {s['compiled_calls']}" for dt, o in r["ours"].items()
            for name, s in o["scenarios"].items() if s["compiled_calls"]]
    if not hits:
        return ["**Compiles.** No step compiled during a timed run: start-up warm-up plus the short compile run "
                "covered every shape."]
    return ["**Compiles.** Some steps of timed runs still compiled a new shape (" + ", ".join(hits) + "): with "
            "Poisson arrivals the mix of sequences prefilled together in one step differs from the compile run's, "
            "and `EngineConfig(warmup=True)` compiles only single-sequence prefill shapes; each such compile (about "
            "1-2 s) lands in that run's TTFT / TPOT tail."]


def splice(existing: str, section: str) -> str:
    """Replaces the serving section in an existing report, or appends it."""
    return md_sections.splice(existing, section, SECTION_BEGIN, SECTION_END)
