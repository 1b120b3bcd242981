"""OpenAI request bodies -> what the engine takes: `SamplingParams`, `Prompt`s, chat messages.

The checks are those of the Python API and gRPC (`SamplingParams`, `jaxinfer.request_limits.check_chat`,
`Engine.make_prompt`), so the three front ends accept the same values with the same messages; what is HTTP's own
is here: OpenAI's defaults (`max_tokens` 16 for completions, the rest of the context for chat, as vLLM), content
part lists, `add_generation_prompt` / `continue_final_message`, and the fields that only make sense together.

Source: the OpenAI API reference (Completions, Chat Completions); vLLM's OpenAI-compatible server docs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from jaxinfer.prompt import Prompt
from jaxinfer.request_limits import MAX_LOGPROBS, check_chat, check_text, show
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured_outputs import structured_outputs_from
from jaxinfer.serving.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from jaxinfer.serving.served import served_model_name  # noqa: F401 - its home was here

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine

COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")  # a logit_bias key: a token id written as a JSON string


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> dict | None:
    """The body's output constraint as `StructuredOutputsParams` fields: from OpenAI's `response_format`
    (`json_object`, or `json_schema` with its `schema`; `text` is none), vLLM's `structured_outputs` dict, or
    vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.

    Raises:
      ValueError: naming the field: more than one of them, or a `response_format` of another shape.
    """
    given = []
    if body.response_format is not None and body.response_format.get("type") != "text":
        rf = body.response_format
        if rf.get("type") == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            _check(isinstance(spec, dict) and isinstance(spec.get("schema"), (dict, bool)),
                   "response_format.json_schema.schema must be a JSON schema (an object)")
            given.append(("response_format", {"json": spec["schema"]}))
        else:
            raise ValueError(f"response_format.type={show(rf.get('type'))} must be text, json_object or json_schema")
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs))
    for kind in ("json", "regex", "choice", "grammar"):
        if (value := getattr(body, f"guided_{kind}")) is not None:
            given.append((f"guided_{kind}", {kind: value}))
    if len(given) > 1:  # named by the last of them (the error's param)
        raise ValueError(f"{given[-1][0]}: set one output constraint, not {' and '.join(n for n, _ in given)}")
    return given[0] if given else None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings, e.g. {"50256": -100}) as `SamplingParams.logit_bias` takes it;
    the ids and values are checked there and at admission.

    Raises:
      ValueError: naming `logit_bias`: a key that is not a token id written in decimal digits, or one id twice.
    """
    if bias is None:
        return None
    for key in bias:
        _check(_TOKEN_ID_KEY.fullmatch(key) is not None,
               f"logit_bias key {show(key)} is not a token id: OpenAI's keys are token ids as strings, e.g. \"50256\"")
    out = {int(key): value for key, value in bias.items()}
    _check(len(out) == len(bias), "logit_bias names a token id twice (e.g. \"7\" and \"07\")")
    return out


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    constraint = structured_outputs(body)
    try:  # the constraint's errors name the field it came from
        so = None if constraint is None else structured_outputs_from(constraint[1], constraint[0])
    except ValueError as e:
        message = str(e).replace("structured_outputs", constraint[0], 1)
        if constraint[0] == "response_format":  # the user's own spelling of the schema's place
            message = message.replace("response_format.json ", "response_format.json_schema.schema ", 1)
        raise ValueError(message if message.startswith(constraint[0]) else f"{constraint[0]}: {message}") from None
    _check(body.stream or body.stream_options is None,
           "stream_options is only allowed with stream: true (as in vLLM)")
    _check(not (body.stream and body.prompt_logprobs is not None),
           "prompt_logprobs is not available with stream: true (as in vLLM): send it without streaming")
    return SamplingParams(
        n=body.n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs, seed=body.seed,
        stop=body.stop,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids,
        skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=so, logit_bias=logit_bias(body.logit_bias), allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words)


def completion_params(body: CompletionRequest) -> SamplingParams:
    """The `SamplingParams` of a `/v1/completions` body.

    Raises:
      ValueError: naming the field: a value out of range (as `SamplingParams`), `best_of` other than `n`, `echo`
        with `logprobs` and `stream` (that needs prompt logprobs, which do not stream) or with a `prompt_logprobs`
        other than `logprobs`.
    """
    _check(body.best_of is None or body.best_of == body.n,
           f"best_of={show(body.best_of)} is not supported: only best_of equal to n ({body.n})")
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if body.echo and body.logprobs is not None:  # the prompt's logprobs come first: the engine's prompt logprobs
        _check(not body.stream, "echo with logprobs is not available with stream: true (the prompt's logprobs do "
                                "not stream): send it without streaming")
        _check(body.prompt_logprobs in (None, body.logprobs),
               f"echo with logprobs={show(body.logprobs)} needs prompt_logprobs unset or equal to logprobs")
        body = body.model_copy(update={"prompt_logprobs": body.logprobs})
    return _sampling(body, max_tokens, body.logprobs)


