"""Property-based fuzzing of `Generate` requests over loopback against a tiny random Llama server.

Requests carry random values within the proto types (huge, negative, NaN / infinite floats, long and odd strings,
random chats), sometimes a string field whose bytes are not UTF-8 on the wire, sometimes random bytes as the whole
request. Property: `INVALID_ARGUMENT` whose message starts with the field it blames, or a well-formed stream (every
completion ends once with "stop" or "length", or "error" where allowed ids and bad words leave it no token, ids in
the vocabulary, no more than max_tokens, usage on the last response). Afterwards the server reports SERVING, nothing is running or waiting, every page is free, and a greedy
canary gives the tokens it gave before the fuzz.

Examples are bounded and derandomized, so the run is the same in CI every time.
"""

from __future__ import annotations

import re

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from jaxinfer.request_limits import CHAT_ROLES
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from tests.jaxinfer.serving.test_server import ServerThread, serve_tiny_chat

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None)
MAX_MODEL_LEN = 96  # short: an accepted request generates at most this many tokens
ENGINE = dict(kv_cache_memory_bytes=8 << 20, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, warmup=False)
BAD_UTF8 = b"\xed\xa0\x80"  # a lone surrogate (U+D800) as CESU-style bytes: not UTF-8
PLACEHOLDER = "\u2603QzQ\u2603"  # replaced on the wire by BAD_UTF8
CANARY = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 21, 40, 33, 9]),
                            sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.floats(width=32)  # NaN and infinities included
# Names an INVALID_ARGUMENT message may start with: the proto's fields and the Python checks' names for them.
FIELD_NAMES = {f.name for m in (pb.GenerateRequest, pb.SamplingParams, pb.ChatInput, pb.ChatMessage, pb.TokenIds)
               for f in m.DESCRIPTOR.fields} | {"sampling", "input", "prompt", "prompt_token_ids", "request", "chat"}
NOT_A_MESSAGE = "the request is not a valid jaxinfer.v1.GenerateRequest message"  # random bytes that do not parse


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    """Strings protobuf can carry (no lone surrogate; those go through `PLACEHOLDER`): odd Unicode included."""
    return st.text(st.characters(codec="utf-8"), max_size=max_size) | st.sampled_from(
        ["", "Hi there", "\x00", "\u200b\ufeff", "e\u0301", "\U0001f600" * 3, "<|im_start|>", "<|im_end|>", "a" * 500])


