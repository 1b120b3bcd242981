"""`AsyncEngine`: an `Engine` driven by one background thread, streamed to asyncio callers.

1. `generate(prompt, params, request_id)` hands the request to the engine thread through a queue and waits for
   its admission: a bad request raises `ValueError` in the caller, and nothing else notices.
2. The engine thread owns the device. Between steps it drains the command queue (add, abort), then runs
   `Engine.step()` and pushes each request's `RequestOutput` (cumulative text plus `delta_text`) onto that
   request's asyncio queue with `call_soon_threadsafe`; callers never block it.
3. When a caller stops iterating (it broke out, was cancelled, or its deadline passed), the request is aborted and
   its pages are freed at the engine's next turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


@dataclasses.dataclass
class _Add:
    prompt: Prompt | str | dict | Sequence[int]
    params: SamplingParams | None
    request_id: str | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    admitted: concurrent.futures.Future


@dataclasses.dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs `Engine.step()` in a background thread; `generate` is an async iterator of `RequestOutput`s.

    Args:
      engine: an `Engine` (the thread takes it over; don't step it elsewhere) or an `EngineConfig` to build one.
    """

    def __init__(self, engine: Engine | EngineConfig) -> None:
        self.engine = engine if isinstance(engine, Engine) else Engine(engine)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: Prompt | str | dict | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs, each with the new `delta_text` / `delta_token_ids`; the last is finished.

        `prompt`: a `Prompt` (e.g. from `Engine.make_prompt`, called off the event loop) is admitted as it is; any
        other form is tokenized once, on the engine thread, by `Engine.add_request`.

        Raises:
          ValueError: the request was rejected (same checks as `Engine.add_request`).
          RuntimeError: the engine was shut down.
        """
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(prompt, params, request_id, loop, outputs, admitted))
        try:
            request_id = await asyncio.wrap_future(admitted)  # raises the engine's ValueError here
        except asyncio.CancelledError:
            # Cancelled while waiting: if the engine thread had already admitted the request, abort it.
            admitted.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self.abort(f.result()))
            raise
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request at the engine's next turn (its pages are freed then)."""
        self._commands.put(_Abort(request_id))

    def is_alive(self) -> bool:
        """True while the engine thread runs (False after `shutdown` or if the loop itself died)."""
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the engine thread; requests still in flight get a RuntimeError."""
        self._stop.set()
        self._thread.join(timeout_s)

    # --- the engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the loop must survive; every open stream learns why
                logger.exception("engine step failed")
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                    self._streams.pop(request_id, None)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
        for request_id in list(self._streams):
            self._deliver(request_id, RuntimeError("the engine was shut down"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                # A caller cancelled while waiting for admission (client gone, deadline): never admit it.
                if command.admitted.set_running_or_notify_cancel():
                    try:
                        request_id = self.engine.add_request(command.prompt, command.params, command.request_id)
                    except ValueError as e:
                        command.admitted.set_exception(e)
                    else:
                        self._streams[request_id] = (command.loop, command.outputs)
                        command.admitted.set_result(request_id)
            elif isinstance(command, _Abort):
                self.engine.abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            self.engine.abort(request_id)
