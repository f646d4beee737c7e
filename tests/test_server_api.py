"""The HTTP surface third-party clients expect (issue 14): Prometheus /metrics, the published
OpenAPI schema, prompts as lm-eval batches them, and `n` (SmolLM2's tokenizer, the tokenizer
endpoints and usage of a stop token: test_server_smol.py).

Expected outputs come from the engine's own Python API on the same engine (greedy, or with the
seed the server documents for choice i: seed + i).
"""

import json

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from graphexec import SamplingParams
from graphexec.server.app import create_app
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
    assert list(executions) == [(("backend", "eager"), ("modes", "extend,decode,mixed,idle"))]
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
    assert set(snapshot["backends"]) == {"extend", "decode", "mixed", "idle"}


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
    prompt_forms = {json.dumps(form, sort_keys=True) for form in completion["properties"]["prompt"]["anyOf"]}
    assert json.dumps({"items": {"type": "integer"}, "type": "array"}, sort_keys=True) in prompt_forms
    body_ref = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body_ref == {"$ref": "#/components/schemas/CompletionRequest"}
    # Errors are published as what they are: OpenAI's shape under 4XX, no FastAPI 422.
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses and responses["4XX"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    assert set(models["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    assert "TokenizeRequest" in models and "DetokenizeRequest" in models
    # The published examples are requests the models accept, and the server serves them.
    (completion_example,) = completion["examples"]
    (chat_example,) = chat["examples"]
    CompletionRequest.model_validate_json(json.dumps(completion_example))
    ChatCompletionRequest.model_validate_json(json.dumps(chat_example))
    served = _post(tiny_server, completion_example | {"model": TINY})  # the example names the default model
    assert served["choices"][0]["finish_reason"] in {"stop", "length"}
    _idle(tiny)


def test_every_body_route_reads_within_the_body_limit(tiny):
    """The typed bodies are still read by limits.read_body: 413 before parsing, on each route."""
    with ServerThread(create_app(tiny, server_config(max_body_bytes=64))) as server, _http() as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
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
