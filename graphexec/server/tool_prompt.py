"""Tools and tool turns into the chat template's input: the messages (and `tools`) that
Tokenizer.apply_chat_template renders for a request that offers tools or carries a tool-calling
history.

A template that renders `tools` (Qwen's, Hermes', Llama 3.1's: found by rendering a probe tool
once) gets the tool definitions and the history as they are, with each past call's arguments
as the object they encode (templates print them with tojson).  A template that ignores tools
(SmolLM2's) gets plain text turns instead: a system section listing the tools as JSON inside
<tools></tools> and saying how to call them in the server's format (merged into the
conversation's own system message, or a new one), past calls written in that format in the
assistant's text, and tool results as <tool_response> blocks in a user turn (consecutive
results in one turn).  A conversation without tools or tool turns is passed through unchanged.
"""

from __future__ import annotations

import json
from functools import cached_property

from graphexec.server.tool_parsers import ToolCallFormat
from graphexec.server.tools import ToolPlan

_PROBE_NAME = "graphexec_probe_function"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


def tools_system_prompt(tools: list[dict], fmt: ToolCallFormat) -> str:
    """The system section that offers `tools` (OpenAI tool objects) to a model whose template
    does not."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help with the user's request. They are defined as JSON inside "
        f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n{fmt.instructions}"
    )


class ToolPrompt:
    """Per server (its tokenizer and tool-call format); used on the server's worker thread."""

    def __init__(self, tokenizer, fmt: ToolCallFormat):
        self._tokenizer = tokenizer
        self.format = fmt

    @cached_property
    def template_renders_tools(self) -> bool:
        """Whether the chat template shows a `tools` list it is given (a template that fails on
        one counts as not)."""
        if self._tokenizer is None or self._tokenizer.chat_template is None:
            return False
        try:
            text = self._tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[_PROBE_TOOL])
        except Exception:  # jinja2's errors, or a template that refuses a tools list
            return False
        return _PROBE_NAME in text

    def render(self, messages: list[dict], plan: ToolPlan | None) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for apply_chat_template; tools None: render none."""
        offered = plan is not None and plan.offered
        tools = [t.definition() for t in plan.tools] if offered else None
        if not offered and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return messages, None
        if self.template_renders_tools:
            return [_for_template(m) for m in messages], tools
        text_turns = _as_text_turns(messages, self.format)
        return (_with_system_section(text_turns, tools_system_prompt(tools, self.format)) if offered else text_turns), None


def _for_template(message: dict) -> dict:
    """A message as tool-aware templates take it: content a string, call arguments objects."""
    out = dict(message, content=message["content"] or "")
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {"name": call["function"]["name"], "arguments": _decoded(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]
    return out


def _decoded(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _as_text_turns(messages: list[dict], fmt: ToolCallFormat) -> list[dict]:
    turns: list[dict] = []
    previous_role = None
    for message in messages:
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous_role == "tool":
                turns[-1] = {"role": "user", "content": turns[-1]["content"] + "\n" + block}
            else:
                turns.append({"role": "user", "content": block})
        elif message.get("tool_calls"):
            calls = fmt.calls_text([(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]])
            text = message["content"] or ""
            turns.append({"role": role, "content": f"{text}\n{calls}" if text else calls})
        else:
            turns.append({"role": role, "content": message["content"]})
        previous_role = role
    return turns


def _with_system_section(turns: list[dict], section: str) -> list[dict]:
    if turns and turns[0]["role"] == "system":
        return [{"role": "system", "content": f"{turns[0]['content']}\n\n{section}"}, *turns[1:]]
    return [{"role": "system", "content": section}, *turns]