def chat_params(body: ChatCompletionRequest) -> SamplingParams:
    """The `SamplingParams` of a `/v1/chat/completions` body: `max_completion_tokens` wins over `max_tokens`
    (None: up to the context limit); `top_logprobs` needs `logprobs: true` (then it defaults to 0).

    Raises:
      ValueError: naming the field, as `completion_params`.
    """
    _check(body.top_logprobs is None or body.logprobs,
           "top_logprobs needs logprobs: true")
    _check(body.top_logprobs is None or 0 <= body.top_logprobs <= MAX_LOGPROBS,
           f"top_logprobs={show(body.top_logprobs)} must be in [0, {MAX_LOGPROBS}]")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        return _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    except ValueError as e:  # name the field the client sent
        if body.max_completion_tokens is None or not str(e).startswith("max_tokens"):
            raise
        raise ValueError(str(e).replace("max_tokens", "max_completion_tokens")) from None


def _content_text(content: object, name: str) -> object:
    """A message's content: a string as it is; OpenAI content parts of type "text" joined by newlines (as vLLM
    joins them); anything else is left for `check_chat` to name."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        _check(isinstance(part, dict), f"{name}[{j}] must be a content part {{'type': 'text', 'text': ...}}, "
                                       f"got {type(part).__name__}")
        kind = part.get("type")
        _check(kind == "text", f"{name}[{j}].type={show(kind)} is not supported: this server takes text parts only")
        _check(set(part) <= {"type", "text"}, f"{name}[{j}] has keys other than 'type' and 'text': "
                                              f"{sorted(set(part) - {'type', 'text'})}")
        _check(isinstance(part.get("text"), str), f"{name}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(body: ChatCompletionRequest | TokenizeRequest, for_generation: bool = True) -> list[dict]:
    """The body's messages as `check_chat` checks them (content part lists joined first).

    Raises:
      ValueError: naming `messages[i]...`: as `check_chat`; a content part that is not text.
    """
    _check(isinstance(body.messages, list), "messages must be a list")
    messages = [dict(m, content=_content_text(m["content"], f"messages[{i}].content"))
                if isinstance(m, dict) and "content" in m else m for i, m in enumerate(body.messages)]
    return check_chat(messages, body.add_generation_prompt and for_generation, name="messages")


def chat_prompt(body: ChatCompletionRequest | TokenizeRequest, engine: Engine, for_generation: bool = True) -> Prompt:
    """The chat's `Prompt` (its template applied; call it off the event loop).

    Raises:
      ValueError: as `chat_messages`; both `add_generation_prompt` and `continue_final_message`
        (`Tokenizer.apply_chat_template`), or the template's own error.
    """
    messages = chat_messages(body, for_generation)
    kwargs = dict(body.chat_template_kwargs or {})
    for key in ("messages", "add_generation_prompt", "continue_final_message"):
        _check(key not in kwargs, f"chat_template_kwargs must not set {key!r}: it is a field of the request")
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                               continue_final_message=body.continue_final_message, **kwargs)
    return Prompt(tuple(ids), cache_salt=getattr(body, "cache_salt", None))


def completion_prompts(body: CompletionRequest, engine: Engine) -> list[Prompt]:
    """The prompts of a `/v1/completions` body: one text, a list of texts, one list of token ids or a list of
    them; tokenized here (call it off the event loop).

    Raises:
      ValueError: naming `prompt` (or `prompt[i]`): empty, not valid text, ids outside the vocabulary; naming
        `cache_salt`: not valid text.
    """
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    _check(len(prompt) > 0, "prompt must not be empty")
    if body.cache_salt is not None:  # the request's field, not the prompt's: named as itself
        check_text("cache_salt", body.cache_salt)
    out = []
    for i, p in enumerate(prompt):
        name = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        _check(len(p) > 0, f"{name} must not be empty")
        try:
            out.append(engine.make_prompt(p, cache_salt=body.cache_salt))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out
