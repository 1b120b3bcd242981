"""Resuming a request with output so far (`Engine.add_request(output_token_ids=...)`, `jaxinfer.engine.admission`)
on the tiny random Llama-3.

A request streams k tokens on one engine, which then "dies" (the request is aborted); a fresh engine gets the
prompt and the k streamed tokens. What the client saw before plus what the fresh engine streams must equal the
uninterrupted run on one engine, token for token and character for character, with the same finish reason: for
greedy requests (max_tokens counts the earlier tokens), for seeded ones with penalties (the t-th token's key and the
penalties see the earlier tokens), min_tokens (a stop id banned until min_tokens output tokens, counting the earlier
ones) and a stop string that starts before the break and ends after it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import CompletionOutput
from tests.jaxinfer.engine.test_kv_handoff import CONFIG, GREEDY, PROMPTS, assert_idle, drain, one_engine
from tests.jaxinfer.engine.tiny_model import FIRST_WORD_ID, make_tiny_model_dir

PENALIZED = SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=14, repetition_penalty=1.3,
                           presence_penalty=0.4, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine]:
    """(the engine that dies, a fresh one)."""
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama3"))
    return tuple(Engine(EngineConfig(model=str(folder), **CONFIG)) for _ in range(2))


def interrupted(engine: Engine, prompt: list[int], params: SamplingParams, k: int) -> tuple[list[int], str]:
    """The ids and text a client got from a stream that stopped after k tokens (the request is aborted)."""
    engine.add_request(prompt, params, request_id="dying")
    ids, text = [], ""
    while len(ids) < k:
        for out in engine.step():
            assert not out.finished
            ids += out.outputs[0].delta_token_ids
            text += out.outputs[0].delta_text
    engine.abort("dying")
    drain(engine)
    assert len(ids) == k
    return ids, text


def check_resume(engines: tuple[Engine, Engine], prompt: list[int], params: SamplingParams, k: int
                 ) -> CompletionOutput:
    """Asserts that before + resumed == the uninterrupted run; returns that run's completion."""
    dying, fresh = engines
    ref = one_engine(dying, prompt, params).outputs[0]
    ids, text = interrupted(dying, prompt, params, k)
    fresh.add_request(prompt, params, request_id="again", output_token_ids=ids)
    outs = drain(fresh)["again"]
    assert ids + sum((o.outputs[0].delta_token_ids for o in outs), []) == ref.token_ids
    assert text + "".join(o.outputs[0].delta_text for o in outs) == ref.text
    done = outs[-1].outputs[0]
    assert (done.token_ids, done.text, done.finish_reason, done.stop_reason) == (
        ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
    assert_idle(*engines)
    return ref


@pytest.mark.parametrize("k", [1, 4, 9])
def test_greedy_resume_equals_the_uninterrupted_run(engines, k):
    for prompt in PROMPTS[:2]:
        ref = check_resume(engines, prompt, GREEDY, k)
        assert ref.finish_reason == "length" and len(ref.token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("k", [2, 5])
def test_seeded_resume_with_penalties_and_min_tokens(engines, k):
    """A stop id is banned until min_tokens: chosen so that the uninterrupted run stops on it at an index in
    [min_tokens, k + min_tokens), where a resumed engine that counted only its own tokens would still ban it."""
    min_tokens, prompt = 6, PROMPTS[1]
    free = one_engine(engines[0], prompt, dataclasses.replace(PENALIZED, min_tokens=min_tokens)).outputs[0].token_ids
    for stop_id in free[min_tokens : min_tokens + k]:
        params = dataclasses.replace(PENALIZED, min_tokens=min_tokens, stop_token_ids=[stop_id])
        ref = one_engine(engines[0], prompt, params)
        if ref.outputs[0].finish_reason == "stop" and len(ref.outputs[0].token_ids) - 1 < k + min_tokens:
            break
    else:
        pytest.fail("no stop id in the window; pick another prompt or seed")
    assert check_resume(engines, prompt, params, k).stop_reason == stop_id


def test_stop_string_across_the_break(engines):
    """The stop string is the words of tokens k - 1 and k: it starts before the break and ends in the first
    resumed token; the stream held its start back, so the resumed deltas must give what precedes it."""
    prompt, params = PROMPTS[0], dataclasses.replace(PENALIZED, min_tokens=2, ignore_eos=True)
    free = one_engine(engines[0], prompt, params).outputs[0].token_ids
    k = next(i for i in range(4, len(free)) if min(free[i - 1 : i + 1]) >= FIRST_WORD_ID)  # two words, no </s>
    stop = f"w{free[k - 1]} w{free[k]}"
    params = dataclasses.replace(params, stop=[stop])
    ref = check_resume(engines, prompt, params, k)
    assert ref.stop_reason == stop and len(ref.token_ids) == k + 1 and ref.finish_reason == "stop"


def test_logprobs_of_the_earlier_tokens_are_left_empty(engines):
    dying, fresh = engines
    params = dataclasses.replace(GREEDY, logprobs=2)
    ref = one_engine(dying, PROMPTS[0], params).outputs[0]
    fresh.add_request(PROMPTS[0], params, request_id="again", output_token_ids=ref.token_ids[:3])
    done = drain(fresh)["again"][-1].outputs[0]
    assert done.logprobs[:3] == [{}] * 3 and len(done.logprobs) == len(done.token_ids)
    for got, want in zip(done.logprobs[3:], ref.logprobs[3:]):
        assert list(got) == list(want)
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    assert done.cumulative_logprob == pytest.approx(sum(next(iter(e.values())).logprob for e in ref.logprobs[3:]))
    assert_idle(*engines)


def test_async_generate_resumes(engines):
    dying, fresh = engines
    ref = one_engine(dying, PROMPTS[0], PENALIZED).outputs[0]

    async def resume() -> list[int]:
        engine = AsyncEngine(fresh)
        try:
            return sum([o.outputs[0].delta_token_ids async for o in engine.generate(
                PROMPTS[0], PENALIZED, output_token_ids=ref.token_ids[:4])], [])
        finally:
            engine.shutdown()

    assert ref.token_ids[:4] + asyncio.run(resume()) == ref.token_ids


def test_bad_output_so_far_is_a_value_error(engines):
    fresh = engines[1]
    eos = next(iter(fresh.tokenizer.eos_ids))
    cases = [
        (GREEDY, [5] * 11, "11 tokens leave nothing to generate with max_tokens=10"),
        (GREEDY, [5] * 10, "10 tokens leave nothing"),
        (GREEDY, [5, 128], r"output_token_ids contains ids outside \[0, 128\)"),
        (GREEDY, [5, -1], "output_token_ids contains ids outside"),
        (GREEDY, ["w5"], "output_token_ids must hold integer token ids"),
        (dataclasses.replace(PENALIZED, n=2), [5], "n=2 must be 1"),
        (dataclasses.replace(GREEDY, prompt_logprobs=1), [5], "prompt_logprobs"),
        (SamplingParams(max_tokens=10), [5, eos, 7], f"token 1 \\(id {eos}\\) already ends the request with "
                                                     "finish_reason 'stop'"),
        (SamplingParams(max_tokens=10, stop=["w6 w7"]), [6, 7, 8], "token 1 .* 'stop' \\(stop_reason 'w6 w7'\\)"),
    ]
    for params, ids, match in cases:
        with pytest.raises(ValueError, match=match):
            fresh.add_request(PROMPTS[0], params, output_token_ids=ids)
    assert_idle(fresh)
