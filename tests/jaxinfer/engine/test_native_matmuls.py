"""The engine with the native CPU matmul kernels (`pallas_kernels.cpu_gemv`, decode steps) against the same engine on
XLA's dots (`JAXINFER_NATIVE_KERNELS=0`), attention on the reference in both: greedy tokens equal, per-token
logprobs close, for every format the kernels take, on the tiny random Llama and on SmolLM2's golden prompts."""

from __future__ import annotations

import os
from contextlib import contextmanager

import jax
import pytest

from jaxinfer import LLM, SamplingParams
from pallas_kernels import cpu_gemv
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

FORMATS = {  # name -> (dtype, quantization); int4 and w8a8 round activations as their XLA paths do not exactly
    "f32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8 weight-only": ("float32", "int8"),
    "int8 w8a8": ("float32", {"format": "int8", "quantize_activations": True}),
    "int4": ("float32", "int4"),
    "int4 w4a8": ("float32", {"format": "int4", "quantize_activations": True}),
}
# |logprob difference| allowed per step: f32 and int8 differ by summation order only (w8a8: the same int32 sums),
# bf16 by activations rounded after sums taken in another order, int8 weight-only and int4 by the kernels' int16
# activation rows; w4a8's blocks sum in another f32 order, which flips a few int8 roundings of the next layers'
# activation blocks (1 / 127 of a block's largest input each): measured up to 0.13 over SmolLM2's golden prompts
LOGPROB_TOLERANCE = {"f32": 1e-4, "bf16": 0.1, "int8 weight-only": 5e-3, "int8 w8a8": 1e-4, "int4": 5e-3,
                     "int4 w4a8": 0.2}


@contextmanager
def _native(on: bool):
    old = os.environ.get("JAXINFER_NATIVE_KERNELS")
    os.environ["JAXINFER_NATIVE_KERNELS"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["JAXINFER_NATIVE_KERNELS"]
        else:
            os.environ["JAXINFER_NATIVE_KERNELS"] = old


def _both(model, fmt: str, prompts: list[list[int]], max_tokens: int, max_model_len: int, max_num_seqs: int = 8):
    """(with the native kernels, without) per prompt: greedy tokens, their logprobs and each step's top-1 minus
    top-2 logprob (its margin). One engine; its jitted steps are traced anew (`jax.clear_caches`) for the second
    run, which picks its matmuls while the environment switches the kernels off."""
    dtype, quantization = FORMATS[fmt]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    # attention on the reference in both runs, so the matmuls alone differ (w8a8's int8 activation rounding turns
    # the native attention's f32 summation order into logprob steps of ~0.1; test_native_attention.py covers it)
    llm = LLM(model, dtype=dtype, quantization=quantization, warmup=False, max_model_len=max_model_len,
              kv_cache_memory_bytes=32 << 20, max_num_seqs=max_num_seqs, attention_backend="reference")
    results = []
    for native in (True, False):
        jax.clear_caches()
        with _native(native):
            assert cpu_gemv.active() == native
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs = []
        for o in outs:
            steps = o.outputs[0].logprobs
            top = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in steps]
            runs.append((o.outputs[0].token_ids, [step[t].logprob for step, t in zip(steps, o.outputs[0].token_ids)],
                         [t[0] - t[1] for t in top]))
        results.append(runs)
    return results


def assert_same_greedy(on: list, off: list, tolerance: float) -> int:
    """Tokens equal and logprobs within `tolerance` until the reference (`off`) meets a near-tie, a step whose
    margin is within twice the tolerance: there the two may pick either token, and the streams part. Returns the
    number of steps compared."""
    compared = 0
    for (tokens, lps, _), (ref_tokens, ref_lps, ref_margins) in zip(on, off):
        for i, (t, lp, r, rlp, margin) in enumerate(zip(tokens, lps, ref_tokens, ref_lps, ref_margins)):
            if margin <= 2 * tolerance and t != r:
                break
            assert t == r, f"step {i}: token {t} != {r} (reference margin {margin:.3g})"
            assert abs(lp - rlp) <= tolerance, f"step {i}: logprob {lp} vs {rlp}"
            compared += 1
    return compared


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_native"))


@pytest.mark.parametrize("fmt", ["f32"])  # the f32 kernels; SmolLM2 below runs the others on real weights
def test_tiny_model_greedy_equal_with_and_without_native_kernels(tiny_dir, fmt):
    prompts = random_prompts(6, seed=23, min_len=3, max_len=20)
    on, off = _both(str(tiny_dir), fmt, prompts, 12, max_model_len=64)
    assert len({tuple(t) for t, _, _ in off}) > 1  # distinct streams: the comparison has teeth
    assert assert_same_greedy(on, off, LOGPROB_TOLERANCE[fmt]) >= 6 * 6  # at least half the steps compared


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int8 weight-only", "int8 w8a8", "int4", "int4 w4a8"])
def test_smollm2_golden_prompts_greedy_equal_with_and_without_native_kernels(smollm2_golden, fmt):
    prompts = [c["prompt_token_ids"] for c in smollm2_golden["cases"]]
    on, off = _both(None, fmt, prompts, 24, max_model_len=384)
    assert assert_same_greedy(on, off, LOGPROB_TOLERANCE[fmt]) >= 3 * 12


@pytest.mark.slow
@pytest.mark.parametrize("fmt,kind,num_prompts", [("int8 weight-only", "int8", 12), ("int4", "int4", 20),
                                                  ("int8 w8a8", "w8a8", 12)])
def test_smollm2_decode_batches_past_8_rows_greedy_equal(smollm2_golden, fmt, kind, num_prompts):
    """Decode batches of 16 and 32 rows (12 and 20 sequences), where `cpu_gemv.row_limit` lets the kernels run past
    8 rows: int8 weight-only and int4 at every level, w8a8 from avx512_vnni (the AMX tile kernels in blocks of 16
    rows at 32), against XLA's dots."""
    rows = 16 if num_prompts <= 16 else 32
    if kind != "w8a8":  # int8 and int4 run on the kernels at these rows on every level (w8a8 from avx512_vnni)
        assert cpu_gemv.row_limit(kind) >= rows
    text = smollm2_golden["cases"][-1]["prompt_token_ids"]
    prompts = [text[12 * i : 12 * i + 24] for i in range(num_prompts)]  # distinct 24-token windows
    on, off = _both(None, fmt, prompts, 8, max_model_len=64, max_num_seqs=32)
    assert len({tuple(t) for t, _, _ in off}) > num_prompts // 2
    assert assert_same_greedy(on, off, LOGPROB_TOLERANCE[fmt]) >= num_prompts * 4
