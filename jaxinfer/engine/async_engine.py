"""`AsyncEngine`: an `Engine` driven by one background thread, streamed to asyncio callers.

1. `generate(prompt, params, request_id)` hands the request to the engine thread through a queue and waits for
   its admission: a bad request raises `ValueError` in the caller, and nothing else notices. Any other exception
   of the admission (a tokenizer that raises `TypeError`, say) is the caller's too: it is logged, raised in that
   caller, nothing is queued, and the loop goes on.
2. The engine thread owns the device. Between steps it drains the command queue (add, abort, export), then runs
   `Engine.step()` and pushes each request's `RequestOutput` (cumulative text plus `delta_text`) onto that
   request's asyncio queue with `call_soon_threadsafe`; callers never block it.
3. When a caller stops iterating (it broke out, was cancelled, or its deadline passed), the request is aborted and
   its pages are freed at the engine's next turn.
4. A failing device call fails only its own requests (`Engine.step`). An exception the engine cannot pin on one
   request (in the scheduler, a KV page move, the bookkeeping of a step, an abort) stops the loop, since the
   engine's state can no longer be trusted: every caller still waiting, streaming or queued gets an
   `EngineStoppedError` (a `RuntimeError`) naming the cause at once, the engine's requests are aborted (best
   effort), `is_alive()` turns False, `error` holds the cause, and every later `generate` raises at once.
5. Disaggregated prefill / decode and resuming (`jaxinfer.engine.kv_handoff`, `jaxinfer.engine.admission`):
   `prefill` streams a prefill-only request and exports its KV pages on the engine thread; `generate_from_handoff`
   streams the request on another engine; `generate(..., output_token_ids=...)` resumes with output so far.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_handoff import KVHandoff
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineStoppedError(RuntimeError):
    """The engine loop no longer runs: `AsyncEngine.shutdown` was called, or an exception stopped it (then the
    message names it and `__cause__` is `AsyncEngine.error`)."""


@dataclasses.dataclass
class _Add:
    submit: Callable[[Engine], str]  # queues the request on the engine (`add_request`, `import_kv`), its id
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    admitted: concurrent.futures.Future


@dataclasses.dataclass
class _Call:
    call: Callable[[Engine], Any]  # runs on the engine thread between steps (`export_kv`)
    done: concurrent.futures.Future


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
        self.error: BaseException | None = None  # what stopped the loop, when an exception did
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        # Taken to queue a command and to close the loop: a command queued before the close is answered by it.
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    def generate(
        self,
        prompt: Prompt | str | dict | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs, each with the new `delta_text` / `delta_token_ids`; the last is finished.

        `prompt`: a `Prompt` (e.g. from `Engine.make_prompt`, called off the event loop) is admitted as it is; any
        other form is tokenized once, on the engine thread, by `Engine.add_request`. `output_token_ids` (resume
        with output so far) and `prefill_only` (the last output has finish_reason "handoff"; then `export_kv`, or
        use `prefill`) are `Engine.add_request`'s.

        Raises:
          ValueError: the request was rejected (same checks as `Engine.add_request`).
          EngineStoppedError: (a RuntimeError) the engine was shut down, or its loop stopped, before or while
            this request ran; the message names the cause.
          Exception: any other exception `Engine.add_request` raised for this request, as it is (logged too).
        """
        return self._stream(lambda engine: engine.add_request(prompt, params, request_id,
                                                              output_token_ids=output_token_ids,
                                                              prefill_only=prefill_only))

    def generate_from_handoff(self, handoff: KVHandoff, params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams a request another engine prefilled (`Engine.import_kv`): only tokens after the handoff's output
        so far; raises as `generate` (a bad payload: ValueError)."""
        return self._stream(lambda engine: engine.import_kv(handoff, params, request_id))

    async def export_kv(self, request_id: str, wire_dtype: str | None = None) -> KVHandoff:
        """`Engine.export_kv` on the engine thread (between steps).

        Raises:
          ValueError: as `Engine.export_kv`.
          EngineStoppedError: the engine loop no longer runs.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._stop.is_set():
                raise self._closed_error()
            self._commands.put(_Call(lambda engine: engine.export_kv(request_id, wire_dtype), done))
        return await asyncio.wrap_future(done)

    async def prefill(self, prompt: Prompt | str | dict | Sequence[int], params: SamplingParams | None = None,
                      request_id: str | None = None, wire_dtype: str | None = None
                      ) -> tuple[RequestOutput, KVHandoff | None]:
        """The prefill side of a disaggregated request: `generate(prefill_only=True)`, then `export_kv`.

        Returns:
          (the last output: its first token, finish_reason "handoff"; the payload), or (a finished output, None)
          when the first token ended the request (EOS, max_tokens=1, an error): nothing to hand over.

        Raises:
          as `generate` and `export_kv`.
        """
        last = None
        async for last in self.generate(prompt, params, request_id, prefill_only=True):
            pass
        if last.outputs[0].finish_reason != "handoff":
            return last, None
        try:
            return last, await self.export_kv(last.request_id, wire_dtype)
        except BaseException:
            self.abort(last.request_id)  # frees the held pages if the export never ran
            raise

    async def _stream(self, submit: Callable[[Engine], str]) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._stop.is_set():
                raise self._closed_error()
            self._commands.put(_Add(submit, loop, outputs, admitted))
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
        """Aborts a request at the engine's next turn (its pages are freed then); a no-op once the loop stopped."""
        if not self._closed:
            self._commands.put(_Abort(request_id))

    def is_alive(self) -> bool:
        """True while the engine loop serves: False after `shutdown` or once the loop stopped on an exception."""
        return not self._closed and self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the engine thread; requests still in flight or queued get an `EngineStoppedError`."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _closed_error(self) -> EngineStoppedError:
        """A fresh exception for one caller (each raise adds to its own traceback)."""
        if self.error is None:
            return EngineStoppedError("the engine is shut down")
        error = EngineStoppedError(f"the engine loop stopped: {type(self.error).__name__}: {self.error}")
        error.__cause__ = self.error
        return error

    # --- the engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    continue
                for out in self.engine.step():  # a device call that fails fails only its requests, in `step`
                    self._deliver(out.request_id, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - the loop is over; every caller must learn why
            logger.exception("the engine loop stopped")
            self.error = e
        finally:
            self._close()

    def _close(self) -> None:
        """Answers every caller with `_closed_error()`: the queued (under the lock, so none slips in after), the
        streaming; then aborts the engine's requests, as far as the engine still can."""
        with self._lock:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            future = command.admitted if isinstance(command, _Add) else (
                command.done if isinstance(command, _Call) else None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(self._closed_error())
        for request_id in list(self._streams):
            self._deliver(request_id, self._closed_error())
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is broken already; its pages no longer matter
                logger.exception("could not abort request %s after the engine loop stopped", request_id)
        self._streams.clear()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                self._admit(command)
            elif isinstance(command, _Abort):
                self.engine.abort(command.request_id)
            elif command.done.set_running_or_notify_cancel():
                self._run_call(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self, command: _Add) -> None:
        """`Engine.add_request` for one caller: any exception it raises is that caller's (nothing was queued)."""
        # A caller cancelled while waiting for admission (client gone, deadline): never admit it.
        if not command.admitted.set_running_or_notify_cancel():
            return
        try:
            request_id = command.submit(self.engine)
        except Exception as e:  # noqa: BLE001 - `add_request` queues all or nothing: only this caller is concerned
            if not isinstance(e, ValueError):
                logger.exception("admission failed with an unexpected exception")
            command.admitted.set_exception(e)
            return
        except BaseException:
            command.admitted.set_exception(EngineStoppedError("the engine loop stopped during admission"))
            raise
        self._streams[request_id] = (command.loop, command.outputs)
        command.admitted.set_result(request_id)

    def _run_call(self, command: _Call) -> None:
        """Runs a `_Call`; its exception is its caller's (a ValueError), the loop goes on."""
        try:
            command.done.set_result(command.call(self.engine))
        except Exception as e:  # noqa: BLE001 - the caller gets it
            command.done.set_exception(e)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            if not self._closed:
                self.engine.abort(request_id)
