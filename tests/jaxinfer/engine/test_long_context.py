"""Long context on the tiny Llama 3 stretched to 131,072 positions by Llama 3 RoPE scaling
(`jaxinfer.benchmarks.longctx.make_long_tiny_model`; the scaled frequencies themselves are checked against
transformers in tests/models/test_rope.py).

1. An 8,192-token prompt prefilled by the engine in 16 chunks of 512 tokens gives the logprobs (every position's,
   and the first output token's) and the greedy token of the same prompt's logits computed in one forward call.
2. A step's temporary memory (XLA's memory analysis of the compiled step) grows no faster than linearly with the
   tokens it prefills, and not at all with the context a fixed chunk attends over: no step holds a score matrix of
   the whole context.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.benchmarks.longctx import TINY_MAX_POSITIONS, make_long_tiny_model
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.step_inputs import NULL_PAGE
from jaxinfer.loading.hf import load_hf_weights
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import RopeType
from models.llama import KVCache
from pallas_kernels.dispatch import AttentionOps
from pallas_kernels.paged_attention import paged_attention_reference
from tests.jaxinfer.engine.tiny_model import DATA

PROMPT_TOKENS = 8192
CHUNK = 512  # max_num_batched_tokens: the engine prefills the prompt in PROMPT_TOKENS / CHUNK steps
PAGE_SIZE = 16
TOP = 5
GREEDY = SamplingRow(SamplingParams(temperature=0), seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_long_tiny_model(DATA, tmp_path_factory.mktemp("longctx") / "tiny_llama3_128k")


def test_the_tiny_model_reaches_128k_positions_by_llama3_rope_scaling(model_dir):
    cfg, _ = load_hf_weights(model_dir)
    assert cfg.max_position_embeddings == TINY_MAX_POSITIONS == 131072
    scaling = cfg.rope_scaling
    assert scaling.rope_type is RopeType.LLAMA3
    assert scaling.factor * scaling.original_max_position_embeddings == TINY_MAX_POSITIONS


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def test_an_8192_token_prompt_prefilled_in_chunks_equals_one_forward_call(model_dir):
    cfg, _ = load_hf_weights(model_dir)
    pages_per_prompt = -(-(PROMPT_TOKENS + 1) // PAGE_SIZE)
    budget = (pages_per_prompt + 2) * KVCache.bytes_per_page(cfg, PAGE_SIZE, jnp.float32)
    llm = LLM(str(model_dir), dtype="float32", page_size=PAGE_SIZE, max_model_len=PROMPT_TOKENS + PAGE_SIZE,
              kv_cache_memory_bytes=budget, max_num_seqs=1, max_num_batched_tokens=CHUNK, warmup=False,
              enable_prefix_caching=False)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, PROMPT_TOKENS).tolist()

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["steps"] == PROMPT_TOKENS // CHUNK and stats["prefill_tokens"] == PROMPT_TOKENS  # chunked

    # The same prompt in one forward call: logits of all 8,192 positions. Its attention runs the whole prompt as one
    # query tile (the default 128-row tiles compile 64 unrolled tiles: minutes here), so the online softmax also
    # sums in another order than the engine's tiles do.
    cfg, weights = load_hf_weights(model_dir)
    one_tile = AttentionOps("reference, one query tile",
                            functools.partial(paged_attention_reference, block_q=PROMPT_TOKENS), None)
    runner = ModelRunner(cfg, jax.tree.map(jnp.asarray, weights), num_pages=PROMPT_TOKENS // PAGE_SIZE + 1,
                         page_size=PAGE_SIZE, kv_dtype=jnp.float32, scan_layers=True, attention=one_tile)
    pages = list(range(1, PROMPT_TOKENS // PAGE_SIZE + 1))
    one_call = _log_softmax(runner.compute_logits([ScheduledChunk(prompt, 0, pages)]))  # [T, V]

    chunked = np.array([entry[prompt[t]].logprob for t, entry in enumerate(out.prompt_logprobs) if t > 0])
    expected = one_call[np.arange(PROMPT_TOKENS - 1), prompt[1:]]
    np.testing.assert_allclose(chunked, expected, atol=2e-5, rtol=0)  # f32 rounding only
    for t in (1, CHUNK, CHUNK + 1, PROMPT_TOKENS // 2, PROMPT_TOKENS - 1):  # chunk edges, middle, end
        top = [i for i in out.prompt_logprobs[t] if out.prompt_logprobs[t][i].rank <= TOP]
        np.testing.assert_allclose([out.prompt_logprobs[t][i].logprob for i in top], one_call[t - 1, top],
                                   atol=2e-5, rtol=0)

    first = out.outputs[0]
    assert first.token_ids[0] == int(np.argmax(one_call[-1]))
    np.testing.assert_allclose(first.logprobs[0][first.token_ids[0]].logprob, one_call[-1].max(), atol=2e-5)


def _temp_bytes(runner: ModelRunner, new_tokens: int, context: int) -> int:
    """XLA's temporary bytes of the compiled step of one chunk of `new_tokens` tokens ending at `context`."""
    pages = [NULL_PAGE] * -(-context // PAGE_SIZE)  # compiled, never run: any valid page ids do
    chunk = ScheduledChunk([3] * new_tokens, context - new_tokens, pages)
    return runner.compile_step([chunk], [GREEDY]).memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    cfg, weights = load_hf_weights(model_dir)
    return ModelRunner(cfg, jax.tree.map(jnp.asarray, weights), num_pages=4, page_size=PAGE_SIZE,
                       kv_dtype=jnp.float32, scan_layers=True)  # the engine's default layer scan


def test_prefill_temporaries_grow_linearly_in_the_prompt(runner):
    # One chunk of T fresh tokens: activations are [T, ...] (about 1 MiB at T = 512); a [T, T] f32 score matrix of
    # even one head would be 4 MiB at T = 1024, 4x its size at T = 512, and push the ratio towards 4.
    small, large = _temp_bytes(runner, 512, 512), _temp_bytes(runner, 1024, 1024)
    assert large <= 2.25 * small, f"step temporaries {small} -> {large} bytes when the prompt doubles"


def test_a_chunks_temporaries_do_not_grow_with_its_context(runner):
    # A 512-token chunk after 512 vs 32,256 cached tokens: the reference streams the context in KV blocks, so
    # nothing of size [chunk, context] exists (one head's f32 scores over 32K keys would be 64 MiB).
    near, far = _temp_bytes(runner, CHUNK, 1024), _temp_bytes(runner, CHUNK, 32768)
    assert far <= 1.25 * near, f"step temporaries {near} -> {far} bytes when the context grows 16x"
