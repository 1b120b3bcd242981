"""Property-based fuzzing of what a Python caller hands the library: `SamplingParams(...)`, prompts (text, token
ids, dicts, `Prompt`) and `Engine.add_request` on the tiny random Llama.

Properties: every input either raises `ValueError` whose message starts with the field it blames, or is accepted
with values inside the documented limits (`jaxinfer.request_limits`); nothing else is ever raised. After the
engine fuzz the engine is idle with every page free and a greedy canary gives the tokens it gave before.

Examples are bounded and derandomized (`FUZZ`), so the run is the same in CI every time.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import assume, event, example, given, settings
from hypothesis import strategies as st

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.prompt import PROMPT_DICT_KEYS, Prompt
from jaxinfer.request_limits import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                     MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY,
                                     MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                     MIN_REPETITION_PENALTY)
from jaxinfer.structured_outputs import KINDS as STRUCTURED_KINDS
from jaxinfer.structured_outputs import StructuredOutputsParams
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model
from tests.jaxinfer.engine.tiny_model import VOCAB_SIZE, make_tiny_model_dir

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None)

FIELDS = [f for f in SamplingParams.__dataclass_fields__]
LONE_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
ODD_TEXT = st.one_of(
    st.text(max_size=20),
    st.text(st.characters(exclude_categories=()), max_size=20),  # surrogates, controls, private use included
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), LONE_SURROGATES, st.text(max_size=5)),
    st.sampled_from(["", " ", "\x00", "\u200b", "\ufeff", "e\u0301", "\U0001f600", "w5 w6", "a" * 300]),
)
# +-2**bits (mapped: hypothesis cannot repr a strategy holding an int of over 4,300 digits).
HUGE_INTS = st.tuples(st.sampled_from([31, 32, 63, 64, 1400, 20000]), st.booleans()).map(
    lambda t: -(2 ** t[0]) if t[1] else 2 ** t[0])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-300, 300), st.integers(), HUGE_INTS,
    st.floats(), st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308]),
    st.complex_numbers(max_magnitude=10), ODD_TEXT, st.binary(max_size=8),
    st.sampled_from([np.int64(3), np.int32(-1), np.uint64(2**63), np.float32(0.5), np.float64(math.nan),
                     np.bool_(True), np.array(3), np.array([1, 2]), np.array([[1]]), np.array([0.5]),
                     np.array([], dtype=np.float32), object(), int, Ellipsis]),
)
ANYTHING = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3), st.sets(st.integers(), max_size=3)),
    max_leaves=8,
) | st.sampled_from([["a"] * 100_000, list(range(100_000)), [["a"]], [[1, 2]], ("a", 1), [1.0], [True],
                     range(3), {"a": 1}])

# Values near each field's limits, so that accepted params are exercised too, not only rejections.
PLAUSIBLE = {
    "n": st.integers(-1, MAX_N + 2),
    "temperature": st.floats(-1, MAX_TEMPERATURE * 2) | st.integers(-1, 3),
    "top_k": st.integers(-3, 200),
    "top_p": st.floats(-0.5, 1.5) | st.integers(0, 2),
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.floats(-1, MAX_REPETITION_PENALTY * 1.5),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "max_tokens": st.none() | st.integers(-2, 70),
    "min_tokens": st.integers(-2, 70),
    "seed": st.none() | st.integers(-2, 2**32 + 2),
    "logprobs": st.none() | st.integers(-2, MAX_LOGPROBS + 2),
    "prompt_logprobs": st.none() | st.integers(-2, MAX_LOGPROBS + 2) | st.floats(0, 3) | st.booleans(),
    "stop": st.none() | ODD_TEXT | st.lists(ODD_TEXT, max_size=MAX_STOP_STRINGS + 2),
    "stop_token_ids": st.none() | st.lists(st.integers(-2, VOCAB_SIZE + 2) | HUGE_INTS, max_size=MAX_STOP_TOKEN_IDS + 2)
    | st.lists(st.integers(0, 50), max_size=4).map(np.array),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "structured_outputs": st.none() | st.dictionaries(
        st.sampled_from(STRUCTURED_KINDS) | st.text(max_size=4),
        st.sampled_from(['{"type": "object"}', '{"type": "integer"}', "{", "[a-z]+", "(", "yes|no", "",
                         'start: "a"']) | st.lists(ODD_TEXT, max_size=3) | st.booleans() | ODD_TEXT,
        max_size=2),
    "logit_bias": st.none() | st.dictionaries(
        st.integers(-2, VOCAB_SIZE + 2) | HUGE_INTS | st.sampled_from([np.int64(5), True, "7", 1.0]),
        st.floats(-MAX_LOGIT_BIAS_VALUE * 1.5, MAX_LOGIT_BIAS_VALUE * 1.5) | st.integers(-150, 150)
        | st.sampled_from([math.nan, math.inf, np.float32(2.5), "1"]), max_size=6)
    | st.integers(MAX_LOGIT_BIAS - 1, MAX_LOGIT_BIAS + 1).map(lambda n: {i: 1.0 for i in range(n)}),
    "allowed_token_ids": st.none() | st.lists(st.integers(-2, VOCAB_SIZE + 2) | HUGE_INTS, max_size=8)
    | st.lists(st.integers(0, 50), max_size=4).map(np.array)
    | st.sampled_from([MAX_ALLOWED_TOKEN_IDS, MAX_ALLOWED_TOKEN_IDS + 1]).map(lambda n: list(range(n))),
    "bad_words": st.none() | ODD_TEXT | st.lists(
        ODD_TEXT | st.integers(3, VOCAB_SIZE + 1).map(lambda i: f"w{i}")
        | st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=2, max_size=3).map(lambda ids: " ".join(map("w{}".format,
                                                                                                        ids)))
        | st.just("b" * (MAX_BAD_WORD_CHARS + 1)), max_size=4)
    | st.just(["w5"] * (MAX_BAD_WORDS + 1)),
}
assert set(PLAUSIBLE) == set(FIELDS)
SAMPLING_KWARGS = st.fixed_dictionaries({}, optional={f: PLAUSIBLE[f] | ANYTHING for f in FIELDS})


def blamed_field(message: str) -> str:
    """The field a message starts with: `stop[2] has ...` -> stop, `max_tokens=5: ...` -> max_tokens."""
    match = re.match(r"[A-Za-z_]+", message)
    return match.group(0) if match else message


def assert_within_limits(sp: SamplingParams) -> None:
    def finite(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def integer(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    assert integer(sp.n) and 1 <= sp.n <= MAX_N
    assert finite(sp.temperature) and 0 <= sp.temperature <= MAX_TEMPERATURE
    assert integer(sp.top_k) and sp.top_k >= -1
    assert finite(sp.top_p) and 0 < sp.top_p <= 1
    assert finite(sp.min_p) and 0 <= sp.min_p <= 1
    assert finite(sp.repetition_penalty) and MIN_REPETITION_PENALTY <= sp.repetition_penalty <= MAX_REPETITION_PENALTY
    assert finite(sp.presence_penalty) and -2 <= sp.presence_penalty <= 2
    assert finite(sp.frequency_penalty) and -2 <= sp.frequency_penalty <= 2
    assert sp.max_tokens is None or (integer(sp.max_tokens) and sp.max_tokens >= 1)
    assert integer(sp.min_tokens) and 0 <= sp.min_tokens <= (sp.max_tokens or sp.min_tokens)
    assert sp.seed is None or (integer(sp.seed) and 0 <= sp.seed < 2**32)
    assert sp.logprobs is None or (integer(sp.logprobs) and 0 <= sp.logprobs <= MAX_LOGPROBS)
    assert sp.prompt_logprobs is None or (integer(sp.prompt_logprobs) and 0 <= sp.prompt_logprobs <= MAX_LOGPROBS)
    assert isinstance(sp.stop, tuple) and len(sp.stop) <= MAX_STOP_STRINGS
    for s in sp.stop:
        assert isinstance(s, str) and 1 <= len(s) <= MAX_STOP_STRING_CHARS
        s.encode("utf-8")  # no lone surrogate
    assert isinstance(sp.stop_token_ids, tuple) and len(sp.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert all(type(t) is int and t >= 0 for t in sp.stop_token_ids)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        assert type(getattr(sp, name)) is bool
    assert sp.structured_outputs is None or isinstance(sp.structured_outputs, StructuredOutputsParams)
    assert sp.logit_bias is None or (isinstance(sp.logit_bias, dict) and 1 <= len(sp.logit_bias) <= MAX_LOGIT_BIAS)
    for t, b in (sp.logit_bias or {}).items():
        assert type(t) is int and t >= 0 and type(b) is float and -MAX_LOGIT_BIAS_VALUE <= b <= MAX_LOGIT_BIAS_VALUE
    assert sp.allowed_token_ids is None or (isinstance(sp.allowed_token_ids, tuple)
                                            and 1 <= len(sp.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                                            and all(type(t) is int and t >= 0 for t in sp.allowed_token_ids))
    assert isinstance(sp.bad_words, tuple) and len(sp.bad_words) <= MAX_BAD_WORDS
    for w in sp.bad_words:
        assert isinstance(w, str) and 1 <= len(w) <= MAX_BAD_WORD_CHARS and w.strip()
        w.encode("utf-8")


def build_params(kw: dict) -> SamplingParams | ValueError:
    """`SamplingParams(**kw)`, or the ValueError it raised (which must name one of the fields given)."""
    try:
        sp = SamplingParams(**kw)
    except ValueError as e:
        assert blamed_field(str(e)) in kw, f"{str(e)[:300]!r} names none of {sorted(kw)}"
        event(f"SamplingParams rejected: {blamed_field(str(e))}")
        return e
    assert_within_limits(sp)
    event("SamplingParams accepted")
    return sp


# --- SamplingParams ---------------------------------------------------------------------------------------------


@FUZZ
@given(kw=SAMPLING_KWARGS)
@example(kw={"temperature": 10**400})  # math.isfinite(int) overflows: was OverflowError
@example(kw={"top_p": -(10**400)})
@example(kw={"n": 10**5000})  # repr() of a >4300-digit int raises its own ValueError, naming no field
@example(kw={"stop_token_ids": [10**5000] * 40})
@example(kw={"logit_bias": {10**5000: 1.0, 3: 10**400}})
@example(kw={"logit_bias": {3: 10**400}})
@example(kw={"allowed_token_ids": [10**5000], "bad_words": ["w5 w6", "\ud800"]})
def test_sampling_params_fuzz(kw: dict) -> None:
    build_params(kw)


# --- prompts and Engine.add_request (tiny model) ----------------------------------------------------------------

TINY_MAX_MODEL_LEN = 64
TOKEN_IDS = st.lists(st.integers(-2, VOCAB_SIZE + 1) | st.integers(3, 40) | HUGE_INTS, max_size=70)
WORDS = st.lists(st.integers(0, VOCAB_SIZE + 2).map(lambda i: f"w{i}") | ODD_TEXT, max_size=12).map(" ".join)
NUMPY_IDS = st.builds(lambda ids, dtype: np.array(ids).astype(dtype), st.lists(st.integers(0, 200), max_size=10),
                      st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.uint64, np.float32, np.bool_])) | \
    st.sampled_from([np.zeros((2, 2), dtype=np.int64), np.array(["w5"]), np.array([], dtype=np.int64)])
PROMPT_VALUES = st.one_of(WORDS, ODD_TEXT, TOKEN_IDS, TOKEN_IDS.map(tuple), NUMPY_IDS, ANYTHING)
PROMPT_DICTS = st.dictionaries(st.sampled_from(PROMPT_DICT_KEYS) | st.text(max_size=4),
                               PROMPT_VALUES | ODD_TEXT | TOKEN_IDS, max_size=3)


@st.composite
def prompt_objects(draw) -> Prompt | ValueError:
    """A `Prompt` built from fuzzed fields, or the ValueError its constructor raised (which must name the field)."""
    kw = draw(st.fixed_dictionaries({"token_ids": PROMPT_VALUES},
                                    optional={"text": st.none() | ODD_TEXT | ANYTHING,
                                              "cache_salt": st.none() | ODD_TEXT | ANYTHING}))
    try:
        return Prompt(**kw)
    except ValueError as e:
        message = str(e)
        assert message.startswith("Prompt token_ids") or message.startswith("Prompt text") or \
            message.startswith("cache_salt"), message[:300]
        return e


PROMPTS = st.one_of(PROMPT_VALUES, PROMPT_DICTS, prompt_objects())
GOOD_PARAMS = st.builds(SamplingParams, temperature=st.sampled_from([0, 0.7]), max_tokens=st.integers(1, 6),
                        n=st.integers(1, 3), seed=st.none() | st.integers(0, 9), logprobs=st.none() | st.integers(0, 3),
                        prompt_logprobs=st.none() | st.integers(0, 2),
                        logit_bias=st.none() | st.dictionaries(st.integers(0, VOCAB_SIZE - 1), st.floats(-100, 100),
                                                               max_size=3),
                        allowed_token_ids=st.none() | st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=6),
                        bad_words=st.none() | st.lists(st.integers(3, VOCAB_SIZE - 1).map("w{}".format), max_size=3))
# Words the engine's messages start with, by the argument they blame.
PROMPT_FIELDS = ("prompt", "Prompt", "a dict prompt", "cache_salt")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Engine:
    """The tiny engine of tests/jaxinfer/engine/test_engine.py (its config), for this module."""
    root = make_tiny_model_dir(tmp_path_factory.mktemp("fuzz_tiny"))
    return Engine(EngineConfig(model=str(root), warmup=False, page_size=8, max_num_seqs=16,
                               max_num_batched_tokens=512, max_model_len=TINY_MAX_MODEL_LEN,
                               kv_cache_memory_bytes=1 << 20))


def _drain(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def _canary(engine: Engine) -> list[int]:
    rid = engine.add_request([5, 17, 42, 9, 30], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return _drain(engine)[rid]


@pytest.fixture(scope="module")
def canary_before(tiny: Engine) -> list[int]:
    return _canary(tiny)


GOOD_PROMPTS = st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=40) | \
    st.lists(st.integers(3, VOCAB_SIZE - 1).map(lambda i: f"w{i}"), min_size=1, max_size=30).map(" ".join)
FUZZED = {"prompt": PROMPTS, "params": st.none() | SAMPLING_KWARGS.map(build_params) | ANYTHING,
          "request_id": ODD_TEXT | ANYTHING, "cache_salt": ODD_TEXT | ANYTHING}
GOOD = {"prompt": GOOD_PROMPTS, "params": st.none() | GOOD_PARAMS, "request_id": st.none(), "cache_salt": st.none()}


@st.composite
def add_request_args(draw) -> dict:
    """`add_request`'s arguments: one of them fuzzed and the others good, or all fuzzed (an eighth of the time)."""
    which = draw(st.sampled_from([*FUZZED, *FUZZED, "all"]))
    return {name: draw(FUZZED[name] if which in (name, "all") else GOOD[name]) for name in FUZZED}


