"""The OpenAI-compatible HTTP API (FastAPI), a front end of a `ServedEngine` beside the gRPC server.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (and `/v1/models/{id}`),
`GET /health` (200 while serving, else 503), `GET /metrics` (the server's Prometheus registry), `POST /tokenize`,
`POST /detokenize` (vLLM's).

1. Every `/v1` route checks the bearer token first when the server has an API key (401). A generation request
   is read by `_read_body` (size limit: 413; bytes that are not UTF-8 JSON, numbers of over 4,300 digits and
   nesting past the recursion limit: 400), validated by its pydantic model
   (`protocol.py`: unknown fields and wrong types are a 400 naming the field), translated (`translate.py`, the
   Python API's checks), and takes one `ServedEngine.slot()` per prompt (429 past the server's limit).
2. Each prompt's first output is awaited before the response starts, so a request the engine refuses (a prompt
   that does not fit the context, an id out of the vocabulary) is a 400, never a broken stream.
3. A client that goes away aborts its requests at once (their KV pages are freed by the engine): a streamed
   response's generator is cancelled by Starlette when the client disconnects; a non-streamed request is raced
   against `streams.disconnected`.
4. Errors (`errors.py`) have OpenAI's shape: 400 bad value, 401, 404 unknown model or route, 413, 429,
   503 not serving, 500 for anything else with the exception's type only (its traceback goes to the log). A
   completion the engine fails after admission because of its own values (a `ValueError`: a constraint and
   `allowed_token_ids` that leave no token, `min_tokens` past a completed constraint) is a 400 naming the field.
   An error after a stream started is sent as a last `data: {"error": ...}` event before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.request_limits import check_text, check_token_ids
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving.openai.errors import (HTTPError, answers_errors, error_response, failure, generation_failed,
                                            route_error, validation_message)
from jaxinfer.serving.openai.streams import close, disconnected, first_outputs, last_outputs, merged
from jaxinfer.serving.openai import translate
from jaxinfer.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest)
from jaxinfer.serving.openai.responses import Shaper, error_body, sse, usage as usage_of
from jaxinfer.serving.metrics import RequestRecorder
from jaxinfer.serving.auth import bearer_matches
from jaxinfer.serving.served import ServedEngine, Unavailable


class _ClientGone(Exception):
    """The client disconnected before its response started."""


class OpenAIApp:
    """The HTTP front end of a `ServedEngine`.

    Args:
      served: the engine, shared with the other front ends (its owner starts and stops it).
      model_name: the name `/v1/models` lists and requests must give as `model` (or omit).
      api_key: when set, every `/v1` route needs `Authorization: Bearer <api_key>`.

    Attributes:
      app: the FastAPI application (an ASGI app, for uvicorn).
    """

    def __init__(self, served: ServedEngine, model_name: str, api_key: str | None = None) -> None:
        self.served, self.model_name, self.api_key = served, model_name, api_key
        self.app = app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(StarletteHTTPException, route_error)  # unknown route (404), wrong method (405)
        for path, handler, method in (("/v1/completions", self.completions, "POST"),
                                      ("/v1/chat/completions", self.chat_completions, "POST"),
                                      ("/v1/models", self.models, "GET"),
                                      ("/v1/models/{model:path}", self.model, "GET"), ("/health", self.health, "GET"),
                                      ("/metrics", self.metrics, "GET"), ("/tokenize", self.tokenize, "POST"),
                                      ("/detokenize", self.detokenize, "POST")):
            app.add_api_route(path, answers_errors(handler), methods=[method])

    # --- request checks ---

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        if not bearer_matches(request.headers.get("authorization"), self.api_key):
            raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            "authentication_error")

    async def _read_body(self, request: Request, model: type[BaseModel]) -> BaseModel:
        """The request body as `model`: read up to the size limit, decoded as UTF-8 JSON, validated."""
        limit = self.served.limits.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise HTTPError(413, f"the body is {length} bytes; the server's limit is {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"the body is over the server's limit of {limit} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise HTTPError(400, f"the body is not valid UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise HTTPError(400, f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
        except ValueError as e:  # an integer of more digits than int() converts
            raise HTTPError(400, f"the body is not valid JSON here: {str(e).split(';')[0]}") from None
        except RecursionError:
            raise HTTPError(400, "the body is not valid JSON here: it is nested too deeply") from None
        if not isinstance(data, dict):
            raise HTTPError(400, f"the body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            message, field = validation_message(e, model)
            raise HTTPError(400, message, param=field) from None

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise HTTPError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                            "not_found_error", "model")

    def _check_supported(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        field = body.unsupported()
        if field is not None:
            raise HTTPError(400, f"{field} is not supported by this server yet", param=field)

    # --- generation ---

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._read_body(request, CompletionRequest)
        engine = self._start(body)
        params = translate.completion_params(body)
        prompts = await asyncio.to_thread(translate.completion_prompts, body, engine.engine)
        decode = engine.engine.tokenizer.decode
        echo = [decode(p.token_ids, skip_special_tokens=False) for p in prompts] if body.echo else None
        shaper = Shaper(False, self.model_name, params.n, params.logprobs,
                        echo_logprobs=body.echo and body.logprobs is not None,
                        show_prompt_logprobs=body.prompt_logprobs is not None)
        firsts = [decode(p.token_ids[:1], skip_special_tokens=False) for p in prompts] if echo else None
        return await self._generate(request, engine, body, params, prompts, shaper, echo=echo, first_tokens=firsts)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._read_body(request, ChatCompletionRequest)
        engine = self._start(body)
        params = translate.chat_params(body)
        prompt = await asyncio.to_thread(translate.chat_prompt, body, engine.engine)
        shaper = Shaper(True, self.model_name, params.n, params.logprobs)
        return await self._generate(request, engine, body, params, [prompt], shaper)

    def _start(self, body: CompletionRequest | ChatCompletionRequest) -> AsyncEngine:
        self._check_model(body.model)
        self._check_supported(body)
        return self.served.ready()

    async def _generate(self, request: Request, engine: AsyncEngine, body, params: SamplingParams,
                        prompts: Sequence[Prompt], shaper: Shaper, echo: list[str] | None = None,
                        first_tokens: list[str] | None = None) -> Response:
        limit = self.served.limits.max_queued_requests
        if len(prompts) > limit:  # a 429 would say "retry later" of a request that can never fit
            raise HTTPError(400, f"prompt has {len(prompts)} prompts; the server takes at most {limit} requests in "
                                 "flight (--max-queued-requests): send fewer prompts per request", param="prompt")
        slots = contextlib.ExitStack()
        recorders: list[RequestRecorder] = []
        try:
            for _ in prompts:
                slots.enter_context(self.served.slot())  # 429 past the limit of requests in flight
            streams = [engine.generate(p, params) for p in prompts]
            firsts = await self._until_disconnect(request, first_outputs(streams))
            recorders = [self.served.record_admitted(out) for out in firsts]
            if body.stream:
                if (failed := failure(firsts)) is not None:  # at its first step: an error status, not a stream
                    for recorder, out in zip(recorders, firsts):
                        recorder.record(out)
                        recorder.abandoned()
                    await close(streams)
                    raise failed
                options = body.stream_options
                usage = (options is not None and options.include_usage,
                         options is not None and options.include_usage and options.continuous_usage_stats)
                events = self._events(shaper, streams, firsts, recorders, echo, usage, slots.pop_all())
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            outs = await self._until_disconnect(request, last_outputs(streams, firsts, recorders))
            if (failed := failure(outs)) is not None:
                raise failed
            return JSONResponse(shaper.whole(outs, echo, first_tokens))
        except _ClientGone:
            for recorder in recorders:
                recorder.abandoned()
            return Response(status_code=499)
        finally:
            slots.close()

    async def _until_disconnect(self, request: Request, work):
        """Awaits `work`; if the client disconnects first, cancels it (aborting its requests): `_ClientGone`."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise _ClientGone
        return task.result()

    async def _events(self, shaper: Shaper, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                      recorders: list[RequestRecorder], echo: list[str] | None, usage: tuple[bool, bool],
                      slots: contextlib.ExitStack) -> AsyncIterator[str]:
        """The SSE stream of a request: a chunk per completion with new tokens (with the usage so far when
        `usage[1]`, vLLM's `continuous_usage_stats`), the usage chunk (when `usage[0]`), `[DONE]`."""
        started: set[tuple[int, int]] = set()
        ended: set[tuple[int, int]] = set()  # an engine output repeats the samples that finished before it
        last = list(firsts)
        try:
            async for p, out in merged(streams, firsts):
                last[p] = out
                recorders[p].record(out)
                for c in out.outputs:
                    if (p, c.index) in ended:
                        continue
                    first = (p, c.index) not in started
                    if c.finish_reason == "error":
                        yield sse(json.loads(error_response(generation_failed(c)).body))
                        yield sse("[DONE]")
                        return
                    chunk = shaper.chunk(p, c, first, echo[p] if echo else "")
                    if chunk is not None:
                        started.add((p, c.index))
                        if c.finish_reason is not None:
                            ended.add((p, c.index))
                        yield sse(chunk | ({"usage": usage_of(last)} if usage[1] else {}))
            if usage[0]:
                yield sse(shaper.usage_chunk(last))
        except Exception as e:  # noqa: BLE001 - the stream has started: the error is its last event
            response = error_response(e)
            yield sse(json.loads(response.body))
        finally:
            for recorder in recorders:  # a client that left mid-stream: its requests count as aborted
                recorder.abandoned()
            slots.close()
            await close(streams)
        yield sse("[DONE]")

    # --- other routes ---

    def _card(self) -> dict:
        engine = self.served.async_engine
        card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "jaxinfer",
                "root": self.served.config.model or self.model_name, "parent": None}
        if engine is not None:
            card["max_model_len"] = engine.engine.max_model_len
        return card

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request, model: str) -> JSONResponse:
        """`GET /v1/models/{model}` (the SDK's `models.retrieve`): the served model's card, else 404."""
        self._authorize(request)
        self._check_model(model)
        return JSONResponse(self._card())

    async def health(self) -> Response:
        if self.served.serving:
            return Response(status_code=200)
        try:
            self.served.ready()
            message = "not serving"
        except Unavailable as e:
            message = str(e)
        return JSONResponse(error_body(message, "service_unavailable_error", None, 503), status_code=503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.served.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await self._read_body(request, TokenizeRequest)
        self._check_model(body.model)
        engine = self.served.ready().engine
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give one of prompt and messages")
        if body.messages is not None:
            ids = list((await asyncio.to_thread(translate.chat_prompt, body, engine, False)).token_ids)
        else:
            add_bos = None if body.add_special_tokens else False  # None: as the model's metadata says
            ids = await asyncio.to_thread(engine.tokenizer.encode, check_text("prompt", body.prompt), add_bos)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> JSONResponse:
        body = await self._read_body(request, DetokenizeRequest)
        self._check_model(body.model)
        engine = self.served.ready().engine
        ids = check_token_ids("tokens", body.tokens, engine.model_config.vocab_size)
        return JSONResponse({"prompt": engine.tokenizer.decode(ids)})
