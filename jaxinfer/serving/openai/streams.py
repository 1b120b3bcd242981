"""Engine streams for the HTTP front end: each prompt's first output (admission), the finished outputs, the
outputs of several prompts merged as they come, closing (which aborts a request not finished), and waiting for a
client to disconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request

from jaxinfer.outputs import RequestOutput
from jaxinfer.serving.metrics import RequestRecorder


async def disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body was read before: `receive` then waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def close(streams: Sequence[AsyncIterator[RequestOutput]]) -> None:
    """Closes engine streams (one not finished aborts its request)."""
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output (admission: the engine's ValueError for a refused prompt is raised here; all
    the streams are closed then)."""
    results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close(streams)
        raise errors[0]
    return list(results)


async def last_outputs(streams, firsts: list[RequestOutput], recorders: list[RequestRecorder]) -> list[RequestOutput]:
    """Each stream's finished output, every output recorded on the way (the streams are closed if this is
    cancelled)."""
    async def last(stream, out: RequestOutput, recorder: RequestRecorder) -> RequestOutput:
        recorder.record(out)
        while not out.finished:
            out = await anext(stream)
            recorder.record(out)
        return out

    try:
        return list(await asyncio.gather(*(last(s, o, r) for s, o, r in zip(streams, firsts, recorders))))
    finally:
        await close(streams)


async def merged(streams, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several engine streams as they come, starting with their first outputs."""
    if len(streams) == 1:  # the common case: no tasks
        out = firsts[0]
        yield 0, out
        while not out.finished:
            out = await anext(streams[0])
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream, out: RequestOutput) -> None:
        try:
            while not out.finished:
                out = await anext(stream)
                await queue.put((p, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((p, e))

    for p, out in enumerate(firsts):
        yield p, out
    tasks = [asyncio.ensure_future(pump(p, s, o)) for p, (s, o) in enumerate(zip(streams, firsts)) if not o.finished]
    try:
        done = 0
        while done < len(tasks):
            p, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            done += item.finished
            yield p, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