@FUZZ
@given(args=add_request_args(), steps=st.integers(0, 2), abort=st.booleans())
@example(args={"prompt": {"prompt_token_ids": [5], "prompt": "w5"}, "params": SamplingParams(stop_token_ids=[10**5000]),
               "request_id": None, "cache_salt": None}, steps=0, abort=False)  # the message repr()'d the huge id
@example(args={"prompt": [5, 6], "params": SamplingParams(logit_bias={10**5000: 1.0}), "request_id": None,
               "cache_salt": None}, steps=0, abort=False)
@example(args={"prompt": [5, 6], "params": SamplingParams(allowed_token_ids=[5], bad_words=["w5 w5"], max_tokens=4),
               "request_id": None, "cache_salt": None}, steps=2, abort=False)  # the second token has none left
def test_add_request_fuzz(tiny: Engine, canary_before, args: dict, steps: int, abort: bool) -> None:
    """Accepted requests run a step or two (some are aborted) so the engine's state moves between examples."""
    prompt, params, request_id, cache_salt = args["prompt"], args["params"], args["request_id"], args["cache_salt"]
    if isinstance(prompt, ValueError) or isinstance(params, ValueError):
        return  # a constructor refused it, naming the field (checked in `prompt_objects` and `build_params`)
    blame = {"params": "params", "request_id": "request_id", "cache_salt": "cache_salt"}
    try:
        rid = tiny.add_request(prompt, params, request_id=request_id, cache_salt=cache_salt)
    except ValueError as e:
        message = str(e)
        named = (*PROMPT_FIELDS, *blame, *FIELDS)
        assert message.startswith(named), f"{message[:300]!r} names no field"
        event(f"rejected: {blamed_field(message)}")
        return
    event("accepted")
    assert isinstance(rid, str) and tiny.has_unfinished_requests()
    for _ in range(steps):
        tiny.step()
    if abort:
        tiny.abort(rid)


