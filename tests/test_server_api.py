"""The HTTP surface third-party clients expect (issue 14): Prometheus /metrics, the published
OpenAPI schema, prompts as lm-eval batches them, and `n` (SmolLM2's tokenizer, the tokenizer
endpoints and usage of a stop token: test_server_smol.py).

Expected outputs come from the engine's own Python API on the same engine (greedy, or with the
seed the server documents for choice i: seed + i).
"""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from graphexec import SamplingParams
from graphexec.server.app import create_app
from graphexec.server.openapi import decimal_below
from graphexec.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers import ServerThread, recorded_batches, server_config, wait_until
from tests.invariants import assert_no_leak

TINY = "tiny-llama"


def _http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=60)


def _idle(engine) -> None:
    wait_until(lambda: engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(engine)


def _post(server, body: dict, endpoint: str = "completions") -> dict:
    with _http() as http:
        answer = http.post(f"{server.url}/v1/{endpoint}", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


# --- /metrics ------------------------------------------------------------------------------


def _scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: {(name, labels): value}."""
    with _http() as http:
        answer = http.get(f"{server.url}/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def test_prometheus_metrics_parse_and_move_with_requests(tiny_server, tiny):
    before = _scrape(tiny_server)
    length = ("graphexec_requests_finished_total", (("finish_reason", "length"),))
    body = {"model": TINY, "prompt": "metrics move, unique prompt", "max_tokens": 4, "ignore_eos": True}
    first = _post(tiny_server, body)["usage"]
    second = _post(tiny_server, body)["usage"]  # the same prompt again: a prefix-cache hit
    # The engine loop counts a request as finished just after its last delta reaches the client.
    wait_until(lambda: _scrape(tiny_server)[length] == before[length] + 2, what="both requests counted")
    after = _scrape(tiny_server)

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved(*length) == 2
    assert moved("graphexec_generation_tokens_total") == 8
    assert moved("graphexec_completion_tokens_total") == 8
    assert moved("graphexec_prompt_tokens_total") == first["prompt_tokens"] + second["prompt_tokens"]
    assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"] - 1
    assert moved("graphexec_prefix_cache_hit_tokens_total") == second["prompt_tokens"] - 1
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"graphexec_{histogram}_count") == 2
        assert moved(f"graphexec_{histogram}_bucket", (("le", "+Inf"),)) == 2
        assert moved(f"graphexec_{histogram}_sum") > 0
    # Idle: nothing runs or waits, and the KV in use is the prefix cache's.
    assert after[("graphexec_requests_running", ())] == after[("graphexec_requests_waiting", ())] == 0
    assert after[("graphexec_kv_slots_total", ())] == 2048
    assert after[("graphexec_kv_slots_used", ())] == after[("graphexec_kv_slots_cached", ())] > 0
    assert after[("graphexec_kv_usage_ratio", ())] == after[("graphexec_kv_slots_used", ())] / 2048
    assert ("graphexec_retractions_total", ()) in after
    # capture=eager: one backend serves all four modes; it is reported once, not four times.
    executions = {labels: v for (name, labels), v in after.items() if name == "graphexec_capture_executions_total"}
    assert list(executions) == [(("backend", "eager"), ("modes", "extend,decode,mixed,idle,target_verify"))]
    assert moved("graphexec_capture_executions_total", next(iter(executions))) >= 2 * 4  # prefill + 3 decodes each
    _idle(tiny)


def test_two_apps_in_one_process_keep_their_own_registries(tiny):
    """No global default registry: a second app registers the same names without a collision,
    and what one app observes stays out of the other's histograms."""
    with ServerThread(create_app(tiny, server_config())) as one, ServerThread(create_app(tiny, server_config())) as two:
        _post(one, {"model": TINY, "prompt": "only one", "max_tokens": 2})
        ttft = "graphexec_time_to_first_token_seconds_count"
        assert _scrape(one)[(ttft, ())] == 1 and _scrape(two)[(ttft, ())] == 0
    _idle(tiny)


def test_metrics_json_keeps_the_snapshot(tiny_server):
    with _http() as http:
        snapshot = http.get(f"{tiny_server.url}/metrics/json").json()
    assert snapshot["model"] == TINY and snapshot["kv_slots_total"] == 2048
    assert set(snapshot["backends"]) == {"extend", "decode", "mixed", "idle", "target_verify"}


# --- OpenAPI -------------------------------------------------------------------------------


def test_openapi_publishes_the_request_models_and_their_examples_are_served(tiny_server, tiny):
    with _http() as http:
        schema = http.get(f"{tiny_server.url}/openapi.json").json()
        docs = http.get(f"{tiny_server.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    models = schema["components"]["schemas"]
    completion, chat = models["CompletionRequest"], models["ChatCompletionRequest"]
    assert completion["required"] == ["model", "prompt"] and chat["required"] == ["model", "messages"]
    assert {"prompt", "n", "best_of", "logprobs", "max_tokens", "seed", "stream", "ignore_eos"} <= set(completion["properties"])
    assert {"messages", "n", "max_completion_tokens", "top_logprobs"} <= set(chat["properties"])
    assert completion["additionalProperties"] is False  # unknown fields are refused, as served
    # One prompt's token ids: in this app's vocabulary (320), shorter than its context (512).
    token_ids = {"items": {"type": "integer", "minimum": 0, "maximum": 319}, "type": "array", "minItems": 1, "maxItems": 511}
    assert token_ids in completion["properties"]["prompt"]["anyOf"]
    assert completion["properties"]["model"]["enum"] == [TINY]  # the served model; another is a 404
    body_ref = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body_ref == {"$ref": "#/components/schemas/CompletionRequest"}
    # Errors are published as what they are: each status the route answers, and any other 4XX, in
    # OpenAI's shape; no FastAPI 422.  Without keys, no security and no 401.
    error_body = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "408", "413", "503", "4XX"}, path
        assert all(responses[s]["content"]["application/json"]["schema"] == error_body for s in set(responses) - {"200"})
    assert "securitySchemes" not in schema["components"]
    assert not any("security" in op for item in schema["paths"].values() for op in item.values())
    assert set(models["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    assert "TokenizeRequest" in models and "DetokenizeRequest" in models
    # The published examples are requests the models accept, and the server serves them.
    (completion_example,) = completion["examples"]
    (chat_example,) = chat["examples"]
    CompletionRequest.model_validate_json(json.dumps(completion_example))
    ChatCompletionRequest.model_validate_json(json.dumps(chat_example))
    assert completion_example["model"] == chat_example["model"] == TINY  # each app's own model
    served = _post(tiny_server, completion_example)
    assert served["choices"][0]["finish_reason"] in {"stop", "length"}
    (detokenize_example,) = models["DetokenizeRequest"]["examples"]
    with _http() as http:
        decoded = http.post(f"{tiny_server.url}/detokenize", json=detokenize_example)
    assert decoded.status_code == 200 and decoded.json()["prompt"] == "Hello, world"
    _idle(tiny)


def _schema_check(schema: dict, model: str):
    """Whether `schema` admits a body as the `model` component (JSON Schema 2020-12, as OpenAPI 3.1)."""
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{model}", "components": schema["components"]})
    return validator.is_valid


def _pydantic_leftovers(node) -> list:
    """Keywords no JSON Schema knows, which pydantic emits for a misplaced constraint."""
    if isinstance(node, list):
        return [k for child in node for k in _pydantic_leftovers(child)]
    if not isinstance(node, dict):
        return []
    own = [k for k in ("ge", "gt", "le", "lt", "x-graphexec-limit") if k in node and not isinstance(node[k], dict)]
    return own + [k for child in node.values() for k in _pydantic_leftovers(child)]


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 99, 100, 101, 320, 1000, 1001, 49152, 128256])
def test_token_id_key_pattern_matches_exactly_the_ids_below_the_vocabulary(limit):
    pattern = re.compile(f"^0*{decimal_below(limit)}\\Z")
    for number in [*range(min(limit * 2 + 11, 2100)), limit - 1, limit, limit * 10 - 1, limit * 10]:
        for text in (str(number), f"00{number}"):
            assert bool(pattern.match(text)) == (number < limit), text
    assert not pattern.match("") and not pattern.match("1a")


def test_published_schema_is_json_schema_throughout(tiny_server):
    with _http() as http:
        schema = http.get(f"{tiny_server.url}/openapi.json").json()
    assert schema["openapi"].startswith("3.1")
    for name, definition in schema["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(definition)
    assert _pydantic_leftovers(schema["components"]) == []


def test_published_bounds_are_each_apps_own(tiny):
    """server.max_n, server.clamp_max_tokens and the KV pool bound what one app publishes."""
    schema = create_app(tiny, server_config(max_n=4, clamp_max_tokens=True, max_prompts_per_request=3)).openapi()
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 4
    assert "maximum" not in completion["max_tokens"]["anyOf"][0]  # clamped: any max_tokens is served
    assert completion["min_tokens"]["anyOf"][0]["maximum"] == tiny.max_request_tokens - 1
    several = [form for form in completion["prompt"]["anyOf"] if form.get("items", {}).get("type") in ("string", "array")]
    assert [form["maxItems"] for form in several] == [3, 3]  # server.max_prompts_per_request


# Bodies at the edges of what the schema says, for the served model (prompt "x", max_tokens 1
# added where absent): the schema admits each exactly when the server serves it.  From an outside
# fuzzer's findings (schemathesis) and the fields checked by functions of their own.
_COMPLETION_BODIES = [
    {"logit_bias": -1284},
    {"logit_bias": {"5": 100, "0319": -100.0}},
    {"logit_bias": {"320": 1}},  # outside the vocabulary
    {"logit_bias": {"5": 100.5}},
    {"logit_bias": {"-5": 1}},
    {"logit_bias": {"a": 1}},
    {"logit_bias": None},
    {"max_tokens": 2.0},  # JSON Schema's integer: 2.0 is 2
    {"max_tokens": 2.5},
    {"max_tokens": "2"},
    {"max_tokens": 511},
    {"max_tokens": 512},  # over the room a one-token prompt leaves
    {"max_tokens": 1e300},
    {"max_tokens": 0},  # only with echo
    {"max_tokens": 0, "echo": True},
    {"prompt": [65.0, 66]},
    {"prompt": [319]},
    {"prompt": [320]},
    {"prompt": []},
    {"prompt": ""},  # encodes to no token here
    {"prompt": ["a", ""]},
    {"prompt": [[65], [66, 67]]},
    {"prompt": [65] * 511},
    {"prompt": [65] * 512},
    {"n": 16},
    {"n": 17},  # server.max_n
    {"n": 2, "best_of": 2},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"stop": ""},
    {"stop": ["a"] * 8},
    {"stop": ["a"] * 9},
    {"stop": [""]},
    {"seed": 2**64 - 1},
    {"seed": 2**64},
    {"min_tokens": 1},
    {"model": "gpt-4"},
    {"guided_choice": ["a", ""]},
    {"guided_choice": ["a", "b"]},
    {"guided_choice": ["a"], "guided_regex": "a"},
    {"guided_choice": ["a"], "response_format": {"type": "text"}},
    {"guided_choice": ["a"], "ignore_eos": True},
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
    {"echo": True, "stream": True, "logprobs": 1},
]


@pytest.mark.parametrize("fields", _COMPLETION_BODIES, ids=lambda fields: json.dumps(fields)[:70])
def test_completions_schema_admits_what_the_server_serves(tiny_server, fields):
    with _http() as http:
        admits = _schema_check(http.get(f"{tiny_server.url}/openapi.json").json(), "CompletionRequest")
        body = {"model": TINY, "prompt": "x", "max_tokens": 1} | fields
        answer = http.post(f"{tiny_server.url}/v1/completions", json=body)
    assert answer.status_code in (200, 400, 404), answer.text
    assert admits(body) == (answer.status_code == 200), answer.text


@pytest.mark.parametrize(
    "path,model,body",
    [
        ("/tokenize", "TokenizeRequest", {}),
        ("/tokenize", "TokenizeRequest", {"prompt": "x"}),
        ("/tokenize", "TokenizeRequest", {"prompt": "x", "messages": None}),
        ("/tokenize", "TokenizeRequest", {"prompt": None, "messages": None}),
        ("/tokenize", "TokenizeRequest", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
        ("/tokenize", "TokenizeRequest", {"prompt": "", "model": TINY}),
        ("/tokenize", "TokenizeRequest", {"prompt": "x", "model": "gpt-4"}),
        ("/detokenize", "DetokenizeRequest", {"tokens": [319, 0, 65.0]}),
        ("/detokenize", "DetokenizeRequest", {"tokens": [320]}),  # outside the vocabulary
        ("/detokenize", "DetokenizeRequest", {"tokens": [-1]}),
        ("/detokenize", "DetokenizeRequest", {"tokens": []}),
    ],
    ids=str,
)
def test_tokenizer_schema_admits_what_the_server_serves(tiny_server, path, model, body):
    with _http() as http:
        admits = _schema_check(http.get(f"{tiny_server.url}/openapi.json").json(), model)
        answer = http.post(f"{tiny_server.url}{path}", json=body)
    assert answer.status_code in (200, 400, 404), answer.text
    assert admits(body) == (answer.status_code == 200), answer.text


@pytest.fixture()
def chat_template(tiny, monkeypatch):
    """A stand-in chat template for the tiny model (it has none), so chat bodies are served."""

    def apply(messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    monkeypatch.setattr(tiny.tokenizer, "apply_chat_template", apply)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_completion_tokens": 2.0},
        {"max_completion_tokens": 1e300},
        {"max_completion_tokens": 512},
        {"max_tokens": 10**6},  # a bound of the request...
        {"max_tokens": 10**6, "max_completion_tokens": 2},  # ...unless max_completion_tokens overrides it
        {"max_tokens": 2, "top_logprobs": 3},
        {"max_tokens": 2, "top_logprobs": 3, "logprobs": True},
        {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]},
        {"max_tokens": 2, "response_format": {"type": "json_object"}, "guided_json": {"type": "integer"}},
    ],
    ids=json.dumps,
)
def test_chat_schema_admits_what_the_server_serves(tiny_server, chat_template, fields):
    with _http() as http:
        admits = _schema_check(http.get(f"{tiny_server.url}/openapi.json").json(), "ChatCompletionRequest")
        body = {"model": TINY, "messages": [{"role": "user", "content": "x"}]} | fields
        answer = http.post(f"{tiny_server.url}/v1/chat/completions", json=body)
    assert answer.status_code in (200, 400), answer.text
    assert admits(body) == (answer.status_code == 200), answer.text


def test_every_body_route_reads_within_the_body_limit(tiny):
    """The typed bodies are still read by limits.read_body: 413 before parsing, on each route."""
    with ServerThread(create_app(tiny, server_config(max_body_bytes=64))) as server, _http() as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"):
            answer = http.post(f"{server.url}{path}", content=b"{" + b" " * 100 + b"}")
            assert answer.status_code == 413, (path, answer.text)
            assert answer.json()["error"]["code"] == "request_too_large"
        assert http.post(f"{server.url}/tokenize", json={"prompt": "fits"}).json()["tokens"] == list(b"fits")


# --- several prompts, n --------------------------------------------------------------------


def test_list_of_prompts_gives_one_choice_each_batched_together(tiny_server, tiny):
    prompts = ["first prompt", "second, longer prompt", "3"]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = tiny.generate(prompts, params)
    with recorded_batches(tiny) as batches:
        out = _post(tiny_server, {"model": TINY, "prompt": prompts, "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == [e.text for e in expected]
    # All three were submitted at once: the first forward prefilled them together.
    assert batches[0].batch_size == 3
    usage = out["usage"]
    assert usage["prompt_tokens"] == sum(e.prompt_tokens for e in expected)
    assert usage["completion_tokens"] == 18 and usage["total_tokens"] == usage["prompt_tokens"] + 18
    # Token-id lists, as lm-eval sends pre-tokenized batches, give the same choices.
    ids = [e.prompt_token_ids for e in expected]
    again = _post(tiny_server, {"model": TINY, "prompt": ids, "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert [c["text"] for c in again["choices"]] == [e.text for e in expected]
    _idle(tiny)


def _stream(server, body: dict, endpoint: str = "completions") -> list[dict]:
    with _http() as http, http.stream("POST", f"{server.url}/v1/{endpoint}", json=body | {"stream": True}) as answer:
        assert answer.status_code == 200
        events = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_prompts_carry_their_choice_index(tiny_server, tiny):
    prompts = ["stream one", "stream two, which is longer"]
    expected = tiny.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    body = {"model": TINY, "prompt": prompts, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks = _stream(tiny_server, body)
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [e.text for e in expected] and reasons == ["length", "length"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 16
    assert usage["prompt_tokens"] == sum(e.prompt_tokens for e in expected)
    _idle(tiny)


def test_n_choices_are_independent_and_reproducible_with_a_seed(tiny_server, tiny):
    """Choice i of each prompt is seeded with seed + i; choices are prompt-major (OpenAI's order)."""
    prompts, n, seed = ["alpha", "beta"], 3, 11
    sampled = {"max_tokens": 10, "ignore_eos": True, "temperature": 1.0, "seed": seed}
    out = _post(tiny_server, {"model": TINY, "prompt": prompts, "n": n, **sampled})
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == list(range(len(prompts) * n))
    for p, prompt in enumerate(prompts):
        for i in range(n):
            (alone,) = tiny.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=seed + i))
            assert texts[p * n + i] == alone.text
    assert len(set(texts[:n])) == n  # independent draws, not one choice repeated
    assert [c["text"] for c in _post(tiny_server, {"model": TINY, "prompt": prompts, "n": n, **sampled})["choices"]] == texts
    usage = out["usage"]
    assert usage["completion_tokens"] == len(prompts) * n * 10
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)  # each prompt billed once, not n times
    # best_of equal to n is accepted (every candidate is returned).
    assert len(_post(tiny_server, {"model": TINY, "prompt": "x", "n": 2, "best_of": 2, "max_tokens": 1})["choices"]) == 2
    _idle(tiny)


def test_greedy_n_through_the_official_client(tiny_server, tiny):
    """Greedy n > 1 is allowed (identical choices, as vLLM); the openai client parses prompt lists × n."""
    http = httpx.Client(trust_env=False, timeout=60)
    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, http_client=http) as client:
        out = client.completions.create(model=TINY, prompt=["greedy", "again"], n=3, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == list(range(6))
    first, second = {c.text for c in out.choices[:3]}, {c.text for c in out.choices[3:]}
    assert len(first) == len(second) == 1
    assert first == {tiny.generate(["greedy"], SamplingParams(max_new_tokens=5))[0].text}
    # tiny-llama has no chat template: chat with n runs on SmolLM2 (test_server_smol.py).
    _idle(tiny)


def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(tiny_server, tiny):
    """vLLM's stream_options.continuous_usage_stats, which load generators (guidellm) send."""
    body = {"model": TINY, "prompt": ["ab", "cde"], "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with _http() as http, http.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        chunks = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    per_choice = [c for c in chunks if c["choices"]]
    assert all("usage" in c for c in per_choice)
    last = {c["choices"][0]["index"]: c["usage"] for c in per_choice}
    assert [u["completion_tokens"] for u in last.values()] == [5, 5]
    assert sum(u["prompt_tokens"] for u in last.values()) == chunks[-1]["usage"]["prompt_tokens"]
    for c in per_choice:
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
    _idle(tiny)
