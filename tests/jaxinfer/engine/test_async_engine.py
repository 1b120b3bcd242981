"""AsyncEngine: concurrent asyncio streams over the engine thread, equal to offline results; abort and bad input."""

from __future__ import annotations

import asyncio

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
