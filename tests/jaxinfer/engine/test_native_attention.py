"""The engine with the native CPU paged decode attention (`pallas_kernels.cpu_gemv.paged_attention`, attention
backend "auto") against the same engine on the `jnp` reference (backend "reference"), native matmuls on in both:
greedy tokens equal and per-step logprobs close, for decodes and speculative verify windows, on the tiny random
Llama and on SmolLM2's golden prompts. (`test_native_matmuls.py` compares all native kernels on against off.)"""

from __future__ import annotations

import jax
import pytest

from jaxinfer import LLM, SamplingParams
from pallas_kernels.cpu_gemv import paged_attention as native_attention
from tests.jaxinfer.engine.test_native_matmuls import FORMATS, assert_same_greedy
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

# |logprob difference| allowed per step: f32 differs by summation order; bf16 by the reference's probabilities
# rounded to bf16 and by outputs rounded to bf16 from sums taken in another order. Measured on the SmolLM2 golden
# prompts: each bf16 run is up to 0.08 from the f32 model's logprobs (neither closer), 0.10 from each other.
LOGPROB_TOLERANCE = {"f32": 1e-4, "bf16": 0.15}


def _generate(model, fmt: str, prompts, max_tokens: int, max_model_len: int, backend: str, spec=None,
              monkeypatch=None) -> tuple[list, int]:
    """(per prompt: tokens, their logprobs, each step's top-1 minus top-2 margin; kernel traces)."""
    dtype, quantization = FORMATS[fmt]
    traces = []
    if monkeypatch is not None:  # count the steps traced onto the kernel
        kernel = native_attention.paged_attention_native
        monkeypatch.setattr(native_attention, "paged_attention_native",
                            lambda *a, **k: traces.append(k["max_q_len"]) or kernel(*a, **k))
    jax.clear_caches()
    llm = LLM(model, dtype=dtype, quantization=quantization, warmup=False, max_model_len=max_model_len,
              kv_cache_memory_bytes=32 << 20, max_num_seqs=8, attention_backend=backend, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    runs = []
    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        steps = o.outputs[0].logprobs
        top = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in steps]
        runs.append((o.outputs[0].token_ids, [step[t].logprob for step, t in zip(steps, o.outputs[0].token_ids)],
                     [t[0] - t[1] for t in top]))
    return runs, traces


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_native_attention"))


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    prompts = random_prompts(6, seed=29, min_len=3, max_len=40)
    return prompts, _generate(str(tiny_dir), "f32", prompts, 12, 96, "reference")[0]


def test_tiny_model_decodes_equal_on_the_kernel_and_the_reference(tiny_dir, tiny_reference, monkeypatch):
    prompts, off = tiny_reference
    on, traces = _generate(str(tiny_dir), "f32", prompts, 12, 96, "auto", monkeypatch=monkeypatch)
    assert traces and set(traces) == {1}  # decode steps ran on the kernel
    assert len({tuple(t) for t, _, _ in off}) > 1  # distinct streams: the comparison has teeth
    assert assert_same_greedy(on, off, LOGPROB_TOLERANCE["f32"]) >= 6 * 6


def test_tiny_model_verify_windows_on_the_kernel(tiny_dir, monkeypatch):
    prompts = [[5, 17, 42, 8, 99] * 4, [7, 3, 64] * 5]  # repeated n-grams: the ngram drafter proposes from them
    off, _ = _generate(str(tiny_dir), "f32", prompts, 12, 96, "reference")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    on, traces = _generate(str(tiny_dir), "f32", prompts, 12, 96, "auto", spec=spec, monkeypatch=monkeypatch)
    assert any(1 < t <= native_attention.MAX_Q_LEN for t in traces), traces  # verify windows ran on the kernel
    assert [t for t, _, _ in on] == [t for t, _, _ in off]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16"])
def test_smollm2_golden_prompts_equal_on_the_kernel_and_the_reference(smollm2_golden, fmt, monkeypatch):
    prompts = [c["prompt_token_ids"] for c in smollm2_golden["cases"]]
    off, _ = _generate(None, fmt, prompts, 24, 384, "reference")
    on, traces = _generate(None, fmt, prompts, 24, 384, "auto", monkeypatch=monkeypatch)
    assert traces
    assert assert_same_greedy(on, off, LOGPROB_TOLERANCE[fmt]) >= 3 * 12
