"""Per-request limits and checks, one home for every front end: `SamplingParams` (and with it `LLM.generate` /
`LLM.chat`, `Engine.add_request`, `AsyncEngine.generate`) and the gRPC server (`jaxinfer.serving.requests`)
apply the same limits with the same messages.

1. Values a request carries are checked where they are built: `SamplingParams.__post_init__` (ranges, types,
   the counts below), `check_text` (strings must be valid Unicode), `check_token_ids` (int ids, numpy integers
   included), `check_chat` (chat messages: their keys, roles and text).
2. Values that depend on the model (vocabulary, EOS ids, context) are checked by `check_against_model` when
   `Engine.add_request` admits the request, before anything is queued.
3. No request parameter picks a compiled shape: the sampler's banned-id array is always `SUPPRESS_WIDTH` wide
   (`jaxinfer.engine.sampling`), which `MAX_STOP_TOKEN_IDS` keeps within bounds; `allowed_token_ids` and
   `bad_words` become the always-present token bitmask (no shape of their own); a logit bias is
   `MAX_LOGIT_BIAS` wide whenever some row of the batch has one (the same variant as the penalty inputs).

Every check raises `ValueError` naming the field (the gRPC server answers it with `INVALID_ARGUMENT`).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxinfer.sampling_params import SamplingParams

MAX_N = 8  # completions per request
MAX_LOGPROBS = 20  # top log-probabilities per output token
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_STRING_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 32  # stop token ids per request
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit); the sampler's bias arrays are this wide
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| per token, as OpenAI: -100 in effect bans a token, +100 forces it
MAX_ALLOWED_TOKEN_IDS = 16384  # allowed_token_ids per request (folded into the token bitmask on the host)
MAX_BAD_WORDS = 64  # bad_words per request
MAX_BAD_WORD_CHARS = 256  # characters per bad word
MAX_TEMPERATURE = 1e4  # far past where sampling is uniform; larger values only overflow f32 arithmetic
# repetition_penalty in [MIN, MAX]: 1 disables, below 1 favours seen tokens, above 1 disfavours them. Past these
# bounds the penalty only saturates (a seen token is as good as forced / banned), and near 0 the sampler's f32
# `logit / penalty` overflows to inf. Both bounds are exact or round up in float32, so a gRPC client (whose floats
# are float32) can send them as written.
MIN_REPETITION_PENALTY = 0.05
MAX_REPETITION_PENALTY = 10.0
# Width of the sampler's per-row banned ids (EOS and stop ids before min_tokens): fixed, so that one compiled step
# serves every request. MAX_STOP_TOKEN_IDS stop ids plus up to 32 EOS ids fit.
SUPPRESS_WIDTH = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's "developer" role is its newer name for "system" (OpenAI API reference, chat messages); chat templates
# know only "system", so `check_chat` hands the template a developer message as a system message.
_ROLE_ALIASES = {"developer": "system"}
CHAT_MESSAGE_KEYS = ("role", "content", "name")  # name: OpenAI's optional participant name, for the template
# Keys of OpenAI chat messages that jaxinfer does not support, by what they are for (tool calling, audio output,
# refusals): refused, naming what they are, rather than dropped.
UNSUPPORTED_CHAT_KEYS = {"tool_calls": "tool calls", "tool_call_id": "tool calls", "function_call": "tool calls",
                         "audio": "audio", "refusal": "refusals"}


def show(value: object, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters; an int too long for `repr` (over
    4,300 digits) is shown by its size instead of raising."""
    try:
        text = repr(value)
    except ValueError:  # int -> str conversion limit
        return f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def type_name(value: object) -> str:
    """A value's type for an error message: "null" for None (the JSON a client sent), else the Python type's name."""
    return "null" if value is None else type(value).__name__


