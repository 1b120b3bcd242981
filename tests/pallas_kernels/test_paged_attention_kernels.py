"""The paged attention kernels (TPU Mosaic, GPU Triton) against `paged_attention_reference`, in interpret mode on CPU.

The reference is itself checked against hand-computed cases and a numpy dense attention in
`test_paged_attention.py`. Here each kernel runs in generic interpret mode (`interpret=True`) over a fixed, sparse
sample of the shape grid (dtype x page_size x q/kv head ratio x head dim x block sizes x lengths 1,
page_size - 1, page_size, page_size + 1 and long, with shuffled page tables and mixed decodes and prefills in one
batch, and windows of exactly one page and of at least the context, checked against a numpy oracle as
well); the TPU kernel also runs once under `pltpu.InterpretParams` (TPU memory, DMA and race simulation, ~3 ms
per grid step, so tiny). Lowering for real TPU / GPU targets on CPU checks what interpret mode does not: Mosaic's
block-shape rules and Triton's power-of-two tiles, at a 32k context.

Tolerances: f32 1e-5 (both sides accumulate in f32; only summation order differs). bf16 3e-2 absolute / 2e-2
relative: inputs are the same bf16 values on both sides, but the kernels round the probabilities of each KV block
to bf16 before the PV product while the reference rounds the globally normalised ones; |v| ~ 1, bf16 keeps 8
significant bits (2^-9 relative per rounding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.block_sizes import BlockSizes, paged_block_sizes
from pallas_kernels.paged_attention import paged_attention_gpu, paged_attention_reference, paged_attention_tpu

KERNELS = {"tpu": paged_attention_tpu, "gpu": paged_attention_gpu}
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=3e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One sampled point of the grid. seqs: (q_len, cached context) per sequence."""

    seqs: tuple[tuple[int, int], ...]
    page_size: int = 16
    group: int = 1
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    block_sizes: BlockSizes | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    num_layers: int = 1  # > 1: a stacked cache read at layer num_layers - 1


