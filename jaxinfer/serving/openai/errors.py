"""Errors of the OpenAI HTTP API in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), with
the status each kind of failure gets and the request field it concerns (see `app.py`'s docstring, item 4).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine.async_engine import EngineStoppedError
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.request_limits import name_hint
from jaxinfer.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest)
from jaxinfer.serving.openai.responses import error_body
from jaxinfer.serving.served import Overloaded, Unavailable

logger = logging.getLogger(__name__)


class HTTPError(Exception):
    """An error response: HTTP status, message, OpenAI error type, and the field it concerns."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(e: Exception) -> JSONResponse:
    """The JSON error response of an exception (the statuses: `app.py`'s docstring, item 4)."""
    if isinstance(e, HTTPError):
        status, message, type_, param = e.status, e.message, e.type, e.param
    elif isinstance(e, ValueError):
        status, message, type_, param = 400, str(e), "invalid_request_error", param_of(str(e))
    elif isinstance(e, Overloaded):
        status, message, type_, param = 429, str(e), "rate_limit_error", None
    elif isinstance(e, (Unavailable, EngineStoppedError)):
        status, message, type_, param = 503, str(e), "service_unavailable_error", None
    elif isinstance(e, StarletteHTTPException):
        status, message, type_, param = e.status_code, str(e.detail), "invalid_request_error", None
        type_ = "not_found_error" if status == 404 else type_
    else:
        logger.exception("internal error", exc_info=e)
        status, message, type_, param = 500, f"internal error ({type(e).__name__}); see the server log", \
            "internal_error", None
    return JSONResponse(error_body(message, type_, param, status), status_code=status)


def answers_errors(handler):
    """Wraps a route handler: any exception it raises becomes its error response (`error_response`)."""
    @functools.wraps(handler)
    async def answer(*args, **kwargs) -> Response:
        try:
            return await handler(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every error is answered; unexpected ones are logged
            return error_response(e)

    return answer


async def route_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """The app's handler of Starlette's own errors (an unknown route, a wrong method)."""
    return error_response(e)


def validation_message(e: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """The first problem of a pydantic error as one line naming the field, and the field."""
    err = e.errors(include_url=False)[0]
    loc = list(err["loc"])
    field = str(loc[0]) if loc else None
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if err["type"] == "extra_forbidden":
        return f"unknown field {name_hint(field, model.model_fields) if len(loc) == 1 else repr(path)}", field
    if err["type"] == "missing":
        return f"{path} is required", field
    if err["type"] == "int_parsing_size":  # pydantic's own text says "Unable to parse input string"
        return f"{path}: {err.get('input')} is too large for an integer", field
    info = model.model_fields.get(field) if field is not None else None
    expected = str(info.annotation).replace("typing.", "").replace(" | None", "") if info is not None else ""
    if " | " in expected and len(loc) > 1 and isinstance(loc[1], str):
        # a union (prompt, stop, ...): pydantic names the first alternative it tried; name them all
        return f"{field} must be {expected}, got {_kind(err.get('input'))}", field
    return f"{path}: {err['msg']}", field


def _kind(value: object) -> str:
    """A JSON value's type for an error message, a list's with its items' ("list of float", "list of list")."""
    if isinstance(value, list) and value:
        return "list of " + " and ".join(sorted({type(v).__name__ for v in value}))
    return "empty list" if isinstance(value, list) else type(value).__name__


# Fields whose name starts a `SamplingParams` / translation / token-id error ("temperature=...", "prompt[1]: ...",
# "tokens contains ..."): the error's `param`.
_PARAM = re.compile(r"^([a-z_]+)(?:\[\d+\])?[=:. ]")
_FIELDS = frozenset().union(*(m.model_fields for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                                         DetokenizeRequest)))


def param_of(message: str) -> str | None:
    """The request field an error message starts with (`_PARAM`), or None."""
    match = _PARAM.match(message)
    return match.group(1) if match and match.group(1) in _FIELDS else None


def generation_failed(completion: CompletionOutput) -> HTTPError:
    """The error of a completion that failed in the engine: a 400 naming the field when its own values made it
    fail (`error_kind` "request", e.g. "allowed_token_ids and structured_outputs allow no common token"), else a
    500 with the engine's message."""
    if completion.error_kind == "request":
        return HTTPError(400, completion.error or "", param=param_of(completion.error or ""))
    return HTTPError(500, f"generation failed: {completion.error}", "internal_error")


def failure(outs: Sequence[RequestOutput]) -> HTTPError | None:
    """The error of the first completion of `outs` that failed in the engine (`generation_failed`), or None."""
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "error":
                return generation_failed(c)
    return None
