"""Response objects and stream events of the Responses API (POST /v1/responses), built from
engine outputs.

Plain dicts in OpenAI's shapes, so the official client parses them (`response.output_text`, and
`client.responses.stream` assembling the final response from the events).  A streamed response is
`response.created`, `response.in_progress`, the message's `output_item.added` and
`content_part.added` at its first text, one `output_text.delta` per engine delta, then
`output_text.done`, `content_part.done`, `output_item.done` and `response.completed` (or
`response.incomplete` when cut by max_output_tokens), each numbered by `sequence_number`; its
last event carries the same response the route answers unstreamed.  Function calls parsed from the
output (chat completions' `tool_calls` shape) come after the message, as `function_call` items.
Nothing here talks to the engine or the network.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.sampling_params import SamplingParams
from graphexec.server.responses import LogprobsFormatter
from graphexec.server.responses_protocol import ResponsesRequest, TextConfig
from graphexec.server.tool_stream import ToolCallStream

_MESSAGE, _TEXT = 0, 0  # the message is the first output item, its text the first content part


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict) -> str:
    """One server-sent event named by its type (the Responses API's framing; no `[DONE]`)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def usage(output: RequestOutput) -> dict:
    return {
        "input_tokens": output.prompt_tokens,
        "input_tokens_details": {"cached_tokens": output.cached_tokens},
        "output_tokens": output.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": output.prompt_tokens + output.completion_tokens,
    }


def output_text(text: str, logprobs: list[dict] | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, status: str, call: dict) -> dict:
    """A call in chat completions' shape (`{"id", "function": {"name", "arguments"}}`) as an item."""
    function = call["function"]
    return {
        "type": "function_call", "id": item_id, "status": status,
        "call_id": call["id"], "name": function["name"], "arguments": function["arguments"],
    }


def text_logprobs(formatter: LogprobsFormatter, entries: list[dict] | None) -> list[dict] | None:
    """The output text's logprobs in OpenAI's shape (chat's); None when not asked for."""
    return None if entries is None else formatter.chat(entries)["content"]


def _text_config(text: TextConfig) -> dict:
    # The format dumped as its own model: pydantic cannot serialize a union a function validated.
    dumped = {"format": text.format.model_dump(by_alias=True, exclude_none=True)}
    return dumped if text.verbosity is None else dumped | {"verbosity": text.verbosity}


def _status(finish_reason: str) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


@dataclass(frozen=True)
class ResponseShell:
    """What every snapshot of one response repeats: its id and time, and the request's settings
    as OpenAI echoes them (sampling as it was applied: the server's defaults filled in)."""

    id: str
    created_at: int
    model: str
    settings: dict

    @classmethod
    def of(cls, body: ResponsesRequest, params: SamplingParams, model: str) -> ResponseShell:
        text = body.text if body.text is not None else TextConfig()
        settings = {
            "background": False,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,  # accepted, never kept: this server is stateless
            "temperature": params.temperature,
            "text": _text_config(text),
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump(),
            "tools": [tool.model_dump() for tool in body.tools],
            "top_logprobs": body.top_logprobs,
            "top_p": params.top_p,
            "truncation": "disabled",
            "user": body.user,
        }
        return cls(new_id("resp"), int(time.time()), model, settings)

    def snapshot(self, status: str, output: list[dict], **fields: object) -> dict:
        """The response object now: `fields` fill usage, incomplete_details, error, completed_at."""
        known = {"error": None, "incomplete_details": None, "usage": None, "completed_at": None}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, **known, **fields, **self.settings,
        }

    def final(
        self,
        output: RequestOutput,
        message_id: str,
        logprobs: list[dict] | None,
        tool_calls: Sequence[dict] = (),
        text: str | None = None,
    ) -> dict:
        """The finished response: the message (unless the output is only function calls), then
        each call; `tool_calls` are what a tool-call parser found (chat completions' shape) and
        `text` the reply around them (default: the whole output text)."""
        status, details = _status(output.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        text = output.text if text is None else text
        items = []
        if text or not tool_calls:
            items.append(message_item(message_id, item_status, [output_text(text, logprobs)]))
        items += [function_call_item(new_id("fc"), item_status, call) for call in tool_calls]
        return self.snapshot(
            status, items, usage=usage(output), incomplete_details=details,
            completed_at=int(time.time()) if status == "completed" else None,
        )


class ResponseEvents:
    """The events of one streamed response, numbered as they are made.  `delta` takes each engine
    delta in order; the last one (finished) closes the response."""

    def __init__(self, shell: ResponseShell, formatter: LogprobsFormatter, calls: ToolCallStream | None = None):
        """`calls`: the reader of a reply offered tools; its text streams as the reader lets it
        out (a possible call is held), and the calls it finds close the response."""
        self._shell = shell
        self._formatter = formatter
        self._calls = calls
        self._found: list[dict] = []
        self._text: list[str] = []
        self._sequence = 0
        self._message_id = new_id("msg")
        self._message_started = False

    def opening(self) -> list[dict]:
        response = self._shell.snapshot("in_progress", [])
        return [self._event(kind, response=response) for kind in ("response.created", "response.in_progress")]

    def delta(self, delta: RequestDelta) -> list[dict]:
        if self._calls is not None:
            return self._tool_delta(delta)
        events = []
        logprobs = text_logprobs(self._formatter, delta.logprobs) or []
        if delta.text or logprobs:
            events += self._start_message()
            events.append(self._text_event("response.output_text.delta", delta=delta.text, logprobs=logprobs))
        if delta.finished:
            events += self.closing(delta.output)
        return events

    def closing(self, output: RequestOutput) -> list[dict]:
        """Every item done, then the response."""
        return self._closing(output, (), None, text_logprobs(self._formatter, output.logprobs))

    def _closing(
        self, output: RequestOutput, tool_calls: Sequence[dict], text: str | None, logprobs: list[dict] | None
    ) -> list[dict]:
        final = self._shell.final(output, self._message_id, logprobs, tool_calls, text=text)
        events = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                events += self._start_message() + self._message_done(item)
            else:
                events += self._function_call(index, item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=final)]

    def _tool_delta(self, delta: RequestDelta) -> list[dict]:
        """A delta of a reply offered tools: text as the reader lets it out, calls kept for the end
        (no logprobs: the held text's tokens would not line up with what is sent)."""
        found = self._calls.push(delta.text) if delta.text else []
        if delta.finished:
            found += self._calls.finish()
        events = []
        for piece in found:
            if isinstance(piece, str):
                self._text.append(piece)
                events += self._start_message()
                events.append(self._text_event("response.output_text.delta", delta=piece, logprobs=[]))
            else:
                self._found.append(piece.as_openai())
        if delta.finished:
            events += self._closing(delta.output, self._found, "".join(self._text), None)
        return events

    def failed(self, message: str) -> list[dict]:
        error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self._shell.snapshot("failed", [], error=error))]

    def _start_message(self) -> list[dict]:
        if self._message_started:
            return []
        self._message_started = True
        item = message_item(self._message_id, "in_progress", [])
        return [
            self._event("response.output_item.added", output_index=_MESSAGE, item=item),
            self._text_event("response.content_part.added", part=output_text("", None)),
        ]

    def _message_done(self, item: dict) -> list[dict]:
        (part,) = item["content"]
        return [
            self._text_event("response.output_text.done", text=part["text"], logprobs=part["logprobs"]),
            self._text_event("response.content_part.done", part=part),
            self._event("response.output_item.done", output_index=_MESSAGE, item=item),
        ]

    def _function_call(self, index: int, item: dict) -> list[dict]:
        """A parsed call streams whole: its arguments in one delta."""
        where = {"output_index": index, "item_id": item["id"]}
        started = item | {"status": "in_progress", "arguments": ""}
        return [
            self._event("response.output_item.added", output_index=index, item=started),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _text_event(self, kind: str, **fields: object) -> dict:
        where = {"item_id": self._message_id, "output_index": _MESSAGE, "content_index": _TEXT}
        return self._event(kind, **where, **fields)

    def _event(self, kind: str, **fields: object) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
