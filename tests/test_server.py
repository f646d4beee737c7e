"""The OpenAI-compatible server, on 127.0.0.1 only: the official client, load, disconnects, bad input."""

import asyncio
import statistics
import time

import httpx
import openai
import pytest

from graphexec import Engine, SamplingParams
from graphexec.server.app import create_app
from tests.conftest import TINY_OVERRIDES
from tests.helpers import ServerThread, paused, server_config, slowed, wait_until
from tests.invariants import assert_no_leak

SMOL = "smollm2-135m"
TINY = "tiny-llama"


@pytest.fixture(scope="module")
def smol_server(smollm2_engine):
    with ServerThread(create_app(smollm2_engine, server_config())) as server:
        yield server


def _client(server, cls=openai.OpenAI):
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    http = (httpx.AsyncClient if cls is openai.AsyncOpenAI else httpx.Client)(trust_env=False, timeout=60)
    return cls(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http)


def _idle(engine) -> None:
    wait_until(lambda: engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(engine)


def test_openai_client_completions_equal_generate(smol_server, smollm2_engine):
    with _client(smol_server) as client:
        prompt = "The capital of France is"
        (expected,) = smollm2_engine.generate([prompt], SamplingParams(max_new_tokens=12))
        out = client.completions.create(model=SMOL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == expected.text and out.choices[0].finish_reason == expected.finish_reason
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (expected.prompt_tokens, expected.completion_tokens)
        chunks = list(client.completions.create(model=SMOL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason
        # A stop string cuts the text where it starts; "stop" is the reason.
        stop = expected.text.strip().split()[1]
        cut = client.completions.create(model=SMOL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].text == expected.text[: expected.text.index(stop)] and cut.choices[0].finish_reason == "stop"
        assert [m.id for m in client.models.list()] == [SMOL]
        _idle(smollm2_engine)


def test_openai_client_chat_equal_generate(smol_server, smollm2_engine):
    with _client(smol_server) as client:
        question = "What is the capital of France?"
        # Both runs compute the whole prompt, so their logprobs compare exactly: a prefix-cache
        # hit computes only the last token, a different kernel shape (last-bit differences).
        smollm2_engine.flush_cache()
        (expected,) = smollm2_engine.generate([question], SamplingParams(max_new_tokens=16, logprobs=2), chat=True)
        smollm2_engine.flush_cache()
        messages = [{"role": "user", "content": question}]
        out = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
        assert out.choices[0].message.content == expected.text and "Paris" in expected.text
        assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == expected.finish_reason
        logprobs = out.choices[0].logprobs.content
        assert [lp.logprob for lp in logprobs] == pytest.approx([e["logprob"] for e in expected.logprobs])
        assert "".join(lp.token for lp in logprobs) == expected.text and all(len(lp.top_logprobs) == 2 for lp in logprobs)
        stream = client.chat.completions.create(
            model=SMOL, messages=messages, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.completion_tokens
        # Sampling parameters reach the engine: a seeded sample equals the engine's own.
        sampling = SamplingParams(max_new_tokens=12, temperature=1.5, top_p=0.95, top_k=50, min_p=0.01, seed=7)
        (sampled,) = smollm2_engine.generate([question], sampling, chat=True)
        assert sampled.text != expected.text[: len(sampled.text)]  # really sampled, not greedy
        extra = {"top_k": 50, "min_p": 0.01}
        over_http = client.chat.completions.create(
            model=SMOL, messages=messages, max_tokens=12, temperature=1.5, top_p=0.95, seed=7, extra_body=extra
        )
        assert over_http.choices[0].message.content == sampled.text
        _idle(smollm2_engine)


def test_penalties_logit_bias_and_min_tokens_reach_the_engine(smol_server, smollm2_engine):
    """OpenAI's string-keyed logit_bias and vLLM's extras, on both endpoints, equal generate's output."""
    question = "Count from 1 to 10, separated by commas."
    penalties = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3}
    with _client(smol_server) as client:
        (expected,) = smollm2_engine.generate(
            [question], SamplingParams(max_new_tokens=16, logit_bias={33: -100}, **penalties), chat=True
        )
        (plain,) = smollm2_engine.generate([question], SamplingParams(max_new_tokens=16), chat=True)
        assert expected.text != plain.text and 33 not in expected.token_ids  # the options do something
        messages = [{"role": "user", "content": question}]
        extra = {"repetition_penalty": 1.3}
        out = client.chat.completions.create(
            model=SMOL, messages=messages, max_tokens=16, temperature=0, logit_bias={"33": -100},
            presence_penalty=0.6, frequency_penalty=0.4, extra_body=extra,
        )
        assert out.choices[0].message.content == expected.text
        prompt = "The capital of France is"
        (expected,) = smollm2_engine.generate([prompt], SamplingParams(max_new_tokens=8, min_tokens=8, stop=("\n",)))
        sent = {"model": SMOL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": "\n", "min_tokens": 8}
        with httpx.Client(trust_env=False, timeout=60) as http:
            body = http.post(f"{smol_server.url}/v1/completions", json=sent).json()
        assert body["choices"][0]["text"] == expected.text and body["usage"]["completion_tokens"] == 8
        _idle(smollm2_engine)


def test_concurrent_streams_complete_then_pool_is_free(tiny_server, tiny):
    """40 streaming requests at once: 32 run, 8 queue; all complete with the right outputs."""
    n, new_tokens = 40, 32
    prompts = [f"request {i}: " + "abcdefgh"[: i % 8] for i in range(n)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    expected = [o.text for o in tiny.generate(prompts, params)]

    async def one(client, prompt):
        start = time.perf_counter()
        first, text, usage = None, "", None
        stream = await client.completions.create(
            model=TINY, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                first = first or time.perf_counter() - start
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return first, text, usage.completion_tokens

    async def run_all():
        client = _client(tiny_server, openai.AsyncOpenAI)
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=120)

    start = time.perf_counter()
    results = asyncio.run(run_all())
    wall = time.perf_counter() - start
    assert [text for _, text, _ in results] == expected
    assert all(count == new_tokens for _, _, count in results)
    ttfts = sorted(first for first, _, _ in results)
    p99 = ttfts[min(n - 1, round(0.99 * (n - 1)))]
    print(
        f"\n[concurrency] {n} streaming requests x {new_tokens} tokens on {TINY} (capture=eager): "
        f"{n * new_tokens / wall:.0f} tokens/s, wall {wall:.2f}s, "
        f"TTFT p50 {statistics.median(ttfts) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
    )
    _idle(tiny)


def test_client_disconnect_aborts_and_frees_slots(tiny_server, tiny):
    body = {"model": TINY, "prompt": "disconnect me", "max_tokens": 400, "ignore_eos": True}
    aborted = tiny.metrics().finished["abort"]
    with slowed(tiny), httpx.Client(trust_env=False, timeout=30) as http:
        with http.stream("POST", f"{tiny_server.url}/v1/completions", json=body | {"stream": True}) as response:
            assert response.status_code == 200
            events = response.iter_lines()
            assert next(e for e in events if e.startswith("data:"))
            assert tiny.num_unfinished() == 1
        # Leaving the block closed the connection mid-stream.
        wait_until(lambda: tiny.metrics().finished["abort"] == aborted + 1, what="the stream's abort")
        # A plain (non-streaming) request whose client gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{tiny_server.url}/v1/completions", json=body, timeout=0.5)
        wait_until(lambda: tiny.metrics().finished["abort"] == aborted + 2, what="the plain request's abort")
    _idle(tiny)


def test_queue_limit_answers_503_then_serves():
    engine = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_running_requests=1"])
    with ServerThread(create_app(engine, server_config(max_queued_requests=1))) as server, httpx.Client(trust_env=False) as http:
        body = {"model": TINY, "prompt": "hi", "max_tokens": 2}
        with paused(engine):
            streams = [engine.stream([1, 2, 3], SamplingParams(max_new_tokens=5)) for _ in range(2)]  # 1 runs, 1 queues
            response = http.post(f"{server.url}/v1/completions", json=body)
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "queue_full" and "server.max_queued_requests=1" in error["message"]
        assert all(s.result().finish_reason == "length" for s in streams)
        assert http.post(f"{server.url}/v1/completions", json=body).status_code == 200
    _idle(engine)
    engine.shutdown()


def test_health_and_metrics(tiny_server, tiny):
    with httpx.Client(trust_env=False) as http:
        assert http.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
        post = http.post(f"{tiny_server.url}/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 8, "ignore_eos": True})
        assert post.status_code == 200
        # The engine loop forgets a request just after its last delta reaches the client.
        wait_until(lambda: tiny.num_unfinished() == 0, what="the engine to go idle")
        metrics = http.get(f"{tiny_server.url}/metrics/json").json()
    assert metrics["model"] == TINY and metrics["running"] == 0 and metrics["waiting"] == 0
    # Nothing runs: every slot is free or holds cached prefix KV.
    assert metrics["kv_slots_free"] + metrics["kv_slots_cached"] == metrics["kv_slots_total"] == 2048
    assert metrics["kv_slots_used"] == metrics["kv_slots_cached"] > 0
    assert metrics["tokens_per_s"] > 0 and metrics["generated_tokens_total"] >= 8
    decode = metrics["backends"]["decode"]
    assert decode["backend"] == "eager" and decode["executions"] > 0 and decode["fallbacks"] == 0
    assert set(decode["modes"]) == {"extend", "decode", "mixed", "idle", "target_verify"}  # capture=eager: one runner


def test_flush_cache_route_and_cached_tokens_in_usage(tiny_server):
    body = {"model": TINY, "prompt": "a prompt only this test sends", "max_tokens": 2, "ignore_eos": True}
    with httpx.Client(trust_env=False) as http:
        usages = [http.post(f"{tiny_server.url}/v1/completions", json=body).json()["usage"] for _ in range(2)]
        flushed = http.post(f"{tiny_server.url}/flush_cache")
        after = http.post(f"{tiny_server.url}/v1/completions", json=body).json()["usage"]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages + [after]]
    assert cached == [0, usages[0]["prompt_tokens"] - 1, 0]
    assert flushed.status_code == 200 and flushed.json()["flushed_slots"] > 0
