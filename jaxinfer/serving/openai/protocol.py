"""Request bodies of the OpenAI-compatible HTTP API, as pydantic models (OpenAI's field names, vLLM's extras).

Unknown fields are refused (HTTP 400 naming the field), except `IGNORED_FIELDS`: fields the OpenAI SDKs and
clients send that change nothing here, accepted and dropped. Fields of features not implemented yet (tool calls:
`tools`, a `tool_choice` other than "none" / "auto"; `suffix`) are declared so that a request that sets them gets
a 400 naming the field (`UNSUPPORTED_FIELDS`) rather than a silent difference; prompt logprobs are supported
(vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions). Value ranges are checked by
`SamplingParams` and the engine, the same as for the Python API and gRPC (`jaxinfer.request_limits`).

Sources: the OpenAI API reference (Completions, Chat Completions), vLLM's OpenAI-compatible server docs (extra
sampling fields, `add_generation_prompt` / `continue_final_message`, `/tokenize`, `/detokenize`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

# Accepted and ignored: bookkeeping and options of OpenAI's hosted service that have no effect on a local server.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier", "reasoning_effort", "verbosity", "modalities", "prediction", "audio",
                  "web_search_options", "function_call", "functions")
# Declared, but a request that sets them (to anything but their "off" value) gets a 400 naming the field: the
# feature is not implemented yet.
UNSUPPORTED_FIELDS = {"tools": "tool calls", "suffix": "suffix (fill-in-the-middle)"}


class _Body(BaseModel):
    """Unknown fields are an error; see `IGNORED_FIELDS`. A known field sent as null takes its default (OpenAI's
    SDKs and clients such as LangChain send `"n": null`, `"presence_penalty": null` for "not set")."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    def unsupported(self) -> str | None:
        """The first field of `UNSUPPORTED_FIELDS` this request sets, or None."""
        for name, value in self:
            if name in UNSUPPORTED_FIELDS and value not in (None, {}, [], ""):
                return name
        return None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """The fields both generation endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # OpenAI's: token ids as strings -> bias in [-100, 100] (`translate.logit_bias`)
    logit_bias: dict[str, float] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: per prompt token its logprob, rank and the top-k (not with stream: vLLM refuses that too)
    prompt_logprobs: int | None = None
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` is a text, a list of texts, a list of token ids or a list of such lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`. `messages` are checked as `LLM.chat` checks them (after text content parts
    are joined), so the three front ends accept the same conversations."""

    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    function_call: Any = None
    functions: list[Any] | None = None

    def unsupported(self) -> str | None:
        name = super().unsupported()
        if name is None and self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        return name


class TokenizeRequest(_Body):
    """`POST /tokenize`: `prompt` (text), or `messages` (a chat, its template applied), as vLLM takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
                    "service_unavailable_error", "internal_error"]
