"""`echo` on /v1/completions, as lm-evaluation-harness uses it for loglikelihoods: the prompt in
front of the completion, one logprob entry per prompt token (null for the first), and max_tokens=0
for the prompt alone.  The values are the engine's prompt logprobs (tests/test_prompt_logprobs.py
holds those against transformers)."""

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


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "allowed only with echo=true"),
        ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo", "not supported when streaming"),
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
