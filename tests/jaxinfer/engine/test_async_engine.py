"""AsyncEngine: concurrent asyncio streams over the engine thread, equal to offline results; abort and bad input."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

PROMPTS = ["The three primary colors are", "Emoji 👋🏽 and CJK 你好:", "def fibonacci(n):", "In 1969,"]


@pytest.fixture
def async_engine(smollm2_llm: LLM):
    engine = AsyncEngine(smollm2_llm.engine)
    yield engine
    engine.shutdown()


def test_concurrent_streams_equal_offline_results(smollm2_llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=10),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, stop=[" the"]),
              SamplingParams(temperature=0, max_tokens=10, logprobs=2),
              SamplingParams(temperature=1.0, seed=11, max_tokens=10)]
    offline = smollm2_llm.generate(PROMPTS, params)
    engine = AsyncEngine(smollm2_llm.engine)
    try:
        async def stream(prompt: str, sp: SamplingParams) -> tuple[str, list[int], str]:
            deltas, last = [], None
            async for out in engine.generate(prompt, sp):
                deltas.append(out.outputs[0].delta_text)
                last = out
            return "".join(deltas), last.outputs[0].token_ids, last.outputs[0].text

        async def main():
            return await asyncio.gather(*(stream(p, sp) for p, sp in zip(PROMPTS, params)))

        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (joined, token_ids, text), want in zip(results, offline):
        assert token_ids == want.outputs[0].token_ids
        assert joined == text == want.outputs[0].text


def test_bad_request_raises_in_caller_and_abort_frees_pages(smollm2_llm: LLM, async_engine: AsyncEngine) -> None:
    allocator = smollm2_llm.engine.page_allocator

    async def main():
        with pytest.raises(ValueError, match="empty"):
            async for _ in async_engine.generate("", SamplingParams(max_tokens=4)):
                pass
        # Leave a long request after its first output: the request is aborted and its pages come back.
        stream = async_engine.generate("Tell me a long story about the sea.",
                                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                       request_id="leaver")
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()
        for _ in range(200):
            if allocator.num_free_pages == allocator.num_usable_pages:
                break
            await asyncio.sleep(0.01)
        good = [out async for out in async_engine.generate("In 1969,", SamplingParams(temperature=0, max_tokens=4))]
        return good

    good = asyncio.run(main())
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 4
    assert allocator.num_free_pages == allocator.num_usable_pages
    stats = smollm2_llm.engine.stats()
    assert stats["kv_pages_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["steps"] > 0 and stats["decode_tokens"] > 0 and stats["ttft_s_mean"] > 0


# Generous bounds: a caller that is not answered waits forever without the fix; these only turn a hang into a failure.
ANSWER_TIMEOUT_S = 60
CRASH_BOUND_S = 1.0  # issue 19: every caller gets an engine-thread crash's error within a second


async def _final(engine: AsyncEngine, prompt: str, params: SamplingParams):
    async def run():
        return [out async for out in engine.generate(prompt, params)][-1]
    return await asyncio.wait_for(run(), ANSWER_TIMEOUT_S)


async def _rest(stream) -> None:
    async def run():
        async for _ in stream:
            pass
    await asyncio.wait_for(run(), ANSWER_TIMEOUT_S)


def _assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests() and stats["running"] == 0 and stats["waiting"] == 0
    assert llm.page_allocator.num_free_pages == llm.page_allocator.num_usable_pages


def test_an_unexpected_admission_error_fails_only_its_caller(smollm2_llm: LLM, monkeypatch) -> None:
    """A tokenizer that raises TypeError for one prompt: that caller gets it; the stream in flight, later requests
    and the loop go on."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = smollm2_llm.generate(["Tell me about the sea.", "In 1969,"], params)
    encode = smollm2_llm.tokenizer.encode

    def encode_or_fail(text: str, *args, **kwargs) -> list[int]:
        if "poison" in text:
            raise TypeError("injected tokenizer failure")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(smollm2_llm.tokenizer, "encode", encode_or_fail)
    engine = AsyncEngine(smollm2_llm.engine)
    try:
        async def main():
            stream = engine.generate("Tell me about the sea.", params)
            first = await asyncio.wait_for(anext(stream), ANSWER_TIMEOUT_S)
            with pytest.raises(TypeError, match="injected tokenizer failure"):
                await _final(engine, "the poison prompt", params)
            ids = list(first.outputs[0].token_ids)
            async for out in stream:
                ids = out.outputs[0].token_ids
            return ids, await _final(engine, "In 1969,", params)

        in_flight, later = asyncio.run(main())
        assert engine.is_alive() and engine.error is None
    finally:
        engine.shutdown()
    assert in_flight == offline[0].outputs[0].token_ids
    assert later.outputs[0].token_ids == offline[1].outputs[0].token_ids
    _assert_idle(smollm2_llm)


def test_an_engine_loop_crash_answers_every_caller_at_once(smollm2_llm: LLM, monkeypatch) -> None:
    """A failure inside a step that no request can be blamed for (the runner's KV cache) stops the loop: the
    streams in flight and the request still queued all get the error within `CRASH_BOUND_S` of the crash (issue
    19's bound; `ANSWER_TIMEOUT_S` is only a safety net), later calls get it without waiting."""
    engine = AsyncEngine(smollm2_llm.engine)
    kv = smollm2_llm.engine.runner.kv
    entered, release = threading.Event(), threading.Event()
    crashed_at: list[float] = []

    def failing_settle() -> None:
        entered.set()
        release.wait(ANSWER_TIMEOUT_S)
        crashed_at.append(time.monotonic())
        raise RuntimeError("injected KV cache failure")

    async def answered(work) -> tuple[float, str]:
        """When `work` raised (it must raise RuntimeError), and its message."""
        with pytest.raises(RuntimeError) as info:
            await work
        return time.monotonic(), str(info.value)

    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:
        async def main():
            streams = [engine.generate(p, long) for p in PROMPTS[:3]]
            for stream in streams:  # all three admitted and running
                await asyncio.wait_for(anext(stream), ANSWER_TIMEOUT_S)
            monkeypatch.setattr(kv, "settle_host_pages", failing_settle)
            await asyncio.to_thread(entered.wait, ANSWER_TIMEOUT_S)  # the engine thread is inside a step now
            queued = asyncio.ensure_future(_final(engine, "In 1969,", long))
            while engine._commands.empty():  # the queued request waits for admission behind the step
                await asyncio.sleep(0.01)
            waiting = [asyncio.ensure_future(answered(work)) for work in [_rest(s) for s in streams] + [queued]]
            release.set()
            answers = await asyncio.gather(*waiting)
            # answered at once, by the caller's own thread
            answers.append(await answered(_final(engine, "After the crash", long)))
            return answers

        answers = asyncio.run(main())
        errors = [message for _, message in answers]
        assert all("the engine loop stopped: RuntimeError: injected KV cache failure" in e for e in errors), errors
        assert len(crashed_at) == 1
        delays = [at - crashed_at[0] for at, _ in answers]
        assert max(delays) < CRASH_BOUND_S, f"callers answered {delays} s after the crash"
        assert not engine.is_alive() and "injected KV cache failure" in str(engine.error)
    finally:
        release.set()
        engine.shutdown()
        monkeypatch.undo()
    # The dead loop aborted its requests: once stepped (here, offline), the engine is idle and serves again.
    while smollm2_llm.engine.has_unfinished_requests():
        smollm2_llm.engine.step()
    _assert_idle(smollm2_llm)
    assert len(smollm2_llm.generate("Fine again", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
