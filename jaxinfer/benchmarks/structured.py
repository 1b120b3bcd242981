r"""`jaxinfer bench structured`: what structured output costs per step: decode tokens/s of constrained against
unconstrained requests at batch 1 and 32, in one engine.

Each batch size runs three passes of B greedy requests with `ignore_eos` and `max_tokens` `--max-tokens` (so every
pass generates the same number of tokens), added at once and stepped to the end: unconstrained, then constrained by
a regex that any text of letters, digits, spaces and punctuation matches (the mask is computed but cuts little),
then by a JSON schema (an object with a free string field: a real grammar state per token). Each pass runs once
untimed first (compiles, and builds llguidance's token table). Reported: tokens/s of each pass (all generated
tokens / wall time), its ratio to the unconstrained pass, and the host seconds per step spent in llguidance (the
masks and the consumed tokens, timed around `Grammars.allowed` / `Grammars.consume`).

Expectation, written before measuring: llguidance computes a mask in ~0.1-2 ms per row on this CPU; a decode step
of SmolLM2 bf16 takes ~35 ms at batch 1 and ~100-150 ms at batch 32, so constrained tokens/s should be within
~5% of unconstrained at batch 1 and ~10-30% lower at batch 32 (32 masks computed one after the other on the host
before the step; the unpacking on device is cheap).

    .venv/bin/jaxinfer bench structured --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import platform
import time

from jaxinfer.benchmarks.report import Report, machine_line, table
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.sampling_params import SamplingParams

SECTION = ("<!-- structured-output: begin -->", "<!-- structured-output: end -->")
CONSTRAINTS = {"none": None, "regex": {"regex": r"[A-Za-z0-9 ,.;:'!?\-]{1,4000}"},
               "json": {"json": {"type": "object", "properties": {"story": {"type": "string"}},
                                 "required": ["story"]}}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")


class _Timed:
    """Wraps the engine's `Grammars` methods to add up their host seconds."""

    def __init__(self, grammars) -> None:
        self.seconds = 0.0
        for name in ("allowed", "consume"):
            setattr(grammars, name, self._wrap(getattr(grammars, name)))

    def _wrap(self, fn):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def _pass(engine: Engine, timed: _Timed, batch: int, max_tokens: int, constraint: dict | None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint)
    for i in range(batch):
        engine.add_request(f"Tell me a short story about the number {i}.", params)
    steps0, grammar0, tokens = engine.stats()["steps"], timed.seconds, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(c.delta_token_ids) for out in engine.step() for c in out.outputs)
    wall = time.perf_counter() - t0
    steps = engine.stats()["steps"] - steps0
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": steps,
            "grammar_ms_per_step": (timed.seconds - grammar0) / max(steps, 1) * 1e3}


def run(args: argparse.Namespace) -> Report:
    """Runs every batch size and constraint; the report (`data`: rows of batch, constraint, tok_s, ratio,
    grammar_ms_per_step, steps, tokens).

    Raises:
      ValueError: bad options.
    """
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.max_tokens < 2:
        raise ValueError("--batches must list sizes >= 1 and --max-tokens be >= 2")
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(batches), warmup=False,
                                 enable_prefix_caching=False))
    timed = _Timed(engine.grammars)
    rows = []
    for batch in batches:
        base = None
        for kind, constraint in CONSTRAINTS.items():
            _pass(engine, timed, batch, args.max_tokens, constraint)  # compiles this batch's shapes
            r = _pass(engine, timed, batch, args.max_tokens, constraint)
            base = r["tok_s"] if kind == "none" else base
            rows.append({"batch": batch, "constraint": kind, **r, "ratio": r["tok_s"] / base})
    cells = [[str(r["batch"]), r["constraint"], f"{r['tok_s']:.1f}", f"{r['ratio']:.2f}",
              f"{r['grammar_ms_per_step']:.2f}", str(r["steps"])] for r in rows]
    markdown = "\n".join([
        "## Structured output\n",
        "`jaxinfer bench structured`: per batch size, B greedy requests of "
        f"{args.max_tokens} tokens (`ignore_eos`) stepped to the end in one engine ({args.dtype}, prefix caching "
        "off): unconstrained, a regex any prose matches, and a JSON schema; each pass once untimed first. tok/s = "
        "generated tokens / wall time (prefill included); llguidance ms per step = host time computing masks and "
        "consuming tokens.\n",
        "```", args.command, "```\n",
        f"- date: {args.date}; model {engine.model_config.name}; {machine_line()}, Python "
        f"{platform.python_version()}\n",
        table(["batch", "constraint", "tok/s", "vs none", "llguidance ms / step", "steps"], cells), ""])
    return Report("structured", markdown, {"rows": rows, "settings": {"batches": batches, "dtype": args.dtype,
                                                                      "max_tokens": args.max_tokens}})