def test_engine_is_idle_and_correct_after_the_fuzz(tiny: Engine, canary_before) -> None:
    """Runs after `test_add_request_fuzz` (file order): what it left finishes, no page leaks, the canary holds."""
    _drain(tiny)
    assert not tiny.has_unfinished_requests() and not tiny.scheduler.has_unfinished()
    assert tiny.page_allocator.num_free_pages == tiny.page_allocator.num_usable_pages
    assert _canary(tiny) == canary_before


# --- LLM.generate / LLM.chat (tiny chat model) ------------------------------------------------------------------

CHAT_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | ANYTHING, "content": ODD_TEXT | ANYTHING},
    optional={"name": ANYTHING}) | ANYTHING, max_size=3)
LLM_PARAMS = st.none() | GOOD_PARAMS | st.lists(GOOD_PARAMS | ANYTHING, max_size=3) | ANYTHING
# Words an LLM error message names (the argument, or the field inside it).
LLM_FIELDS = ("prompt", "sampling_params", "messages", "add_generation_prompt", "cache_salt", *FIELDS)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    """The tiny random Llama with a ChatML template (tests/jaxinfer/benchmarks/tiny_chat_model.py)."""
    root = make_tiny_chat_model(tmp_path_factory.mktemp("fuzz_llm") / "tiny")
    return LLM(model=str(root), warmup=False, page_size=8, max_num_seqs=8, max_model_len=TINY_MAX_MODEL_LEN,
               kv_cache_memory_bytes=1 << 20)


