"""What the gRPC server checks and translates before a request reaches the engine: per-request limits, sampling
values, chat messages, and the prompt (tokenized here, off the event loop)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Per-request limits; a request past one gets `INVALID_ARGUMENT` (or `RESOURCE_EXHAUSTED` for the queue).

    Attributes:
      max_request_bytes: serialized request size.
      max_n: completions per request.
      max_logprobs: top log-probabilities per token.
      max_stop: stop strings per request; max_stop_len: characters per stop string.
      max_queued_requests: requests in flight (running or waiting) before new ones are refused.
    """

    max_request_bytes: int = 1 << 20
    max_n: int = 8
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_len: int = 256
    max_queued_requests: int = 256


_SAMPLING_FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "max_tokens", "min_tokens", "seed", "ignore_eos",
                    "include_stop_str_in_output", "skip_special_tokens", "logprobs")


def sampling_params_from_proto(msg: pb.SamplingParams, limits: ServerLimits) -> SamplingParams:
    """`jaxinfer.v1.SamplingParams` -> `SamplingParams`; unset optional fields keep the defaults.

    Raises:
      ValueError: a value out of range or past a limit, the message naming the field (`sampling.<field>`).
    """
    kw = {name: getattr(msg, name) for name in _SAMPLING_FIELDS if msg.HasField(name)}
    if kw.get("n", 1) > limits.max_n:
        raise ValueError(f"sampling.n={kw['n']} is above the server's limit of {limits.max_n}")
    if kw.get("logprobs", 0) > limits.max_logprobs:
        raise ValueError(f"sampling.logprobs={kw['logprobs']} is above the server's limit of {limits.max_logprobs}")
    if len(msg.stop) > limits.max_stop:
        raise ValueError(f"sampling.stop has {len(msg.stop)} strings; the server's limit is {limits.max_stop}")
    for s in msg.stop:
        if not s or len(s) > limits.max_stop_len:
            raise ValueError(f"sampling.stop strings must have 1 to {limits.max_stop_len} characters; got {len(s)}")
    if msg.stop:
        kw["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = list(msg.stop_token_ids)
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"sampling: {e}") from None


def chat_messages(chat: pb.ChatInput) -> list[dict]:
    """`ChatInput` -> message dicts. Raises ValueError naming the field for no messages or an unknown role."""
    if not chat.messages:
        raise ValueError("chat.messages must not be empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise ValueError(f"chat.messages[{i}].role={m.role!r} is not one of {', '.join(CHAT_ROLES)}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def chat_ids(engine: Engine, chat: pb.ChatInput, for_generation: bool) -> list[int]:
    """The token ids of a chat (its template applied), for generation or for `Tokenize`.

    Raises:
      ValueError: naming the field: no messages, an unknown role, or (for generation) a last assistant message
        with the generation prompt on.
    """
    messages = chat_messages(chat)
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if for_generation and add and messages[-1]["role"] == "assistant":
        raise ValueError("chat.messages: the last message is the assistant's; continuing a message is not "
                         "supported (end with a user message, or set chat.add_generation_prompt=false)")
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add)


def prompt_from_request(request: pb.GenerateRequest, engine: Engine) -> Prompt:
    """The request's `Prompt`, tokenized here once (call it off the event loop); the engine takes it as it is and
    checks the context at admission. The proto's empty `cache_salt` default means no salt.

    Raises:
      ValueError: naming the field: no input, an empty one, ids outside the vocabulary, a bad chat.
    """
    salt = request.cache_salt or None
    which = request.WhichOneof("input")
    if which == "text":
        if not request.text:
            raise ValueError("text must not be empty")
        return engine.make_prompt(request.text, cache_salt=salt)
    if which == "token_ids":
        if not request.token_ids.ids:
            raise ValueError("token_ids.ids must not be empty")
        return engine.make_prompt(list(request.token_ids.ids), cache_salt=salt)
    if which == "chat":
        return Prompt(tuple(chat_ids(engine, request.chat, for_generation=True)), cache_salt=salt)
    raise ValueError("input is required: set one of text, token_ids, chat")