def build(case: Case, seed: int = 0):
    """Random ragged batch: per-sequence K/V scattered into shuffled pages of a garbage-filled cache."""
    rng = np.random.default_rng(seed)
    ps, kh, hd = case.page_size, case.num_kv_heads, case.head_dim
    kv_lens = [q + c for q, c in case.seqs]
    pages_per_seq = max(-(-n // ps) for n in kv_lens) + 1  # one spare column of null pages
    num_pages = 1 + sum(-(-n // ps) for n in kv_lens) + 2
    shape = (case.num_layers, num_pages, kh, ps, hd)
    # Unused slots hold large finite garbage: a leak through the mask changes the result visibly.
    k_pages = rng.normal(0, 20, shape).astype(np.float32)
    v_pages = rng.normal(0, 20, shape).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    b_pad = len(case.seqs) + 1  # a trailing padding sequence
    page_table = np.zeros((b_pad, pages_per_seq), np.int32)
    for b, n in enumerate(kv_lens):
        page_table[b, : -(-n // ps)] = [free.pop() for _ in range(-(-n // ps))]
        for pos in range(n):
            for arr in (k_pages, v_pages):
                arr[-1, page_table[b, pos // ps], :, pos % ps] = rng.normal(size=(kh, hd))
    q_lens = [q for q, _ in case.seqs]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    q = rng.normal(size=(sum(q_lens) + 3, kh * case.group, hd)).astype(np.float32)  # 3 padding rows
    dtype = ml_dtypes.bfloat16 if case.dtype == "bfloat16" else np.float32
    layer = case.num_layers - 1 if case.num_layers > 1 else None
    if layer is None:
        k_pages, v_pages = k_pages[0], v_pages[0]
    args = (jnp.asarray(q.astype(dtype)), jnp.asarray(k_pages.astype(dtype)), jnp.asarray(v_pages.astype(dtype)),
            jnp.asarray(np.concatenate([kv_lens, [0]]), jnp.int32), jnp.asarray(page_table),
            jnp.asarray(cu_q_lens), layer)
    kw = dict(max_q_len=max(8, int(2 ** np.ceil(np.log2(max(q_lens))))) if max(q_lens) > 1 else 1,
              sm_scale=hd**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    return args, kw, int(cu_q_lens[-1])


# Lengths around a page: 1, page_size - 1, page_size, page_size + 1, and long; decode (q_len 1) and prefill
# chunks with and without cached context share batches.
CASES = [
    Case(seqs=((1, 0), (1, 15), (1, 16), (1, 40)), group=1),  # pure decode, contexts 1, ps, ps + 1, long
    Case(seqs=((1, 33), (5, 0), (15, 2), (17, 16)), group=3, block_sizes=BlockSizes(8, 32)),  # SmolLM2 heads
    Case(seqs=((16, 0), (1, 70), (3, 13)), group=4, page_size=32, head_dim=128, block_sizes=BlockSizes(8, 64)),
    Case(seqs=((1, 0), (9, 7)), group=8, num_kv_heads=1, dtype="bfloat16", block_sizes=BlockSizes(16, 16)),
    Case(seqs=((1, 95), (1, 17)), group=2, dtype="bfloat16", block_sizes=BlockSizes(1, 32, 3)),  # split-K
    Case(seqs=((1, 120), (6, 30)), group=3, block_sizes=BlockSizes(4, 16, 2), num_layers=3),  # stacked, split
    Case(seqs=((1, 60), (12, 20)), group=2, sliding_window=20, block_sizes=BlockSizes(8, 16)),  # skips blocks
    Case(seqs=((1, 50), (7, 9)), group=1, soft_cap=5.0, sliding_window=9, dtype="bfloat16"),  # Gemma 2 style
    Case(seqs=((2, 250),), group=2, page_size=256, head_dim=256, block_sizes=BlockSizes(8, 256)),
]


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("seed", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_kernel_matches_reference(backend, seed):
    case = CASES[seed]
    args, kw, num_tokens = build(case, seed=seed)
    expected = np.asarray(paged_attention_reference(*args, **kw).astype(jnp.float32))
    out = KERNELS[backend](*args, **kw, block_sizes=case.block_sizes, interpret=True)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out, expected, **TOLERANCE[case.dtype])
    np.testing.assert_array_equal(out[num_tokens:], 0.0)  # padding rows


def _windowed_oracle(case: Case, args) -> np.ndarray:
    """Numpy float64 attention per sequence, query and head over the keys at positions (p - window, p], read from
    the pages through the page table; [tokens, N, H]. The inputs are the (possibly bf16-rounded) values the kernels
    get."""
    q, k_pages, v_pages, _, page_table, _, _ = (None if a is None else np.asarray(a, np.float64) for a in args)
    ps, group, out = case.page_size, case.group, []
    window = case.sliding_window or 1 << 30
    row = 0
    for b, (q_len, cached) in enumerate(case.seqs):
        pages = page_table[b].astype(int)
        for pos in range(cached, cached + q_len):
            keys = range(max(0, pos - window + 1), pos + 1)
            k = np.stack([k_pages[pages[t // ps], :, t % ps] for t in keys])  # [n, K, H]
            v = np.stack([v_pages[pages[t // ps], :, t % ps] for t in keys])
            heads = []
            for n in range(q.shape[1]):
                s = k[:, n // group] @ q[row, n] * case.head_dim**-0.5
                p = np.exp(s - s.max())
                heads.append(p / p.sum() @ v[:, n // group])
            out.append(heads)
            row += 1
    return np.asarray(out)


# Windows at their edges (issue 21), decodes and prefill chunks in each batch, 16-token pages:
# - a window of exactly one page: a decode at position 15 sees page 0 whole, at 16 two pages, at 47 only page 2
#   (pages 0-1 skipped); chunks 11-15, 16-31 (page-aligned) and 40-48;
# - a window equal to the longest context (40 = kv_len of three sequences) and one far past it (4096): nothing is
#   masked, so the result equals the unwindowed kernel's as well.
WINDOW_EDGE_CASES = {
    "page-f32": Case(seqs=((1, 15), (1, 16), (1, 47), (5, 11), (16, 16), (9, 40)), group=2, sliding_window=16,
                     block_sizes=BlockSizes(8, 16)),
    "page-bf16": Case(seqs=((1, 47), (16, 16), (3, 29)), group=1, sliding_window=16, dtype="bfloat16",
                      block_sizes=BlockSizes(4, 32)),
    "context-f32": Case(seqs=((1, 0), (1, 39), (7, 33), (16, 24)), group=2, sliding_window=40,
                        block_sizes=BlockSizes(8, 16)),
    "past-context-bf16": Case(seqs=((1, 63), (12, 20)), group=3, num_kv_heads=1, sliding_window=4096,
                              dtype="bfloat16"),
}


@functools.cache
def _window_edge_reference(name: str):
    """(args, kw, num_tokens, reference output) of one window edge case; the reference checked against the oracle
    once for both backends."""
    case = WINDOW_EDGE_CASES[name]
    args, kw, num_tokens = build(case, seed=len(name))
    expected = np.asarray(paged_attention_reference(*args, **kw).astype(jnp.float32))
    np.testing.assert_allclose(expected[:num_tokens], _windowed_oracle(case, args), **TOLERANCE[case.dtype])
    return args, kw, num_tokens, expected


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("name", sorted(WINDOW_EDGE_CASES))
def test_window_of_one_page_or_at_least_the_context(backend, name):
    # For a window >= every context the oracle is plain causal attention: the window masks nothing.
    case = WINDOW_EDGE_CASES[name]
    args, kw, num_tokens, expected = _window_edge_reference(name)
    out = KERNELS[backend](*args, **kw, block_sizes=case.block_sizes, interpret=True)
    assert out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out, expected, **TOLERANCE[case.dtype])
    np.testing.assert_array_equal(out[num_tokens:], 0.0)


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_k_matches_unsplit_kernel(backend, num_splits):
    # FlashDecoding: splitting a long context over programs and merging by log-sum-exp changes only rounding.
    case = Case(seqs=((1, 150), (1, 47), (1, 0)), group=2)
    args, kw, _ = build(case, seed=num_splits)
    whole = KERNELS[backend](*args, **kw, block_sizes=BlockSizes(1, 16, 1), interpret=True)
    split = KERNELS[backend](*args, **kw, block_sizes=BlockSizes(1, 16, num_splits), interpret=True)
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_tpu_kernel_under_tpu_interpret_mode():
    # Simulates TPU memory spaces and DMAs, and fails on data races between the double-buffered page copies.
    case = Case(seqs=((1, 20), (3, 5)), group=3, num_kv_heads=1, page_size=8, head_dim=64,
                block_sizes=BlockSizes(4, 16, 2))
    args, kw, _ = build(case, seed=5)
    expected = np.asarray(paged_attention_reference(*args, **kw))
    out = paged_attention_tpu(*args, **kw, block_sizes=case.block_sizes,
                              interpret=pltpu.InterpretParams(detect_races=True))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_bad_block_kv_and_heads_raise():
    args, kw, _ = build(Case(seqs=((1, 3),), group=2))
    with pytest.raises(ValueError, match="block_kv"):
        paged_attention_tpu(*args, **kw, block_sizes=BlockSizes(1, 24), interpret=True)
    q = args[0][:, :3]  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_tpu(q, *args[1:], **kw, interpret=True)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_tpu(*args, **{**kw, "sliding_window": 0}, interpret=True)


# --- lowering for real targets (no hardware: an abstract device) ---------------------------------------------------

TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
GPU = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


def _abstract_args(num_seqs, max_q_len, num_heads, num_kv_heads, head_dim, page_size, context, dtype):
    s = jax.ShapeDtypeStruct
    pages = num_seqs * (context // page_size) + 1
    cache = s((2, pages, num_kv_heads, page_size, head_dim), dtype)
    return (s((num_seqs * max_q_len, num_heads, head_dim), dtype), cache, cache, s((num_seqs,), jnp.int32),
            s((num_seqs, context // page_size), jnp.int32), s((num_seqs + 1,), jnp.int32), s((), jnp.int32))


def _lower(kernel, device: AbstractDevice, platform: str, args, **kw) -> str:
    mesh = AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(functools.partial(kernel, **kw)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# (num_seqs, max_q_len, N, K, H, page_size, dtype, sliding_window, soft_cap): SmolLM2 decode and prefill at head
# dim 64 (where jax's own TPU paged attention does not lower), Llama-3-8B heads, and head dim 256 with Gemma 2's
# window and soft cap; all at a 32k-token page table.
LOWERING = [
    (8, 1, 9, 3, 64, 16, jnp.bfloat16, None, None),
    (2, 64, 9, 3, 64, 16, jnp.bfloat16, None, None),
    (1, 1, 32, 8, 128, 64, jnp.bfloat16, None, None),
    (64, 1, 32, 8, 128, 64, jnp.float32, None, None),
    (2, 128, 16, 8, 256, 128, jnp.bfloat16, 4096, 50.0),
]


@pytest.mark.parametrize("shape", LOWERING, ids=[f"lower{i}" for i in range(len(LOWERING))])
def test_tpu_kernel_lowers_for_tpu_at_32k_context(shape):
    b, tq, n, k, h, ps, dtype, window, cap = shape
    args = _abstract_args(b, tq, n, k, h, ps, 32768, dtype)
    text = _lower(paged_attention_tpu, TPU, "tpu", args, max_q_len=tq, sm_scale=0.1, sliding_window=window,
                  soft_cap=cap)
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("shape", LOWERING, ids=[f"lower{i}" for i in range(len(LOWERING))])
def test_gpu_kernel_lowers_for_gpu_at_32k_context(shape):
    b, tq, n, k, h, ps, dtype, window, cap = shape
    args = _abstract_args(b, tq, n, k, h, ps, 32768, dtype)
    text = _lower(paged_attention_gpu, GPU, "cuda", args, max_q_len=tq, sm_scale=0.1, sliding_window=window,
                  soft_cap=cap)
    assert "__gpu$xla.gpu.triton" in text  # the Triton custom call


def test_tpu_lowering_rejects_a_tile_that_breaks_mosaic_rules():
    # 3 query tokens x 3 heads = 9 rows per tile: neither a multiple of 8 nor the whole (18-row) array. Interpret
    # mode runs it; lowering must refuse it, which is what makes the lowering tests above able to fail.
    args = _abstract_args(2, 6, 9, 3, 64, 16, 1024, jnp.float32)
    with pytest.raises(ValueError, match="divisible by 8"):
        _lower(paged_attention_tpu, TPU, "tpu", args, max_q_len=6, sm_scale=0.1, block_sizes=BlockSizes(3, 64))


def _kernel_refs(kernel, args, **kw):
    """Avals of the refs one program sees (blocks and scratch), found in the pallas_call of the traced kernel."""
    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn
            for param in eqn.params.values():
                sub = getattr(param, "jaxpr", param)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns") and (found := find(sub)) is not None:
                    return found
        return None

    eqn = find(jax.make_jaxpr(functools.partial(kernel, **kw))(*args).jaxpr)
    assert eqn is not None
    return [v.aval for v in eqn.params["jaxpr"].invars]


def test_tpu_kernel_tiles_do_not_grow_with_context():
    # No kernel is one big block in disguise: a program's VMEM refs (query/output tiles, double-buffered page
    # buffers) are the same at a 1k and a 32k context, and one buffer slot holds block_kv tokens.
    kw = dict(max_q_len=1, sm_scale=0.1)
    small = _abstract_args(4, 1, 9, 3, 64, 16, 1024, jnp.bfloat16)
    large = _abstract_args(4, 1, 9, 3, 64, 16, 32768, jnp.bfloat16)

    def local(refs):
        return [(r.shape, r.dtype) for r in refs if str(r.memory_space) not in ("any", "smem", "semaphore_mem")]

    refs_small, refs_large = _kernel_refs(paged_attention_tpu, small, **kw), _kernel_refs(paged_attention_tpu, large,
                                                                                          **kw)
    bs = paged_block_sizes("tpu", max_q_len=1, page_size=16, max_kv_len=1024, num_seqs=4)
    kv_buffers = [shape for shape, _ in local(refs_small) if len(shape) == 4]
    assert kv_buffers and all(shape[1] * shape[2] == bs.block_kv for shape in kv_buffers)
    # The split variant at 32k adds f32 partial outputs, but never a context-sized buffer.
    assert all(np.prod(shape) <= 2 * bs.block_kv * 64 for shape, _ in local(refs_large))
    assert [s for s in local(refs_large) if len(s[0]) == 4] == [s for s in local(refs_small) if len(s[0]) == 4]


@pytest.mark.parametrize("backend", sorted(KERNELS) + ["reference"])
def test_shape_errors_name_the_problem(backend):
    fn = paged_attention_reference if backend == "reference" else functools.partial(KERNELS[backend], interpret=True)
    (q, k, v, kv_lens, table, cu, layer), kw, _ = build(Case(seqs=((1, 5), (2, 9)), group=2))
    bad = {
        "v_pages shape": (q, k, v[..., :32], kv_lens, table, cu, layer),  # v head dim 32, k 64
        "v_pages shape ": (q, k, v[:, :1], kv_lens, table, cu, layer),  # 1 kv head in v, 2 in k
        "same B": (q, k, v, kv_lens, table[:-1], cu, layer),  # page table one row short
        "same B ": (q, k, v, kv_lens, table, cu[:-1], layer),  # cu_q_lens of length B
        "T >= 1": (q[:0], k, v, kv_lens, table, cu, layer),
        "stacked cache": (q, k[None], v[None], kv_lens, table, cu, None),
        "\\[P, K, page_size, H\\]": (q, k[0], v[0], kv_lens, table, cu, layer),
    }
    for match, args in bad.items():
        with pytest.raises(ValueError, match=match.strip()):
            fn(*args, **kw)
    for window, cap in ((2.5, None), (None, float("inf")), (0, None), (None, -1.0)):
        with pytest.raises(ValueError, match="sliding_window|soft_cap"):
            fn(q, k, v, kv_lens, table, cu, layer, **{**kw, "sliding_window": window, "soft_cap": cap})


def test_validate_inputs_catches_what_the_device_cannot():
    from pallas_kernels.paged_attention import validate_inputs

    table = np.array([[3, 1], [2, 0]])
    ok = dict(page_size=16, num_pages=4)
    validate_inputs([1, 5], [20, 5], table, max_q_len=8, **ok)
    with pytest.raises(ValueError, match="max_q_len"):  # query rows past max_q_len would be dropped silently
        validate_inputs([1, 9], [20, 9], table, max_q_len=8, **ok)
    with pytest.raises(ValueError, match="capacity"):
        validate_inputs([1, 5], [33, 5], table, max_q_len=8, **ok)
    with pytest.raises(ValueError, match="kv_len 0"):
        validate_inputs([1, 5], [0, 5], table, max_q_len=8, **ok)
    with pytest.raises(ValueError, match="page ids"):
        validate_inputs([1, 5], [20, 5], np.array([[3, 7], [2, 0]]), max_q_len=8, **ok)


@pytest.mark.parametrize("backend", sorted(KERNELS) + ["reference"])
def test_a_local_layers_decode_reads_only_the_windows_pages(backend):
    """A sliding-window decode at a context far longer than the window reads only the pages the window touches
    (issue 21): every page wholly before the window is overwritten with NaN, which any read would carry into the
    output (masked scores give probability 0, and 0 * NaN is NaN), yet the output equals the clean run. Context 400
    over 16-token pages (25 pages), window 20: 23 of the decode sequence's 25 pages hold NaN (and 2 of a 4-token chunk's); blocks are one page."""
    case = Case(seqs=((1, 399), (4, 60)), group=2, sliding_window=20)
    args, kw, num_tokens = build(case, seed=7)
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer = args
    fn = (functools.partial(paged_attention_reference, block_kv_tokens=16) if backend == "reference" else
          functools.partial(KERNELS[backend], block_sizes=BlockSizes(1 if backend == "tpu" else 8, 16),
                            interpret=True))
    expected = np.asarray(fn(*args, **kw))
    poisoned = []
    for b, (q_len, cached) in enumerate(case.seqs):
        first_visible = cached - case.sliding_window + 1  # the window of the sequence's first query (at cached)
        poisoned += [int(page_table[b, p]) for p in range(max(first_visible, 0) // case.page_size)]
    assert len(poisoned) == 23 + 2  # sequence 0: pages 0-22 (keys 0-367 < 380); sequence 1 (first query 60): 0-1
    k_nan = np.asarray(k_pages).copy()
    v_nan = np.asarray(v_pages).copy()
    k_nan[poisoned] = np.nan
    v_nan[poisoned] = np.nan
    out = np.asarray(fn(q, jnp.asarray(k_nan), jnp.asarray(v_nan), kv_lens, page_table, cu_q_lens, layer, **kw))
    assert np.isfinite(out[:num_tokens]).all()
    np.testing.assert_allclose(out, expected, **TOLERANCE["float32"])
