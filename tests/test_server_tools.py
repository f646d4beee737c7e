"""Tool calling on /v1/chat/completions, on the real default model (SmolLM2, whose template knows
no tools: the Hermes prompt is injected): constrained calls that always parse and validate,
streamed calls the official client reassembles into the plain answer, multi-turn histories, the
Llama 3 format, the grammars themselves, and bad tool definitions answered 400 naming the field."""

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest

from graphexec.server.app import create_app
from graphexec.server.tool_parsers import HERMES, LLAMA3
from graphexec.server.tool_prompt import ToolPrompt
from graphexec.server.tools import ToolChoice, ToolPlan, ToolSpec, tool_constraint
from tests.helpers import ServerThread, server_config, wait_until
from tests.invariants import assert_no_leak

SMOL = "smollm2-135m"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with ServerThread(create_app(smollm2_engine, server_config(max_n=32))) as running:
        yield running


def _post(server, body: dict) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=300) as http:
        return http.post(f"{server.url}/v1/chat/completions", json={"model": SMOL, "messages": ASK} | body)


def _idle(engine) -> None:
    wait_until(lambda: engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(engine)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=300))


def _checked_calls(choice: dict) -> list[tuple[str, dict]]:
    """The choice's calls, each validated against its function's schema."""
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None, choice
    calls = []
    for call in choice["message"]["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
        calls.append((call["function"]["name"], arguments))
    return calls


# ---- the real model ----


def test_constrained_calls_parse_and_validate_in_every_sampled_run(server, smollm2_engine):
    """24 runs at temperature 1, each choice seeded apart (seed + i), sent together so the engine
    batches them (after one run that puts the prompt in the prefix cache): a named function, and
    "required" with one call.  Every one is a call of an offered function whose arguments validate."""
    named = {"tool_choice": {"type": "function", "function": {"name": "add"}}}
    common = {"tools": TOOLS, "temperature": 1.0, "max_tokens": 96}
    runs = 12  # per body: every run is checked; the 24 seeded runs give 23 distinct calls here
    bodies = [{"n": runs, "seed": 100} | named, {"n": runs, "seed": 200, "tool_choice": "required", "parallel_tool_calls": False}]
    assert _post(server, common | {"max_tokens": 1}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: _post(server, common | body), bodies))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    named_runs, single_runs = ([_checked_calls(c) for c in a.json()["choices"]] for a in answers)
    assert len(named_runs) == len(single_runs) == runs
    assert all([name for name, _ in calls] == ["add"] for calls in named_runs)
    assert all(len(calls) == 1 for calls in single_runs)
    assert len({json.dumps(calls) for calls in named_runs + single_runs}) > 10  # sampled, not one answer
    _idle(smollm2_engine)


