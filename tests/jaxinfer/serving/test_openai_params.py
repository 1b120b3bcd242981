"""vLLM's extra sampling fields over the OpenAI HTTP API act as they do in the Python API: each response equals
`LLM.generate` / `LLM.chat` with the same `SamplingParams` (same seed), and differs from the response without
the field where the field must change it (so each check can fail), on the session's SmolLM2 server.

Fields: `top_k`, `min_tokens`, `include_stop_str_in_output`, `max_completion_tokens` against `max_tokens`,
`repetition_penalty`, `min_p`, `cache_salt` (prefix-cache hits in `usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import httpx2 as httpx
import pytest

from jaxinfer import SamplingParams

STORY = "Once upon a time, in a small village,"
YES_NO = [{"role": "user", "content": "Reply with one word: is the sky blue?"}]


@pytest.fixture(scope="module")
def post(both_servers):
    """POSTs a body to a route of the session's server; returns the 200 response's JSON."""
    def post(path: str, **body) -> dict:
        r = httpx.post(both_servers.base_url + path, json={"model": both_servers.model_name, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    return post


def _text(response: dict) -> str:
    choice = response["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _offline(llm, prompt: str, **kw) -> str:
    return llm.generate(prompt, SamplingParams(**kw))[0].outputs[0].text


def test_top_k_1_at_temperature_1_is_greedy(post, smollm2_llm):
    """top_k=1 keeps only the most likely token, so temperature 1 with any seed samples the greedy text."""
    greedy = _text(post("/v1/completions", prompt=STORY, max_tokens=12, temperature=0))
    assert greedy == _offline(smollm2_llm, STORY, max_tokens=12, temperature=0.0)
    sampled = _text(post("/v1/completions", prompt=STORY, max_tokens=12, temperature=1.0, seed=3))
    assert sampled != greedy  # without top_k this seed leaves the greedy path
    for seed in (3, 4):
        assert _text(post("/v1/completions", prompt=STORY, max_tokens=12, temperature=1.0, seed=seed,
                          top_k=1)) == greedy


def test_min_tokens_holds_off_eos_until_reached(post, smollm2_llm):
    """The model ends this reply with EOS after a few tokens; `min_tokens` bans EOS until that many tokens came,
    so the reply runs on (to `LLM.chat`'s text) and the first tokens stay the same."""
    plain = post("/v1/chat/completions", messages=YES_NO, max_tokens=20, temperature=0)
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 12
    forced = post("/v1/chat/completions", messages=YES_NO, max_tokens=20, temperature=0, min_tokens=12)
    assert forced["usage"]["completion_tokens"] >= 12
    ref = smollm2_llm.chat(YES_NO, SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12))[0].outputs[0]
    assert _text(forced) == ref.text and forced["usage"]["completion_tokens"] == len(ref.token_ids)
    assert ref.text.startswith(_text(plain)) and ref.text != _text(plain)


def test_include_stop_str_in_output(post, smollm2_llm):
    """The matched stop string ends the text with the field, not without it; `stop_reason` names it both ways."""
    greedy = _text(post("/v1/completions", prompt=STORY, max_tokens=10, temperature=0))
    assert " wizard" in greedy
    without = post("/v1/completions", prompt=STORY, max_tokens=10, temperature=0, stop=["wizard"])
    kept = post("/v1/completions", prompt=STORY, max_tokens=10, temperature=0, stop=["wizard"],
                include_stop_str_in_output=True)
    assert _text(kept) == _text(without) + "wizard" and greedy.startswith(_text(kept))
    assert [r["choices"][0]["stop_reason"] for r in (without, kept)] == ["wizard", "wizard"]
    assert _text(kept) == _offline(smollm2_llm, STORY, max_tokens=10, temperature=0.0, stop=["wizard"],
                                   include_stop_str_in_output=True)


def test_max_completion_tokens_wins_over_max_tokens(post):
    """Chat: `max_completion_tokens` bounds the reply when both are set (vLLM: max_tokens is its deprecated
    alias); either alone bounds it the same way."""
    chat = {"messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0,
            "ignore_eos": True}
    both = post("/v1/chat/completions", **chat, max_tokens=7, max_completion_tokens=3)
    assert both["usage"]["completion_tokens"] == 3 and both["choices"][0]["finish_reason"] == "length"
    old = post("/v1/chat/completions", **chat, max_tokens=5)
    new = post("/v1/chat/completions", **chat, max_completion_tokens=5)
    assert old["usage"]["completion_tokens"] == new["usage"]["completion_tokens"] == 5
    assert _text(old) == _text(new) and _text(new).startswith(_text(both)) and _text(new) != _text(both)


def test_repetition_penalty_and_min_p_equal_llm_generate(post, smollm2_llm):
    """Greedy with `repetition_penalty` (the greedy text repeats a name; the penalty avoids it) and seeded
    sampling with `min_p` give `LLM.generate`'s text for the same params and seed, not the text without them."""
    cases = [dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=1.0, seed=3, min_p=0.2)]
    refs = smollm2_llm.generate([STORY] * 4, [SamplingParams(max_tokens=14, **kw) for kw in cases]
                                + [SamplingParams(max_tokens=14, temperature=kw["temperature"], seed=kw.get("seed"))
                                   for kw in cases])
    for kw, ref, ref_without in zip(cases, refs[:2], refs[2:]):
        http = _text(post("/v1/completions", prompt=STORY, max_tokens=14, **kw))
        assert http == ref.outputs[0].text != ref_without.outputs[0].text, kw
    chat = dict(temperature=1.0, seed=5, min_p=0.3, repetition_penalty=1.2)
    ref = smollm2_llm.chat(YES_NO, SamplingParams(max_tokens=10, **chat))[0].outputs[0].text
    assert _text(post("/v1/chat/completions", messages=YES_NO, max_tokens=10, **chat)) == ref


def test_cache_salt_misses_the_prefix_cache_where_the_same_prompt_without_it_hits(post):
    """The second of two equal prompts is served from the prefix cache (`cached_tokens` > 0); the same prompt with
    a salt shares nothing with them (0), and a repeat with the same salt hits again. Chat the same."""
    prompt = "A lighthouse keeper counted the gulls on the rocks every morning, " * 4 + "and one day"

    def cached(route: str = "/v1/completions", **body) -> int:
        text = {"messages": [{"role": "user", "content": prompt}]} if route.endswith("chat/completions") \
            else {"prompt": prompt}
        r = post(route, **text, max_tokens=1, temperature=0, **body)
        assert r["usage"]["prompt_tokens"] > 32, r["usage"]
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()  # the prompt's pages enter the cache
    assert cached() > 0
    assert cached(cache_salt="salt-1") == 0
    assert cached(cache_salt="salt-1") > 0
    assert cached(cache_salt="salt-2") == 0
    chat = "/v1/chat/completions"
    cached(chat)
    assert cached(chat) > 0 and cached(chat, cache_salt="salt-1") == 0
