"""Property-based fuzzing of OpenAI HTTP request bodies (`/v1/completions`, `/v1/chat/completions`) against the
session's SmolLM2 server (`both_servers`).

Bodies mix plausible values with anything JSON holds, field by field: wrong types, strings with lone surrogates
(JSON `\\ud800` escapes), NaN / Infinity literals, numbers past any range (thousands of digits), huge lists,
nesting deeper than Python's recursion limit, unknown fields; sometimes the bytes are no UTF-8, cut short, or
random. `max_tokens` is always small when it is valid, so accepted requests stay fast. Half of them stream.

The fields include the token rules (`logit_bias` with real ids and biases, `allowed_token_ids`, `bad_words`) and
every output constraint (`response_format`, `structured_outputs`, `guided_choice`, `guided_regex`), alone and
clashing.

Property: a 200 with a well-formed completion (one choice per prompt and sample, each finished once; usage that
adds up and agrees with the choices' token counts where they are visible) or a 400 / 404 / 429 in OpenAI's error
shape with a non-empty message, a 400 naming its field in `param` (issue 19; only an error about the body as a
whole, which is not UTF-8 JSON or not an object, has no field to name); a stream may end with such a 400 error
event when its own values fail it after its first step. Never a 5xx, never a hang (every request has a timeout).
Afterwards nothing runs, no KV page is in use, and a greedy canary gives the text it gave before the fuzz.

Examples are bounded and derandomized (`FUZZ`), so the run is the same in CI every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import types

import httpx2 as httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jaxinfer.request_limits import (CHAT_ROLES, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS,
                                     MAX_LOGIT_BIAS)
from jaxinfer.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxinfer.serving.openai.translate import COMPLETION_MAX_TOKENS
from tests.jaxinfer.serving.test_fuzz_grpc import FUZZ, plausible_or_any, texts
from tests.jaxinfer.test_fuzz_requests import ODD_TEXT

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
TIMEOUT_S = 60
CANARY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
BODY_ERROR = "the body "  # a 400 about the body as a whole (not UTF-8 JSON, not an object): no field to name


@dataclasses.dataclass(frozen=True)
class Raw:
    """A JSON literal written as it is: NaN, Infinity, numbers of any size, nesting of any depth."""

    text: str


def to_json(value: object) -> str:
    """JSON text of `value` (`Raw` literals as they are; lone surrogates as `\\uXXXX` escapes)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(to_json, value)) + "]"
    return json.dumps(value)  # ensure_ascii: every non-ASCII character, surrogates included, is escaped


RAW_NUMBERS = st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"),
                               Raw("2e-400"), Raw("-0"), Raw("9" * 5000), Raw("-" + "9" * 60), Raw("1" + "0" * 30)])
DEEP = st.sampled_from([Raw("[" * 50 + "]" * 50), Raw("[" * 3000 + "]" * 3000),
                        Raw('{"a": ' * 2500 + "1" + "}" * 2500)])
HUGE_LISTS = st.sampled_from([list(range(10_000)), ["a"] * 300, [[7, 8]] * 300, [{"role": "user"}] * 2000])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-300, 300), st.integers(-(2**70), 2**70),
                    st.sampled_from([2**31, 2**32, 2**63, -(2**63), 2**64]), st.floats(allow_nan=False),
                    RAW_NUMBERS, ODD_TEXT, texts(12), st.sampled_from(["", "3", "0.5", "true", "null", "NaN"]))
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(5), inner, max_size=3),
                   max_leaves=8) | DEEP | HUGE_LISTS

# max_tokens: small when valid (as sent, or after pydantic's coercion: "3", 2.0, true), else invalid.
SMALL_MAX_TOKENS = st.integers(1, 3)
WILD_MAX_TOKENS = st.one_of(st.integers(-3, 0), st.integers(9000, 2**70), st.sampled_from(
    ["3", "four", 2.0, 2.5, True, False, [], {}, [3], Raw("NaN"), Raw("1e400"), Raw("9" * 5000), "\ud800"]))
