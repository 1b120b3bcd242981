"""The GPU (Triton) attention kernels compiled and run on a real GPU, against the `jnp` references; and the engine's
greedy tokens with the kernels against the engine with the reference attention.

Accelerator-only: marked `accelerator` (tests/conftest.py skips those on CPU) and skipped on any backend but GPU.
`scripts/gpu_check.sh` runs them on a lent GPU machine. The same kernels run in interpret mode on CPU in
`test_paged_attention_kernels.py` / `test_flash_attention.py`; here the Triton compiler, tiling and numerics are
what is tested, at SmolLM2's heads (9 query / 3 KV, head dim 64) and Llama-3-8B's (32 / 8, head dim 128).

Tolerances: bf16 3e-2 absolute / 2e-2 relative (the kernels round each KV block's probabilities to bf16 before
the PV product, the reference the globally normalised ones; 8 significant bits). f32 5e-3 / 5e-3: Pallas' Triton
lowering runs an f32 `dot` at DEFAULT precision as TF32 (10-bit mantissa inputs), while the reference here runs
at HIGHEST precision, so the difference is the kernel's TF32 rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_reference
from pallas_kernels.paged_attention import paged_attention_gpu, paged_attention_reference

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton kernels need a GPU"),
]

TOLERANCE = {"bfloat16": dict(rtol=2e-2, atol=3e-2), "float32": dict(rtol=5e-3, atol=5e-3)}
HEADS = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}  # (N, K, H)
# bf16 (what the engine serves in) at both head shapes; f32 at SmolLM2's. Each case compiles its own kernel, and
# the whole file must fit gpu_check's one-minute test budget.
HEADS_DTYPES = [("smollm2", "bfloat16"), ("llama3_8b", "bfloat16"), ("smollm2", "float32")]


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """seqs: (q_len, cached context) per sequence; a trailing padding sequence (kv_len 0) is always added."""

    seqs: tuple[tuple[int, int], ...]
    page_size: int = 16
    num_layers: int = 1  # > 1: a stacked cache read at layer num_layers - 1 (a traced index)
    sliding_window: int | None = None
    soft_cap: float | None = None


PAGED_CASES = {
    # lengths 1, page_size - 1, page_size, page_size + 1 and long; kv_len 1 (a first token)
    "decode": PagedCase(((1, 0), (1, 14), (1, 15), (1, 16), (1, 200), (1, 2047))),
    "prefill_chunks": PagedCase(((16, 0), (17, 15), (100, 1000), (1, 33), (64, 64))),
    # contexts >= 8192 at <= 8 sequences pick num_splits > 1 (pallas_kernels.block_sizes)
    "long_decode_split": PagedCase(((1, 9000), (1, 12000))),
    "stacked_page32": PagedCase(((1, 50), (40, 100)), page_size=32, num_layers=3),
    "window_softcap": PagedCase(((1, 500), (70, 300)), sliding_window=128, soft_cap=30.0),
}


def _build_paged(case: PagedCase, heads: tuple[int, int, int], dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, k, h = heads
    ps = case.page_size
    seqs = case.seqs + ((0, 0),)  # padding sequence
    kv_lens = [q + c for q, c in seqs]
    pages = [-(-kv // ps) for kv in kv_lens]
    num_pages = 1 + sum(pages) + 2
    free = 1 + rng.permutation(num_pages - 1)
    table = np.zeros((len(seqs), max(pages) + 1), np.int32)  # one spare column of null pages
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = free[used: used + p]
        used += p
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    cache_shape = (case.num_layers, num_pages, k, ps, h)
    # Every slot holds N(0, 1) values, the null page and spare pages included: a mask leak shows.
    k_pages = jnp.asarray(rng.standard_normal(cache_shape, np.float32), dtype)
    v_pages = jnp.asarray(rng.standard_normal(cache_shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 3, n, h), np.float32), dtype)  # 3 padding rows
    max_q = max(q for q, _ in seqs)
    max_q = 1 if max_q == 1 else 1 << (max_q - 1).bit_length()
    layer = None if case.num_layers == 1 else jnp.int32(case.num_layers - 1)
    if layer is None:
        k_pages, v_pages = k_pages[0], v_pages[0]
    return (q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu), layer), max_q


def _assert_close(out: jax.Array, ref: jax.Array, dtype: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize(("heads", "dtype"), HEADS_DTYPES)
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_attention_gpu_matches_reference(name: str, heads: str, dtype: str) -> None:
    case = PAGED_CASES[name]
    args, max_q = _build_paged(case, HEADS[heads], dtype)
    kw = dict(max_q_len=max_q, sm_scale=HEADS[heads][2] ** -0.5, sliding_window=case.sliding_window,
              soft_cap=case.soft_cap)
    out = jax.block_until_ready(paged_attention_gpu(*args, **kw))
    with jax.default_matmul_precision("highest"):
        ref = paged_attention_reference(*args, **kw)
    _assert_close(out, ref, dtype)
    num_tokens = int(args[5][-1])
    np.testing.assert_array_equal(np.asarray(out[num_tokens:].astype(jnp.float32)), 0.0)  # padding rows


@pytest.mark.parametrize(("name", "kv_dtype"), [("decode", "int8"), ("prefill_chunks", "fp8")])
def test_paged_attention_gpu_on_quantized_pages_matches_reference(name: str, kv_dtype: str) -> None:
    """int8 and fp8 (uint8 bit patterns) pages with per-token scales (`pallas_kernels.kv_quant`), SmolLM2 heads,
    bf16 queries: the kernel against the reference over the same quantized pages (bf16 tolerance, as above)."""
    from pallas_kernels.paged_attention import quantize, storage_dtype

    case = PAGED_CASES[name]
    (q, k_pages, v_pages, *rest), max_q = _build_paged(case, HEADS["smollm2"], "bfloat16", seed=2)
    dtype = storage_dtype(jnp.int8 if kv_dtype == "int8" else jnp.float8_e4m3fn)
    (k_q, k_scale), (v_q, v_scale) = quantize(k_pages, dtype), quantize(v_pages, dtype)
    args = (q, k_q, v_q, *rest)
    kw = dict(max_q_len=max_q, sm_scale=64**-0.5, k_scale=k_scale, v_scale=v_scale)
    out = jax.block_until_ready(paged_attention_gpu(*args, **kw))
    with jax.default_matmul_precision("highest"):
        ref = paged_attention_reference(*args, **kw)
    _assert_close(out, ref, "bfloat16")


FLASH_CASES = {
    "ragged": ((1, 15, 16, 17, 100, 300), None, None),
    "one_long": ((2048,), None, None),
    "window_softcap": ((300, 77), 64, 20.0),
}


@pytest.mark.parametrize(("heads", "dtype"), HEADS_DTYPES)
@pytest.mark.parametrize("name", list(FLASH_CASES))
def test_flash_attention_gpu_matches_reference(name: str, heads: str, dtype: str) -> None:
    lengths, window, cap = FLASH_CASES[name]
    n, k, h = HEADS[heads]
    rng = np.random.default_rng(1)
    t = sum(lengths) + 5  # 5 padding rows
    q, kk, vv = (jnp.asarray(rng.standard_normal((t, heads_, h), np.float32), dtype) for heads_ in (n, k, k))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    kw = dict(sm_scale=h**-0.5, sliding_window=window, soft_cap=cap)
    out = jax.block_until_ready(flash_attention_gpu(q, kk, vv, cu, **kw))
    with jax.default_matmul_precision("highest"):
        ref = flash_attention_reference(q, kk, vv, cu, **kw)
    _assert_close(out, ref, dtype)
    np.testing.assert_array_equal(np.asarray(out[sum(lengths):].astype(jnp.float32)), 0.0)


def test_engine_greedy_tokens_pallas_match_reference(tmp_path) -> None:
    """The tiny random Llama-3 through `Engine`: fresh prefills (flash kernel), chunked prefills and decodes
    (paged kernel) give the reference backend's greedy tokens.

    Both run in f32, but the kernels' TF32 dots move logits by ~1e-3, so a near tie may flip: the streams are
    compared up to each request's first divergence, which must be at a step where the reference's top-2
    log-probabilities are within `TIE` (after it the contexts differ); most tokens must be compared.
    """
    pytest.importorskip("tokenizers")
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.sampling_params import SamplingParams
    from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

    tie = 2e-2
    model_dir = make_tiny_model_dir(tmp_path / "tiny_llama3")
    prompts = random_prompts(6, seed=3, min_len=5, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for backend in ("reference", "pallas"):
        # 64-token steps: the 6 prompts (~130 tokens) need several steps and some are prefilled in chunks.
        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", warmup=False, page_size=8,
                                     max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                     kv_cache_memory_bytes=1 << 20, attention_backend=backend))
        assert engine.runner.attention.name == ("reference" if backend == "reference" else "pallas-gpu")
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0]
        results[backend] = final
    compared = 0
    for rid, ref in results["reference"].items():
        got = results["pallas"][rid]
        assert got.finish_reason == ref.finish_reason == "length"
        for j, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a != b:
                top = sorted((e.logprob for e in ref.logprobs[j].values()), reverse=True)
                assert top[0] - top[1] < tie, (f"request {rid} token {j}: pallas {b} != reference {a} with a "
                                               f"top-2 margin of {top[0] - top[1]:.3g}")
                break
            compared += 1
    assert compared >= 0.75 * sum(len(r.token_ids) for r in results["reference"].values())
