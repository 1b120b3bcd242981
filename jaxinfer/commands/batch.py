"""`jaxinfer generate --input-file`: a JSONL file of requests, generated as one batch, written as JSONL in input order.

1. `read_batch` reads and checks every line before the model loads: a bad line is a `ValueError` naming its number.
   A line is a JSON object with "prompt" (text; a user message with --chat) or "messages" (a conversation, OpenAI's
   list of {"role", "content"}, rendered with the chat template); optionally "id" or "custom_id", copied to the
   output line; and any `SamplingParams` field (max_tokens, temperature, top_p, top_k, seed, stop, ...) but n,
   logprobs and prompt_logprobs, overriding the command's flags for that line. Blank lines are skipped.
2. `run_batch` renders and tokenizes every request, then generates them all in one `LLM.generate` call, so the
   engine batches them (progress bar on stderr). A request the engine refuses at admission (a prompt or max_tokens
   beyond the context, ...) fails its own line only.
3. One output line per request, in input order: the id key, "text", "prompt_tokens", "completion_tokens",
   "finish_reason", "stop_reason" (the stop string or token id that ended it, or null) and "error" (null unless
   finish_reason is "error").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import TYPE_CHECKING, TextIO

from jaxinfer.cli_parser import error_line

if TYPE_CHECKING:
    from jaxinfer.llm import LLM
    from jaxinfer.prompt import Prompt
    from jaxinfer.sampling_params import SamplingParams

ID_KEYS = ("id", "custom_id")  # vLLM's and OpenAI's batch files carry "custom_id"
UNSUPPORTED_FIELDS = ("n", "logprobs", "prompt_logprobs")  # what they return has no place in an output line
EXIT_REQUEST_FAILED = 1


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """One request of a batch file.

    Attributes:
      number: its line number in the file, from 1.
      messages: the conversation to render with the chat template, or None for a plain `prompt`.
      prompt: the prompt text, or None for `messages`.
      params: the command's sampling flags with the line's fields applied.
      ids: {"id" or "custom_id": value} as the line gave it (any JSON value), else empty.
    """

    number: int
    messages: list[dict] | None
    prompt: str | None
    params: SamplingParams
    ids: dict


def read_batch(path: str, params: SamplingParams, chat: bool) -> list[BatchLine]:
    """Reads and checks a batch file (module docstring, step 1); no jax. A UTF-8 byte-order mark is skipped.

    Args:
      path: the JSONL file, UTF-8.
      params: the sampling flags' params, which each line's fields override.
      chat: a "prompt" line is a user message rendered with the chat template (generate's --chat).

    Raises:
      ValueError: "--input-file PATH line N: ..." for a line that is not a JSON object, has both or neither of
        "prompt" and "messages", an empty or non-text prompt, malformed messages, an unknown key (named, with the
        close one), an unsupported field or a field value `SamplingParams` refuses; or the file cannot be read or
        holds no request.
    """
    fields = {f.name for f in dataclasses.fields(params)} - set(UNSUPPORTED_FIELDS)
    keys = ("prompt", "messages", *ID_KEYS, *sorted(fields))
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is not JSON
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--input-file {path}: {e}") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"--input-file {path} line {number}"
        try:
            lines.append(_read_line(raw, number, params, chat, fields, keys))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e.msg} at column {e.colno}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    if not lines:
        raise ValueError(f"--input-file {path} holds no request (one JSON object per line)")
    return lines


def _read_line(raw: str, number: int, params: SamplingParams, chat: bool, fields: set[str],
               keys: tuple[str, ...]) -> BatchLine:
    from jaxinfer.request_limits import check_chat, check_text, name_hint  # numpy: not at the CLI's start-up

    item = json.loads(raw)
    if not isinstance(item, dict):
        raise ValueError(f"a line must be a JSON object, got {type(item).__name__}")
    for key in item:
        if key in UNSUPPORTED_FIELDS:
            raise ValueError(f"{key!r} is not supported in a batch file (its output has no place in a line)")
        if key not in keys:
            raise ValueError(f"unknown key {name_hint(key, keys)}; a line has 'prompt' or 'messages', optionally "
                             f"'id' or 'custom_id', and SamplingParams fields")
    if ("prompt" in item) == ("messages" in item):
        raise ValueError("a line needs exactly one of 'prompt' (text) and 'messages' (a conversation)")
    if all(key in item for key in ID_KEYS):
        raise ValueError("a line has 'id' or 'custom_id', not both")
    overrides = {key: value for key, value in item.items() if key in fields}
    if isinstance(overrides.get("logit_bias"), dict):  # JSON object keys are strings: OpenAI's token ids
        overrides["logit_bias"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                                   for k, v in overrides["logit_bias"].items()}
    line_params = dataclasses.replace(params, **overrides)
    ids = {key: item[key] for key in ID_KEYS if key in item}
    if "messages" in item:
        return BatchLine(number, check_chat(item["messages"]), None, line_params, ids)
    prompt = check_text("prompt", item["prompt"])
    if not prompt:
        raise ValueError("'prompt' must not be empty")
    if chat:
        return BatchLine(number, [{"role": "user", "content": prompt}], None, line_params, ids)
    return BatchLine(number, None, prompt, line_params, ids)


def run_batch(llm: LLM, lines: list[BatchLine], out: TextIO) -> int:
    """Generates every line's request in one batch and writes one JSON line each to `out`, in input order
    (module docstring, steps 2 and 3).

    Returns:
      The exit status: 0, or 1 when any request failed (its line carries the error; one line on stderr says how
      many).

    Raises:
      ValueError: "--input-file line N: ..." for a conversation the chat template refuses.
    """
    prompts: list[Prompt] = []
    for line in lines:
        try:
            if line.messages is not None:
                prompts.extend(llm.render_chat(line.messages))
            else:
                prompts.append(llm.engine.make_prompt(line.prompt))
        except ValueError as e:
            raise ValueError(f"--input-file line {line.number}: {e}") from None
    # A request the engine refuses (no room in the context for its max_tokens, ...) fails its own line only.
    outputs = llm.generate(prompts, [line.params for line in lines], use_tqdm=True, refused="output")
    failed = 0
    for line, out_i in zip(lines, outputs):
        record = dict(line.ids)
        completion = out_i.outputs[0]
        record.update(text=completion.text, prompt_tokens=len(out_i.prompt_token_ids),
                      completion_tokens=len(completion.token_ids), finish_reason=completion.finish_reason,
                      stop_reason=completion.stop_reason, error=completion.error)
        failed += record["finish_reason"] == "error"
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    logging.getLogger("jaxinfer").info("%d requests done; %d lines written to %s", len(lines), len(lines),
                                       getattr(out, "name", "the output"))
    if failed:
        sys.stderr.write(error_line(f"{failed} of {len(lines)} requests failed (their lines give the error)"))
        return EXIT_REQUEST_FAILED
    return 0