STREAM_OPTIONS = st.none() | st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                 "continuous_usage_stats": st.booleans()})
WORD = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)  # a valid stop string
# Each field: (a value within the limits, a value near them or past them). The wild one is drawn a quarter of the
# time from anything JSON holds (`plausible_or_any`).
SAMPLING = {  # the fields both endpoints share
    "model": (st.sampled_from([MODEL, None]), st.sampled_from(["gpt-4", "", MODEL.lower(), "\ud800"])),
    "temperature": (st.sampled_from([0, 0.7, 1.0]), st.floats(-1, 3) | st.sampled_from([1e4, 10001])),
    "top_p": (st.floats(0.125, 1), st.floats(-0.25, 1.25)),
    "top_k": (st.integers(-1, 50), st.integers(-3, 2**40)),
    "min_p": (st.floats(0, 1), st.floats(-0.25, 1.25)),
    "presence_penalty": (st.floats(-2, 2), st.floats(-2.5, 2.5)),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-2.5, 2.5)),
    "repetition_penalty": (st.floats(0.5, 2), st.floats(-1, 12)),
    "n": (st.integers(1, 2), st.integers(-1, 12)),
    "seed": (st.integers(0, 2**32 - 1), st.integers(-2, 2**64)),
    "stop": (st.none() | WORD | st.lists(WORD, max_size=3), ODD_TEXT | st.lists(ODD_TEXT, max_size=20)),
    "min_tokens": (st.integers(0, 1), st.integers(-1, 6)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4),
                       st.lists(st.integers(-2, VOCAB + 2), max_size=40)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "stream": (st.booleans(), st.booleans()),
    "stream_options": (STREAM_OPTIONS, st.dictionaries(st.sampled_from(["include_usage", "x"]), ANY, max_size=2)),
    "cache_salt": (st.none() | texts(8), ODD_TEXT),
    "user": (texts(8), ODD_TEXT),  # ignored
    "metadata": (st.none() | st.dictionaries(texts(5), texts(5), max_size=2), st.dictionaries(texts(5), ANY)),
    # Output constraints: mostly none when plausible (two at once are a 400 naming them).
    "response_format": (st.sampled_from([None, None, None, {"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}]), st.sampled_from([
            {}, {"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "n"}},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "bogus"}}},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "required": 3}}}])),
    "structured_outputs": (st.sampled_from([None, None, None, {"choice": ["yes", "no"]}, {"regex": "[a-z]{1,6}"},
                                            {"json_object": True}, {"json": {"type": "boolean"}},
                                            {"grammar": 'start: "yes" | "no"'}]),
                           st.sampled_from([{}, {"choice": []}, {"choice": ["a", 3]}, {"regex": "("}, {"jsn": {}},
                                            {"regex": "a", "choice": ["a"]}, {"json": "{not json"},
                                            {"grammar": "start: undefined_rule"}, {"regex": "a{1000000}"}])),
    "guided_choice": (st.sampled_from([None, None, None, ["apple", "pear"], ["x"]]),
                      st.sampled_from([[], [""], ["a", 5], "apple", ["\ud800"]])),
    "guided_regex": (st.sampled_from([None, None, None, "a+", "[0-9]{1,3}"]),
                     st.sampled_from(["", "(", "a" * 5000, "a{1000000}"])),
    # OpenAI's token ids as strings -> a bias in [-100, 100] (at most MAX_LOGIT_BIAS of them)
    "logit_bias": (st.none() | st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=4),
                   st.dictionaries(st.integers(-2, VOCAB + 2).map(str) | texts(4) | st.sampled_from(["07", " 7"]),
                                   st.floats(-200, 200) | st.sampled_from([Raw("NaN"), Raw("1e400")]), max_size=6)
                   | st.just({str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)})),
    "allowed_token_ids": (st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                          st.lists(st.integers(-2, VOCAB + 2), max_size=12)
                          | st.just(list(range(MAX_ALLOWED_TOKEN_IDS + 1)))),
    "bad_words": (st.none() | st.lists(WORD, max_size=3),
                  st.lists(ODD_TEXT, max_size=4) | st.sampled_from([["   "], [""], ["w"] * (MAX_BAD_WORDS + 1),
                                                                    ["x" * (MAX_BAD_WORD_CHARS + 1)]])),
    "prompt_logprobs": (st.none() | st.integers(0, 3), st.integers(-1, 22) | st.floats(0, 2)),  # 400 with stream
}
COMPLETION_ONLY = {
    "prompt": (st.one_of(texts(40).filter(bool), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
                         st.lists(WORD, min_size=1, max_size=2)),
               st.one_of(ODD_TEXT, st.lists(st.integers(-1, VOCAB + 1), max_size=30), st.lists(ODD_TEXT, max_size=3),
                         st.lists(st.lists(st.integers(0, VOCAB), max_size=12), max_size=3))),
    "max_tokens": (SMALL_MAX_TOKENS, WILD_MAX_TOKENS | st.none()),  # None: 16
    "logprobs": (st.none() | st.integers(0, 5), st.integers(-1, 22)),
    "echo": (st.booleans(), st.booleans()),
    "best_of": (st.none(), st.integers(0, 3)),
    "suffix": (st.sampled_from([None, ""]), st.just("end")),
}
PARTS = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": ODD_TEXT}),
                           st.just({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), ANY),
                 max_size=3)
GOOD_CHAT = st.builds(lambda system, user: ([{"role": "system", "content": system}] if system else [])
                      + [{"role": "user", "content": user}], st.none() | WORD, texts(30).filter(bool))
WILD_MESSAGE = st.fixed_dictionaries(
    {"role": plausible_or_any(st.sampled_from(CHAT_ROLES), ODD_TEXT), "content": plausible_or_any(ODD_TEXT, PARTS)},
    optional={"name": texts(6), "tool_calls": st.just([])}) | ANY
CHAT_ONLY = {
    "messages": (GOOD_CHAT, st.lists(WILD_MESSAGE, max_size=3)),
    "max_tokens": (SMALL_MAX_TOKENS, WILD_MAX_TOKENS),  # never None: that is the whole context
    "max_completion_tokens": (st.none() | SMALL_MAX_TOKENS, WILD_MAX_TOKENS),
    "logprobs": (st.booleans(), st.booleans()),
    "top_logprobs": (st.none(), st.integers(-1, 22)),
    "add_generation_prompt": (st.just(True), st.booleans()),
    "continue_final_message": (st.just(False), st.booleans()),
    "chat_template_kwargs": (st.sampled_from([None, {}, {"enable_thinking": False}]), st.dictionaries(
        st.sampled_from(["enable_thinking", "tools", "messages", "raise_exception", "bos_token"]) | texts(4), ANY,
        max_size=2)),
    "tools": (st.sampled_from([None, []]), st.just([{"type": "function", "function": {"name": "f"}}])),
    "tool_choice": (st.sampled_from([None, "none", "auto"]), st.sampled_from(["required", {"type": "function"}])),
}
REQUIRED = ("prompt", "messages", "max_tokens", "stream")  # always sent (max_tokens: accepted requests stay short)
SAFE_WILD = ("max_tokens", "max_completion_tokens")  # never anything: a valid large value would run for minutes
UNKNOWN_KEYS = st.sampled_from(["temprature", "max_token", "prompt_logprob", "streaming", "best_of"]) | texts(8)
BAD_BYTES = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80", b"\x01"])


@st.composite
def bodies(draw, chat: bool) -> bytes:
    """A request body: a JSON object whose fields are all within the limits, or one of them wild, or all of them
    (and sometimes an unknown field); sometimes another JSON value, random bytes, bytes that are not UTF-8 inside
    a string, or a body cut short."""
    kind = draw(st.sampled_from(["object"] * 16 + ["value", "bytes", "bad bytes", "cut"]))
    if kind == "bytes":
        return draw(st.binary(max_size=80))
    if kind == "value":
        return to_json(draw(ANY)).encode()
    spec = SAMPLING | (CHAT_ONLY if chat else COMPLETION_ONLY)
    mode = draw(st.sampled_from(["good"] * 3 + ["one"] * 4 + ["all"]))
    wild_one = draw(st.sampled_from(sorted(spec))) if mode == "one" else None

    def strategy(name: str) -> st.SearchStrategy:
        good, wild = spec[name]
        if mode == "all" or name == wild_one:
            return wild if name in SAFE_WILD else plausible_or_any(wild, ANY)
        return good

    body = draw(st.fixed_dictionaries({n: strategy(n) for n in spec if n in REQUIRED},
                                      optional={n: strategy(n) for n in spec if n not in REQUIRED}))
    if wild_one is not None and wild_one not in body:
        body[wild_one] = draw(strategy(wild_one))
    if mode != "good" and draw(st.integers(0, 5)) == 0:
        body[draw(UNKNOWN_KEYS)] = draw(ANY)
    data = to_json(body).encode()
    if kind == "bad bytes":  # inside the first key, or the last string
        at = data.index(b'"') + 1 if draw(st.booleans()) else data.rindex(b'"')
        return data[:at] + draw(BAD_BYTES) + data[at:]
    if kind == "cut":
        return data[:draw(st.integers(0, len(data) - 1))]
    return data


def assert_error(status: int, error_body: dict) -> None:
    assert status in ERROR_TYPES, status
    assert set(error_body) == {"error"}, error_body
    error = error_body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert error["type"] == ERROR_TYPES[status], error
    assert error["param"] is None or isinstance(error["param"], str), error
    if status == 404:
        assert error["param"] == "model", error
    if status == 400:  # issue 19: a 400 names the field it concerns (or the body, when there is no field to name)
        assert error["param"] or error["message"].startswith((BODY_ERROR, "unknown field ''")), error
    event(f"{status}: {error['param'] or ' '.join(error['message'].split()[:4])}")


@dataclasses.dataclass
class Expected:
    """What an accepted request must answer: its number of choices, the most tokens each may hold, logprobs."""

    choices: int
    max_tokens: int | None
    logprobs: bool
    include_usage: bool
    n: int = 1
    echo_tokens: list[int] | None = None  # echo with logprobs: per prompt, its tokens (they lead the logprobs)
    continuous_usage: bool = False  # vLLM's continuous_usage_stats (with include_usage): usage on every chunk


def expected(data: bytes, chat: bool, http: httpx.Client) -> Expected:
    """From the accepted body, parsed as the server parsed it (pydantic's coercions included); echoed prompts'
    lengths from the server's /tokenize."""
    raw = json.loads(data.decode("utf-8"))
    if chat:
        body = ChatCompletionRequest.model_validate(raw)
        prompts = 1
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = body.logprobs
    else:
        body = CompletionRequest.model_validate(raw)
        prompt = body.prompt
        prompts = 1 if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt) else len(prompt)
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        logprobs = body.logprobs is not None
        if body.echo and logprobs:
            texts = [prompt] if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt) else prompt
            echo = [len(p) if not isinstance(p, str) else
                    http.post("/tokenize", json={"prompt": p}).json()["count"] for p in texts]
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Expected(prompts * body.n, max_tokens, logprobs, include_usage, body.n,
                    None if chat or not (body.echo and logprobs) else echo,
                    include_usage and body.stream_options.continuous_usage_stats)


