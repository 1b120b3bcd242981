"""The measuring half of `jaxinfer bench pipeline`, run by it in a child process whose `XLA_FLAGS` give it fake CPU
devices before jax starts (`python -m jaxinfer.benchmarks.pipeline_worker --pps 2,4 --micro 1,2,4,8 ...`).

For each stage count pp, step kind and micro-batch count M: `models.pipeline.pipeline_forward` on a random Llama
(`init_weights`) split over pp stages, jitted with an `EventLog` (per stage and micro-batch, the wall-clock
interval of the stage's work, recorded by the running program: `models.pipeline_events`), `WARMUP_STEPS` steps,
then `reps` timed steps. Step kinds, T rows each: `uniform` (T decodes, each at `context` tokens of context) and
`uneven` (one T/2-token prefill chunk of a new sequence, then T/2 decodes). Prints one JSON object as its last
stdout line: {"rows": [...], "model": {...}, "devices": N}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import numpy as np

from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, init_weights
from models.partition import shard_model
from models.pipeline import num_microbatches_for, pad_layers, pipeline_forward, stage_layout, staged_config
from models.pipeline_events import EventLog, Interval, idle_shares, textbook_idle
from sharding.mesh import make_mesh

WARMUP_STEPS = 2
PAGE_SIZE = 16
MODEL = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=512, intermediate_size=1536, num_layers=8,
                    num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=4096, name="random-llama-8x512")


def make_batch(rows: int, context: int, prefill: int, vocab: int) -> tuple[np.ndarray, AttentionMetadata, int]:
    """A step of `rows` token rows: a `prefill`-token chunk of a new sequence (none when 0), then `rows - prefill`
    decodes each at `context` tokens of context; pages numbered from 1 in order. (tokens i32[rows], metadata,
    pages used + 1)."""
    lens = ([prefill] if prefill else []) + [1] * (rows - prefill)
    kv = ([prefill] if prefill else []) + [context] * (rows - prefill)
    per_seq = -(-max(kv) // PAGE_SIZE)
    table = np.arange(1, 1 + len(lens) * per_seq, dtype=np.int32).reshape(len(lens), per_seq)
    positions = np.concatenate([np.arange(k - q, k) for q, k in zip(lens, kv)]).astype(np.int32)
    seq = np.repeat(np.arange(len(lens)), lens)
    kv_loc = (table[seq, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    meta = AttentionMetadata(positions=positions, cu_q_lens=cu, kv_lens=np.array(kv, np.int32), page_table=table,
                             kv_loc=kv_loc, logits_indices=(cu[1:] - 1).astype(np.int32), max_q_len=max(lens))
    tokens = np.random.default_rng(0).integers(3, vocab, rows).astype(np.int32)
    return tokens, meta, int(table.max()) + 1


def record_steps(cfg: ModelConfig, pp: int, micro: int, tokens: np.ndarray, meta: AttentionMetadata,
                 num_pages: int, steps: int, events: bool = True) -> tuple[list[list[Interval]], list[float]]:
    """Runs `WARMUP_STEPS + steps` pipelined steps; (the intervals of each timed step, its wall time in s)."""
    layout = stage_layout(cfg.num_layers, pp)
    mesh = make_mesh(pp=pp)
    weights = jax.tree.map(np.asarray, pad_layers(init_weights(cfg, jax.random.key(0)), layout))
    model = shard_model(staged_config(cfg, layout), weights, mesh)
    sharding = model.kv_cache_sharding()
    cache = jax.device_put(KVCache.zeros(model.cfg, num_pages, PAGE_SIZE), KVCache(sharding, sharding))
    log = EventLog() if events else None
    step = jax.jit(functools.partial(pipeline_forward, cfg=model.cfg, mesh=mesh, num_microbatches=micro, events=log),
                   donate_argnums=3)
    tokens, meta = jax.device_put((tokens, meta))
    intervals, walls = [], []
    for i in range(WARMUP_STEPS + steps):
        t0 = time.perf_counter()
        logits, cache = step(model.weights, tokens, meta, cache)
        jax.block_until_ready((logits, cache))
        wall = time.perf_counter() - t0
        got = log.take() if log is not None else []
        if i >= WARMUP_STEPS:
            intervals.append(got)
            walls.append(wall)
    return intervals, walls


def measure(cfg: ModelConfig, pp: int, kind: str, micro: int, rows: int, context: int, reps: int) -> dict:
    """One row: medians over `reps` steps of the step's wall time, the pipeline span and each stage's idle share;
    the last step's intervals as [stage, micro-batch, start ns, end ns] from its first start."""
    tokens, meta, pages = make_batch(rows, context, rows // 2 if kind == "uneven" else 0, cfg.vocab_size)
    steps, walls = record_steps(cfg, pp, micro, tokens, meta, pages, reps)
    shares = [idle_shares(s, pp) for s in steps]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    t0 = min(i.start_ns for i in steps[-1])
    return {"pp": pp, "kind": kind, "micro": micro, "micro_used": num_microbatches_for(rows, micro), "rows": rows,
            "step_ms": 1e3 * med(walls), "span_ms": med([s["span_ms"] for s in shares]),
            "idle": [med([s["idle"][k] for s in shares]) for k in range(pp)],
            "busy_ms": [med([s["busy_ms"][k] for s in shares]) for k in range(pp)],
            "textbook": textbook_idle(num_microbatches_for(rows, micro), pp),
            "intervals": [[i.stage, i.micro, i.start_ns - t0, i.end_ns - t0] for i in steps[-1]]}


def overhead(cfg: ModelConfig, pp: int, micro: int, rows: int, context: int, reps: int) -> dict:
    """Median step wall time (ms) of one uniform step with and without recording."""
    tokens, meta, pages = make_batch(rows, context, 0, cfg.vocab_size)
    out = {"pp": pp, "micro": micro}
    for events in (False, True):
        _, walls = record_steps(cfg, pp, micro, tokens, meta, pages, reps, events)
        out["with_events_ms" if events else "without_ms"] = 1e3 * statistics.median(walls)
    return out


def main() -> None:
    """Parses the options, measures every (pp, kind, M) row, prints the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--pps", required=True)
    ap.add_argument("--micro", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--hidden", type=int, default=MODEL.hidden_size, help="hidden size (MLP 3x, heads of 64)")
    args = ap.parse_args()
    cfg = dataclasses.replace(MODEL, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                              num_heads=max(2, args.hidden // 64), num_kv_heads=2)
    pps, micros = [int(p) for p in args.pps.split(",")], [int(m) for m in args.micro.split(",")]
    rows = [measure(cfg, pp, kind, m, args.rows, args.context, args.reps)
            for pp in pps for kind in ("uniform", "uneven") for m in micros]
    cost = overhead(cfg, pps[0], micros[-1], args.rows, args.context, args.reps)
    model = {"name": cfg.name, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.intermediate_size}
    print(json.dumps({"rows": rows, "overhead": cost, "model": model, "devices": jax.device_count()}))


if __name__ == "__main__":
    main()
