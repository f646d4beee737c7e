"""One streamed reply read for tool calls as it arrives: text goes out as content at once, unless
it may be (part of) a call, which is held until the call closes (then sent as a call, or as the
text it was if it does not parse) or the reply ends.

What the pieces add up to is what `ToolCallFormat.parse` makes of the whole reply: the same calls
in the same order, and the same content (all of it without calls; with calls, the text around
them, or nothing if that is only whitespace).  So a client reassembling the stream gets the
non-streamed answer.  Whitespace is held until text follows it, since whether it is content
depends on what comes after.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from graphexec.engine.request_output import RequestDelta
from graphexec.server.responses import ResponseHeader, tool_finish_reason
from graphexec.server.tool_parsers import PYTHON_TAG, ToolCall, ToolCallFormat

# What `push` and `finish` return, in order: content text, or a whole call.
Event = str | ToolCall


class ToolCallStream:
    """One reply's reader: `push` each text delta, then `finish`; each returns the events now
    known.  `names` and `max_calls` as ToolCallFormat.parse takes them."""

    def __init__(self, fmt: ToolCallFormat, names: Collection[str] | None = None, max_calls: int | None = None):
        self._fmt = fmt
        self._names = names
        self._max_calls = max_calls
        self._held = ""  # text not sent yet: a possible call opening, or a call's body
        self._in_call = False  # hermes: inside a block, after its trigger
        self._whole: bool | None = None  # llama3: is the reply a call (None: not known yet)
        self._pending_space = ""
        self._sent_text = False
        self.calls = 0

    def push(self, text: str) -> list[Event]:
        self._held += text
        return [e for e in self._drain(final=False) if e != ""]

    def finish(self) -> list[Event]:
        """What is still held, at the end of the reply."""
        events = self._drain(final=True)
        if self._sent_text or not self.calls:
            events.append(self._pending_space)
        self._pending_space = ""
        return [e for e in events if e != ""]

    def _drain(self, *, final: bool) -> list[Event]:
        if self._fmt.trigger is None:
            return self._drain_whole(final)
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._held.find(self._fmt.close_tag)
                if end < 0:
                    if final:  # never closed: it was text
                        events += self._content(self._fmt.trigger + self._held)
                        self._held, self._in_call = "", False
                    return events
                block, self._held = self._held[:end], self._held[end + len(self._fmt.close_tag) :]
                self._in_call = False
                events += self._block(block)
                continue
            start = self._held.find(self._fmt.trigger)
            if start >= 0:
                events += self._content(self._held[:start])
                self._held, self._in_call = self._held[start + len(self._fmt.trigger) :], True
                continue
            keep = 0 if final else _opening_suffix(self._held, self._fmt.trigger)
            events += self._content(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return events

    def _block(self, block: str) -> list[Event]:
        room = self._max_calls is None or self.calls < self._max_calls
        call = self._fmt.parse_block(block, self._names) if room else None
        if call is None:
            return self._content(self._fmt.trigger + block + self._fmt.close_tag)
        self.calls += 1
        return [call]

    def _drain_whole(self, final: bool) -> list[Event]:
        """llama3: the first text that is not whitespace says whether the reply is a call."""
        if self._whole is None:
            start = self._held.lstrip()
            undecided = not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG)
            if undecided and not final:
                return []
            self._whole = start.startswith(("{", PYTHON_TAG))
        if not self._whole:
            text, self._held = self._held, ""
            return [text]
        if not final:
            return []
        parsed = self._fmt.parse(self._held, self._names, self._max_calls)
        self._held = ""
        self.calls += len(parsed.calls)
        return list(parsed.calls) or [parsed.content]

    def _content(self, text: str) -> list[Event]:
        """Text outside calls: whitespace waits for what follows it (or for the end)."""
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if body:
            self._sent_text = True
        return [body]


def _opening_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that `trigger` starts with (a call may be opening)."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


class ToolCallChunks:
    """A chat stream's chunks when replies are read for calls (serving.py's `chunks` for such a
    request): content deltas as text goes out, and per call the two deltas the openai client
    accumulates (index, id, type and name first, with empty arguments; then the arguments)."""

    def __init__(
        self,
        header: ResponseHeader,
        new_stream: Callable[[], ToolCallStream],
        choices: int,
        logprobs: Callable[[Sequence[dict] | None], dict | None],
    ):
        self._header = header
        self._streams = [new_stream() for _ in range(choices)]
        self._logprobs = logprobs

    def __call__(self, index: int, delta: RequestDelta) -> list[dict]:
        stream = self._streams[index]
        calls_before = stream.calls
        events = stream.push(delta.text) if delta.text else []
        if delta.finished:
            events += stream.finish()
        deltas = []
        for event in events:
            if isinstance(event, str):
                deltas.append({"content": event})
                continue
            deltas += _call_deltas(calls_before, event)
            calls_before += 1
        logprobs = self._logprobs(delta.logprobs)
        if delta.finished or (logprobs is not None and not deltas):
            deltas.append({})  # the choice's last chunk carries its finish reason; or these logprobs
        chunks = [self._header.chat_chunk(index, d, None, None) for d in deltas]
        if chunks and logprobs is not None:
            chunks[0]["choices"][0]["logprobs"] = logprobs  # with the first chunk of this delta's text
        if delta.finished:
            chunks[-1]["choices"][0]["finish_reason"] = tool_finish_reason(stream.calls > 0, delta.finish_reason)
        return chunks


def _call_deltas(index: int, call: ToolCall) -> list[dict]:
    head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
