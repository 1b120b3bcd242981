"""Chat templates: the sandboxed Jinja2 environment, message checks, template lookup, and the
encoding of rendered prompts with message contents kept as plain text.

* `_make_jinja_env`: an `ImmutableSandboxedEnvironment` (`_StrictSandbox`) with HF's extras:
  `{% generation %}` (`_GenerationTag`), `loopcontrols`, `tojson`, `raise_exception`,
  `strftime_now`. Templates are untrusted.
* `_check_messages`: messages must be a list of dicts with a str `role` and a str or None
  `content`.
* `_chat_template_from_config`: the template of a `tokenizer_config.json` (a string, or the
  `default` entry of a list of named templates).
* `_compile_template` / `_render`: source -> `jinja2.Template`; messages -> prompt text.
* `_content_spans`: the `(start, end, message_index)` character spans of a rendered prompt that
  came from message contents, found by re-rendering with a unique placeholder per content (or,
  when the template rewrites contents, by searching for them).
* `_chat_prompt`: messages -> prompt text and content spans, with HF's `add_generation_prompt`
  and `continue_final_message` (the prompt cut right after the final message's content).
* `_encode_rendered`: prompt text -> `list[int]`, special-token text recognised outside the
  content spans only.

Errors: every failure is a `ValueError`: malformed messages, a template that does not compile
or fails while rendering (syntax error, sandbox violation, `raise_exception(...)`, a Python error
inside the template), a malformed `chat_template` config entry, a content holding
special-token text that a rewriting template makes impossible to locate, or a final message that
cannot be continued.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from jaxinfer.tokenizer.backends import _Backend

logger = logging.getLogger(__name__)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` markers and renders their body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


class _TemplateRefusal(jinja2.TemplateError):
    """A template's own `raise_exception(...)`: it refuses the conversation (e.g. Gemma's refuses a system role)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRefusal(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Immutable sandbox in which any unsafe attribute access is an error, not a silent Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _make_jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Errors a broken (or hostile) template can raise while rendering; all become ValueError.
_TEMPLATE_ERRORS = (
    jinja2.TemplateError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    ValueError,
    ZeroDivisionError,
    OverflowError,
    RecursionError,
)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a str 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str or None, got {type(content).__name__}")


def _chat_template_from_config(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"tokenizer_config.json: chat_template list has no 'default' entry (names: {sorted(named)})")
    raise ValueError(f"tokenizer_config.json: chat_template must be a string or list, got {type(template).__name__}")


def _compile_template(source: str | None) -> jinja2.Template:
    """`source` compiled in the sandbox (`Tokenizer` caches the result)."""
    if not source:
        raise ValueError("this tokenizer has no chat template")
    try:
        return _make_jinja_env().from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"invalid chat template: {e}") from e


