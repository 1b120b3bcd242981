"""Engine outputs -> OpenAI response bodies (plain dicts, serialized by the app): completions and chat
completions, whole or as server-sent-event chunks, with usage and logprobs in OpenAI's shapes (token texts are the
engine's `Logprob.decoded_token`s) and vLLM's `stop_reason` on each choice.

Choice indices: a request with several prompts (`/v1/completions` with a list) numbers its choices
`prompt_index * n + completion_index`, as OpenAI does.

Source: the OpenAI API reference (the completion, chat completion and chunk objects).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput


def new_id(kind: str) -> str:
    """A response id, `cmpl-...` or `chatcmpl-...`."""
    return f"{kind}-{uuid.uuid4().hex}"


def error_body(message: str, type_: str, param: str | None = None, code: int | str | None = None) -> dict:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(outs: Sequence[RequestOutput]) -> dict:
    """Prompt, completion and total tokens over a request's prompts, and the prompt tokens served from the
    prefix cache (`prompt_tokens_details.cached_tokens`)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely of an output token's entries (its top tokens plus the sampled one), by rank on ties."""
    return sorted(entry.values(), key=lambda lp: (-lp.logprob, lp.rank))[:k]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int, offset: int) -> dict:
    """The `logprobs` of a completion choice: `tokens`, `token_logprobs`, `top_logprobs` (k per token, by token
    text) and `text_offset` (characters from `offset`, where this span of the choice's text starts)."""
    tokens = [e[t].decoded_token for t, e in zip(token_ids, entries)]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [e[t].logprob for t, e in zip(token_ids, entries)],
            "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(e, k)} for e in entries],
            "text_offset": offsets}


def echo_logprobs(prompt_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], first_text: str,
                  k: int) -> dict:
    """The prompt's part of an echoed completion's `logprobs` (OpenAI's `echo` with `logprobs`): the prompt tokens
    with their logprobs and top k, from `RequestOutput.prompt_logprobs`; the first token has none (null), as in
    OpenAI's legacy completions. `first_text` is that token's text. Offsets start at 0."""
    tokens = [first_text] + [e[t].decoded_token for t, e in zip(prompt_ids[1:], entries[1:])]
    offsets, offset = [], 0
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [None] + [e[t].logprob for t, e in zip(prompt_ids[1:], entries[1:])],
            "top_logprobs": [None] + [{lp.decoded_token: lp.logprob for lp in _top(e, k)} for e in entries[1:]],
            "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int) -> dict:
    """The `logprobs` of a chat choice: `content`, one `{token, logprob, bytes, top_logprobs}` per token."""
    def item(lp: Logprob) -> dict:
        text = lp.decoded_token
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    return {"content": [item(e[t]) | {"top_logprobs": [item(lp) for lp in _top(e, k)]}
                        for t, e in zip(token_ids, entries)]}


def prompt_logprobs(entries: Sequence[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's JSON `prompt_logprobs`: per prompt position null (position 0) or {"<token id>": {logprob, rank,
    decoded_token}}, the prompt token first, then the top ones (`RequestOutput.prompt_logprobs`)."""
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def finish_reason(c: CompletionOutput) -> str | None:
    """OpenAI's finish reason: "stop" or "length"; an aborted or failed completion is reported as "stop" with
    the error raised separately by the caller."""
    return None if c.finish_reason is None else ("length" if c.finish_reason == "length" else "stop")


class Shaper:
    """Builds one request's response bodies.

    Args:
      chat: chat completions (else completions).
      model: the served model name.
      n: completions per prompt (for choice indices).
      logprobs: top logprobs per token, or None for no logprobs.
      echo_logprobs: completions with `echo` and `logprobs`: a choice's logprobs start with its prompt's
        (`echo_logprobs`; the outputs carry prompt logprobs for them).
      show_prompt_logprobs: whether outputs' prompt logprobs are also shown as vLLM's `prompt_logprobs` field (off
        when they were asked for only by echo with logprobs).
    """

    def __init__(self, chat: bool, model: str, n: int, logprobs: int | None, echo_logprobs: bool = False,
                 show_prompt_logprobs: bool = True) -> None:
        self.chat, self.model, self.n, self.k = chat, model, n, logprobs
        self.echo_logprobs, self.show_prompt_logprobs = echo_logprobs, show_prompt_logprobs
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}

    def _logprobs(self, c: CompletionOutput, start: int, offset: int) -> dict | None:
        if self.k is None or c.logprobs is None:
            return None
        ids, entries = c.token_ids[start:], c.logprobs[start:]
        return (chat_logprobs(ids, entries, self.k) if self.chat
                else completion_logprobs(ids, entries, self.k, offset))

    def whole(self, outs: Sequence[RequestOutput], echo: Sequence[str] | None = None,
              first_tokens: Sequence[str] | None = None) -> dict:
        """The response to a non-streamed request: every prompt's finished output (in prompt order); `echo` the
        prompts' texts when echoed, `first_tokens` their first tokens' texts (with `echo_logprobs`)."""
        choices = []
        for p, out in enumerate(outs):
            for c in out.outputs:
                index = p * self.n + c.index
                if self.chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": self._logprobs(c, 0, 0), "finish_reason": finish_reason(c),
                                    "stop_reason": c.stop_reason})
                else:
                    prefix = echo[p] if echo else ""
                    logprobs = self._logprobs(c, 0, len(prefix))
                    if self.echo_logprobs and logprobs is not None:
                        head = echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, first_tokens[p], self.k)
                        logprobs = {key: head[key] + logprobs[key] for key in head}
                    choices.append({"index": index, "text": prefix + c.text, "logprobs": logprobs,
                                    "finish_reason": finish_reason(c), "stop_reason": c.stop_reason})
        head = self._head(False)
        if not self.show_prompt_logprobs:
            pass
        elif self.chat and any(out.prompt_logprobs is not None for out in outs):  # vLLM's place for chat
            head["prompt_logprobs"] = prompt_logprobs(outs[0].prompt_logprobs)
        elif not self.chat:
            for choice in choices:
                out = outs[choice["index"] // self.n]
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs)
        return head | {"choices": choices, "usage": usage(outs)}

    def chunk(self, p: int, c: CompletionOutput, first: bool, echo: str = "") -> dict | None:
        """The chunk of one completion's new tokens (None when there is nothing new): the first chat chunk of a
        choice carries the role; a completion's first chunk starts with `echo` (its prompt's text when echoed;
        pass it with every chunk, for the logprobs' text offsets)."""
        index = p * self.n + c.index
        new = len(c.delta_token_ids)
        if not new and not first and c.finish_reason is None:
            return None
        start = len(c.token_ids) - new
        offset = len(echo) + len(c.text) - len(c.delta_text)
        if self.chat:
            delta = ({"role": "assistant", "content": c.delta_text} if first else {"content": c.delta_text})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": (echo if first else "") + c.delta_text}
        choice |= {"logprobs": self._logprobs(c, start, offset) if new else None,
                   "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
        return self._head(True) | {"choices": [choice]}

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict:
        """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
        return self._head(True) | {"choices": [], "usage": usage(outs)}
