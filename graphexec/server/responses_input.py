"""A Responses API request as the chat conversation the chat template renders.

Pure functions from the validated body (responses_protocol.py) to chat-completions messages:
`instructions` become a system message in front; a string `input` is one user message; items map
one to one, a developer message to a system one (what chat templates know).  Function calls of an
earlier turn take chat completions' shape, so tool calling there serves here too: calls become the
`tool_calls` of one assistant message (the one whose text they follow, if any), and each output a
`tool` message answering its `call_id`.
"""

from __future__ import annotations

from graphexec.server.responses_protocol import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest
from graphexec.server.tool_parsers import ToolCallFormat
from graphexec.server.tools import ToolChoice, ToolPlan, ToolSpec, check_unique_names

_CHAT_ROLE = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """The conversation of `body`, in chat completions' message shape."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": _CHAT_ROLE[item.role], "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            _calling_message(messages)["tool_calls"].append(_tool_call(item))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def tool_plan(body: ResponsesRequest, fmt: ToolCallFormat) -> ToolPlan | None:
    """The request's function tools as chat completions' tool calling takes them (None without
    tools).  `strict` defaults to true, as OpenAI's Responses API has it: a call's arguments are
    held to the function's schema.  InvalidRequestError for two functions of one name."""
    if not body.tools:
        return None
    check_unique_names([t.name for t in body.tools], "tools[{}].name")
    specs = tuple(ToolSpec(t.name, t.description, t.parameters, t.strict is not False) for t in body.tools)
    choice = body.tool_choice
    mode = ToolChoice(choice) if isinstance(choice, str) else ToolChoice("function", choice.name)
    return ToolPlan(specs, mode, body.parallel_tool_calls, fmt, parameters_field="tools[{}].parameters")


def _calling_message(messages: list[dict]) -> dict:
    """The assistant message a function call belongs to: the last message if it is the
    assistant's (its text, or the calls before this one), else a new one without text."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", [])
    return last


def _tool_call(item: FunctionCallItem) -> dict:
    return {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