def check_text(name: str, value: object) -> str:
    """Returns `value` if it is a string that encodes to UTF-8 (no lone surrogate), else raises.

    Raises:
      ValueError: naming `name`: not a string, or a lone surrogate (its index given).
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: a lone surrogate {value[e.start]!r} at index "
                         f"{e.start}") from None
    return value


def _is_id(t: object) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def check_token_ids(name: str, ids: object, vocab_size: int | None = None) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints.

    Args:
      name: the field, for messages.
      ids: a list or tuple of ints or numpy integers, or a 1-D numpy integer array.
      vocab_size: when given, every id must lie in [0, vocab_size); else ids must be >= 0.

    Raises:
      ValueError: naming `name`: another container type, a non-integer id, or an id out of range (the first few
        named).
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise ValueError(f"{name} must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    wrong = [t for t in ids if not _is_id(t)]
    if wrong:
        raise ValueError(f"{name} must hold integer token ids; got {show(wrong[0])} ({type(wrong[0]).__name__})")
    out = tuple(int(t) for t in ids)
    bad = [t for t in out if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        where = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab size)"
        raise ValueError(f"{name} contains ids outside {where}: [{", ".join(map(show, bad[:5]))}]")
    return out


def check_chat(messages: object, add_generation_prompt: bool = True, name: str = "messages") -> list[dict]:
    """A conversation's messages, checked: what `LLM.chat` and the gRPC `chat` input accept alike.

    Args:
      messages: a non-empty list of dicts with a `role` in CHAT_ROLES, a string `content` and optionally a
        string `name` (OpenAI's participant name, kept for the chat template); no other key.
      add_generation_prompt: whether the prompt ends with the assistant's header; then the last message must not
        be the assistant's (to continue it, render with add_generation_prompt off and continue_final_message on).
      name: the field, for messages (`chat.messages` on gRPC).

    Returns:
      The messages as a list of dicts; a "developer" message becomes a "system" one (`_ROLE_ALIASES`).

    Raises:
      ValueError: naming the field and the message index: not a list, empty, a message that is not a dict, a key
        other than CHAT_MESSAGE_KEYS (named, with the close key, or as an OpenAI key that is not supported), an
        unknown role, content or name that is not valid text, or a last assistant message with the generation
        prompt on.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{name} must be a list of {{'role', 'content'}} dicts, got {type_name(messages)}")
    if not messages:
        raise ValueError(f"{name} must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            kind = type_name(m)
            article = "" if m is None else "an " if kind[0] in "aeiouAEIOU" else "a "
            raise ValueError(f"{name}[{i}] is {article}{kind}; a message is a dict "
                             "with 'role' and 'content'")
        _check_message_keys(m, f"{name}[{i}]")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"{name}[{i}].role={show(m.get('role'))} is not one of {', '.join(CHAT_ROLES)}")
        check_text(f"{name}[{i}].content", m.get("content"))
        if "name" in m:
            check_text(f"{name}[{i}].name", m["name"])
    if add_generation_prompt and messages[-1]["role"] == "assistant":
        raise ValueError(f"{name}: the last message is the assistant's while add_generation_prompt is on: end "
                         "with a user message, or turn add_generation_prompt off (and continue_final_message on, "
                         "to continue that reply)")
    return [dict(m, role=_ROLE_ALIASES[m["role"]]) if m["role"] in _ROLE_ALIASES else m for m in messages]


def name_hint(name: object, valid: Collection[str]) -> str:
    """`name` as written (`show`), with " (did you mean 'x'?)" when one of `valid` is close: for errors that name an
    unknown field, key or option."""
    close = difflib.get_close_matches(name, list(valid), n=1) if isinstance(name, str) else []
    return show(name) + (f" (did you mean {close[0]!r}?)" if close else "")


def _check_message_keys(message: dict, name: str) -> None:
    """Raises ValueError naming the first key of `message` that is not one of CHAT_MESSAGE_KEYS."""
    for key in message:
        if key in CHAT_MESSAGE_KEYS:
            continue
        keys = f"a message's keys are {', '.join(CHAT_MESSAGE_KEYS)}"
        if key in UNSUPPORTED_CHAT_KEYS:
            raise ValueError(f"{name} has the key {key!r}, an OpenAI message key jaxinfer does not support "
                             f"({UNSUPPORTED_CHAT_KEYS[key]}); {keys}")
        raise ValueError(f"{name} has an unknown key {name_hint(key, CHAT_MESSAGE_KEYS)}; {keys}")


def tokens_text(n: int) -> str:
    """A token count in words: "1 token", "2 tokens"."""
    return f"{n} token{'' if n == 1 else 's'}"


class MaxTokensBeyondContext(ValueError):
    """max_tokens is more than the context leaves after the prompt: the `ValueError` of `check_against_model`,
    with its numbers, so that a front end can say it in its own words (the CLI names --max-tokens).

    Attributes:
      max_tokens: the request's max_tokens.
      num_prompt_tokens: the prompt's length in tokens.
      max_model_len: the context in tokens; `room` = max_model_len - num_prompt_tokens is the most max_tokens can be.
    """

    def __init__(self, max_tokens: int, num_prompt_tokens: int, max_model_len: int) -> None:
        self.max_tokens, self.num_prompt_tokens, self.max_model_len = max_tokens, num_prompt_tokens, max_model_len
        self.room = max_model_len - num_prompt_tokens
        super().__init__(f"max_tokens={max_tokens}: {self.reason()} (max_tokens=None generates until the context "
                         "is full)")

    def reason(self) -> str:
        """The message's middle, without naming the field: "the prompt (1 token) leaves room for at most ..."."""
        return (f"the prompt ({tokens_text(self.num_prompt_tokens)}) leaves room for at most {self.room} in the "
                f"context of {self.max_model_len} tokens")

    def __reduce__(self):  # pickles (across processes) with its numbers, not the message
        return type(self), (self.max_tokens, self.num_prompt_tokens, self.max_model_len)


def check_against_model(params: SamplingParams, num_prompt_tokens: int, vocab_size: int, eos_ids: Collection[int],
                        max_model_len: int, sampled_vocab_size: int | None = None) -> None:
    """The admission checks of a request that need the model: its ids, its context and whether it can generate.

    Args:
      params: the request's sampling parameters (already valid on their own).
      num_prompt_tokens: the prompt's length in tokens.
      vocab_size: ids must lie in [0, vocab_size).
      eos_ids: the model's EOS ids (banned with the stop ids before min_tokens unless ignore_eos).
      max_model_len: the context in tokens.
      sampled_vocab_size: ids the sampler may pick are [0, sampled_vocab_size) (the tokenizer's vocabulary may be
        smaller than the model's); None means vocab_size.

    Raises:
      MaxTokensBeyondContext: prompt + max_tokens beyond the context (a ValueError naming max_tokens).
      ValueError: naming the field: an empty prompt, or one that leaves no room to generate; prompt + min_tokens
        beyond the context; a stop token id, logit_bias id or allowed token id outside the
        vocabulary; allowed_token_ids of which none can be sampled; or min_tokens with every token of the
        vocabulary (or of allowed_token_ids) banned (nothing could be generated).
    """
    if num_prompt_tokens < 1:
        raise ValueError("prompt must not be empty (it encodes to no tokens)")
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of {max_model_len} tokens "
                         "(at least one token must be generated)")
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is not None and params.max_tokens > room:
        raise MaxTokensBeyondContext(params.max_tokens, num_prompt_tokens, max_model_len)
    if params.min_tokens > room:
        raise ValueError(f"min_tokens={params.min_tokens}: the prompt ({tokens_text(num_prompt_tokens)}) leaves room "
                         f"for at most {room} in the context of {max_model_len} tokens")
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    check_token_ids("logit_bias", list(params.logit_bias or ()), vocab_size)
    sampled = vocab_size if sampled_vocab_size is None else sampled_vocab_size
    allowed = None
    if params.allowed_token_ids is not None:
        check_token_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
        allowed = {t for t in params.allowed_token_ids if t < sampled}
        if not allowed:
            raise ValueError(f"allowed_token_ids allows no id the model can sample (ids below {sampled})")
    if params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if len(banned) > SUPPRESS_WIDTH:
            raise ValueError(f"stop_token_ids: with min_tokens={params.min_tokens}, {len(banned)} ids (stop ids and "
                             f"the model's EOS ids) would be banned; at most {SUPPRESS_WIDTH} can be")
        if sum(0 <= t < sampled for t in banned) >= sampled:
            raise ValueError(f"min_tokens={params.min_tokens} with stop_token_ids={list(params.stop_token_ids)} bans "
                             f"every token the model can sample ({sampled}, with its EOS ids): nothing could be "
                             "generated")
        if allowed is not None and allowed <= banned:
            raise ValueError(f"min_tokens={params.min_tokens} bans every one of allowed_token_ids (they are stop or "
                             "EOS ids): nothing could be generated")