def assert_usage(usage: dict, exp: Expected, finishes: list[str], counts: list[int] | None) -> None:
    """Usage adds up; completion tokens lie between what the "length" choices must hold and the most allowed, and
    equal the choices' own counts when those are visible (logprobs)."""
    assert usage["prompt_tokens"] >= 1 and usage["completion_tokens"] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage
    if exp.max_tokens is not None:
        assert finishes.count("length") * exp.max_tokens <= usage["completion_tokens"] <= exp.choices * exp.max_tokens
    if counts is not None:
        assert sum(counts) == usage["completion_tokens"], (counts, usage)


def _choice_tokens(choice: dict, chat: bool, exp: Expected | None = None) -> int:
    """The generated tokens a choice's logprobs hold (an echoed prompt's lead them: not counted)."""
    lp = choice["logprobs"]
    echoed = exp.echo_tokens[choice["index"] // exp.n] if exp is not None and exp.echo_tokens else 0
    return 0 if lp is None else len(lp["content"] if chat else lp["tokens"]) - echoed


def assert_completion(body: dict, exp: Expected, chat: bool) -> None:
    assert body["object"] == ("chat.completion" if chat else "text_completion") and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
    choices = body["choices"]
    assert sorted(c["index"] for c in choices) == list(range(exp.choices)), choices
    finishes = [c["finish_reason"] for c in choices]
    assert set(finishes) <= {"stop", "length"}, finishes
    for c in choices:
        if chat:
            assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
        else:
            assert isinstance(c["text"], str)
        assert (c["logprobs"] is not None) == exp.logprobs, c
        if exp.logprobs and c["finish_reason"] == "length":
            assert _choice_tokens(c, chat, exp) == exp.max_tokens
    assert_usage(body["usage"], exp, finishes,
                 [_choice_tokens(c, chat, exp) for c in choices] if exp.logprobs else None)


def assert_stream(lines: list[str], exp: Expected, chat: bool) -> None:
    """SSE: `data: {chunk}` lines then `data: [DONE]`; each choice finishes once; usage last when asked for."""
    assert lines and all(line.startswith("data: ") for line in lines), lines[:3]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1, lines[-3:]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    errors = [c for c in chunks if "error" in c]
    if errors:  # a request its own values fail after its first step (e.g. min_tokens past a completed constraint)
        assert len(errors) == 1 and errors[0] is chunks[-1], errors
        assert_error(errors[0]["error"]["code"], errors[0])
        return
    with_usage = [c for c in chunks if c.get("usage")]
    if exp.continuous_usage:  # every chunk, the last one (no choices) with the final usage
        assert with_usage == chunks and not chunks[-1]["choices"], chunks
        done = [c["usage"]["completion_tokens"] for c in chunks]
        assert done == sorted(done), done  # running totals never go back
    else:
        assert len(with_usage) == exp.include_usage and (not with_usage or with_usage[0] is chunks[-1])
    finish: dict[int, str] = {}
    tokens = {i: 0 for i in range(exp.choices)}
    for chunk in chunks[:len(chunks) - exp.include_usage]:
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion") and chunk["model"] == MODEL
        for c in chunk["choices"]:
            i = c["index"]
            assert i in tokens and i not in finish, (i, finish)
            if chat:
                assert isinstance(c["delta"]["content"], str)
            else:
                assert isinstance(c["text"], str)
            tokens[i] += _choice_tokens(c, chat)
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in ("stop", "length"), c
                finish[i] = c["finish_reason"]
    assert sorted(finish) == list(range(exp.choices)), finish
    if exp.logprobs and exp.max_tokens is not None:
        assert all(tokens[i] == exp.max_tokens for i, f in finish.items() if f == "length"), (tokens, finish)
    if chat:  # the first chunk of each choice carries the role
        firsts: dict[int, dict] = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                firsts.setdefault(c["index"], c["delta"])
        assert all(d.get("role") == "assistant" for d in firsts.values()), firsts
    if with_usage:
        assert chunks[-1]["choices"] == []
        assert_usage(chunks[-1]["usage"], exp, list(finish.values()), list(tokens.values()) if exp.logprobs else None)


def send(http: httpx.Client, path: str, data: bytes, chat: bool) -> None:
    """Posts `data` and checks the property (module docstring) on whatever comes back."""
    headers = {"content-type": "application/json"}
    with http.stream("POST", path, content=data, headers=headers, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            assert r.status_code < 500, (r.status_code, r.text[:500])
            assert r.headers["content-type"].startswith("application/json"), r.headers
            assert_error(r.status_code, r.json())
            return
        exp = expected(data, chat, http)
        if r.headers["content-type"].startswith("text/event-stream"):
            assert_stream([line for line in r.iter_lines() if line], exp, chat)
            event("200 stream")
        else:
            r.read()
            assert_completion(r.json(), exp, chat)
            event("200")


@pytest.fixture(scope="module")
def http(both_servers) -> httpx.Client:
    with httpx.Client(base_url=both_servers.base_url, timeout=TIMEOUT_S) as client:
        yield client


def _canary(http: httpx.Client) -> str:
    r = http.post(COMPLETIONS, json=CANARY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def canary_before(http) -> str:
    return _canary(http)


@settings(FUZZ, max_examples=100)
@given(data=bodies(chat=False))
def test_completions_fuzz(http, canary_before, data) -> None:
    send(http, COMPLETIONS, data, chat=False)


@settings(FUZZ, max_examples=100)
@given(data=bodies(chat=True))
def test_chat_completions_fuzz(http, canary_before, data) -> None:
    send(http, CHAT, data, chat=True)


def test_server_is_idle_and_correct_after_the_fuzz(both_servers, http, canary_before) -> None:
    """Runs after the fuzz tests (file order)."""
    both_servers.wait_idle()
    assert http.get("/health").status_code == 200
    assert _canary(http) == canary_before
    both_servers.wait_idle()


def test_a_sample_that_finishes_before_the_others_gets_one_finish_chunk() -> None:
    """Found by `test_chat_completions_fuzz` (a streamed chat with n=3, greedy, max_tokens=3, when the samples'
    first tokens came in different steps): each later engine output repeats a finished sample, and every repeat
    was sent as one more chunk with its finish_reason. Here the engine's outputs are given, so it is deterministic."""
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.serving.openai.app import OpenAIApp
    from jaxinfer.serving.openai.responses import Shaper
    from jaxinfer.serving.served import ServedEngine

    def out(finished: bool, *samples: tuple[list[int], int, str | None]) -> RequestOutput:
        completions = [CompletionOutput(i, "x" * len(ids), ids, reason, "x" * new, ids[len(ids) - new:])
                       for i, (ids, new, reason) in enumerate(samples)]
        return RequestOutput("r", None, [5], completions, finished)

    outputs = [out(False, ([1], 1, None), ([], 0, None)),  # sample 1 has no token yet
               out(False, ([1, 2], 1, "length"), ([1], 1, None)),
               out(True, ([1, 2], 0, "length"), ([1, 2], 1, "length"))]  # sample 0 repeated, finished already

    async def stream():
        for o in outputs[1:]:
            yield o

    async def events(chat: bool) -> list[str]:
        api = OpenAIApp(ServedEngine(EngineConfig(warmup=False)), MODEL)
        shaper = Shaper(chat, MODEL, 2, None)
        recorders = [types.SimpleNamespace(record=lambda out: None, abandoned=lambda: None)]  # metrics not under test
        return [e async for e in api._events(shaper, [stream()], outputs[:1], recorders, None, (True, False),
                                             contextlib.ExitStack())]

    for chat in (False, True):
        lines = [line for e in asyncio.run(events(chat)) for line in e.splitlines() if line]
        assert_stream(lines, Expected(choices=2, max_tokens=2, logprobs=False, include_usage=True), chat)
