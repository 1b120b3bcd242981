"""One-call device check for a lent GPU (run by `scripts/gpu_check.sh`): tests, kernel accuracy, kernel speed, engine.

The machine has no network and nothing over 64 MiB can be sent to it, so models are random weights of real shapes
(the shapes, not the values, set the speed). Six sections, each with its own time budget and its own try/except,
so that one failure keeps the others; the markdown report is rewritten after every row, so a run killed by the
outer timeout still leaves everything measured so far.

1. tests: `pytest -m accelerator` over the test files that use the marker, in a subprocess that runs before this
   process touches the GPU.
2. kernels: `paged_attention_gpu` (decodes, prefill chunks, ragged mixes) and `flash_attention_gpu` (packed fresh
   prompts) against `paged_attention_reference` / `flash_attention_reference`, Llama-3-8B heads (32 query / 8 KV,
   head dim 128, bf16), contexts 1k-32k. Where a reference's score matrix would not fit (`--ref-limit-gb`) it runs
   per sequence over chunks of queries: chunk [c0, c1) of a sequence with q_len q and kv_len L is the same
   attention as a step with q_len c1 - c0 at kv_len L - q + c1 (flash cases are first copied into pages).
3. timing: decode (paged kernel, q_len 1): HBM GB/s = bytes of K and V in the batch's contexts / time, beside
   `paged_attention_reference` and `jax.nn.dot_product_attention` over the same cache gathered contiguous;
   prefill (flash kernel): TFLOP/s = 4 * (T^2 / 2) * N * H causal flops / time, beside
   `jax.nn.dot_product_attention(is_causal=True)` (cuDNN, else XLA).
4. engine: `ModelRunner` with random Llama-3-8B-shaped bf16 weights decoding for a few seconds at batch 1 and 64
   (Pallas kernels with the layers scanned, then unrolled into a Python loop over per-layer arrays, then the XLA
   reference, as time allows): tokens/s beside the HBM roofline, bytes one step
   must read (weights + the batch's KV) / peak bandwidth (`PEAK_HBM_BYTES_S`, or `--peak-hbm-gbs`).
5. quant: the same model with its weights quantized on device (`models.quant`): bf16, fp8 weight-only, fp8 w8a8,
   int8 w8a8, int4 group 32, MXFP8 (weight-only and w8a8), MXFP4, NVFP4 (those this tree has), each decoding at batch 1 and the largest engine batch beside its own roofline (its weight bytes),
   with XLA's memory analysis of the batch-1 decode step, the full-precision weight copies in it (XLA:GPU should
   fuse the converts into the dots: none), and its prefill logits' largest difference from bf16's.
6. qmatmul: the weight-only int8 / int4 matmul kernel (`pallas_kernels.quant_matmul.weight_only_matmul_gpu`) at
   Llama-3-8B decode shapes (rows 1 / 4 / 8) against its f32 reference, and its speed beside XLA's dot on the weight
   dequantized inside the jitted call (`qeinsum`'s path) and on a bf16 weight: GB/s of weight bytes read.

    python scripts/gpu_check.py [--quick] [--out FILE] [--budget-s 265]
                                [--sections tests,kernels,timing,engine,quant,qmatmul]
                                [--section-budget tests=120 ...]
    python scripts/gpu_check.py --dry-run    # everything on CPU at tiny sizes, the GPU kernels in interpret mode
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# bytes/s of HBM; the longest matching substring of `device.device_kind` wins. Vendor data sheets, except "cpu"
# (measured on the project's 2-core CI machine, /work/shared/JAX_ON_CPU.md).
PEAK_HBM_BYTES_S = {
    "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "H20": 4.0e12, "GH200": 4.0e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12,
    "TPU v6 lite": 1.64e12, "TPU v5p": 2.765e12, "TPU v5 lite": 0.819e12, "TPU v4": 1.2e12, "cpu": 45e9,
}
# Elementwise |kernel - reference| <= atol + rtol * |reference|, as in tests/pallas_kernels (bf16: the kernels round
# each KV block's probabilities to bf16, the reference the normalised ones; f32: Triton runs f32 dots as TF32).
TOL = {"bfloat16": dict(atol=3e-2, rtol=2e-2), "float32": dict(atol=5e-3, rtol=5e-3)}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape the run uses. Cases are tuples so that the presets below read as tables."""

    name: str
    heads: tuple[int, int, int]  # N, K, H
    page_size: int
    decode: tuple[tuple[int, int], ...]  # correctness, q_len 1: (batch, context)
    mixed: tuple[tuple[tuple[int, int], ...], ...]  # correctness, one ragged batch each: ((q_len, kv_len), ...)
    flash: tuple[tuple[int, ...], ...]  # correctness: lengths of the fresh sequences packed in one call
    time_decode: tuple[tuple[int, int], ...]  # (batch, context)
    time_prefill: tuple[tuple[int, int], ...]  # (sequences, length each)
    model: dict  # ModelConfig fields of the engine's model
    engine_batches: tuple[int, ...]
    engine_context: int
    engine_seconds: float
    engine_backends: tuple[str, ...]  # "pallas" / "reference", "-unrolled" for a Python loop over the layers
    quant_seconds: float  # decode timed per format and batch in section 5
    qmatmul: tuple[tuple[int, int], ...]  # section 6: (K, N) of the weight
    qmatmul_rows: tuple[int, ...]
    ref_limit_bytes: float  # largest reference score matrix computed in one call
    xla_limit_bytes: float  # largest [B, N, T, T] f32 score matrix XLA's own prefill attention may materialise
    min_time_s: float  # per timing sample
    budgets_s: dict  # per section


LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e5, max_position_embeddings=8192,
                 tie_word_embeddings=False, name="llama3-8b-shaped")
GPU = Sizes(
    name="gpu", heads=(32, 8, 128), page_size=16,
    decode=((1, 1024), (64, 1024), (8, 4096), (32, 4096), (4, 16384), (1, 32768), (16, 32768)),
    mixed=(((1, 1024), (512, 4096), (1, 16384), (256, 256)),  # decodes, a chunk ending a 4k context, a fresh one
           ((1024, 32768),),  # a long chunk at 32k: the reference runs in chunks
           ((16, 16), (1, 1), (300, 3000), (1, 17), (33, 33))),  # lengths that are not page or tile multiples
    flash=((1024,), (4096,), (1000, 3000, 77), (512,) * 8, (16384,), (32768,)),
    time_decode=((1, 1024), (64, 1024), (1, 32768), (64, 4096), (16, 16384), (64, 32768), (1, 4096), (8, 16384)),
    time_prefill=((1, 1024), (1, 4096), (1, 16384), (1, 32768), (8, 4096)),
    model=LLAMA3_8B, engine_batches=(1, 64), engine_context=1024, engine_seconds=3.0,
    engine_backends=("pallas", "pallas-unrolled", "reference"), quant_seconds=1.5, ref_limit_bytes=12e9,
    xla_limit_bytes=24e9, qmatmul=((4096, 14336), (14336, 4096)), qmatmul_rows=(1, 4, 8),
    min_time_s=0.05, budgets_s=dict(tests=55, kernels=35, timing=35, engine=65, quant=45, qmatmul=30),
)
QUICK = dataclasses.replace(
    GPU, name="quick", decode=((1, 1024), (32, 4096), (1, 32768)), mixed=GPU.mixed[:1],
    flash=((1024,), (1000, 3000, 77), (16384,)), time_decode=((1, 1024), (64, 4096), (1, 32768)),
    time_prefill=((1, 4096), (1, 16384)), engine_seconds=2.0, engine_backends=("pallas",), quant_seconds=1.0,
    qmatmul_rows=(1, 8), budgets_s=dict(tests=55, kernels=25, timing=30, engine=65, quant=45, qmatmul=25),
)
TINY = Sizes(
    name="tiny", heads=(8, 2, 32), page_size=16,
    decode=((1, 40), (3, 70)), mixed=(((1, 20), (17, 50), (5, 5)),), flash=((33,), (20, 9, 3), (16,)),
    time_decode=((1, 64), (4, 128)), time_prefill=((1, 64), (2, 32)),
    model=dict(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
               num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=5e5, max_position_embeddings=512,
               tie_word_embeddings=False, name="tiny-llama3-shaped"),
    engine_batches=(1, 4), engine_context=48, engine_seconds=0.3,
    engine_backends=("pallas", "pallas-unrolled", "reference"),
    quant_seconds=0.2, ref_limit_bytes=50e3, xla_limit_bytes=1e9, qmatmul=((256, 320),), qmatmul_rows=(1, 8),
    min_time_s=0.01, budgets_s=dict(tests=120, kernels=120, timing=120, engine=120, quant=120, qmatmul=120),
)