@pytest.fixture(scope="module")
def llm_canary_before(tiny_llm: LLM) -> list[int]:
    return tiny_llm.generate([[5, 17, 42, 9, 30]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
                             )[0].outputs[0].token_ids


@FUZZ
@given(prompts=PROMPTS | st.lists(PROMPTS | GOOD_PROMPTS, max_size=3), messages=st.none() | CHAT_MESSAGES
       | st.lists(CHAT_MESSAGES, max_size=2), params=LLM_PARAMS, add=st.booleans() | ANYTHING)
@example(prompts=object(), messages=None, params=None, add=True)  # list(prompts) raised TypeError
@example(prompts=np.float32(1.5), messages=None, params=None, add=True)
def test_llm_generate_and_chat_fuzz(tiny_llm: LLM, llm_canary_before, prompts, messages, params, add) -> None:
    """`LLM.generate(prompts)` (or `LLM.chat(messages)` when messages are drawn): a ValueError naming the argument
    or the field, or one finished output per prompt; a batch is admitted whole or not at all (nothing stays
    queued either way)."""
    # A list of 100,000 one-character texts is a valid batch of 100,000 requests: right, but too slow to run here.
    assume(not isinstance(prompts, (list, tuple, range)) or len(prompts) <= 8)
    if isinstance(prompts, list) and any(isinstance(p, ValueError) for p in prompts) or \
            isinstance(prompts, ValueError):
        return
    try:
        if messages is None:
            outs = tiny_llm.generate(prompts, params)
        else:
            outs = tiny_llm.chat(messages, params, add_generation_prompt=add)
    except ValueError as e:
        message = str(e)
        assert any(name in message for name in LLM_FIELDS), f"{message[:300]!r} names no field"
        event(f"LLM rejected: {blamed_field(message)}")
    else:
        event("LLM accepted")
        assert all(out.finished and out.outputs for out in outs)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_llm_is_idle_and_correct_after_the_fuzz(tiny_llm: LLM, llm_canary_before) -> None:
    """Runs after `test_llm_generate_and_chat_fuzz` (file order)."""
    assert tiny_llm.page_allocator.num_free_pages == tiny_llm.page_allocator.num_usable_pages
    assert tiny_llm.generate([[5, 17, 42, 9, 30]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
                             )[0].outputs[0].token_ids == llm_canary_before
