"""Tool-call parsing (graphexec/server/tool_parsers.py) on fixed model outputs, per format, and
the streamed reading (tool_stream.py), which must give the same calls and content whatever way
the text is cut into deltas."""

import json
import random

import pytest

from graphexec.server.tool_parsers import HERMES, LLAMA3, ToolCall, parse_tool_calls, resolve_format
from graphexec.server.tool_stream import ToolCallStream

NAMES = {"get_weather", "add"}
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
A = '{"name": "add", "arguments": {"a": 1, "b": 2}}'

# (text, expected content, expected calls as (name, arguments object))
HERMES_CASES = [
    (f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>\n{W}\n</tool_call>\n<tool_call>{A}</tool_call>", None,
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    (f"Let me check. <tool_call>\n{W}\n</tool_call>", "Let me check. ", [("get_weather", {"city": "Paris"})]),
    (f"  <tool_call>{W}</tool_call>  \n", None, [("get_weather", {"city": "Paris"})]),
    # arguments written as a JSON string, or left out (a function without parameters)
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("add", {"a": 1})]),
    ('<tool_call>{"name": "get_weather"}</tool_call>', None, [("get_weather", {})]),
    # malformed: all of it stays content, as generated
    ("Plain answer, no call.", "Plain answer, no call.", []),
    ("", "", []),
    ("  \n", "  \n", []),
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>", None, []),
    (f"<tool_call>\n{W}\n", None, []),  # never closed (cut by max_tokens)
    ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', None, []),  # not offered
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', None, []),
    ('<tool_call>["add"]</tool_call>', None, []),
    ("a < b and <tool_ca", None, []),
    # one bad block among good ones: the bad one stays text, in place
    (f'<tool_call>oops</tool_call> then <tool_call>{A}</tool_call>', "<tool_call>oops</tool_call> then ",
     [("add", {"a": 1, "b": 2})]),
    (f"<tool_call>x <tool_call>{A}</tool_call>", None, []),  # the first block runs to the first close
]

LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    (' {"name": "add", "arguments": {"a": 1, "b": 2}}\n', None, [("add", {"a": 1, "b": 2})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', None, [("add", {"a": 1})]),
    ('{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("add", {"a": 1}), ("get_weather", {"city": "Rome"})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "add", "parameters": {"a": 1}} and then text', None, []),
    ('{"name": "add", "parameters": ', None, []),
    ('{"name": "nope", "parameters": {}}', None, []),
    ('{"answer": 42}', None, []),
    ("  ", "  ", []),
]


def _calls(calls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt, cases", [(HERMES, HERMES_CASES), (LLAMA3, LLAMA3_CASES)], ids=["hermes", "llama3"])
def test_fixed_outputs_parse_to_calls_or_stay_content(fmt, cases):
    for text, content, calls in cases:
        parsed = parse_tool_calls(text, fmt, NAMES)
        assert _calls(parsed.calls) == calls, text
        # Without calls the content is the text exactly as generated (None in the table: the text).
        assert parsed.content == (content if calls or content is not None else text), text
        for call in parsed.calls:
            assert call.id.startswith("call_") and len(call.id) == 29
            assert call.as_openai()["function"]["name"] == call.name and call.as_openai()["type"] == "function"


def _streamed(fmt, text: str, cuts: list[int], max_calls=None) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(fmt, NAMES, max_calls)
    events = []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        events += stream.push(text[start:end])
    events += stream.finish()
    assert "" not in events
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


@pytest.mark.parametrize("max_calls", [None, 1])
@pytest.mark.parametrize("fmt, cases", [(HERMES, HERMES_CASES), (LLAMA3, LLAMA3_CASES)], ids=["hermes", "llama3"])
def test_streamed_pieces_reassemble_into_the_parsed_reply(fmt, cases, max_calls):
    """Every single cut, and random multi-cuts, of every case: the same calls, the same content."""
    rng = random.Random(0)
    for text, _, _ in cases:
        parsed = parse_tool_calls(text, fmt, NAMES, max_calls)
        splits = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), min(5, max(len(text) - 1, 0)))) for _ in range(20)]
        for cuts in [[], *splits]:
            content, calls = _streamed(fmt, text, cuts, max_calls)
            assert _calls(calls) == _calls(parsed.calls), (text, cuts)
            assert content == (parsed.content or ""), (text, cuts)


def test_calls_past_the_limit_are_text():
    """parallel_tool_calls=false: one call; a later block is text, a whole reply with two is text."""
    two = f"<tool_call>{W}</tool_call> and <tool_call>{A}</tool_call>"
    parsed = parse_tool_calls(two, HERMES, NAMES, max_calls=1)
    assert _calls(parsed.calls) == [("get_weather", {"city": "Paris"})] and parsed.content == f" and <tool_call>{A}</tool_call>"
    llama = '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    assert parse_tool_calls(llama, LLAMA3, NAMES, max_calls=1).calls == () and len(parse_tool_calls(llama, LLAMA3, NAMES).calls) == 2


def test_text_goes_out_before_the_reply_ends():
    """Plain text is not held back: only what may open a call, and trailing whitespace, wait."""
    stream = ToolCallStream(HERMES, NAMES)
    assert stream.push("Hello wor") == ["Hello wor"]
    assert stream.push("ld <tool") == ["ld"]
    assert stream.push("box> ") == [" <toolbox>"]
    assert stream.push("<tool_call>\n" + W[:20]) == []
    (call,) = stream.push(W[20:] + "\n</tool_call>")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert stream.push("bye") == [" bye"] and stream.finish() == [] and stream.calls == 1
    plain = ToolCallStream(LLAMA3, NAMES)
    assert plain.push("  ") == [] and plain.push("Sun") == ["  Sun"] and plain.push("ny") == ["ny"]
    whole = ToolCallStream(LLAMA3, NAMES)
    assert whole.push('{"name": "add", ') == [] and whole.push('"parameters": {}}') == []
    assert [c.name for c in whole.finish()] == ["add"]


def test_format_is_chosen_from_the_template_unless_configured():
    assert resolve_format("auto", None) is HERMES
    assert resolve_format("auto", "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is HERMES
    assert resolve_format("auto", "{%- if message.role == 'ipython' %}<|python_tag|>{% endif %}") is LLAMA3
    assert resolve_format("llama3", None) is LLAMA3 and resolve_format("hermes", "ipython") is HERMES


def test_past_calls_are_written_back_in_each_format():
    calls = [("add", '{"a": 1}'), ("get_weather", '{"city": "Oslo"}')]
    hermes = HERMES.calls_text(calls)
    assert hermes == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _calls(HERMES.parse(hermes, NAMES).calls) == [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]
    llama = LLAMA3.calls_text(calls)
    assert _calls(LLAMA3.parse(llama, NAMES).calls) == [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]