def test_streamed_calls_reassemble_into_the_plain_answer(server, smollm2_engine):
    """The official client's stream accumulation gives the non-streamed answer: the same calls
    (ids aside), content and finish reasons, for constrained calls (two choices) and for an auto
    reply under a strict function's lazy grammar (SmolLM2 answers "Say hi." in text)."""
    strict = [TOOLS[0], {"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}]
    bodies = [
        {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2},
        {"messages": [{"role": "user", "content": "Say hi."}], "tools": strict, "logprobs": True},
    ]
    with _client(server) as client:
        for body in bodies:
            body |= {"temperature": 0, "max_tokens": 96}  # the stream helper refuses a reply cut by "length"
            plain = client.chat.completions.create(model=SMOL, **body)
            with client.chat.completions.stream(model=SMOL, **body) as stream:
                streamed = stream.get_final_completion()
            for a, b in zip(plain.choices, sorted(streamed.choices, key=lambda c: c.index), strict=True):
                assert (a.finish_reason, a.message.content or None) == (b.finish_reason, b.message.content or None)
                calls = [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []]
                assert calls == [(c.function.name, c.function.arguments) for c in b.message.tool_calls or []]
                assert all(c.id.startswith("call_") for c in b.message.tool_calls or [])
                if body.get("logprobs"):
                    assert "".join(t.token for t in b.logprobs.content) == a.message.content
            if body.get("tool_choice") == "required":
                assert all(c.finish_reason == "tool_calls" and c.message.tool_calls for c in plain.choices)
            else:
                (choice,) = plain.choices
                assert choice.finish_reason == "stop" and choice.message.content and not choice.message.tool_calls
    _idle(smollm2_engine)


def test_a_tool_calling_history_is_templated(server, smollm2_engine):
    """An assistant turn that made calls (content null) and the tool's answers are accepted and
    reach the prompt as the injected format writes them; the prompt is what the server tokenized."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    answer = _post(server, {"messages": history, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    from graphexec.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": SMOL, "messages": history, "tools": TOOLS})
    prompt = ToolPrompt(smollm2_engine.tokenizer, HERMES)
    messages, tools = prompt.render(body.chat_messages(), ToolPlan.of(body, HERMES))
    assert tools is None and not prompt.template_renders_tools  # SmolLM2's template ignores tools
    ids = smollm2_engine.encode_chat(messages)
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)
    text = smollm2_engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.count("<|im_start|>system") == 1 and '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>\n<tool_response>\n5\n</tool_response><|im_end|>' in text
    # Without tools offered the history is still written out, and no tools are listed; /tokenize
    # renders it the same way.
    plain = _post(server, {"messages": history, "max_tokens": 4, "temperature": 0})
    assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] < len(ids)
    with httpx.Client(trust_env=False, timeout=60) as http:
        tokens = http.post(f"{server.url}/tokenize", json={"messages": history}).json()["tokens"]
    assert len(tokens) == plain.json()["usage"]["prompt_tokens"]
    assert "<tool_response>\n5\n</tool_response>" in smollm2_engine.tokenizer.decode(tokens) and "<tools>" not in smollm2_engine.tokenizer.decode(tokens)
    _idle(smollm2_engine)


def test_llama3_format_end_to_end(smollm2_engine):
    """server.tool_parser=llama3: the injected prompt asks for {"name", "parameters"} and the
    constrained call is that object, read back as a call."""
    with ServerThread(create_app(smollm2_engine, server_config(tool_parser="llama3"))) as server:
        answer = _post(server, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                                "max_tokens": 64, "temperature": 0, "logprobs": True})
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    ((name, arguments),) = _checked_calls(choice)
    assert name == "get_weather" and arguments["city"]
    tokens = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert tokens.startswith('{"name": "get_weather", "parameters": {')
    _idle(smollm2_engine)


# ---- the grammars and templates, without a model ----


def _grammar_matches(spec, text: str) -> bool:
    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.text.tokenizer import ByteTokenizer

    grammar = GrammarBackend(ByteTokenizer(300), 320, [257]).matcher(spec)
    return all(grammar.accept(b) for b in text.encode()) and grammar.is_completed


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_grammars_hold_calls_to_their_schemas():
    specs = [ToolSpec("get_weather", None, WEATHER), ToolSpec("add", None, ADD, strict=True), ToolSpec("ping")]
    paris, two = '{"city": "Paris", "unit": "celsius"}', '{"a": 1, "b": 2}'
    required = tool_constraint(specs, ToolChoice("required"), True, HERMES)
    assert _grammar_matches(required, _call("get_weather", paris) + "\n" + _call("add", two) + "\n" + _call("ping", "{}"))
    assert not _grammar_matches(required, "Sure! " + _call("add", two))  # calls only
    assert not _grammar_matches(required, _call("add", '{"a": 1}'))  # b is required
    assert not _grammar_matches(required, _call("add", '{"a": 1, "b": 2, "c": 3}'))  # closed
    assert not _grammar_matches(required, _call("ping", '{"x": 1}'))
    single = tool_constraint(specs, ToolChoice("required"), False, HERMES)
    assert _grammar_matches(single, _call("add", two)) and not _grammar_matches(single, _call("add", two) + "\n" + _call("add", two))
    named = tool_constraint(specs, ToolChoice("function", "get_weather"), True, HERMES)
    assert _grammar_matches(named, _call("get_weather", paris)) and not _grammar_matches(named, _call("add", two))
    assert _grammar_matches(tool_constraint(specs, ToolChoice("function", "add"), True, LLAMA3), '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    # auto: free text; only the strict function's arguments are held (get_weather takes any object)
    assert tool_constraint(specs[:1], ToolChoice("auto"), True, HERMES) is None
    assert tool_constraint(specs, ToolChoice("none"), True, HERMES) is None
    auto = tool_constraint(specs, ToolChoice("auto"), True, HERMES)
    assert _grammar_matches(auto, "It is sunny.") and _grammar_matches(auto, "")
    assert _grammar_matches(auto, "Let me add. <tool_call>" + '{"name": "add", "arguments": {"a": 5, "b": 6}}' + "</tool_call> Done.")
    assert _grammar_matches(auto, _call("get_weather", '{"anything": [1]}'))
    assert not _grammar_matches(auto, "Let me add. " + _call("add", '{"a": "five", "b": 6}'))
    assert not _grammar_matches(auto, _call("launch", "{}"))
    auto_single = tool_constraint(specs, ToolChoice("auto"), False, HERMES)  # the first call only is held
    assert not _grammar_matches(auto_single, _call("add", '{"a": "five", "b": 6}'))
    assert _grammar_matches(auto_single, _call("add", two) + " then " + _call("add", '{"a": "five"}'))
    llama_auto = tool_constraint(specs, ToolChoice("auto"), True, LLAMA3)
    assert _grammar_matches(llama_auto, "No call here, {not json} is fine mid-text.")
    assert _grammar_matches(llama_auto, ' {"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert not _grammar_matches(llama_auto, '{"name": "add", "parameters": {"a": 1}}')


# A tool-aware template in the style of Qwen's (written for this test): tools in the system turn,
# calls and results in their own tags, arguments printed with tojson.
_AWARE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else 'Tools:' }}"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' and tools %}{%- elif m.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}{%- for c in m.tool_calls or [] %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_renders_tools_gets_them_as_they_are(smollm2_engine):
    from graphexec.text.tokenizer import Tokenizer

    smol = smollm2_engine.tokenizer
    tokenizer = Tokenizer(smol._backend, bos_token_id=smol.bos_token_id, eos_token_ids=smol.eos_token_ids,
                          chat_template=_AWARE_TEMPLATE)
    from graphexec.server.protocol import ChatCompletionRequest

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    body = ChatCompletionRequest.model_validate({"model": SMOL, "messages": history, "tools": TOOLS})
    prompt = ToolPrompt(tokenizer, HERMES)
    messages, tools = prompt.render(body.chat_messages(), ToolPlan.of(body, HERMES))
    assert prompt.template_renders_tools and tools == TOOLS
    text = tokenizer.apply_chat_template(messages, tools=tools)
    assert '{"type": "function", "function": {"name": "add", "description": "Add two integers"' in text
    assert '<|im_start|>assistant\nWhat' not in text and '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>5</tool_response>" in text
    assert "You can call functions" not in text  # nothing injected: the template shows the tools
    none = ChatCompletionRequest.model_validate({"model": SMOL, "messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert prompt.render(none.chat_messages(), ToolPlan.of(none, HERMES)) == (none.chat_messages(), None)


# ---- bad requests ----

_GOOD = {"tools": TOOLS, "max_tokens": 1}
_FN = TOOLS[1]["function"]
# (fields, param, words, whether the published schema can say it is refused)
BAD_TOOL_REQUESTS = [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "'function'", True),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name", "should match pattern", True),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters", "JSON Schema of an object", False),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]},
     "tools[0].function.parameters", "nope", False),
    ({"tools": [TOOLS[1], {"type": "function", "function": {**_FN, "description": "again"}}]}, "tools[1].function.name", "already defined by tools[0]", False),
    ({"tools": []}, "tools", "at least 1", True),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict", "valid boolean", True),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "requires tools", True),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}, "tools": None}, "tool_choice", "requires tools", True),
    ({"tool_choice": {"type": "function", "function": {"name": "subtract"}}}, "tool_choice", "'subtract', which tools does not define", False),
    ({"tool_choice": "sometimes"}, "tool_choice", "'none', 'auto' or 'required'", True),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean", True),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "cannot be combined", True),
    ({"tools": [{"type": "function", "function": {**_FN, "strict": True}}], "guided_regex": "a+"}, "guided_regex", "cannot be combined", True),
    ({"tool_choice": "required", "ignore_eos": True}, "tool_choice", "ignore_eos", False),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "field required", True),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "field required", True),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id", "field required", True),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id", 'only a "tool" message', True),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only an assistant message", True),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "valid string", True),
]
GOOD_TOOL_REQUESTS = [
    {},
    {"tool_choice": "none", "tools": None},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"},
    {"tool_choice": "none", "response_format": {"type": "json_object"}},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "0"}]}]},
]


def _schema_admits(server):
    with httpx.Client(trust_env=False, timeout=60) as http:
        schema = http.get(f"{server.url}/openapi.json").json()
    request = {"$ref": "#/components/schemas/ChatCompletionRequest", "components": schema["components"]}
    return jsonschema.Draft202012Validator(request).is_valid


@pytest.mark.parametrize("fields, param, words, expressible", BAD_TOOL_REQUESTS, ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_bad_tool_requests_are_400s_naming_the_field(server, fields, param, words, expressible):
    answer = _post(server, _GOOD | fields)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if expressible:
        assert not _schema_admits(server)({"model": SMOL, "messages": ASK} | _GOOD | fields)


def test_the_published_schema_admits_good_tool_requests(server, smollm2_engine):
    admits = _schema_admits(server)
    for fields in GOOD_TOOL_REQUESTS:
        body = {"model": SMOL, "messages": ASK} | _GOOD | fields
        answer = _post(server, body)
        assert answer.status_code == 200 and admits(body), (fields, answer.text)
    with httpx.Client(trust_env=False, timeout=60) as http:
        schemas = http.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"tool_calls", "tool_call_id"} <= set(schemas["ChatMessage"]["properties"])
    _idle(smollm2_engine)