def plausible_or_any(plausible: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `plausible` (values near the limits), a quarter of the time anything the proto type holds."""
    return st.one_of(plausible, plausible, plausible, anything)


VALID_SAMPLING = st.fixed_dictionaries({}, optional={  # within the limits, so that many requests stream
    "n": st.integers(1, 3), "temperature": st.sampled_from([0.0, 0.7, 1.0]), "top_k": st.integers(-1, 5),
    "top_p": st.floats(0.125, 1, width=32), "min_p": st.floats(0, 1, width=32),
    "repetition_penalty": st.floats(0.5, 2, width=32), "presence_penalty": st.floats(-2, 2, width=32),
    "frequency_penalty": st.floats(-2, 2, width=32), "max_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 1),
    "seed": st.integers(0, 2**32 - 1), "stop": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=8),
                                                        max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 127), max_size=5), "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(), "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 127), st.floats(-100, 100, width=32), max_size=4),
    "allowed_token_ids": st.lists(st.integers(0, 127), max_size=6),
    "bad_words": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=4).filter(str.strip), max_size=3),
}).map(lambda kw: pb.SamplingParams(**{k: v for k, v in kw.items()  # allowed ids and bad words could leave no token
                                       if not (k == "bad_words" and kw.get("allowed_token_ids"))}))
WILD_SAMPLING = st.fixed_dictionaries({}, optional={
    "n": plausible_or_any(st.integers(0, 4), INT32),
    "temperature": plausible_or_any(st.sampled_from([0.0, 0.7, 1.0]), FLOAT32),
    "top_k": plausible_or_any(st.integers(-2, 5), INT32),
    "top_p": plausible_or_any(st.floats(0, 1.25, width=32), FLOAT32),
    "min_p": plausible_or_any(st.floats(0, 1.25, width=32), FLOAT32),
    "repetition_penalty": plausible_or_any(st.floats(0, 2, width=32), FLOAT32),
    "presence_penalty": plausible_or_any(st.floats(-2.5, 2.5, width=32), FLOAT32),
    "frequency_penalty": plausible_or_any(st.floats(-2.5, 2.5, width=32), FLOAT32),
    "max_tokens": plausible_or_any(st.integers(-1, 8), INT32),
    "min_tokens": plausible_or_any(st.integers(-1, 8), INT32),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(texts(), max_size=18) | st.lists(st.just("a" * 300), min_size=1, max_size=2),
    "stop_token_ids": st.lists(st.integers(-2, 140) | INT32, max_size=35),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logprobs": plausible_or_any(st.integers(-1, 22), INT32),
    "prompt_logprobs": plausible_or_any(st.integers(-1, 22), INT32),
    "logit_bias": st.dictionaries(plausible_or_any(st.integers(-2, 140), INT32),
                                  plausible_or_any(st.floats(-150, 150, width=32), FLOAT32), max_size=5)
    | st.just({i: 1.0 for i in range(301)}),
    "allowed_token_ids": st.lists(st.integers(-2, 140) | INT32, max_size=8),
    "bad_words": st.lists(texts(), max_size=4) | st.lists(st.just("b" * 300), min_size=1, max_size=2)
    | st.just(["x"] * 65),
}).map(lambda kw: pb.SamplingParams(**kw))
SAMPLING = VALID_SAMPLING | WILD_SAMPLING
CHAT = st.builds(
    lambda messages, add: pb.ChatInput(messages=messages, **({} if add is None else {"add_generation_prompt": add})),
    st.lists(st.builds(pb.ChatMessage, role=plausible_or_any(st.sampled_from(CHAT_ROLES), texts(8)), content=texts()), max_size=4),
    st.none() | st.booleans())
INPUT = st.one_of(
    st.none(),
    (texts(200) | st.text(min_size=1, max_size=60)).map(lambda t: {"text": t}),
    st.lists(st.integers(0, 127), max_size=60).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    st.lists(st.integers(0, 140) | INT32, max_size=120).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    CHAT.map(lambda chat: {"chat": chat}),
)


@st.composite
def request_bytes(draw) -> bytes:
    """A serialized GenerateRequest of fuzzed fields; a string field may hold non-UTF-8 bytes; or random bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=80))
    kw = draw(INPUT) or {}
    if draw(st.booleans()):
        kw["sampling"] = draw(SAMPLING)
    kw["request_id"] = draw(st.just("") | texts(12))
    kw["cache_salt"] = draw(st.just("") | texts(12))
    request = pb.GenerateRequest(**kw)
    corrupt = draw(st.sampled_from([None] * 10 + ["text", "request_id", "cache_salt", "stop", "content",
                                                  "bad_words"]))
    if corrupt in ("text", "request_id", "cache_salt"):
        setattr(request, corrupt, PLACEHOLDER)
    elif corrupt in ("stop", "bad_words"):
        getattr(request.sampling, corrupt).append(PLACEHOLDER)
    elif corrupt == "content":
        request.chat.messages.add(role="user", content=PLACEHOLDER)
    data = request.SerializeToString()
    if corrupt is not None and data.count(PLACEHOLDER.encode()) == 1:
        data = data.replace(PLACEHOLDER.encode(), BAD_UTF8)
    return data


@pytest.fixture(scope="module")
def served_tiny(tmp_path_factory):
    st_ = serve_tiny_chat(tmp_path_factory.mktemp("fuzz"), **ENGINE)
    yield st_
    st_.stop()


def _generate(server: ServerThread, data: bytes) -> list[pb.GenerateResponse]:
    call = server.channel.unary_stream("/jaxinfer.v1.JaxInfer/Generate", request_serializer=None,
                                       response_deserializer=pb.GenerateResponse.FromString)
    return list(call(data, timeout=120))


@pytest.fixture(scope="module")
def canary_before(served_tiny) -> list[int]:
    return [t for r in _generate(served_tiny, CANARY.SerializeToString()) for t in r.token_ids]