def _render(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """`template` rendered with `variables`; any failure becomes ValueError."""
    try:
        return template.render(**variables)
    except _TemplateRefusal as e:  # the template's own message says what it refuses: give it as it is
        raise ValueError(f"messages: the model's chat template refuses them: {e}") from e
    except _TEMPLATE_ERRORS as e:
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e


def _content_spans(
    render: Callable[[list[dict[str, Any]]], str],
    special_re: re.Pattern[str] | None,
    messages: list[dict[str, Any]],
    contents: list[Any],
    rendered: str,
) -> list[tuple[int, int, int]]:
    """Character spans of `rendered` that came from message contents (user text).

    `render` renders a message list with the same template and arguments that produced `rendered`;
    `special_re` matches the vocabulary's special-token texts (None when it has none).

    Returns:
      `(start, end, message_index)` triples, sorted and non-overlapping; a content the template
      writes twice has two spans, one it drops (or rewrites beyond recognition) has none.
    """
    texts = [(i, c) for i, c in enumerate(contents) if isinstance(c, str) and c]
    if not texts:
        return []
    # Render once more with a unique placeholder for each content; if substituting the real
    # contents back reproduces `rendered`, the placeholders mark exactly where contents went.
    nonce = secrets.token_hex(8)
    while any(nonce in t for _, t in texts):
        nonce = secrets.token_hex(8)
    marker = re.compile("\ue000" + nonce + r"_(\d+)\ue001")
    ph_messages = []
    for i, m in enumerate(messages):
        m = dict(m)
        if isinstance(m.get("content"), str) and m["content"]:
            m["content"] = f"\ue000{nonce}_{i}\ue001"
        ph_messages.append(m)
    try:
        ph_rendered = render(ph_messages)
    except ValueError:
        ph_rendered = None  # the template inspects contents; use the fallback below
    if ph_rendered is not None:
        spans: list[tuple[int, int, int]] = []
        out: list[str] = []
        pos = 0
        last = 0
        for m in marker.finditer(ph_rendered):
            piece = ph_rendered[last : m.start()]
            out.append(piece)
            pos += len(piece)
            index = int(m.group(1))
            content = contents[index]
            out.append(content)
            spans.append((pos, pos + len(content), index))
            pos += len(content)
            last = m.end()
        out.append(ph_rendered[last:])
        if "".join(out) == rendered:
            return spans
    # Fallback: the template transforms or inspects contents. Find each content (or its
    # stripped form) in order; refuse if one holding special-token text cannot be found.
    logger.debug("chat template rewrites message contents; locating them by search")
    spans = []
    cursor = 0
    for index, text in texts:
        found = False
        for candidate in (text, text.strip()):
            idx = rendered.find(candidate, cursor) if candidate else -1
            if idx >= 0:
                spans.append((idx, idx + len(candidate), index))
                cursor = idx + len(candidate)
                found = True
                break
        if not found and special_re is not None and special_re.search(text):
            raise ValueError(
                "a message content contains special-token text and the chat template rewrites it, "
                "so it cannot be kept as plain text"
            )
    return spans


def _chat_prompt(
    render: Callable[[list[dict[str, Any]], bool], str],
    special_re: re.Pattern[str] | None,
    messages: Any,
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    locate: bool,
) -> tuple[str, list[tuple[int, int, int]]]:
    """The prompt text of `messages` and the spans of their contents in it.

    `render(messages, add_generation_prompt)` renders with the model's template. With
    `continue_final_message` the prompt is rendered without a generation prompt and cut right
    after the last place the final message's content went (HF's rule: it is the model's turn to
    continue that message, so no end-of-turn follows). A content the template writes verbatim
    is kept whole, trailing whitespace included; one it trims (found by search) ends where its
    stripped text ends.

    Args:
      messages: checked with `_check_messages`; copied, never modified.
      add_generation_prompt: None means `not continue_final_message`.
      locate: compute the content spans (they are always computed to continue a message);
        otherwise the spans come back empty.

    Returns:
      `(text, spans)`, spans as in `_content_spans`, all inside `text`.

    Raises:
      ValueError: malformed messages; `add_generation_prompt` and `continue_final_message` both
        True; continuing with no messages, a final message without text content, or one whose
        content the rendered template does not contain; any `_render` / `_content_spans` error.
    """
    _check_messages(messages)
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are both True; choose one: "
                         "start a new assistant turn, or continue the final message")
    msgs = [dict(m) for m in messages]
    if continue_final_message and (not msgs or not msgs[-1].get("content")):
        got = msgs[-1].get("content") if msgs else "no messages"
        raise ValueError(f"continue_final_message needs a final message with non-empty str content, got {got!r}")
    rendered = render(msgs, add_generation_prompt)
    if not (locate or continue_final_message):
        return rendered, []
    spans = _content_spans(lambda ms: render(ms, add_generation_prompt), special_re, msgs,
                           [m.get("content") for m in msgs], rendered)
    if not continue_final_message:
        return rendered, spans
    final = len(msgs) - 1
    ends = [e for _, e, i in spans if i == final]
    if not ends:
        raise ValueError(f"continue_final_message: the final message's content (messages[{final}]) does not appear "
                         "in the rendered chat template, which drops or rewrites it, so it cannot be continued")
    cut = ends[-1]
    return rendered[:cut], [span for span in spans if span[1] <= cut]


def _encode_rendered(
    backend: _Backend,
    special_texts: Mapping[str, int],
    special_re: re.Pattern[str] | None,
    rendered: str,
    content_spans: list[tuple[int, int, int]],
) -> list[int]:
    """Encodes template output: specials allowed outside `content_spans`, plain inside."""
    if special_re is None:
        return backend.encode(rendered, False)
    all_matches = [(m.start(), m.end()) for m in special_re.finditer(rendered)]
    # Special tokens found in the template's own text only (each template segment scanned alone).
    bounds = [0]
    for s, e, _ in content_spans:
        bounds += [s, e]
    bounds.append(len(rendered))
    kept: list[tuple[int, int]] = []
    for seg_start, seg_end in zip(bounds[0::2], bounds[1::2]):
        for m in special_re.finditer(rendered, seg_start, seg_end):
            kept.append((m.start(), m.end()))
    if kept == all_matches:
        # No special-token text in user content: one native encode, identical to HF's.
        return backend.encode(rendered, True)
    ids: list[int] = []
    pos = 0
    for s, e in kept:
        if s > pos:
            ids.extend(backend.encode(rendered[pos:s], False))
        ids.append(special_texts[rendered[s:e]])
        pos = e
    if pos < len(rendered):
        ids.extend(backend.encode(rendered[pos:], False))
    return ids
