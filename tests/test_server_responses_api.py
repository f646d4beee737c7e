"""POST /v1/responses (OpenAI's Responses API) on the tiny model, with a stand-in chat template.

The route is the chat path under another shape, so its answers are held against
/v1/chat/completions for the same conversation (greedy): the same text, tokens and logprobs.
The official `openai` client parses the answers and assembles streamed ones.  Request→chat
conversion and the function-call output items, which tool calling will use, are checked as the
pure functions they are.
"""

import json

import httpx
import jsonschema
import openai
import pytest

from graphexec.engine.request_output import RequestOutput
from graphexec.server.responses import LogprobsFormatter
from graphexec.server.responses_input import chat_messages
from graphexec.server.responses_output import ResponseEvents, ResponseShell
from graphexec.server.responses_protocol import ResponsesRequest
from graphexec.server.tool_parsers import HERMES
from graphexec.server.tool_stream import ToolCallStream
from graphexec.sampling_params import SamplingParams
from tests.helpers import before_each_step, slowed, wait_until
from tests.invariants import assert_no_leak

TINY = "tiny-llama"
# What the tiny random model can finish in a few byte tokens (tests/test_structured_output.py).
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"],
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}}


def _template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def server(tiny, tiny_server):
    """The tiny server, its model given a chat template for this module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny.tokenizer, "apply_chat_template", _template)
        yield tiny_server


def _http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=60)


def _idle(engine) -> None:
    wait_until(lambda: engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(engine)


def _respond(server, body: dict) -> httpx.Response:
    with _http() as http:
        return http.post(f"{server.url}/v1/responses", json={"model": TINY} | body)


def _chat(server, body: dict) -> dict:
    with _http() as http:
        answer = http.post(f"{server.url}/v1/chat/completions", json={"model": TINY, "temperature": 0} | body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _events(server, body: dict) -> list[dict]:
    """A streamed response's events; each SSE `event:` line names its data's type."""
    with _http() as http:
        with http.stream("POST", f"{server.url}/v1/responses", json={"model": TINY, "stream": True} | body) as answer:
            assert answer.status_code == 200, answer.read()
            lines = [line for line in answer.iter_lines() if line]
    assert len(lines) % 2 == 0 and "[DONE]" not in lines
    events = []
    for name, data in zip(lines[::2], lines[1::2]):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def _assert_same_logprobs(got: list[dict], want: list[dict]) -> None:
    """The same tokens and alternatives, their values to rounding (a cached prefix changes the last digits)."""

    def tokens(entries: list[dict]) -> list:
        return [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in entries]

    def values(entries: list[dict]) -> list[float]:
        return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]

    assert tokens(got) == tokens(want)
    assert values(got) == pytest.approx(values(want), abs=1e-4)


def _kinds(events: list[dict]) -> list[str]:
    kinds = [e["type"].removeprefix("response.") for e in events]
    deltas = kinds.count("output_text.delta")
    assert deltas >= 1 and kinds[4 : 4 + deltas] == ["output_text.delta"] * deltas
    return [*kinds[:4], "output_text.delta...", *kinds[4 + deltas :]]


# ---- answers, held against chat completions -----------------------------------------------------


def test_streamed_events_come_in_order_and_join_into_the_unstreamed_response(server, tiny):
    body = {
        "instructions": "Answer in French.",
        "input": "Where is Paris?",
        "max_output_tokens": 6,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    events = _events(server, body)
    assert _kinds(events) == [
        "created", "in_progress", "output_item.added", "content_part.added", "output_text.delta...",
        "output_text.done", "content_part.done", "output_item.done", events[-1]["type"].removeprefix("response."),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and events[0]["response"]["status"] == "in_progress"
    (message,) = final["output"]
    (part,) = message["content"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == part["text"] == events[-4]["text"]
    assert [lp for e in deltas for lp in e["logprobs"]] == part["logprobs"]
    assert {e["item_id"] if "item_id" in e else e["item"]["id"] for e in events[2:-1]} == {message["id"]}

    # The same request unstreamed, and as a chat completion: the same answer.
    unstreamed = _respond(server, body)
    assert unstreamed.status_code == 200, unstreamed.text
    unstreamed = unstreamed.json()
    chat = _chat(server, {
        "messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Where is Paris?"}],
        "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
    })
    (choice,) = chat["choices"]
    assert unstreamed["output"][0]["content"][0]["text"] == part["text"] == choice["message"]["content"]
    # Another run (its prompt now cached, so computed in another shape): the same tokens, logprobs to rounding.
    for other in (unstreamed["output"][0]["content"][0]["logprobs"], choice["logprobs"]["content"]):
        _assert_same_logprobs(other, part["logprobs"])
    assert len(part["logprobs"]) == chat["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop")
    assert all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    for response in (final, unstreamed):
        assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
        assert response["usage"]["total_tokens"] == chat["usage"]["total_tokens"]
        if choice["finish_reason"] == "length":
            assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
            assert events[-1]["type"] == "response.incomplete" and message["status"] == "incomplete"
        else:
            assert (response["status"], response["incomplete_details"]) == ("completed", None)
        assert (response["instructions"], response["max_output_tokens"], response["store"]) == ("Answer in French.", 6, False)
    _idle(tiny)


def test_message_items_render_as_the_chat_conversation(server, tiny):
    """Every message form (easy, typed, content parts, an earlier output item sent back, developer
    as system) renders the prompt chat completions renders from the same turns."""
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi. "}, {"type": "input_text", "text": "Who?"}]},
        {
            "type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "A model.", "annotations": [], "logprobs": []}],
        },
        {"role": "user", "content": "And?"},
    ]
    answer = _respond(server, {"instructions": "Rules.", "input": items, "max_output_tokens": 5, "temperature": 0})
    assert answer.status_code == 200, answer.text
    chat = _chat(server, {
        "messages": [
            {"role": "system", "content": "Rules."}, {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi. Who?"}, {"role": "assistant", "content": "A model."},
            {"role": "user", "content": "And?"},
        ],
        "max_tokens": 5,
    })
    response = answer.json()
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    _idle(tiny)


def test_the_official_client_parses_and_assembles_responses(server, tiny):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", http_client=httpx.Client(trust_env=False))
    asked = {"model": TINY, "input": "A pet, please.", "text": JSON_FORMAT, "max_output_tokens": 60, "temperature": 0}
    raw = client.responses.with_raw_response.create(**asked)
    assert raw.http_response.json()["text"] == JSON_FORMAT  # the format as asked, `schema` and all
    response = raw.parse()
    assert response.status == "completed" and response.object == "response"
    assert response.output[0].content[0].type == "output_text"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.usage.output_tokens > 0 and response.usage.input_tokens_details.cached_tokens >= 0

    with client.responses.stream(**asked) as stream:  # the client's helper assembles the events
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == response.output_text and final.id != response.id

    # Cut by max_output_tokens: incomplete, streamed (typed events) or not.
    short = {"model": TINY, "input": "Go on.", "max_output_tokens": 2, "temperature": 0}
    cut = client.responses.create(**short)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == ("incomplete", "max_output_tokens", 2)
    events = list(client.responses.create(stream=True, **short))
    assert [type(e).__name__ for e in events[:2]] == ["ResponseCreatedEvent", "ResponseInProgressEvent"]
    assert type(events[-1]).__name__ == "ResponseIncompleteEvent" and events[-1].response.output_text == cut.output_text
    _idle(tiny)


def test_a_client_gone_mid_stream_aborts_its_request(server, tiny):
    aborted = tiny.metrics().finished["abort"]
    with slowed(tiny), _http() as http:
        # A JSON string the grammar keeps open past max_output_tokens (a byte token is a character at most).
        endless = {"format": {"type": "json_schema", "name": "s", "schema": {"type": "string", "minLength": 500}}}
        body = {"model": TINY, "stream": True, "input": "Talk.", "max_output_tokens": 400, "text": endless}
        with http.stream("POST", f"{server.url}/v1/responses", json=body) as answer:
            assert next(line for line in answer.iter_lines() if "output_text.delta" in line)
            assert tiny.num_unfinished() == 1
        wait_until(lambda: tiny.metrics().finished["abort"] == aborted + 1, what="the stream's abort")
    _idle(tiny)


def test_a_failed_step_ends_the_stream_with_response_failed(server, tiny):
    def fail(fb):
        raise RuntimeError("injected failure")

    with before_each_step(tiny, fail):
        events = _events(server, {"input": "x", "max_output_tokens": 2})
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
    assert failed["error"]["code"] == "server_error" and "injected failure" in failed["error"]["message"]
    _idle(tiny)


# ---- bad requests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,status,param,words",
    [
        ({"colour": "red"}, 400, "colour", "unknown field"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0]", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0]", "input_text"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role", "'user'"),
        ({"input": []}, 400, "input", "non-empty"),
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "stores no responses"),
        ({"reasoning": {"effort": "high"}}, 400, "reasoning", "do not reason"),
        ({"truncation": "auto"}, 400, "truncation", "disabled"),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, 400, "text.format.name", "required"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, "text.format.schema", ""),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, 400, "tools[1].name", "unique"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, 400, "tools[0].parameters", ""),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice", "not among tools"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0]", "function"),
        ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
        ({"max_output_tokens": 100_000}, 400, "max_output_tokens", "maximum context length"),
        ({"input": "x" * 600}, 400, "input", "context limit"),
        ({"model": "gpt-4o"}, 404, "model", "does not exist"),
    ],
    ids=lambda value: json.dumps(value)[:60] if isinstance(value, dict) else None,
)
def test_bad_requests_name_the_field(server, fields, status, param, words):
    answer = _respond(server, {"input": "x"} | fields)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_openapi_publishes_the_request_and_its_example_is_served(server, tiny):
    with _http() as http:
        schema = http.get(f"{server.url}/openapi.json").json()
    request = schema["components"]["schemas"]["ResponsesRequest"]
    assert not [name for name in schema["components"]["schemas"] if "__" in name]  # no two models share a name
    assert request["required"] == ["model", "input"] and request["additionalProperties"] is False
    assert request["properties"]["model"]["enum"] == [TINY]
    assert request["properties"]["max_output_tokens"]["anyOf"][0]["maximum"] == tiny.max_request_tokens - 1
    operation = schema["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert {"400", "404", "503"} <= set(operation["responses"])
    (example,) = request["examples"]
    validator = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ResponsesRequest", "components": schema["components"]})
    for body in (example, {"model": TINY, "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]}):
        assert validator.is_valid(body)
    assert not validator.is_valid({"model": TINY, "input": "x", "previous_response_id": "resp_1"})
    assert not validator.is_valid({"model": TINY, "input": []})
    answer = _respond(server, example | {"max_output_tokens": 2})
    assert answer.status_code == 200, answer.text
    _idle(tiny)


# ---- pure parts: conversion and function-call items ----------------------------------------------


def test_function_calls_and_outputs_convert_to_chat_completions_shape():
    body = ResponsesRequest.model_validate({
        "model": TINY,
        "instructions": "Use tools.",
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "message", "role": "assistant", "content": "Checking."},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call", "call_id": "c3", "name": "time", "arguments": "{}"},
        ],
    })
    call = lambda i, name, args: {"id": i, "type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    assert chat_messages(body) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("c1", "weather", '{"city": "Paris"}'), call("c2", "weather", '{"city": "Rome"}'),
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "time", "{}")]},
    ]


def test_parsed_function_calls_become_output_items_and_events(tiny):
    """A streamed reply read for calls: the text around a call streams as output_text deltas, the
    call closes the stream as a function_call item after the message."""
    from graphexec.engine.request_output import RequestDelta

    body = ResponsesRequest.model_validate({"model": TINY, "input": "x"})
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    output = RequestOutput("r", [1, 2], text, [5, 6], "stop")
    events = ResponseEvents(ResponseShell.of(body, SamplingParams(), TINY), LogprobsFormatter(tiny.tokenizer), ToolCallStream(HERMES, {"f"}))
    sent = events.opening()
    for i in range(0, len(text), 7):  # in pieces, as deltas come
        last = i + 7 >= len(text)
        piece = RequestDelta("r", [5], text[i:i + 7], None, "stop" if last else None, output if last else None)
        sent += events.delta(piece)
    kinds = [e["type"].removeprefix("response.") for e in sent]
    assert kinds[:4] == ["created", "in_progress", "output_item.added", "content_part.added"]
    assert kinds[-8:] == ["output_text.done", "content_part.done", "output_item.done", "output_item.added",
                          "function_call_arguments.delta", "function_call_arguments.done", "output_item.done", "completed"]
    content = HERMES.parse(text, {"f"}).content  # what the unstreamed answer's message holds
    assert content.strip() == "Sure."
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == content
    message, call = sent[-1]["response"]["output"]
    assert message["content"][0]["text"] == content
    assert call | {"id": None, "call_id": None} == {
        "type": "function_call", "id": None, "status": "completed", "call_id": None, "name": "f", "arguments": '{"a": 1}',
    }
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "weather", "description": "Weather in a city", "parameters": WEATHER}]
SMOL = "smollm2-135m"


@pytest.fixture(scope="module")
def smol_server(smollm2_engine):
    """SmolLM2 (its own chat template; the tools' system section does not fit the tiny model's context)."""
    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config

    with ServerThread(create_app(smollm2_engine, server_config())) as running:
        yield running


def _smol(server, body: dict) -> httpx.Response:
    with _http() as http:
        return http.post(f"{server.url}/v1/responses", json={"model": SMOL} | body)


def test_a_required_call_is_a_function_call_item_streamed_or_not(smol_server, smollm2_engine):
    """tool_choice required (greedy): the output is a function_call whose arguments hold to the
    schema; streamed, the events close on the same items; the official client parses them."""
    body = {"input": "Weather in Paris?", "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_output_tokens": 64}
    answer = _smol(smol_server, body)
    assert answer.status_code == 200, answer.text
    items = answer.json()["output"]
    calls = [i for i in items if i["type"] == "function_call"]
    assert len(calls) >= 1 and all(c["name"] == "weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    with _http() as http:
        with http.stream("POST", f"{smol_server.url}/v1/responses", json={"model": SMOL, "stream": True} | body) as sent:
            lines = [line for line in sent.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert events[-1]["type"] == "response.completed"
    streamed = events[-1]["response"]["output"]
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in streamed] == [
        (i["type"], i.get("name"), i.get("arguments")) for i in items
    ]
    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", http_client=_http())
    parsed = client.responses.create(model=SMOL, **body)
    assert [c.name for c in parsed.output if c.type == "function_call"] == [c["name"] for c in calls]
    _idle(smollm2_engine)


def test_a_tool_result_goes_back_into_the_prompt(smol_server, smollm2_engine):
    """A function_call and its output in input render into the prompt the model continues."""
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny and warm"},
    ]
    body = {"tools": TOOLS, "max_output_tokens": 4, "temperature": 0}
    with_result = _smol(smol_server, body | {"input": turns})
    assert with_result.status_code == 200, with_result.text
    without = _smol(smol_server, body | {"input": turns[:1]})
    # The call and its result (tags, arguments, "sunny and warm") are in the prompt.
    assert with_result.json()["usage"]["input_tokens"] >= without.json()["usage"]["input_tokens"] + 10
    _idle(smollm2_engine)
