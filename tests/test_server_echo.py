"""`echo` on /v1/completions, as lm-evaluation-harness uses it for loglikelihoods: the prompt in
front of the completion, one logprob entry per prompt token (null for the first), and max_tokens=0
for the prompt alone.  The values are the engine's prompt logprobs (tests/test_prompt_logprobs.py
holds those against transformers).  Streamed, the prompt (with its logprobs, once the prefill has
made them) comes first, and the chunks join into the unstreamed choices."""

import json

import httpx
import pytest

from graphexec import SamplingParams
from tests.helpers import wait_until
from tests.invariants import assert_no_leak

TINY = "tiny-llama"
PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 7, 120, 64]]


def _post(server, body: dict) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=60) as http:
        return http.post(f"{server.url}/v1/completions", json={"model": TINY} | body)


def _idle(engine) -> None:
    wait_until(lambda: engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(engine)


def test_echo_with_logprobs_gives_every_prompt_token_then_the_completion(tiny_server, tiny):
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs=1, max_tokens=1."""
    body = {"prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    answer = _post(tiny_server, body)
    assert answer.status_code == 200, answer.text
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    expected = tiny.generate(PROMPTS, SamplingParams(max_new_tokens=1, prompt_logprobs=1, logprobs=1, ignore_eos=True))
    for prompt, choice, out in zip(PROMPTS, choices, expected):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:-1] == [e["logprob"] for e in out.prompt_logprobs[1:]]
        assert lp["token_logprobs"][-1] == out.logprobs[0]["logprob"]
        prompt_text = tiny.tokenizer.decode(prompt, skip_special_tokens=False)
        assert choice["text"] == prompt_text + out.text
        assert lp["text_offset"][len(prompt)] == len(prompt_text)  # the completion's offsets follow the prompt
        # What lm-eval's parse_logprobs reads: each top_logprobs holds the chosen token and the best one,
        # and a greedy token's logprob equals the top value exactly.
        for logprob, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert logprob in top.values() and max(top.values()) >= logprob
    assert answer.json()["usage"]["completion_tokens"] == 2
    _idle(tiny)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(tiny_server, tiny):
    answer = _post(tiny_server, {"prompt": PROMPTS[0], "echo": True, "logprobs": 0, "max_tokens": 0})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"] == tiny.tokenizer.decode(PROMPTS[0], skip_special_tokens=False)
    assert len(choice["logprobs"]["token_logprobs"]) == len(PROMPTS[0])
    assert choice["finish_reason"] == "length" and answer.json()["usage"]["completion_tokens"] == 0
    # Without logprobs there is nothing to compute: the prompt comes straight back.
    plain = _post(tiny_server, {"prompt": "abc", "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert plain["text"] == "abc" and plain["logprobs"] is None
    _idle(tiny)


def test_echo_streams_the_prompt_first(tiny_server, tiny):
    body = {"prompt": PROMPTS[1], "echo": True, "max_tokens": 3, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", f"{tiny_server.url}/v1/completions", json={"model": TINY} | body) as answer:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks]
    prompt_text = tiny.tokenizer.decode(PROMPTS[1], skip_special_tokens=False)
    assert texts[0] == prompt_text
    expected = tiny.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].text
    assert "".join(texts) == prompt_text + expected
    _idle(tiny)


def test_the_first_delta_carries_the_prompt_logprobs(tiny):
    """What streamed echo builds on: the engine hands a request's prompt logprobs out with its first
    delta (after the prefill), all of them, and never again."""
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    deltas = list(tiny.stream(PROMPTS[0], params))
    first = deltas[0].prompt_logprobs
    assert len(first) == len(PROMPTS[0]) and first[0] is None and None not in first[1:]
    assert first == deltas[-1].output.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    _idle(tiny)


_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _streamed_choices(server, body: dict) -> tuple[list[dict], dict[int, dict]]:
    """The chunks of a streamed completion, and per choice index their text, finish reason and
    legacy logprobs lists joined."""
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={"model": TINY, "stream": True} | body) as answer:
            assert answer.status_code == 200, answer.read()
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    joined: dict[int, dict] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        into = joined.setdefault(
            choice["index"], {"text": "", "finish_reason": None, "logprobs": {key: [] for key in _LOGPROB_LISTS}}
        )
        into["text"] += choice["text"]
        into["finish_reason"] = choice["finish_reason"] or into["finish_reason"]
        for key in _LOGPROB_LISTS:
            into["logprobs"][key] += choice["logprobs"][key]
    return chunks, joined


@pytest.mark.parametrize(
    "body",
    [
        # lm-eval's loglikelihood batch, with n=2 choices per prompt and alternatives
        {"prompt": PROMPTS, "n": 2, "max_tokens": 3, "logprobs": 2, "temperature": 0, "ignore_eos": True},
        {"prompt": PROMPTS[0], "max_tokens": 0, "logprobs": 1},  # the prompt's score alone
        {"prompt": "abc", "max_tokens": 2, "logprobs": 0, "temperature": 0, "ignore_eos": True},
    ],
    ids=["batch-n2", "max_tokens0", "text"],
)
def test_streamed_echo_with_logprobs_joins_into_the_unstreamed_choices(tiny_server, tiny, body):
    body = body | {"echo": True}
    unstreamed = _post(tiny_server, body)
    assert unstreamed.status_code == 200, unstreamed.text
    chunks, streamed = _streamed_choices(tiny_server, body)
    choices = unstreamed.json()["choices"]
    assert sorted(streamed) == [c["index"] for c in choices]
    for choice in choices:
        joined = streamed[choice["index"]]
        assert (joined["text"], joined["finish_reason"]) == (choice["text"], choice["finish_reason"])
        expected = choice["logprobs"]
        for key in ("tokens", "text_offset"):
            assert joined["logprobs"][key] == expected[key], key
        assert joined["logprobs"]["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-5)
        for got, want in zip(joined["logprobs"]["top_logprobs"], expected["top_logprobs"], strict=True):
            assert got == want or got == pytest.approx(want, abs=1e-5)
    # Each choice's first chunk is its whole prompt, with one logprob entry per prompt token.
    prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
    n = body.get("n", 1)
    for index in streamed:
        first = next(c["choices"][0] for c in chunks if c["choices"][0]["index"] == index)
        prompt = prompts[index // n]
        ids = prompt if isinstance(prompt, list) else tiny.tokenizer.encode(prompt)
        assert len(first["logprobs"]["tokens"]) == len(ids) and first["logprobs"]["token_logprobs"][0] is None
    _idle(tiny)


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "allowed only with echo=true"),
        ({"prompt": "hi", "max_tokens": 0, "stream": True, "logprobs": 1}, "max_tokens", "allowed only with echo=true"),
        ({"prompt": "hi", "echo": "yes"}, "echo", "valid boolean"),
    ],
)
def test_bad_echo_requests_name_the_field(tiny_server, body, param, message):
    answer = _post(tiny_server, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_chat_keeps_max_tokens_at_least_1(tiny_server):
    with httpx.Client(trust_env=False, timeout=60) as http:
        answer = http.post(
            f"{tiny_server.url}/v1/chat/completions",
            json={"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
