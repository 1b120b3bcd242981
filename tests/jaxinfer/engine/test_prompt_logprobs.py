"""Prompt logprobs (`SamplingParams.prompt_logprobs`) through the engine, against HF transformers' logits of the
tiny Llama-3 golden: every position's value, rank and top tokens, with chunked prefill across pages, a prompt the
prefix cache holds, a batch mixed with requests that want none, and n > 1."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams
from tests.jaxinfer.engine.tiny_model import DATA, make_tiny_model_dir

GOLDEN = json.loads((DATA / "golden.json").read_text())
IDS = GOLDEN["token_ids"]  # 40 ids
HF_LOGPROBS = [np.asarray(row, np.float64) - np.logaddexp.reduce(np.asarray(row, np.float64))
               for row in GOLDEN["logits"]]  # log_softmax of HF's logits at each position


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Chunks of 16 tokens over pages of 8, prefix caching on."""
    root = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama3"))
    return Engine(EngineConfig(model=str(root), dtype="float32", warmup=False, page_size=8, max_num_seqs=8,
                               max_num_batched_tokens=16, max_model_len=128, kv_cache_memory_bytes=1 << 20,
                               enable_prefix_caching=True))


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    ids = [engine.add_request(Prompt(token_ids=p), params) for p, params in requests]
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    return [last[i] for i in ids]


def check_against_hf(prompt_logprobs: list, k: int, prompt: list[int] = IDS) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        ref = HF_LOGPROBS[pos - 1]
        entry = prompt_logprobs[pos]
        token = prompt[pos]
        assert next(iter(entry)) == token, pos  # the prompt token first, as vLLM orders them
        assert entry[token].logprob == pytest.approx(ref[token], abs=1e-4), pos
        assert entry[token].rank == 1 + int(np.sum(ref > ref[token] + 1e-6)), pos
        top = np.argsort(-ref, kind="stable")[:k].tolist()
        assert set(entry) == set(top) | {token}, pos
        for rank, t in enumerate(top, 1):
            assert entry[t].logprob == pytest.approx(ref[t], abs=1e-4)
            if t != token:
                assert entry[t].rank == rank
        assert entry[token].decoded_token == f"w{token}" or token < 3


def test_prompt_logprobs_equal_hf_over_chunks_and_pages(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    (out,) = run(engine, [(IDS, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3))])
    check_against_hf(out.prompt_logprobs, 3)
    assert out.num_cached_tokens == 0
    (plain,) = run(engine, [(IDS, greedy)])  # sampling from the gathered rows is the plain step's
    assert plain.prompt_logprobs is None
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs(engine: Engine) -> None:
    run(engine, [(IDS, SamplingParams(temperature=0, max_tokens=1))])  # caches the prompt's pages
    (cached,) = run(engine, [(IDS, SamplingParams(temperature=0, max_tokens=1))])
    assert cached.num_cached_tokens > 0  # the cache holds it: the next request must skip it
    (out,) = run(engine, [(IDS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))])
    assert out.num_cached_tokens == 0
    check_against_hf(out.prompt_logprobs, 0)


def test_mixed_batch_and_n_samples(engine: Engine) -> None:
    short = IDS[:9]
    outs = run(engine, [(IDS[:30], SamplingParams(temperature=0, max_tokens=3)),
                        (IDS, SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=3, prompt_logprobs=2)),
                        (short, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))])
    assert outs[0].prompt_logprobs is None
    check_against_hf(outs[1].prompt_logprobs, 2)
    check_against_hf(outs[2].prompt_logprobs, 1, short)
    alone = run(engine, [(IDS[:30], SamplingParams(temperature=0, max_tokens=3))])
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert len(outs[1].outputs) == 2


def test_a_one_token_prompt_has_just_the_leading_none(engine: Engine) -> None:
    (out,) = run(engine, [(IDS[:1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5))])
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_out_of_range_prompt_logprobs_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
