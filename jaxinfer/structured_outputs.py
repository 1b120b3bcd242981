"""`StructuredOutputsParams`: a constraint on what a request may generate (a JSON schema, any JSON object, a
regular expression, a choice of strings, or a grammar), as vLLM's request field of that name takes it.

Each constraint becomes an llguidance grammar (`llguidance_grammar()`; llguidance is the Rust grammar engine vLLM and
llama.cpp use, https://github.com/guidance-ai/llguidance), checked when the params are built, so an invalid schema,
regex or grammar is a `ValueError` naming the field before anything is queued. The engine turns the grammar into
a token mask per step (`jaxinfer.engine.grammar`). This module imports no jax.
"""

from __future__ import annotations

import dataclasses
import json as json_lib
from typing import Any

from jaxinfer.request_limits import check_text, show

MAX_GRAMMAR_CHARS = 100_000  # a schema (as JSON), regex, grammar or the choices together
MAX_CHOICES = 256
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    Attributes:
      json: a JSON schema (a dict, or its JSON text): the output is a JSON value that validates against it
        (stored as canonical JSON text, so the params stay hashable).
      json_object: True: the output is a JSON object (any keys).
      regex: the output matches this regular expression (Rust `regex` syntax, anchored at both ends).
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar in llguidance's Lark syntax (`start: ...`), or GBNF (llama.cpp's, with
        `::=`), converted to Lark.

    The output ends where the constraint is complete and the model emits EOS (which the mask allows only then);
    `max_tokens` can cut it short, so set it large enough.

    Raises:
      ValueError: none or more than one constraint set; a value of the wrong type or over MAX_GRAMMAR_CHARS /
        MAX_CHOICES; a schema, regex or grammar llguidance refuses (its message, naming the field).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json_lib.loads(check_text("structured_outputs.json", schema))
                except json_lib.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if isinstance(schema, (dict, bool)):
                object.__setattr__(self, "json", json_lib.dumps(schema, sort_keys=True))
            else:
                raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                                 f"{type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object={show(self.json_object)} must be True or False")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not check_text(f"structured_outputs.{name}", value):
                raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(self.choice)} strings; the limit is "
                                 f"{MAX_CHOICES}")
            for i, c in enumerate(self.choice):
                if not check_text(f"structured_outputs.choice[{i}]", c):
                    raise ValueError(f"structured_outputs.choice[{i}] must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        size = len(self.grammar_source())
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{kind} has {size} characters; the limit is {MAX_GRAMMAR_CHARS}")
        from llguidance import LLMatcher  # noqa: PLC0415 - a Rust extension, loaded only for constrained requests

        error = LLMatcher.validate_grammar(self.llguidance_grammar())
        if error and not error.startswith("WARNING"):
            message = " ".join(line.strip() for line in error.strip().splitlines())
            raise ValueError(f"structured_outputs.{kind} is not valid: {message}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_source(self) -> str:
        """The constraint as the user gave it (a schema's JSON text, the choices joined), for size limits."""
        value = getattr(self, self.kind)
        return "\n".join(value) if isinstance(value, tuple) else str(value)

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (what `llguidance.LLMatcher` takes)."""
        from llguidance import LLMatcher  # noqa: PLC0415 - see __post_init__

        kind = self.kind
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(self.json)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":  # JSON string literals are Lark string literals
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json_lib.dumps(c, ensure_ascii=False) for c in self.choice))
        grammar = self.grammar
        if "::=" in grammar:  # GBNF (llama.cpp's grammar format)
            from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: PLC0415

            grammar = gbnf_to_lark(grammar)
        return LLMatcher.grammar_from_lark(grammar)


def structured_outputs_from(value: object, name: str = "structured_outputs") -> StructuredOutputsParams | None:
    """A `StructuredOutputsParams` from itself, a dict of its fields, or None.

    Raises:
      ValueError: naming `name`: not a dict, an unknown key, or what `StructuredOutputsParams` raises.
    """
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a StructuredOutputsParams or a dict with one of {', '.join(KINDS)}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        from jaxinfer.request_limits import name_hint  # noqa: PLC0415 - one line: the close key

        raise ValueError(f"{name} has an unknown key {name_hint(unknown[0], KINDS)}; the keys are {', '.join(KINDS)}")
    return StructuredOutputsParams(**value)