# --- report -----------------------------------------------------------------------------------------------------------


class Report:
    """Markdown report, rewritten to `path` after every change so that a killed run keeps what it measured."""

    def __init__(self, path: Path | None):
        self.path, self.header, self.sections, self.problems = path, [], [], []

    def section(self, title: str) -> list[str]:
        lines = [f"## {title}", ""]
        self.sections.append(lines)
        print(f"\n## {title}\n", flush=True)
        self.flush()
        return lines

    def add(self, lines: list[str], line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        self.flush()

    def problem(self, what: str) -> None:
        self.problems.append(what)

    def flush(self) -> None:
        if self.path is not None:
            text = "\n".join(self.header + [""] + [ln for s in self.sections for ln in s + [""]])
            self.path.write_text(text + "\n")


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300].replace("|", "/")


def guarded(report: Report, lines: list[str], what: str, fn: Callable[[], None]) -> None:
    """Runs one case; an exception becomes a report row (traceback on stderr) and the section goes on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (any failure of one case must not lose the others)
        traceback.print_exc()
        report.add(lines, f"- **{what} failed**: `{first_line(e)}`")
        report.problem(f"{what}: {first_line(e)}")


def time_call(fn: Callable[[], object], min_time_s: float) -> float:
    """Seconds per call: after a warm-up call, 3 samples of n back-to-back async calls (n so that a sample lasts
    about `min_time_s`), each sample ended by waiting for the last result; the median."""
    import jax

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    n = max(1, min(200, int(min_time_s / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


# --- 1. accelerator tests ---------------------------------------------------------------------------------------------


def section_tests(report: Report, args: argparse.Namespace, budget: Budget) -> None:
    lines = report.section("1. Accelerator tests (`pytest -m accelerator`)")
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.accelerator" in p.read_text())
    if not files:
        report.add(lines, "- no test file uses `@pytest.mark.accelerator`")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "-p", "no:cacheprovider", "--durations=8", *files]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if args.platform:
        env["JAX_PLATFORMS"] = args.platform
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(budget.left(), 5))
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, rc = out + f"\n[killed after {time.perf_counter() - t0:.0f} s: section budget]", -1
    if report.path is not None:
        (report.path.parent / "pytest.txt").write_text(" ".join(cmd) + "\n\n" + out)
    summary = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
    report.add(lines, f"- `{' '.join(['pytest', '-m', 'accelerator', *files])}`: exit {rc} in "
                      f"{time.perf_counter() - t0:.0f} s: `{summary[0].strip()}` (full log: pytest.txt)")
    for ln in out.splitlines():
        if ln.startswith(("FAILED", "ERROR")):
            report.add(lines, f"  - `{ln[:300]}`")
    if rc not in (0, 5):  # 5: nothing collected
        report.problem(f"accelerator tests exit {rc}")


# --- 2. kernels against references ------------------------------------------------------------------------------------


@dataclasses.dataclass
class PagedCase:
    """A ragged batch over a shuffled, garbage-filled single-layer cache; `seqs` = ((q_len, kv_len), ...)."""

    seqs: tuple[tuple[int, int], ...]
    q: object  # [T, N, H]
    k_pages: object  # [P, K, page_size, H]
    v_pages: object
    kv_lens: object  # i32[B]
    page_table: object  # i32[B, W]
    cu_q_lens: object  # i32[B + 1]
    max_q_len: int


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def num(x: float) -> str:
    """3 significant digits without exponents for the sizes seen here: 4,812 / 48.1 / 0.481 / 0.00481."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def make_paged_case(seqs, sizes: Sizes, dtype, seed: int, pad_rows: int = 3) -> PagedCase:
    import jax
    import jax.numpy as jnp
    import numpy as np

    n, k, h = sizes.heads
    ps = sizes.page_size
    pages = [-(-kv // ps) for _, kv in seqs]
    num_pages = 1 + sum(pages) + 3  # null page, the sequences' pages, spares nothing uses
    rng = np.random.default_rng(seed)
    free = 1 + rng.permutation(num_pages - 1)
    table = np.zeros((len(seqs), max(pages)), np.int32)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = free[used: used + p]
        used += p
    q_lens = [q for q, _ in seqs]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    keys = jax.random.split(jax.random.key(seed), 3)
    # Every page, the null page and spares included, holds N(0, 1) values: a mask leak changes the output.
    k_pages = jax.random.normal(keys[0], (num_pages, k, ps, h), dtype)
    v_pages = jax.random.normal(keys[1], (num_pages, k, ps, h), dtype)
    q = jax.random.normal(keys[2], (int(cu[-1]) + pad_rows, n, h), dtype)
    max_q = 1 if max(q_lens) == 1 else max(16, _next_pow2(max(q_lens)))  # the runner's bucket rule
    return PagedCase(tuple(seqs), q, k_pages, v_pages, jnp.asarray([kv for _, kv in seqs], jnp.int32),
                     jnp.asarray(table), jnp.asarray(cu), max_q)


def _paged_ref_bytes(num_seqs: int, max_q: int, width_tokens: int, sizes: Sizes, itemsize: int) -> float:
    n, k, h = sizes.heads
    return num_seqs * n * max_q * width_tokens * 4 * 2 + 2 * num_seqs * k * width_tokens * h * itemsize


def errors(ref, out) -> tuple[float, float]:
    """(max |out - ref|, max of |out - ref| / (atol + rtol |ref|)) in f32; the second is <= 1 when within TOL."""
    import jax.numpy as jnp

    tol = TOL[str(out.dtype)]
    ref, out = ref.astype(jnp.float32), out.astype(jnp.float32)
    diff = jnp.abs(out - ref)
    return float(jnp.max(diff, initial=0.0)), float(jnp.max(diff / (tol["atol"] + tol["rtol"] * jnp.abs(ref)),
                                                            initial=0.0))


def compare_paged(case: PagedCase, out, sizes: Sizes) -> tuple[float, float, str]:
    """`errors` of `out` [T, N, H] against `paged_attention_reference`: over the whole batch, or per sequence in
    query chunks when the whole batch's score matrix would exceed `sizes.ref_limit_bytes`."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_attention_reference

    sm_scale = sizes.heads[2] ** -0.5
    width = case.page_table.shape[1] * sizes.page_size
    itemsize = case.q.dtype.itemsize
    if _paged_ref_bytes(len(case.seqs), case.max_q_len, width, sizes, itemsize) <= sizes.ref_limit_bytes:
        ref = paged_attention_reference(case.q, case.k_pages, case.v_pages, case.kv_lens, case.page_table,
                                        case.cu_q_lens, max_q_len=case.max_q_len, sm_scale=sm_scale)
        return (*errors(ref, out), "whole batch")
    cu = np.asarray(case.cu_q_lens)
    err, ratio, calls = 0.0, 0.0, 0
    for b, (q_len, kv_len) in enumerate(case.seqs):
        gathers = _paged_ref_bytes(1, 0, width, sizes, itemsize)
        per_row = _paged_ref_bytes(1, 1, width, sizes, itemsize) - gathers
        fit = int(max((sizes.ref_limit_bytes - gathers) / per_row, 1))  # query rows whose scores fit the limit
        chunk = min(_next_pow2(q_len), 1 << (fit.bit_length() - 1))
        for c0 in range(0, q_len, chunk):
            c1 = min(c0 + chunk, q_len)
            rows = case.q[cu[b] + c0: cu[b] + c1]
            rows = jnp.pad(rows, ((0, chunk - (c1 - c0)), (0, 0), (0, 0)))
            ref = paged_attention_reference(
                rows, case.k_pages, case.v_pages, jnp.asarray([kv_len - q_len + c1], jnp.int32),
                case.page_table[b: b + 1], jnp.asarray([0, c1 - c0], jnp.int32), max_q_len=chunk, sm_scale=sm_scale)
            e, r = errors(ref[: c1 - c0], out[cu[b] + c0: cu[b] + c1])
            err, ratio, calls = max(err, e), max(ratio, r), calls + 1
    e, r = errors(jnp.zeros_like(out[int(cu[-1]):]), out[int(cu[-1]):])  # padding rows must be 0
    return max(err, e), max(ratio, r), f"per sequence, {calls} chunked calls"


def flash_as_paged(q, k, v, lengths, sizes: Sizes, max_q: int) -> PagedCase:
    """The same fresh sequences as a paged batch (pages in order after the null page), for the chunked oracle."""
    import jax.numpy as jnp
    import numpy as np

    ps = sizes.page_size
    _, kh, h = k.shape
    pages, starts, kp, vp = [], np.concatenate([[0], np.cumsum(lengths)]), [jnp.zeros((1, kh, ps, h), k.dtype)], []
    vp.append(kp[0])
    for b, n in enumerate(lengths):
        p = -(-n // ps)
        pages.append(p)
        for src, dst in ((k, kp), (v, vp)):
            x = jnp.pad(src[starts[b]: starts[b] + n], ((0, p * ps - n), (0, 0), (0, 0)))
            dst.append(x.reshape(p, ps, kh, h).transpose(0, 2, 1, 3))
    table = np.zeros((len(lengths), max(pages)), np.int32)
    first = 1
    for b, p in enumerate(pages):
        table[b, :p] = np.arange(first, first + p)
        first += p
    return PagedCase(tuple((n, n) for n in lengths), q, jnp.concatenate(kp), jnp.concatenate(vp),
                     jnp.asarray(lengths, jnp.int32), jnp.asarray(table), jnp.asarray(starts, jnp.int32), max_q)


def section_kernels(report: Report, sizes: Sizes, args: argparse.Namespace, budget: Budget) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_reference
    from pallas_kernels.paged_attention import paged_attention_gpu

    n, k, h = sizes.heads
    dtype, dname = jnp.bfloat16, "bfloat16"
    sm_scale = h**-0.5
    lines = report.section(f"2. Kernels against references ({n} query / {k} KV heads, head dim {h}, {dname}, "
                           f"page size {sizes.page_size}, inputs N(0, 1))")
    report.add(lines, f"Pass: |kernel - reference| <= {TOL[dname]['atol']:g} + {TOL[dname]['rtol']:g} |reference| "
                      "everywhere (err / tol <= 1); padding rows must be 0. Kernels compiled with the default block "
                      "sizes (`pallas_kernels.block_sizes`); s = case total (data, compile, run, reference).\n")
    report.add(lines, "| kernel | case | reference computed | max abs err | worst err / tol | status | s |")
    report.add(lines, "|---|---|---|---|---|---|---|")

    def row(kernel: str, label: str, err: float, ratio: float, how: str, t0: float) -> None:
        ok = ratio <= 1.0
        if not ok:
            report.problem(f"{kernel} {label}: max abs err {err:.3g}, {ratio:.2f}x the tolerance")
        report.add(lines, f"| {kernel} | {label} | {how} | {err:.2e} | {ratio:.2f} | {'ok' if ok else '**MISMATCH**'} "
                          f"| {time.perf_counter() - t0:.1f} |")

    paged_budget = Budget(budget.left() * 0.6)  # the rest is the flash cases
    cases = [(f"decode b{b} ctx {c}", ((1, c),) * b) for b, c in sizes.decode]
    cases += [("mixed " + " ".join(f"{q}/{kv}" for q, kv in seqs) + " (q_len/kv_len)", seqs) for seqs in sizes.mixed]
    for i, (label, seqs) in enumerate(cases):
        if paged_budget.left() <= 0:
            report.add(lines, f"| paged | {label} | skipped: budget spent | | | | |")
            continue

        def paged_case(label=label, seqs=seqs, i=i):
            t0 = time.perf_counter()
            case = make_paged_case(seqs, sizes, dtype, seed=i)
            out = paged_attention_gpu(case.q, case.k_pages, case.v_pages, case.kv_lens, case.page_table,
                                      case.cu_q_lens, max_q_len=case.max_q_len, sm_scale=sm_scale,
                                      interpret=args.interpret)
            row("paged", label, *compare_paged(case, out, sizes), t0)

        guarded(report, lines, f"paged {label}", paged_case)

    for i, lengths in enumerate(sizes.flash):
        label = "fresh " + ("+".join(map(str, lengths)) if len(set(lengths)) > 1 else
                            f"{len(lengths)} x {lengths[0]}" if len(lengths) > 1 else str(lengths[0]))
        if budget.left() <= 0:
            report.add(lines, f"| flash | {label} | skipped: budget spent | | | | |")
            continue

        def flash_case(label=label, lengths=lengths, i=i):
            t0 = time.perf_counter()
            total = sum(lengths)
            t_pad = total + 5  # a few padding rows past cu_q_lens[-1]
            keys = jax.random.split(jax.random.key(100 + i), 3)
            q = jax.random.normal(keys[0], (t_pad, n, h), dtype)
            kk = jax.random.normal(keys[1], (t_pad, k, h), dtype)
            vv = jax.random.normal(keys[2], (t_pad, k, h), dtype)
            cu = jnp.asarray([0, *itertools.accumulate(lengths)], jnp.int32)
            out = flash_attention_gpu(q, kk, vv, cu, sm_scale=sm_scale, interpret=args.interpret)
            if n * t_pad * t_pad * 4 * 2 <= sizes.ref_limit_bytes:
                ref = flash_attention_reference(q, kk, vv, cu, sm_scale=sm_scale)
                err, ratio, how = *errors(ref, out), "whole"
            else:
                case = flash_as_paged(q, kk, vv, lengths, sizes, max_q=max(lengths))
                err, ratio, how = compare_paged(case, out, sizes)
                how = "as pages, " + how
            row("flash", label, err, ratio, how, t0)

        guarded(report, lines, f"flash {label}", flash_case)


# --- 3. kernel speed --------------------------------------------------------------------------------------------------


def xla_attention(q, k, v, *, causal: bool, kv_lens=None, impls=("cudnn", "xla")):
    """`jax.nn.dot_product_attention` with the first implementation of `impls` that runs; returns (call, impl)."""
    import jax

    errors = []
    for impl in impls:
        fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=impl))
        call = (lambda fn=fn: fn(q, k, v, key_value_seq_lengths=kv_lens)) if kv_lens is not None else \
            (lambda fn=fn: fn(q, k, v))
        try:
            jax.block_until_ready(call())
            return call, impl
        except Exception as e:  # noqa: BLE001  (cuDNN refuses some shapes and every CPU)
            errors.append(f"{impl}: {first_line(e)[:120]}")
    raise RuntimeError("; ".join(errors))


def section_timing(report: Report, sizes: Sizes, args: argparse.Namespace, budget: Budget, peak: float | None) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention import flash_attention_gpu
    from pallas_kernels.paged_attention import paged_attention_gpu, paged_attention_reference

    n, k, h = sizes.heads
    dtype = jnp.bfloat16
    sm_scale = h**-0.5
    note = " (interpret mode: interpreter speed, not kernel speed)" if args.interpret else ""
    lines = report.section(f"3. Kernel speed{note}")
    report.add(lines, "Decode, one layer, q_len 1, every sequence at the full context, pages shuffled. GB/s = bytes "
                      "of K and V in the contexts / time; `dpa` = `jax.nn.dot_product_attention` over the same cache "
                      "already gathered contiguous [B, S, K, H] (its gather is not timed).\n")
    pct = "% of peak" if peak else "% of peak (no peak known)"
    report.add(lines, f"| batch | context | K+V MB | kernel us | kernel GB/s | {pct} | reference us | reference GB/s "
                      "| dpa (impl) us | dpa GB/s | kernel speed-up vs best XLA |")
    report.add(lines, "|---|---|---|---|---|---|---|---|---|---|---|")
    decode_budget = Budget(budget.left() * 0.6)  # the rest is prefill
    for i, (batch, context) in enumerate(sizes.time_decode):
        if decode_budget.left() <= 0:
            report.add(lines, f"| {batch} | {context} | skipped: section budget spent |||||||||")
            continue

        def decode_case(batch=batch, context=context, i=i):
            case = make_paged_case(((1, context),) * batch, sizes, dtype, seed=1000 + i, pad_rows=0)
            kv_bytes = 2 * batch * context * k * h * jnp.dtype(dtype).itemsize
            args_ = (case.q, case.k_pages, case.v_pages, case.kv_lens, case.page_table, case.cu_q_lens)
            common = dict(max_q_len=1, sm_scale=sm_scale)
            t_kernel = time_call(lambda: paged_attention_gpu(*args_, **common, interpret=args.interpret),
                                 sizes.min_time_s)
            t_ref = time_call(lambda: paged_attention_reference(*args_, **common), sizes.min_time_s)
            cells = [num(t_ref * 1e6), num(kv_bytes / t_ref / 1e9)]
            best = t_ref
            try:  # the contiguous cache [B, S, K, H], gathered once outside the timing
                gather = lambda p: p[case.page_table].transpose(0, 1, 3, 2, 4).reshape(batch, -1, k, h)  # noqa: E731
                kc, vc = gather(case.k_pages), gather(case.v_pages)
                call, impl = xla_attention(case.q[:, None], kc, vc, causal=False, kv_lens=case.kv_lens)
                t_dpa = time_call(call, sizes.min_time_s)
                best = min(best, t_dpa)
                cells += [f"{num(t_dpa * 1e6)} ({impl})", num(kv_bytes / t_dpa / 1e9)]
            except Exception as e:  # noqa: BLE001
                cells += [f"failed: {first_line(e)[:80]}", ""]
            gbs = kv_bytes / t_kernel / 1e9
            report.add(lines, f"| {batch} | {context} | {num(kv_bytes / 1e6)} | {num(t_kernel * 1e6)} | {num(gbs)} | "
                              f"{f'{100 * gbs * 1e9 / peak:.0f}%' if peak else '-'} | {' | '.join(cells)} | "
                              f"{best / t_kernel:.2f}x |")

        guarded(report, lines, f"decode timing b{batch} ctx {context}", decode_case)

    report.add(lines, "\nPrefill of fresh prompts (flash kernel), causal: TFLOP/s = 4 * (T^2 / 2) * N * H per "
                      "sequence / time; `dpa` = `jax.nn.dot_product_attention(is_causal=True)` on [B, T, N, H].\n")
    report.add(lines, "`paged ms`: the same prompts through the ragged paged kernel (K/V read back from pages, "
                      "as if prefilled in one chunk): whether one kernel could serve both uses.\n")
    report.add(lines, "| sequences x tokens | kernel ms | kernel TFLOP/s | dpa (impl) ms | dpa TFLOP/s "
                      "| kernel speed-up | paged ms | flash speed-up over paged |")
    report.add(lines, "|---|---|---|---|---|---|---|---|")
    for i, (seqs, length) in enumerate(sizes.time_prefill):
        if budget.left() <= 0:
            report.add(lines, f"| {seqs} x {length} | skipped: section budget spent |||||")
            continue

        def prefill_case(seqs=seqs, length=length, i=i):
            keys = jax.random.split(jax.random.key(2000 + i), 3)
            t = seqs * length
            q = jax.random.normal(keys[0], (t, n, h), dtype)
            kk = jax.random.normal(keys[1], (t, k, h), dtype)
            vv = jax.random.normal(keys[2], (t, k, h), dtype)
            cu = jnp.arange(seqs + 1, dtype=jnp.int32) * length
            flops = seqs * 4 * length * length / 2 * n * h
            t_kernel = time_call(lambda: flash_attention_gpu(q, kk, vv, cu, sm_scale=sm_scale,
                                                             interpret=args.interpret), sizes.min_time_s)
            # XLA's own attention materialises [B, N, T, T] f32 scores: at 32k tokens that is 137 GB.
            fits = seqs * n * length * length * 4 <= sizes.xla_limit_bytes
            try:
                shape = lambda x: x.reshape(seqs, length, *x.shape[1:])  # noqa: E731
                call, impl = xla_attention(shape(q), shape(kk), shape(vv), causal=True,
                                           impls=("cudnn", "xla") if fits else ("cudnn",))
                t_dpa = time_call(call, sizes.min_time_s)
                cells = [f"{num(t_dpa * 1e3)} ({impl})", num(flops / t_dpa / 1e12), f"{t_dpa / t_kernel:.2f}x"]
            except Exception as e:  # noqa: BLE001
                cells = [f"failed: {first_line(e)[:100]}" + ("" if fits else " (XLA not tried: scores too big)"),
                         "", ""]
            try:
                pc = flash_as_paged(q, kk, vv, [length] * seqs, sizes, _next_pow2(length))
                t_paged = time_call(lambda: paged_attention_gpu(
                    pc.q, pc.k_pages, pc.v_pages, pc.kv_lens, pc.page_table, pc.cu_q_lens, max_q_len=pc.max_q_len,
                    sm_scale=sm_scale, interpret=args.interpret), sizes.min_time_s)
                cells += [num(t_paged * 1e3), f"{t_paged / t_kernel:.2f}x"]
            except Exception as e:  # noqa: BLE001
                cells += [f"failed: {first_line(e)[:100]}", ""]
            report.add(lines, f"| {seqs} x {length} | {num(t_kernel * 1e3)} | {num(flops / t_kernel / 1e12)} | "
                              + " | ".join(cells) + " |")

        guarded(report, lines, f"prefill timing {seqs}x{length}", prefill_case)


# --- 4. engine --------------------------------------------------------------------------------------------------------

_MODELS: dict[str, tuple] = {}  # sizes.name -> (cfg, weights, init seconds): sections 4 and 5 share one model


def random_model(sizes: Sizes) -> tuple:
    """(ModelConfig, random bf16 `Weights` on device, seconds the first initialisation took) of `sizes.model`,
    made once per run."""
    if sizes.name not in _MODELS:
        import jax
        import jax.numpy as jnp

        from models.config import ModelConfig
        from models.llama import init_weights

        cfg = ModelConfig(**sizes.model)
        t0 = time.perf_counter()
        weights = jax.block_until_ready(init_weights(cfg, jax.random.key(0), jnp.bfloat16))
        _MODELS[sizes.name] = (cfg, weights, time.perf_counter() - t0)
    return _MODELS[sizes.name]


def attention_ops(backend: str, interpret: bool):
    """The `AttentionOps` of "pallas" (the GPU kernels in interpret mode when `interpret`) or "reference"."""
    from pallas_kernels.dispatch import AttentionOps, select_attention

    if backend == "pallas" and interpret:
        from pallas_kernels.flash_attention import flash_attention_gpu
        from pallas_kernels.paged_attention import paged_attention_gpu

        return AttentionOps("pallas-gpu-interpret", functools.partial(paged_attention_gpu, interpret=True),
                            functools.partial(flash_attention_gpu, interpret=True))
    return select_attention(backend)


def kv_token_bytes(cfg) -> int:
    """Bytes of one token's bf16 K and V over all layers."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def step_weight_bytes(cfg, weights) -> float:
    """Weight bytes one decode step reads (plain or quantized): all but the embedding table, of which it gathers
    one row per token (a tied table is the LM head too, read whole)."""
    from models import quant

    return quant.weight_bytes(weights)["bytes"] - (0 if cfg.tie_word_embeddings else weights.embed.nbytes)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Where the engine sections' decode runs: every sequence starts at `sizes.engine_context` on pages of its own
    and steps at most `max_steps` times, inside the starting page-table bucket (crossing it would compile a new
    step shape mid-timing)."""

    context: int
    max_steps: int
    pages_per_seq: int
    max_pages: int

    @staticmethod
    def of(cfg, sizes: Sizes) -> DecodePlan:
        from jaxinfer.engine.step_inputs import page_bucket

        ps, ctx = sizes.page_size, sizes.engine_context
        max_pages = -(-cfg.max_position_embeddings // ps)
        max_steps = page_bucket(-(-(ctx + 1) // ps), max_pages) * ps - ctx - 3
        return DecodePlan(ctx, max_steps, -(-(ctx + max_steps + 3) // ps), max_pages)

    def num_pages(self, max_batch: int) -> int:
        return 1 + max_batch * self.pages_per_seq

    def chunks(self, tokens: list[int], pos: int) -> list:
        from jaxinfer.scheduler.chunk import ScheduledChunk

        return [ScheduledChunk([t], pos, list(range(1 + b * self.pages_per_seq, 1 + (b + 1) * self.pages_per_seq)))
                for b, t in enumerate(tokens)]

    def decode(self, runner, batch: int, seconds: float) -> tuple[list[float], list[int], int]:
        """Greedy decode of `batch` sequences, each feeding back its token: at least 3 steps, then until the
        timed ones (all but the first 2) took about `seconds`. Returns (seconds per `execute` call, the last
        tokens, the position after the last step)."""
        from jaxinfer.engine.sampling import SamplingRow
        from jaxinfer.sampling_params import SamplingParams

        rows = [SamplingRow(SamplingParams(temperature=0), 0)] * batch
        tokens, pos = [7 + b for b in range(batch)], self.context
        times: list[float] = []
        t_start = time.perf_counter()
        while len(times) < 2 + self.max_steps and (len(times) < 3 or time.perf_counter() - t_start
                                                    < seconds + sum(times[:2])):
            t0 = time.perf_counter()
            res = runner.execute(self.chunks(tokens, pos), rows)
            times.append(time.perf_counter() - t0)
            tokens, pos = [int(t) for t in res.token_ids], pos + 1
        return times, tokens, pos


def section_engine(report: Report, sizes: Sizes, args: argparse.Namespace, budget: Budget, peak: float | None) -> None:
    lines = report.section(f"4. Engine decode ({sizes.model['name']}, random bf16 weights, `ModelRunner`, "
                           "scan over layers unless `unrolled`, greedy)")
    import jax
    import jax.numpy as jnp

    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.scheduler.chunk import ScheduledChunk
    from jaxinfer.engine.sampling import SamplingRow
    from jaxinfer.sampling_params import SamplingParams

    cfg, weights, init_s = random_model(sizes)
    leaves = jax.tree.leaves(weights)
    w_bytes = sum(x.nbytes for x in leaves)
    step_w_bytes = step_weight_bytes(cfg, weights)
    kv_tok = kv_token_bytes(cfg)
    report.add(lines, f"Weights: {fmt_bytes(w_bytes)} ({sum(x.size for x in leaves) / 1e6:,.1f} M params), "
                      f"initialised on device in {init_s:.1f} s. Each sequence starts at context "
                      f"{sizes.engine_context} (its cache is zeros: attention reads it all the same) and feeds back "
                      f"its greedy token; steps timed for ~{sizes.engine_seconds:g} s after 2 untimed ones (the first "
                      "compiles). Times are whole `execute` calls (host padding, transfer, step, sampling, sync). "
                      f"Roofline = batch / (bytes per step / peak): weights {fmt_bytes(step_w_bytes)} (the "
                      f"embedding table is gathered, not read) + KV {fmt_bytes(kv_tok)} per context "
                      f"token; peak {f'{peak / 1e12:.2f} TB/s' if peak else 'unknown (--peak-hbm-gbs)'}.\n")
    report.add(lines, "| attention | batch | context | compile s | steps | ms/step | tok/s | bytes read/step "
                      "| roofline tok/s | % of roofline |")
    report.add(lines, "|---|---|---|---|---|---|---|---|---|---|")
    greedy = SamplingParams(temperature=0)
    plan = DecodePlan.of(cfg, sizes)
    ctx = plan.context
    verify_rows = []  # speculative decoding's verify step beside the decode step (calibrates policy.py's knee)
    for backend in sizes.engine_backends:
        if budget.left() <= 0:
            report.add(lines, f"| {backend} | skipped: section budget spent |||||||||")
            continue
        # Unrolled: one array per layer weight and a Python loop over layers, so no step slices a layer's weights
        # out of the stacked arrays (whether those slices are copied is what bounds decode on CPU: issue 18).
        attention, unrolled = backend.removesuffix("-unrolled"), backend.endswith("-unrolled")
        ops = attention_ops(attention, args.interpret)
        ops = dataclasses.replace(ops, name=ops.name + " unrolled") if unrolled else ops
        runner = ModelRunner(cfg, weights, num_pages=plan.num_pages(max(sizes.engine_batches)),
                             page_size=sizes.page_size, kv_dtype=jnp.bfloat16, scan_layers=not unrolled,
                             attention=ops, max_pages_per_seq=plan.max_pages)
        for batch in sizes.engine_batches:
            if budget.left() <= 0:
                report.add(lines, f"| {ops.name} | {batch} | skipped: section budget spent ||||||||")
                continue

            def decode(batch=batch, runner=runner, ops=ops):
                times, tokens, pos = plan.decode(runner, batch, sizes.engine_seconds)
                rows = [SamplingRow(greedy, 0)] * batch
                timed = times[2:]
                step_s = sum(timed) / len(timed)
                mean_ctx = ctx + 2 + len(timed) / 2
                step_bytes = step_w_bytes + batch * mean_ctx * kv_tok
                roof = batch * peak / step_bytes if peak else None
                report.add(lines, f"| {ops.name} | {batch} | {ctx}-{pos} | {times[0] - step_s:.1f} | {len(timed)} | "
                                  f"{num(step_s * 1e3)} | {num(batch / step_s)} | {fmt_bytes(step_bytes)} | "
                                  f"{num(roof) if roof else '-'} | "
                                  f"{f'{100 * batch / step_s / roof:.0f}%' if roof else '-'} |")
                # A verify step of k drafts per sequence at the same context (drafts are arbitrary ids; the
                # step's cost does not depend on them): its time over the decode step's is what speculation pays.
                k = 4
                chunks = [ScheduledChunk([c.token_ids[0]] + [11] * k, ctx, c.page_ids)
                          for c in plan.chunks(tokens, ctx)]
                vt = [0.0] * 3
                for i in range(3):
                    t0 = time.perf_counter()
                    runner.execute_verify(chunks, rows, [[11] * k] * batch, k)
                    vt[i] = time.perf_counter() - t0
                verify_s = min(vt[1:])
                verify_rows.append(f"| {ops.name} | {batch} | {k} | {batch * (k + 1)} | {num(verify_s * 1e3)} | "
                                   f"{verify_s / step_s:.2f} |")

            guarded(report, lines, f"engine {ops.name} batch {batch}", decode)
        del runner
    if verify_rows:
        report.add(lines, "\nSpeculative decoding's verify step (last token + k drafts per sequence, "
                          "`ModelRunner.execute_verify`, best of 2 after a compiling call) against the decode step "
                          "above: while the ratio stays near 1 the step is bandwidth-bound and drafts are nearly free "
                          "(`jaxinfer.engine.spec_decode.policy.DEFAULT_MAX_STEP_TOKENS`).\n")
        report.add(lines, "| attention | batch | k | token rows | verify ms/step | / decode step |")
        report.add(lines, "|---|---|---|---|---|---|")
        for row in verify_rows:
            report.add(lines, row)


# --- 5. quantized weights ---------------------------------------------------------------------------------------------

# (label, QuantizationConfig kwargs or None for the unquantized baseline), the baseline first.
QUANT_FORMATS = (
    ("bf16", None),
    ("fp8 weight-only", dict(format="fp8")),
    ("fp8 w8a8", dict(format="fp8", quantize_activations=True)),
    ("int8 w8a8", dict(format="int8")),
    ("int4 g32 weight-only", dict(format="int4")),
    ("mxfp8 weight-only", dict(format="mxfp8")),
    ("mxfp8 w8a8", dict(format="mxfp8", quantize_activations=True)),
    ("mxfp4 weight-only", dict(format="mxfp4")),
    ("nvfp4 weight-only", dict(format="nvfp4")),
)  # a format this tree's models.quant.FORMATS lacks is skipped with a note
QUANT_PROMPT_TOKENS = 12  # the prefill whose logits are compared with bf16's
QUANT_MAX_LOGIT_ERR = 0.5  # max |logits - bf16| / max |bf16| above this: a broken matmul path, not rounding


def section_quant(report: Report, sizes: Sizes, args: argparse.Namespace, budget: Budget, peak: float | None) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.scheduler.chunk import ScheduledChunk
    from jaxinfer.engine.sampling import SamplingRow
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.benchmarks import hlo
    from models import quant

    backend = "reference" if args.interpret else "pallas"
    lines = report.section(f"5. Quantized weights ({sizes.model['name']}, the random model of section 4, "
                           f"`ModelRunner` with {backend} attention, greedy)")
    cfg, weights, _ = random_model(sizes)
    plan = DecodePlan.of(cfg, sizes)
    batches = (1, max(sizes.engine_batches))
    kv_tok = kv_token_bytes(cfg)
    on_cpu = jax.default_backend() == "cpu"
    report.add(lines, "Each format's weights are quantized on device from the bf16 ones (`models.quant."
                      "quantize_weights` under `jax.jit`; fp8 keeps the embedding and LM head bf16, int8 quantizes "
                      "them; w8a8 folds the norm gains first), then decoded as in section 4 for "
                      f"~{sizes.quant_seconds:g} s per batch after 2 untimed steps (the first compiles). Roofline: the "
                      "format's own weight "
                      f"bytes (less the gathered embedding) + KV {fmt_bytes(kv_tok)} per context token, at "
                      f"{f'{peak / 1e12:.2f} TB/s' if peak else 'unknown peak'}. `step temp`: XLA's temporary "
                      "buffers of the compiled batch-1 decode step (`compile_step(...).memory_analysis()`); `weight "
                      "copies`: full-precision copies of quantized weights among its buffers "
                      "(`jaxinfer.benchmarks.hlo.materialized_weight_copies`; XLA:GPU should fuse the converts into the dots: 0"
                      f"{', while XLA:CPU materializes them' if on_cpu else ''}). `logit err`: max |logits - bf16 "
                      f"logits| / max |bf16 logits| over one {QUANT_PROMPT_TOKENS}-token prefill "
                      f"(`compute_logits`). Each format gets an equal share of the section's time left; past it, "
                      f"batch {batches[-1]} is skipped.\n")
    report.add(lines, "| format | batch | weights (quantized share) | quantize s | compile s | steps | ms/step | tok/s "
                      "| vs bf16 | roofline tok/s | % of roofline | step temp | weight copies | logit err |")
    report.add(lines, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    prompt = [ScheduledChunk([(31 * i + 5) % cfg.vocab_size for i in range(QUANT_PROMPT_TOKENS)], 0,
                            list(range(1, 1 + -(-QUANT_PROMPT_TOKENS // sizes.page_size))))]
    greedy = [SamplingRow(SamplingParams(temperature=0), 0)]
    base: dict = {}  # "logits" and tok/s by batch of bf16, for the other formats' comparisons
    for i, (label, qkw) in enumerate(QUANT_FORMATS):
        if budget.left() <= 0:
            report.add(lines, f"| {label} | skipped: section budget spent |||||||||||||")
            continue
        if qkw is not None and qkw["format"] not in quant.FORMATS:
            report.add(lines, f"| {label} | skipped: not a format of this tree |||||||||||||")
            continue
        share = Budget(budget.left() / (len(QUANT_FORMATS) - i))

        def one_format(label=label, qkw=qkw, share=share):
            t0 = time.perf_counter()
            if qkw is None:
                qweights = weights
            else:
                fn = functools.partial(quant.quantize_weights, cfg=cfg, qcfg=quant.QuantizationConfig(**qkw),
                                       dtype=jnp.bfloat16)
                qweights = jax.block_until_ready(jax.jit(fn)(weights))
            quantize_s = time.perf_counter() - t0
            wb = quant.weight_bytes(qweights)
            w_cell = f"{fmt_bytes(wb['bytes'])} ({100 * wb['quantized_share']:.0f}%)"
            step_w = step_weight_bytes(cfg, qweights)
            runner = ModelRunner(cfg, qweights, num_pages=plan.num_pages(batches[-1]), page_size=sizes.page_size,
                                 kv_dtype=jnp.bfloat16, scan_layers=True, attention=attention_ops(backend, False),
                                 max_pages_per_seq=plan.max_pages)
            logits = runner.compute_logits(prompt).astype(np.float32)
            if qkw is None:
                base["logits"] = logits
            if not np.isfinite(logits).all():
                err_cell = "**not finite**"
                report.problem(f"quant {label}: non-finite logits")
            elif qkw is None:
                err_cell = "(baseline)"
            elif "logits" in base:
                err = float(np.max(np.abs(logits - base["logits"])) / np.max(np.abs(base["logits"])))
                err_cell = f"{err:.2e}" if err <= QUANT_MAX_LOGIT_ERR else f"**{err:.2e}**"
                if err > QUANT_MAX_LOGIT_ERR:
                    report.problem(f"quant {label}: logits differ from bf16 by {err:.2f} of their max")
            else:
                err_cell = "no bf16 baseline"
            for batch in batches:
                if batch != batches[0] and share.left() <= 0:
                    report.add(lines, f"| {label} | {batch} | skipped: the format's share of the section budget "
                                      "spent ||||||||||||")
                    continue
                times, _, pos = plan.decode(runner, batch, sizes.quant_seconds)
                timed = times[2:]
                step_s = sum(timed) / len(timed)
                tok_s = batch / step_s
                step_bytes = step_w + batch * (plan.context + 2 + len(timed) / 2) * kv_tok
                roof = batch * peak / step_bytes if peak else None
                if qkw is None:
                    base[batch] = tok_s
                mem_cells = ["", "", ""]
                if batch == batches[0]:  # the step just run, compiled again for its analysis (XLA's cache: instant)
                    compiled = runner.compile_step(plan.chunks([7], plan.context), greedy)
                    copies = hlo.materialized_weight_copies(compiled.as_text(), runner.weights)
                    mem_cells = [fmt_bytes(compiled.memory_analysis().temp_size_in_bytes),
                                 "-" if qkw is None else str(len(copies)) if not copies or on_cpu
                                 else f"**{len(copies)}**", err_cell]
                    if copies and not on_cpu:
                        report.problem(f"quant {label}: {len(copies)} full-precision weight copies in the decode "
                                       f"step, e.g. `{copies[0]}`")
                report.add(lines, f"| {label} | {batch} | {w_cell} | {'-' if qkw is None else f'{quantize_s:.1f}'} | "
                                  f"{times[0] - step_s:.1f} | "
                                  f"{len(timed)} | {num(step_s * 1e3)} | {num(tok_s)} | "
                                  f"{f'{tok_s / base[batch]:.2f}x' if batch in base else '-'} | "
                                  f"{num(roof) if roof else '-'} | "
                                  f"{f'{100 * tok_s / roof:.0f}%' if roof else '-'} | " + " | ".join(mem_cells) + " |")
            del runner, qweights  # the next format's weights and cache take their place

        guarded(report, lines, f"quant {label}", one_format)


# --- 6. weight-only quantized matmul kernel -----------------------------------------------------------------------

# (label, group_size, asymmetric min): int8 per row, int4 symmetric group 32 (jaxinfer's default), int4 asymmetric
# group 128 (GPTQ / AWQ's usual group, with mins).
QMATMUL_FORMATS = (("int8 per row", "int8", 0, False), ("int4 g32", "int4", 32, False),
                   ("int4 g128 asym", "int4", 128, True))
QMATMUL_TILES = ((64, None), (32, 64), (128, 64), (64, 128), (128, 128), (64, 32), (256, 64))  # None: default


def section_qmatmul(report: Report, sizes: Sizes, args: argparse.Namespace, budget: Budget,
                    peak: float | None) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quant_matmul import GpuBlocks, dequantize, weight_only_matmul_gpu, weight_only_matmul_reference

    note = " (interpret mode: interpreter speed, not kernel speed)" if args.interpret else ""
    lines = report.section(f"6. Weight-only quantized matmul kernel{note}")
    report.add(lines, "`weight_only_matmul_gpu` (Pallas Triton), bf16 x [rows, K] times a quantized weight [N, K], "
                      "f32 out. `err`: max |kernel - reference| / max(|x| @ |w|.T) (the reference dequantizes to f32 "
                      "and multiplies at HIGHEST precision; the kernel rounds the dequantized weight to bf16, so up "
                      "to 2^-9 is rounding). GB/s: bytes of the quantized weight (values, scales, mins) / time; "
                      "`XLA dequant`: `jnp.dot` on the weight dequantized to bf16 inside the same jit (what "
                      "`qeinsum` does); `bf16`: a bf16 weight's 2 bytes per element through `jnp.dot`.\n")
    pct = "% of peak" if peak else "% of peak (no peak known)"
    report.add(lines, f"| format | K x N | rows | err | kernel us | kernel GB/s | {pct} | XLA dequant us | XLA dequant "
                      "GB/s | bf16 dot us | bf16 GB/s | speed-up vs XLA dequant | vs bf16 |")
    report.add(lines, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f, (label, fmt, group, asym) in enumerate(QMATMUL_FORMATS):
        for s_i, (k, n) in enumerate(sizes.qmatmul):
            if budget.left() <= 0:
                report.add(lines, f"| {label} | {k} x {n} | skipped: section budget spent |||||||||||")
                continue

            def one_shape(label=label, fmt=fmt, group=group, asym=asym, k=k, n=n, seed=10 * f + s_i):
                keys = jax.random.split(jax.random.key(3000 + seed), 4)
                groups = k // group if group else 1
                if fmt == "int8":
                    values = jax.random.randint(keys[0], (n, k), -127, 128, jnp.int32).astype(jnp.int8)
                else:
                    values = jax.random.randint(keys[0], (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
                scale = jax.random.uniform(keys[1], (n, groups), jnp.float32, 1e-3, 2e-2)
                mins = jax.random.normal(keys[2], (n, groups), jnp.float32) * 0.05 if asym else None
                wbytes = values.size * values.dtype.itemsize + scale.size * 4 * (2 if asym else 1)
                w16 = dequantize(values, scale, mins, group_size=group).astype(jnp.bfloat16)
                kernel = jax.jit(functools.partial(weight_only_matmul_gpu, group_size=group, interpret=args.interpret))
                xla = jax.jit(lambda x, v, s, m: jnp.dot(x, dequantize(v, s, m, group_size=group).astype(x.dtype).T,
                                                         preferred_element_type=jnp.float32))
                plain = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
                for rows in sizes.qmatmul_rows:
                    if budget.left() <= 0:
                        report.add(lines, f"| {label} | {k} x {n} | {rows} | skipped: section budget spent ||||||||||")
                        continue
                    x = jax.random.normal(jax.random.fold_in(keys[3], rows), (rows, k), jnp.bfloat16)
                    out = kernel(x, values, scale, mins)
                    ref = weight_only_matmul_reference(x, values, scale, mins, group_size=group)
                    bound = jnp.max(jnp.abs(x.astype(jnp.float32)) @ jnp.abs(w16.astype(jnp.float32)).T)
                    err = float(jnp.max(jnp.abs(out - ref)) / bound)
                    err_cell = f"{err:.1e}" if err <= 2.0**-8 else f"**{err:.1e}**"
                    if err > 2.0**-8:
                        report.problem(f"qmatmul {label} {k}x{n} rows {rows}: error {err:.2e} of |x| @ |w|.T")
                    t_kernel = time_call(lambda: kernel(x, values, scale, mins), sizes.min_time_s)
                    t_xla = time_call(lambda: xla(x, values, scale, mins), sizes.min_time_s)
                    t_bf16 = time_call(lambda: plain(x, w16), sizes.min_time_s)
                    gbs = wbytes / t_kernel / 1e9
                    report.add(lines, f"| {label} | {k} x {n} | {rows} | {err_cell} | {num(t_kernel * 1e6)} | "
                                      f"{num(gbs)} | {f'{100 * gbs * 1e9 / peak:.0f}%' if peak else '-'} | "
                                      f"{num(t_xla * 1e6)} | {num(wbytes / t_xla / 1e9)} | {num(t_bf16 * 1e6)} | "
                                      f"{num(2 * n * k / t_bf16 / 1e9)} | {t_xla / t_kernel:.2f}x | "
                                      f"{t_bf16 / t_kernel:.2f}x |")

            guarded(report, lines, f"qmatmul {label} {k}x{n}", one_shape)

    # Untuned defaults: a few other tiles at the first shape, int4 g32, one row, as the budget allows.
    k, n = sizes.qmatmul[0]
    report.add(lines, f"\nTiles (`GpuBlocks`: block_n x block_k columns of values, split_k chosen), int4 g32, "
                      f"{k} x {n}, 1 row; the default is the first row.\n")
    report.add(lines, "| block_n | block_k | us | GB/s |")
    report.add(lines, "|---|---|---|---|")
    for bn, bk in QMATMUL_TILES:
        if budget.left() <= 0 or (bk or 0) * 2 > k:
            continue

        def one_tile(bn=bn, bk=bk):
            keys = jax.random.split(jax.random.key(4000), 3)
            values = jax.random.randint(keys[0], (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
            scale = jax.random.uniform(keys[1], (n, k // 32), jnp.float32, 1e-3, 2e-2)
            x = jax.random.normal(keys[2], (1, k), jnp.bfloat16)
            blocks = GpuBlocks(block_n=bn, block_k=bk) if bk else GpuBlocks()
            fn = jax.jit(functools.partial(weight_only_matmul_gpu, group_size=32, blocks=blocks,
                                           interpret=args.interpret))
            t = time_call(lambda: fn(x, values, scale), sizes.min_time_s)
            report.add(lines, f"| {bn} | {bk or 'default'} | {num(t * 1e6)} | "
                              f"{num((values.size + scale.size * 4) / t / 1e9)} |")

        guarded(report, lines, f"qmatmul tile {bn}x{bk}", one_tile)


# --- main -------------------------------------------------------------------------------------------------------------


def peak_bandwidth(device_kind: str, override_gbs: float | None) -> tuple[float | None, str]:
    if override_gbs:
        return override_gbs * 1e9, "--peak-hbm-gbs"
    matches = [key for key in PEAK_HBM_BYTES_S if key.lower() in device_kind.lower()]
    if not matches:
        return None, "unknown device kind"
    key = max(matches, key=len)
    return PEAK_HBM_BYTES_S[key], f"table entry {key!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) / "gpu_check.md" if os.environ.get("OUT")
                    else None, help="markdown report (default $OUT/gpu_check.md when $OUT is set)")
    ap.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (for CPU)")
    ap.add_argument("--platform", default=None, help="force a jax platform, e.g. cpu")
    ap.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode")
    ap.add_argument("--dry-run", action="store_true", help="= --platform cpu --tiny --interpret")
    ap.add_argument("--sections", default="tests,kernels,timing,engine,quant,qmatmul")
    ap.add_argument("--budget-s", type=float, default=265.0, help="whole run; sections also have their own")
    ap.add_argument("--section-budget", action="append", default=[], metavar="NAME=S",
                    help="override one section's budget in seconds (repeatable), e.g. tests=120")
    ap.add_argument("--peak-hbm-gbs", type=float, default=None, help="HBM peak GB/s (default: by device kind)")
    args = ap.parse_args()
    if args.dry_run:
        args.platform, args.tiny, args.interpret = args.platform or "cpu", True, True
    sizes = TINY if args.tiny else QUICK if args.quick else GPU
    sections = [s for s in args.sections.split(",") if s]
    overrides = {}
    for item in args.section_budget:
        name, _, seconds = item.partition("=")
        if name not in sizes.budgets_s or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--section-budget {item!r}: want NAME=SECONDS with NAME one of {', '.join(sizes.budgets_s)}")
        overrides[name] = float(seconds)
    sizes = dataclasses.replace(sizes, budgets_s={**sizes.budgets_s, **overrides})
    if args.platform:
        os.environ["JAX_PLATFORMS"] = args.platform
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    total = Budget(args.budget_s)
    t_start = time.perf_counter()

    def budget(name: str) -> Budget:
        return Budget(min(sizes.budgets_s[name], total.left()))

    def run(name: str, fn: Callable[[], None]) -> None:
        if name not in sections:
            return
        if total.left() <= 0:
            report.add(report.section(name), "- skipped: the run's budget is spent")
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (a failed section must not lose the rest)
            traceback.print_exc()
            report.add(report.sections[-1] if report.sections else report.section(name),
                       f"- **section {name} failed**: `{first_line(e)}`")
            report.problem(f"section {name}: {first_line(e)}")

    # The tests run first, in their own process, before this one takes the GPU's memory.
    run("tests", lambda: section_tests(report, args, budget("tests")))

    import jax

    device = jax.devices()[0]
    peak, peak_src = peak_bandwidth(device.device_kind, args.peak_hbm_gbs)
    try:
        import importlib.metadata as md

        triton = md.version("triton")
    except Exception:  # noqa: BLE001
        triton = "not installed"
    report.header = [
        "# gpu_check", "",
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; `{' '.join(sys.argv)}`; sizes `{sizes.name}`",
        f"- jax {jax.__version__}, backend {jax.default_backend()}, device `{device.device_kind}` x "
        f"{jax.device_count()}, Python {platform.python_version()}, triton {triton}; kernels "
        f"{'in interpret mode' if args.interpret else 'compiled'}",
        f"- HBM peak used for rooflines: {f'{peak / 1e12:.2f} TB/s' if peak else 'none'} ({peak_src})",
    ]
    print("\n".join(report.header), flush=True)
    report.flush()
    run("kernels", lambda: section_kernels(report, sizes, args, budget("kernels")))
    run("timing", lambda: section_timing(report, sizes, args, budget("timing"), peak))
    run("engine", lambda: section_engine(report, sizes, args, budget("engine"), peak))
    run("quant", lambda: section_quant(report, sizes, args, budget("quant"), peak))
    run("qmatmul", lambda: section_qmatmul(report, sizes, args, budget("qmatmul"), peak))

    lines = report.section("Summary")
    report.add(lines, f"- run time {time.perf_counter() - t_start:.0f} s; "
                      + ("all checks passed" if not report.problems else f"{len(report.problems)} problem(s):"))
    for p in report.problems:
        report.add(lines, f"  - {p}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
