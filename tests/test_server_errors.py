"""The server's answers to bad input: an OpenAI error body naming the field, then it keeps serving."""

import httpx
import pytest

from graphexec import ConfigError
from graphexec.config import compose
from graphexec.server.config import ServerConfig
from tests.helpers import server_defaults, wait_until
from tests.invariants import assert_no_leak

TINY = "tiny-llama"


LONG_PROMPT = [65] * 600  # tiny-llama's context is 512

# (endpoint, body or raw bytes, status, param, message fragment)
BAD_REQUESTS = [
    ("completions", b'{"model": "tiny-llama", "prompt": ', 400, None, "request body is not valid JSON"),
    ("completions", b"", 400, None, "request body is not valid JSON"),
    ("completions", b'["tiny-llama"]', 400, None, "request body must be a JSON object"),
    ("completions", {"model": TINY, "prompt": "x", "max_tokns": 5}, 400, "max_tokns", "unknown field"),
    ("completions", {"prompt": "x"}, 400, "model", "model: field required"),
    ("completions", {"model": TINY}, 400, "prompt", "prompt: field required"),
    ("completions", {"model": TINY, "prompt": 42}, 400, "prompt", "must be a string, a list of token ids"),
    ("completions", {"model": TINY, "prompt": ["a", [1]]}, 400, "prompt", "a list of strings or a list of token-id lists"),
    ("completions", {"model": TINY, "prompt": [[1], [2, "x"]]}, 400, "prompt", "prompt[1] must be a list of token ids"),
    ("completions", {"model": TINY, "prompt": ["a", ""]}, 400, "prompt", "prompt[1] is empty"),
    ("completions", {"model": TINY, "prompt": [[1], LONG_PROMPT]}, 400, "prompt", "prompt[1] has 600 tokens"),
    ("completions", {"model": TINY, "prompt": ["a"] * 257}, 400, "prompt", "at most 256 prompts per request (server.max_prompts_per_request), got 257"),
    ("completions", {"model": TINY, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("completions", {"model": TINY, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "allowed only with echo=true"),
    ("completions", {"model": TINY, "prompt": "x", "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("completions", {"model": TINY, "prompt": "x", "temperature": True}, 400, "temperature", "valid number"),
    ("completions", {"model": TINY, "prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("completions", {"model": TINY, "prompt": "x", "top_k": 0}, 400, "top_k", "-1 (disabled) or >= 1"),
    ("completions", {"model": TINY, "prompt": "x", "min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
    ("completions", {"model": TINY, "prompt": "x", "seed": -1}, 400, "seed", "greater than or equal to 0"),
    ("completions", {"model": TINY, "prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {"model": TINY, "prompt": "x", "n": 17}, 400, "n", "at most 16 choices per prompt (server.max_n), got 17"),
    ("completions", {"model": TINY, "prompt": ["x"] * 200, "n": 2}, 400, "n", "needs 400 engine requests (prompts x n)"),
    ("completions", {"model": TINY, "prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", "only best_of equal to n"),
    ("completions", {"model": TINY, "prompt": "x", "logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    ("completions", {"model": TINY, "prompt": "x", "stop": ["a"] * 9}, 400, "stop", "at most 8 stop strings"),
    ("completions", {"model": TINY, "prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ("completions", {"model": TINY, "prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("completions", {"model": TINY, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "less than or equal to 2"),
    ("completions", {"model": TINY, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "greater than or equal to -2"),
    ("completions", {"model": TINY, "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty", "valid number"),
    ("completions", {"model": TINY, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ("completions", {"model": TINY, "prompt": "x", "min_tokens": -1}, 400, "min_tokens", "greater than or equal to 0"),
    ("completions", {"model": TINY, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", "min_tokens must be <= max_new_tokens (max_tokens over HTTP), got 5 > 4"),
    ("completions", {"model": TINY, "prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "must be an object mapping token ids to biases"),
    ("completions", {"model": TINY, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "keys must be token ids"),
    ("completions", {"model": TINY, "prompt": "x", "logit_bias": {"-5": 1}}, 400, "logit_bias", "keys must be token ids"),
    ("completions", {"model": TINY, "prompt": "x", "logit_bias": {"5": True}}, 400, "logit_bias", "bias of token 5 must be a number"),
    ("completions", {"model": TINY, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "logit_bias[5] must be a number in [-100, 100]"),
    ("completions", {"model": TINY, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "logit_bias has token id 99999 outside the vocabulary"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": -2.1}, 400, "presence_penalty", "greater than or equal to -2"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias", "keys must be token ids"),
    ("completions", {"model": TINY, "prompt": ""}, 400, "prompt", "prompt is empty"),
    ("completions", {"model": TINY, "prompt": [1, 99999]}, 400, "prompt", "token id 99999 outside the vocabulary"),
    ("completions", {"model": TINY, "prompt": LONG_PROMPT}, 400, "prompt", "prompt has 600 tokens; the context limit is 512"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model 'gpt-4' does not exist"),
    ("chat/completions", {"model": TINY, "messages": []}, 400, "messages", "at least 1 item"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user"}]}, 400, "messages[0].content", "field required"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "'system', 'user', 'assistant' or 'tool'"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "must be a string or a list"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs", "requires logprobs=true"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "less than or equal to 20"),
    ("chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "has no chat template"),
]


@pytest.mark.parametrize("endpoint,body,status,param,message", BAD_REQUESTS)
def test_bad_request_gets_openai_error_then_server_serves(tiny_server, tiny, endpoint, body, status, param, message):
    url = f"{tiny_server.url}/v1/{endpoint}"
    with httpx.Client(trust_env=False) as http:
        sent = http.post(url, content=body) if isinstance(body, bytes) else http.post(url, json=body)
        assert sent.status_code == status, sent.text
        error = sent.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert message in error["message"]
        good = http.post(f"{tiny_server.url}/v1/completions", json={"model": TINY, "prompt": "ok", "max_tokens": 3})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    wait_until(lambda: tiny.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(tiny)

def test_serve_config_composes_with_overrides():
    cfg = compose(["server.port=8123", "capture=eager"], config_name="serve")
    server = ServerConfig.from_mapping(cfg.server)
    assert (server.host, server.port, server.max_queued_requests) == ("127.0.0.1", 8123, 256)
    assert cfg.model.name == "smollm2-135m"  # the served model name is the config's


@pytest.mark.parametrize(
    "change,message",
    [
        ({"port": 70000}, "server.port must be an integer in [0, 65535], got 70000"),
        ({"port": "80"}, "server.port must be an integer in [0, 65535], got '80'"),
        ({"host": ""}, "server.host must be a non-empty string"),
        ({"max_queued_requests": -1}, "server.max_queued_requests must be an integer >= 0"),
        ({"log_level": "loud"}, "server.log_level must be one of"),
        ({"workers": 4}, "server.workers is not an option"),
    ],
)
def test_bad_server_option_is_named(change, message):
    values = server_defaults() | change
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        ServerConfig.from_mapping(values)
