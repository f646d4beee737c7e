"""The caller's end of one request: its deltas as a (sync or async) iterator, and its result.

The engine loop thread pushes into a per-request channel; a blocking consumer reads a thread-safe
queue, an asyncio consumer an asyncio.Queue fed through `call_soon_threadsafe`.  A stream that is
dropped, closed or cancelled before its request finished aborts the request, so an abandoned
consumer never keeps KV slots busy.
"""

from __future__ import annotations

import asyncio
import queue
import weakref
from collections.abc import Callable

from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.errors import RequestFailedError

Item = RequestDelta | BaseException

# How often a blocked reader checks that the engine loop is still alive.
_LIVENESS_POLL_S = 0.5


class _ThreadChannel:
    """Deltas for a consumer blocked on a thread."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def put(self, item: Item) -> bool:
        self.queue.put(item)
        return True


class _AsyncioChannel:
    """Deltas for a consumer on an asyncio event loop; created on that loop."""

    def __init__(self) -> None:
        try:
            self.event_loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("astream()/agenerate() need a running asyncio event loop; use stream() on a thread") from None
        self.queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> bool:
        try:
            self.event_loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody will ever read this request
            return False
        return True


class _StreamState:
    def __init__(self, request_id: str, abort: Callable[[str], object]):
        self.request_id = request_id
        self._abort = abort
        self._done = False
        self._output: RequestOutput | None = None
        self._abort_if_dropped = weakref.finalize(self, abort, request_id)

    @property
    def finished(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Abort the request unless it already ended; its last delta still arrives."""
        if not self._done:
            self._abort(self.request_id)

    def _accept(self, item: Item) -> RequestDelta:
        if isinstance(item, BaseException):
            self._end()
            # A named engine failure (WorkerFailedError) keeps its type for the caller.
            error_type = type(item) if isinstance(item, RequestFailedError) else RequestFailedError
            raise error_type(f"request {self.request_id} failed: {item}") from item
        if item.finished:
            self._end()
            self._output = item.output
        return item

    def _end(self) -> None:
        self._done = True
        self._abort_if_dropped.detach()


class RequestStream(_StreamState):
    """Blocking iterator over one request's deltas (`for delta in engine.stream(...)`)."""

    def __init__(self, request_id: str, abort: Callable[[str], object], loop_alive: Callable[[], bool]):
        super().__init__(request_id, abort)
        # The engine loop holds only the channel, never the stream, so dropping the stream
        # lets its finalizer abort the request.
        self.channel = _ThreadChannel()
        self._loop_alive = loop_alive

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestDelta:
        if self._done:
            raise StopIteration
        while True:
            try:
                return self._accept(self.channel.queue.get(timeout=_LIVENESS_POLL_S))
            except queue.Empty:
                if not self._loop_alive():
                    self._end()
                    raise RequestFailedError(f"request {self.request_id}: the engine loop is not running") from None

    def result(self) -> RequestOutput:
        """Wait for the end; the whole request's output."""
        for _ in self:
            pass
        assert self._output is not None
        return self._output

    def close(self) -> None:
        self.cancel()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncRequestStream(_StreamState):
    """Async iterator over one request's deltas (`async for delta in engine.astream(...)`).

    Must be created on the event loop that consumes it.
    """

    def __init__(self, request_id: str, abort: Callable[[str], object]):
        super().__init__(request_id, abort)
        self.channel = _AsyncioChannel()

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self.channel.queue.get()
        except asyncio.CancelledError:
            self.cancel()  # the consumer went away (a client disconnected, a task was cancelled)
            raise
        return self._accept(item)

    async def result(self) -> RequestOutput:
        async for _ in self:
            pass
        assert self._output is not None
        return self._output

    async def aclose(self) -> None:
        self.cancel()
