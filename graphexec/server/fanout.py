"""One HTTP request, several engine requests: every prompt × n choices, started together and read
as one.  `merged` interleaves their deltas as they come, each tagged with its choice index;
`results` waits for all of them, or for the client to go away.  Either way, an engine request
left unfinished (a client gone, a sibling failed) is aborted, so it releases its KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.engine.request_stream import AsyncRequestStream
from graphexec.errors import RequestFailedError

_DONE = object()  # a choice's stream ended


async def merged(streams: Sequence[AsyncRequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(choice index, delta) from every stream as deltas arrive; raises a stream's RequestFailedError.

    Closing the iterator early (the client went away) cancels every unfinished request.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncRequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
        except RequestFailedError as error:
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, RequestFailedError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a pump cancelled inside its stream aborts that request
        cancel_unfinished(streams)


async def results(streams: Sequence[AsyncRequestStream], request: Request) -> list[RequestOutput] | None:
    """Every stream's output in order, or None when the client disconnected first.

    A failed request raises its RequestFailedError after the others are aborted.
    """
    gathered = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    # Cancelled or failed, its exception is read here or below, never left to asyncio's "never retrieved".
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gathered, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not gathered.done():
            gathered.cancel()  # the client left (or this handler was cancelled): abort
            cancel_unfinished(streams)
    if not gathered.done() or gathered.cancelled():
        return None
    try:
        return gathered.result()
    except RequestFailedError:
        cancel_unfinished(streams)
        raise


def cancel_unfinished(streams: Sequence[AsyncRequestStream]) -> list[str]:
    """Abort every request still running; their ids."""
    ids = [s.request_id for s in streams if not s.finished]
    for stream in streams:
        stream.cancel()
    return ids


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
