"""Drives an `Engine` through a serving scenario and records every device call: the serving workload's
measurements (throughput, TTFT / TPOT, padding, host share, decode roofline, compile seconds).

Requests are added with `Engine.add_request` when their arrival time has come (checked before every step; an idle
engine sleeps until the next arrival) and `Engine.step` runs until all finish. `Recorder` wraps the runner's
padding and jitted step to record each call's padded shapes and blocked device time.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxinfer.benchmarks.serving_scenarios import Request
from jaxinfer.engine.engine import Engine
from jaxinfer.sampling_params import SamplingParams


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
        """(padded tokens, padded sequences, padded query run, page-table width): what selects the executable."""
        return (self.tokens_pad, self.seqs_pad, self.max_q_pad, self.pages_pad)


@dataclasses.dataclass
class Step:
    """One `Engine.step`: its wall time, the prefill and decode tokens it computed, and its device calls."""

    wall_s: float
    prefill_tokens: int
    decode_tokens: int
    calls: list[Call]


def num_executables(runner) -> int:
    """Executables a runner holds: its table of compiled calls, warm-up's and those a new shape added. Reads
    `ModelRunner` internals (`_compiled`), like `_hook_runner_internals`."""
    return len(runner._compiled)


def _hook_runner_internals(runner, on_prepare: Callable, on_step: Callable) -> None:
    """Wraps the runner's padding (`_prepare`) and its step dispatch (`_call`) by instance attributes.

    The one place this module reaches into `ModelRunner` internals (re-point it when they move):
    `_prepare(chunks, all_rows, ...) -> (tokens, metadata, padded batch)` and `_call(kind, *args)`, which runs the
    "step" (or "verify") call through warm-up's ahead-of-time executable for its shapes or else the jitted
    `_step`; hooking `_call` rather than `_step` times both. `on_prepare(chunks, tokens, metadata, padded_batch)`
    runs after each padding; `on_step(seconds)` gets each step's device time, blocked until its outputs are ready.
    """
    prepare, call = runner._prepare, runner._call

    @functools.wraps(prepare)
    def _prepare(chunks, *args, **kwargs):
        out = prepare(chunks, *args, **kwargs)
        on_prepare(chunks, *out)
        return out

    def _call(kind, *args):
        t0 = time.perf_counter()
        out = jax.block_until_ready(call(kind, *args))
        if kind == "step":
            on_step(time.perf_counter() - t0)
        return out

    runner._prepare, runner._call = _prepare, _call


class Recorder:
    """Records every `ModelRunner.execute` call of one runner as a `Call` (shapes, device and execute seconds,
    whether it compiled), by wrapping the runner's methods (see `_hook_runner_internals`).

    Attributes:
      calls: the recorded calls, oldest first.
    """

    def __init__(self, runner) -> None:
        self.calls: list[Call] = []
        self.runner = runner
        _hook_runner_internals(runner, self._on_prepare, self._on_step)
        execute = runner.execute

        @functools.wraps(execute)
        def _execute(chunks, rows, **kwargs):
            before = num_executables(runner)
            t0 = time.perf_counter()
            out = execute(chunks, rows, **kwargs)
            self.calls[-1].execute_s = time.perf_counter() - t0
            self.calls[-1].compiled = num_executables(runner) > before
            return out

        runner.execute = _execute

    def _on_prepare(self, chunks, tokens, md, b_pad: int) -> None:
        q = [len(c.token_ids) for c in chunks]
        kv = [c.num_computed_tokens + n for c, n in zip(chunks, q)]
        self.calls.append(Call(
            decode=max(q) == 1, tokens=sum(q), tokens_pad=int(tokens.shape[0]), seqs=len(chunks),
            seqs_pad=b_pad, max_q_pad=int(md.max_q_len), pages_pad=int(md.page_table.shape[1]),
            kv_tokens=sum(kv), attn_cells=sum(a * b for a, b in zip(q, kv)),
            attn_cells_pad=b_pad * int(md.max_q_len) * int(md.page_table.shape[1]) * self.runner.page_size))

    def _on_step(self, seconds: float) -> None:
        self.calls[-1].device_s = seconds


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
        """Every device call of the run, in order."""
        return [c for s in self.steps for c in s.calls]


def run_scenario(engine: Engine, recorder: Recorder, reqs: list[Request]) -> RunResult:
    """Adds each request at its arrival time and steps the engine until every request finished.

    The prefix cache is reset first: the compile run sends the same prompts just before the timed run, and their
    cached pages would turn the timed run's prefills into one-token steps.
    """
    engine.reset_prefix_cache()
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
    """The q-th percentile (0-100) of `xs`; NaN for an empty list."""
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summarize(run: RunResult, weight_bytes: int, kv_bytes_per_token: int, dense_flops_per_token: float,
              lm_head_flops_per_row: float) -> dict:
    """Throughput, latency, padding, host share and decode roofline of one timed run.

    Args:
      run: the timed run.
      weight_bytes: bytes of all weights (what every decode step reads once).
      kv_bytes_per_token: K and V bytes of one token over all layers.
      dense_flops_per_token, lm_head_flops_per_row: from `dense_matmuls.model_flops`.

    Returns:
      {metric: value}: seconds (`wall_s`, `ttft_p50`...), tokens/s (`output_tok_s`, `decode_tok_s`...), GB/s
      (`decode_gb_s`), GFLOP/s, shares in [0, 1], padding ratios (>= 1) and counts.
    """
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