def assert_well_formed(responses: list[pb.GenerateResponse], data: bytes, vocab_size: int) -> None:
    request = pb.GenerateRequest.FromString(data)  # it parsed on the server, so it parses here
    sampling = request.sampling
    n = sampling.n if sampling.HasField("n") else 1
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    finishes: dict[int, list[str]] = {i: [] for i in range(n)}
    assert responses and len({r.request_id for r in responses}) == 1 and responses[0].request_id
    if request.request_id:
        assert responses[0].request_id == request.request_id
    for r in responses:
        assert r.index in tokens, f"index {r.index} of n={n}"
        assert not finishes[r.index], f"completion {r.index} streamed after its finish"
        assert all(0 <= t < vocab_size for t in r.token_ids)
        tokens[r.index] += r.token_ids
        if r.finish_reason:
            finishes[r.index].append(r.finish_reason)
    # A request with both allowed ids and bad words may leave itself no token at some step: it fails ("error").
    ends = (["stop"], ["length"]) + ((["error"],) if sampling.allowed_token_ids and sampling.bad_words else ())
    assert all(f in ends for f in finishes.values()), finishes
    assert all(len(t) <= max_tokens for t in tokens.values())
    assert [r.HasField("usage") for r in responses].count(True) == 1 and responses[-1].HasField("usage")
    usage = responses[-1].usage
    assert usage.prompt_tokens >= 1 and usage.completion_tokens == sum(map(len, tokens.values()))
    # prompt logprobs: on the first response only, one per prompt position after the first, the prompt token first
    assert not any(r.prompt_logprobs for r in responses[1:])
    if sampling.HasField("prompt_logprobs"):
        entries = responses[0].prompt_logprobs
        assert len(entries) == usage.prompt_tokens - 1
        assert all(1 <= len(e.top) <= sampling.prompt_logprobs + 1 and e.top[0].rank >= 1 for e in entries)
    else:
        assert not responses[0].prompt_logprobs


def _request(**sampling) -> bytes:
    return pb.GenerateRequest(text="Hi there", sampling=pb.SamplingParams(max_tokens=6, **sampling)).SerializeToString()


@FUZZ
@given(data=request_bytes())
@example(data=_request(temperature=0.7, seed=3, logit_bias={40: 5.0, 41: -100.0, 99: 100.0}))
@example(data=_request(allowed_token_ids=[40, 41, 42, 2], n=2, seed=1))
@example(data=_request(bad_words=["ab", "c", "\U0001f600"], temperature=0))
@example(data=_request(allowed_token_ids=[40, 41, 42], bad_words=["BC", "D"], temperature=1.0, seed=5))  # 40 is B
@example(data=_request(allowed_token_ids=[40], bad_words=["BB"]))  # no token left after "B": "error"
def test_generate_fuzz(served_tiny, canary_before, data: bytes) -> None:
    try:
        responses = _generate(served_tiny, data)
    except grpc.RpcError as e:
        details = e.details() or ""
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), details)
        blamed = re.match(r"[A-Za-z_]*", details).group(0)
        assert blamed in FIELD_NAMES or details == NOT_A_MESSAGE, details[:300]
        event(f"INVALID_ARGUMENT: {blamed}")
        return
    assert_well_formed(responses, data, served_tiny.engine.model_config.vocab_size)
    event("OK")
    sampling = pb.GenerateRequest.FromString(data).sampling
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(sampling, name):
            event(f"OK with {name}")
    if any(r.finish_reason == "error" for r in responses):
        # the client is told why, and that its own values are to blame (a field named first)
        failed = [r for r in responses if r.finish_reason == "error"]
        assert all(r.error_kind == "request" and re.match(r"[A-Za-z_]*", r.error).group(0) in FIELD_NAMES
                   for r in failed), [(r.error_kind, r.error[:200]) for r in failed]
        event("OK: no token left")


def test_server_is_idle_and_correct_after_the_fuzz(served_tiny, canary_before) -> None:
    """Runs after `test_generate_fuzz` (file order)."""
    assert served_tiny.health_status() == health_pb2.HealthCheckResponse.SERVING
    stats = served_tiny.engine.stats()
    assert stats["running"] == stats["waiting"] == stats["kv_pages_used"] == 0, stats
    after = [t for r in _generate(served_tiny, CANARY.SerializeToString()) for t in r.token_ids]
    assert after == canary_before and len(after) == 8
