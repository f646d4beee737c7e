"""The server on SmolLM2's real tokenizer: the vLLM-style tokenizer endpoints lm-eval's remote
tokenizer uses (against Hugging Face's tokenizer for the same GGUF), the EOS counted in usage,
and logprobs offsets that index the text when EOS is ignored.
"""

import json
import threading

import httpx
import pytest

from graphexec import SamplingParams
from graphexec.server.app import create_app
from tests.helpers import ServerThread, server_config, wait_until
from tests.invariants import assert_no_leak

SMOL = "smollm2-135m"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number. 👋"}]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with ServerThread(create_app(smollm2_engine, server_config())) as running:
        yield running


@pytest.fixture(scope="module")
def hf_tokenizer(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer


def _post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=60) as http:
        return http.post(f"{server.url}{path}", json=body)


def _answered_prompt(engine) -> str:
    """A conversation whose assistant turn is complete but for its end: the model's next token is EOS."""
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello! How can I help you today?"}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return text.rstrip("\n").removesuffix("<|im_end|>")


def test_tokenizer_endpoints_match_transformers(server, smollm2_engine, hf_tokenizer):
    with httpx.Client(trust_env=False, timeout=60) as http:
        info = http.get(f"{server.url}/tokenizer_info").json()
    # What lm-eval's RemoteTokenizer reads (lm_eval 0.4.13, lm_eval/utils.py).
    assert (info["eos_token"], info["bos_token"]) == (hf_tokenizer.eos_token, hf_tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert info["chat_template"] == smollm2_engine.tokenizer.chat_template and "<|im_start|>" in info["chat_template"]
    assert "pad_token" in info and info["model_max_length"] == smollm2_engine.max_context
    text = "Graphs, tokens: 1234 ünïcødé 👋\n\tend"
    tokens = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == smollm2_engine.max_context
    # lm-eval takes EOS's id as the encoding of the EOS string: it must be the one special id.
    eos = _post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [hf_tokenizer.eos_token_id] == [smollm2_engine.model_config.eos_token_ids[0]]
    chat = _post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert chat == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chat == smollm2_engine.encode_chat(MESSAGES)
    no_turn = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert chat[: len(no_turn)] == no_turn and len(no_turn) < len(chat)
    back = _post(server, "/detokenize", {"tokens": chat}).json()["prompt"]
    assert back == hf_tokenizer.decode(chat) and back.startswith("<|im_start|>system")


@pytest.mark.parametrize(
    "path,body,param,message",
    [
        ("/tokenize", {}, "prompt", "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one"),
        ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
        ("/tokenize", {"prompt": "a", "add_special_token": False}, "add_special_token", "unknown field"),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens", "tokens[1]: token id 49152 outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "valid array"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, "model", "model 'gpt-4' does not exist"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_bodies_by_field(server, path, body, param, message):
    answer = _post(server, path, body)
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert _post(server, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_tokenize_runs_on_the_worker_thread(server, smollm2_engine):
    tokenizer = smollm2_engine.tokenizer
    real, threads = tokenizer.encode, []

    def recorded(text):
        threads.append(threading.current_thread().name)
        return real(text)

    tokenizer.encode = recorded
    try:
        assert _post(server, "/tokenize", {"prompt": "where am I tokenized?"}).status_code == 200
    finally:
        del tokenizer.encode
    assert threads and all(name.startswith("graphexec-http-prepare") for name in threads), threads


def test_usage_counts_the_eos_that_ended_the_request(server, smollm2_engine):
    """vLLM counts the EOS that ended a request in completion_tokens; text and token_ids leave it out."""
    prompt = _answered_prompt(smollm2_engine)
    out = _post(server, "/v1/completions", {"model": SMOL, "prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    (choice,) = out["choices"]
    assert (choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"]) == ("", "stop", 1)
    (direct,) = smollm2_engine.generate([prompt], SamplingParams(max_new_tokens=5))
    assert direct.token_ids == [] and direct.stop_token_id == 2 and direct.completion_tokens == 1
    wait_until(lambda: smollm2_engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(smollm2_engine)


def test_omitted_chat_max_tokens_is_the_room_left_not_the_completions_16(server, smollm2_engine):
    """Chat completions keep "the room left" (OpenAI's chat default); min_tokens past 16 shows it is
    not the completions default, which would cap the answer and refuse min_tokens > max_tokens."""
    import openai

    http = httpx.Client(trust_env=False, timeout=60)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http) as client:
        out = client.chat.completions.create(model=SMOL, messages=MESSAGES, temperature=0, extra_body={"min_tokens": 24})
    assert out.usage.completion_tokens >= 24 and out.choices[0].finish_reason == "stop"
    wait_until(lambda: smollm2_engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(smollm2_engine)


def test_text_offset_indexes_the_text_when_eos_is_ignored(server, smollm2_engine):
    prompt = _answered_prompt(smollm2_engine)
    (direct,) = smollm2_engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert direct.token_ids[0] == 2  # EOS first, then text: "<|im_end|>" is in no text
    decode = smollm2_engine.tokenizer.decode
    expected = [len(decode(direct.token_ids[:i])) for i in range(len(direct.token_ids))]
    body = {"model": SMOL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "logprobs": 0}
    out = _post(server, "/v1/completions", body).json()
    (choice,) = out["choices"]
    assert choice["text"] == direct.text and choice["logprobs"]["tokens"][0] == "<|im_end|>"
    assert choice["logprobs"]["text_offset"] == expected and expected[:2] == [0, 0]
    # Streamed, the offsets run on across chunks.
    offsets = []
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    logprobs = json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]
                    offsets += logprobs["text_offset"] if logprobs else []
    assert offsets == expected


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", f"{server.url}{path}", json=body | {"stream": True}) as answer:
            assert answer.status_code == 200
            events = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_n_choices_are_seeded_and_streamed_by_index(server, smollm2_engine):
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Say hi."}], "n": 2,
            "max_tokens": 6, "temperature": 1.0, "seed": 3}
    plain = _post(server, "/v1/chat/completions", body).json()
    chunks = _stream(server, "/v1/chat/completions", body)
    expected = [
        smollm2_engine.generate(["Say hi."], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3 + i), chat=True)[0].text
        for i in range(2)
    ]
    assert [c["message"]["content"] for c in plain["choices"]] == expected
    texts, roles = ["", ""], [None, None]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        roles[choice["index"]] = choice["delta"].get("role", roles[choice["index"]])
        texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == expected and roles == ["assistant", "assistant"]
    wait_until(lambda: smollm2_engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(smollm2_engine)


def test_lm_eval_generation_batch_round_trip(server, smollm2_engine):
    """The body lm-eval 0.4.13's local-completions sends for generate_until (openai_completions.py
    `_create_payload`: a list of prompts, temperature 0, its stop list plus the EOS string read from
    /tokenizer_info, seed 1234), read back as its `parse_generations` does (by choice index)."""
    with httpx.Client(trust_env=False, timeout=60) as http:
        eos = http.get(f"{server.url}/tokenizer_info").json()["eos_token"]
    prompts = ["Question: What is 2 + 3?\nAnswer:", "Question: Name a colour.\nAnswer:"]
    payload = {"prompt": prompts, "model": SMOL, "max_tokens": 16, "temperature": 0, "stop": ["\n\n", eos], "seed": 1234}
    out = _post(server, "/v1/completions", payload).json()
    texts = [None] * len(out["choices"])
    for choice in out["choices"]:
        texts[choice["index"]] = choice["text"]
    expected = smollm2_engine.generate(prompts, SamplingParams(max_new_tokens=16, stop=("\n\n", eos)))
    assert texts == [e.text for e in expected]
    wait_until(lambda: smollm2_engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(smollm2_engine)
