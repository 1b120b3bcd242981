"""What the gRPC server checks and translates before a request reaches the engine: sampling values, chat messages
and the prompt (tokenized here, off the event loop). The per-request limits are those of `jaxinfer.request_limits`, the
same as the Python API's; the server's own (request bytes, requests in flight) are `served.ServerLimits`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.prompt import Prompt
from jaxinfer.request_limits import check_chat
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


_SAMPLING_FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "max_tokens", "min_tokens", "seed", "ignore_eos",
                    "include_stop_str_in_output", "skip_special_tokens", "logprobs", "prompt_logprobs")


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """`jaxinfer.v1.SamplingParams` -> `SamplingParams`; unset optional fields keep the defaults.

    Raises:
      ValueError: a value out of range or past a limit, the message naming the field (`sampling: <field>=...`).
    """
    kw = {name: getattr(msg, name) for name in _SAMPLING_FIELDS if msg.HasField(name)}
    if msg.stop:
        kw["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kw["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:  # empty (proto's unset) allows every token
        kw["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        kw["bad_words"] = list(msg.bad_words)
    if msg.HasField("structured_outputs"):
        kind = msg.structured_outputs.WhichOneof("constraint")
        if kind is None:
            raise ValueError("sampling: structured_outputs must set one of json, json_object, regex, choice, grammar")
        value = getattr(msg.structured_outputs, kind)
        kw["structured_outputs"] = {kind: list(value.choices) if kind == "choice" else value}
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"sampling: {e}") from None


def chat_messages(chat: pb.ChatInput, for_generation: bool) -> tuple[list[dict], bool]:
    """`ChatInput` -> (message dicts, add_generation_prompt), checked as `LLM.chat` checks them
    (`jaxinfer.request_limits.check_chat`; with `for_generation` False, a last assistant message is allowed).

    Raises:
      ValueError: naming the field (`chat.messages[i]...`).
    """
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    messages = [{"role": m.role, "content": m.content} | ({"name": m.name} if m.HasField("name") else {})
                for m in chat.messages]
    return check_chat(messages, add and for_generation, name="chat.messages"), add


def chat_ids(engine: Engine, chat: pb.ChatInput, for_generation: bool) -> list[int]:
    """The token ids of a chat (its template applied), for generation or for `Tokenize`.

    Raises:
      ValueError: naming the field: no messages, an unknown role, or (for generation) a last assistant message
        with the generation prompt on.
    """
    messages, add = chat_messages(chat, for_generation)
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
