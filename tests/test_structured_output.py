"""Structured output (graphexec/structured/): outputs held to JSON schemas, any JSON object, regexes
and choices, on the real default model and the tiny one; checked against jsonschema and re, and
against runs without constraints or without memory pressure."""

import json
import re

import httpx
import jsonschema
import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.errors import InvalidRequestError
from graphexec.structured.spec import StructuredSpec
from tests.conftest import TINY_OVERRIDES
from tests.helpers import ServerThread, server_config, wait_until
from tests.invariants import assert_no_leak

SMOL = "smollm2-135m"

_STR20 = {"type": "string", "maxLength": 20}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": _STR20, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": {"type": "string", "maxLength": 30}},
                "required": ["id", "email"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["price", "quantity"],
    },
    "booleans": {
        "type": "object",
        "properties": {"is_open": {"type": "boolean"}, "has_parking": {"type": "boolean"}},
        "required": ["is_open", "has_parking"],
    },
    "optional": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 30}, "subtitle": {"type": "string", "maxLength": 30}},
        "required": ["title"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["name", "qty"],
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 5},
    "answer": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
    },
    "nullable": {
        "type": "object",
        "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["middle_name"],
    },
    "matrix": {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
}

# Schemas the tiny random model can finish in a few dozen byte tokens: enums, booleans, bounded
# integers, short strings.
TINY_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["kind", "ok", "n", "tag"],
}


def _prompt(name: str) -> str:
    return f"Reply with one JSON value for a '{name.replace('_', ' ')}' record."


def _assert_valid(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ---- the constraint itself: validation, compile errors, the cache ----


@pytest.mark.parametrize(
    "make, param",
    [
        (lambda: StructuredSpec.json_schema("{not json", param="guided_json"), "guided_json"),
        (lambda: StructuredSpec.json_schema([1, 2], param="guided_json"), "guided_json"),
        (lambda: StructuredSpec.json_schema({"x": float("nan")}), "structured"),
        (lambda: StructuredSpec.regex(3, param="guided_regex"), "guided_regex"),
        (lambda: StructuredSpec.regex("", param="guided_regex"), "guided_regex"),
        (lambda: StructuredSpec.choice("yes", param="guided_choice"), "guided_choice"),
        (lambda: StructuredSpec.choice([], param="guided_choice"), "guided_choice"),
        (lambda: StructuredSpec.choice(["a", ""], param="guided_choice"), "guided_choice"),
        (lambda: StructuredSpec("yaml", "x"), "structured"),
        (lambda: SamplingParams(structured={"type": "object"}), "structured"),
        (lambda: SamplingParams(ignore_eos=True, structured=StructuredSpec.json_object(param="response_format")), "response_format"),
    ],
)
def test_malformed_constraints_are_rejected_naming_the_field(make, param):
    with pytest.raises(InvalidRequestError) as error:
        make()
    assert error.value.param == param
    assert str(error.value).startswith(param)


def test_spec_key_keeps_property_order_and_ignores_param():
    a = StructuredSpec.json_schema({"b": 1, "a": 2}, param="guided_json")
    assert a == StructuredSpec.json_schema('{"b": 1, "a": 2}') and a.key == ("json_schema", '{"b":1,"a":2}')
    assert a != StructuredSpec.json_schema({"a": 2, "b": 1})  # llguidance emits properties in this order


def test_grammar_cache_is_a_bounded_lru_and_reports_compile_errors():
    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.text.tokenizer import ByteTokenizer

    backend = GrammarBackend(ByteTokenizer(300), 320, [257], cache_capacity=2)
    cache = backend.cache
    specs = [StructuredSpec.regex(r"[a-c]+"), StructuredSpec.choice(["x", "y"]), StructuredSpec.json_object()]
    first = cache.get(specs[0])
    assert cache.get(StructuredSpec.regex(r"[a-c]+", param="other")) is first and (cache.hits, cache.misses) == (1, 1)
    cache.get(specs[1])
    cache.get(specs[0])  # now the most recent: specs[1] is the one evicted next
    cache.get(specs[2])
    assert len(cache) == 2 and cache.get(specs[0]) is first
    cache.get(specs[1])
    assert cache.misses == 4  # specs[1] had been evicted
    for spec, reason in [
        (StructuredSpec.regex("(ab", param="guided_regex"), "unclosed group$"),
        (StructuredSpec.json_schema({"type": "nope"}, param="guided_json"), "nope"),
        (StructuredSpec.json_schema({"enum": []}, param="guided_json"), "admits no output"),
        (StructuredSpec.json_schema({"type": "string", "pattern": "(?=a)b"}, param="guided_json"), "look-around"),
        # Unimplemented keywords are ignored unless the schema asks for strictness.
        (StructuredSpec.json_schema({"not": {"type": "string"}, "x-guidance": {"lenient": False}}, param="guided_json"), "not"),
    ]:
        with pytest.raises(InvalidRequestError, match=reason) as error:
            cache.get(spec)
        assert error.value.param == spec.param and str(error.value).startswith(spec.param)
        assert "\n" not in str(error.value)
    assert len(cache) == 2
    # By default a schema is not refused for keywords llguidance does not enforce (as xgrammar did).
    lenient = StructuredSpec.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert cache.get(lenient) is not None


def test_matcher_accepts_exactly_the_grammar():
    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.text.tokenizer import ByteTokenizer

    backend = GrammarBackend(ByteTokenizer(300), 320, [257])
    grammar = backend.matcher(StructuredSpec.choice(['a"b', "x\ny"]))
    assert not grammar.accept(ord("b")) and grammar.num_accepted == 0  # refused, nothing changes
    assert all(grammar.accept(b) for b in b"x\ny") and grammar.is_completed
    assert not grammar.accept(ord("y"))
    assert grammar.accept(257) and grammar.is_terminated
    assert not grammar.accept(257) and grammar.num_accepted == 4


def test_a_requests_stop_tokens_are_allowed_only_where_the_grammar_may_end():
    """EOS is llguidance's to place; a request's own stop token (here "!", also plain text, and id
    300, which has no text) gets the same treatment from RequestGrammar: masked out mid-grammar, let
    through once the text is a whole match; one past the logits has no bit and is left out."""
    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.structured.token_bitmask import TokenBitmask
    from graphexec.text.tokenizer import ByteTokenizer

    backend = GrammarBackend(ByteTokenizer(300), 320, [257])
    grammar = backend.matcher(StructuredSpec.regex(r"a!?b+"), stop_token_ids=[ord("!"), 300, 10_000])
    mask = TokenBitmask(320, 1)

    def allowed() -> list[int]:
        return torch.isfinite(mask.apply(torch.zeros(1, 320), [grammar])[0]).nonzero().flatten().tolist()

    assert allowed() == [ord("a")]
    assert grammar.accept(ord("a")) and allowed() == [ord("b")]  # "!" would end the request here
    assert not grammar.accept(ord("!")) and not grammar.accept(300) and grammar.num_accepted == 1
    assert grammar.accept(ord("b")) and allowed() == [ord("!"), ord("b"), 257, 300]
    assert grammar.accept(300) and grammar.is_terminated and not grammar.accept(ord("b"))


def test_both_mask_paths_agree_with_llguidance_and_leave_free_rows_alone():
    """The CPU (numpy) and device (torch unpack) paths give the logits llguidance's own reference
    gives for the same bitmask, on a sparse row, a free row and a dense row; a row without a
    grammar keeps its values bit for bit."""
    import llguidance.numpy

    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.structured.token_bitmask import TokenBitmask
    from graphexec.text.tokenizer import ByteTokenizer

    backend = GrammarBackend(ByteTokenizer(300), 320, [257])
    grammars = [backend.matcher(StructuredSpec.regex(r"[0-9]{2}z")), None, backend.matcher(StructuredSpec.json_schema({"type": "string"}))]
    grammars[0].accept(ord("4"))
    grammars[2].accept(ord('"'))  # inside a string: nearly every byte fits
    logits = torch.randn(3, 320)
    bitmask = TokenBitmask(320, 2)
    chosen = bitmask.apply(logits.clone(), grammars)  # grows past its 2 planned rows
    unpacked = logits.clone()
    TokenBitmask(bitmask.vocab_size, bitmask.max_rows, unpack="torch").apply(unpacked, grammars)
    expected = logits.numpy().copy()
    constrained = expected[[0, 2]]
    llguidance.numpy.apply_token_bitmask_inplace(constrained, bitmask._buffer.numpy()[[0, 2]])
    expected[[0, 2]] = constrained
    assert torch.equal(chosen, torch.from_numpy(expected)) and torch.equal(chosen, unpacked)
    assert torch.equal(chosen[1], logits[1])
    assert torch.isfinite(chosen[0]).nonzero().flatten().tolist() == list(range(ord("0"), ord("9") + 1))
    allowed = set(torch.isfinite(chosen[2]).nonzero().flatten().tolist())
    assert ord("a") in allowed and ord('"') in allowed and 0x17 not in allowed and 257 not in allowed


def test_real_vocabulary_masks_control_and_padding_tokens(smollm2_engine):
    """Inside a JSON string almost any text token fits, but never a control token (<|im_start|>
    spells like text) nor an id past the tokenizer; EOS only once the grammar is complete."""
    from graphexec.structured.token_bitmask import TokenBitmask

    from graphexec.structured.grammar_backend import GrammarBackend

    engine = smollm2_engine
    vocab = engine.model_config.vocab_size
    wider = vocab + 64  # as if the LM head were padded: the mask covers the extra ids too
    backend = GrammarBackend(engine.tokenizer, wider, engine.model_config.eos_token_ids)
    grammar = backend.matcher(StructuredSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}))
    for token in engine.tokenizer.encode('{"s": "ab'):
        assert grammar.accept(token)
    masked = TokenBitmask(wider, 1).apply(torch.zeros(1, wider), [grammar])[0]
    allowed = set(torch.isfinite(masked).nonzero().flatten().tolist())
    assert len(allowed) > 40_000
    assert not allowed & set(engine.tokenizer.special_token_ids)
    assert max(allowed) < engine.tokenizer.vocab_size
    for token in engine.tokenizer.encode('"}'):
        assert grammar.accept(token)
    masked = TokenBitmask(wider, 1).apply(torch.zeros(1, wider), [grammar])[0]
    assert torch.isfinite(masked).nonzero().flatten().tolist() == list(engine.model_config.eos_token_ids)


def test_real_vocabulary_bytes_are_what_the_tokenizer_decodes(smollm2_engine):
    """SmolLM2's byte-level vocabulary as llguidance sees it spells each token as the tokenizer
    decodes it (every 7th id; ids whose bytes are not whole UTF-8 decode to U+FFFD and are skipped)."""
    from graphexec.structured.vocabulary import token_bytes

    tokenizer = smollm2_engine.tokenizer
    assert tokenizer.vocab_encoding.kind == "byte_level"
    tokens, special = token_bytes(tokenizer, tokenizer.vocab_size)
    ids = [i for i in range(0, tokenizer.vocab_size, 7) if i not in special]
    texts = [tokenizer.decode([i]) for i in ids]
    assert [tokens[i] for i, t in zip(ids, texts) if "\ufffd" not in t] == [t.encode() for t in texts if "\ufffd" not in t]
    assert len(ids) > 7000 and special >= set(tokenizer.special_token_ids)


# ---- the tiny model: retraction, prompt chunks ----


def _tiny_workload():
    prompts = [[(7 * i + j) % 250 + 1 for j in range(12 + 3 * i)] for i in range(8)]
    spec = StructuredSpec.json_schema(TINY_SCHEMA)
    params = [
        SamplingParams(max_new_tokens=80, structured=spec, temperature=0.0 if i % 2 else 0.9, seed=None if i % 2 else 50 + i)
        if i % 4 != 3
        else SamplingParams(max_new_tokens=40, ignore_eos=True, seed=70 + i, temperature=0.8)
        for i in range(8)
    ]
    return prompts, params


def test_retracted_requests_resume_with_the_same_valid_json():
    """A pool far smaller than the requests' worst cases retracts running requests; each resumes by
    recompute, its last token fed again without reaching its matcher a second time, so outputs are
    token for token those of a run with a large pool, and valid.  A prompt cut into chunks samples
    nothing until its last chunk, so chunking changes nothing either."""
    prompts, params = _tiny_workload()
    expected = Engine(overrides=TINY_OVERRIDES).generate(prompts, params)
    for o, p in zip(expected, params):
        if p.structured is not None:
            assert o.finish_reason == "stop"
            _assert_valid(o.text, TINY_SCHEMA)
    small = Engine(overrides=TINY_OVERRIDES + ["cache.num_slots=120", "scheduler.max_running_requests=8"])
    assert [o.token_ids for o in small.generate(prompts, params)] == [o.token_ids for o in expected]
    assert small.metrics().retractions_total > 0
    assert_no_leak(small)
    chunked = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_prefill_tokens=8"])
    assert [o.token_ids for o in chunked.generate(prompts, params)] == [o.token_ids for o in expected]


# ---- the real model ----


@pytest.mark.slow
def test_retraction_on_the_real_model_still_yields_valid_json():
    """Six JSON requests (greedy and seeded) in a pool that holds one of them at its worst (no
    prefix cache, so every prompt costs its slots), admitted as if they would stop early (a low
    new-token ratio): running requests are retracted and resume by recompute, and every output
    still parses and validates."""
    names = ["person", "nested", "array_of_objects", "answer", "tags", "matrix"]
    params = [SamplingParams(max_new_tokens=64, structured=StructuredSpec.json_schema(SCHEMAS[n])) for n in names]
    params = [p if i % 2 else p.replace(temperature=0.8, seed=i) for i, p in enumerate(params)]
    with Engine(overrides=["model=smollm2-135m", "capture=eager", "cache.num_slots=120", "cache.prefix_cache=false",
                         "scheduler.init_new_token_ratio=0.05", "scheduler.min_new_token_ratio=0.01"]) as small:
        outputs = small.generate([_prompt(n) for n in names], params, chat=True)
        assert small.metrics().retractions_total > 0
        assert_no_leak(small)
    for name, output in zip(names, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        _assert_valid(output.text, SCHEMAS[name])


def test_json_schemas_greedy_and_seeded(smollm2_engine):
    """Every schema, greedy and seeded, in one batch: each output parses, validates and ends with
    "stop"; a seeded run repeats itself."""
    names = list(SCHEMAS)
    prompts = [_prompt(n) for n in names] * 2
    params = [SamplingParams(max_new_tokens=96, structured=StructuredSpec.json_schema(SCHEMAS[n])) for n in names]
    params += [p.replace(temperature=0.8, top_p=0.95, seed=i) for i, p in enumerate(params)]
    outputs = smollm2_engine.generate(prompts, params, chat=True)
    for name, output in zip(names * 2, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        _assert_valid(output.text, SCHEMAS[name])
    again = smollm2_engine.generate(prompts[len(names) :][:3], params[len(names) :][:3], chat=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs[len(names) :][:3]]
    assert_no_leak(smollm2_engine)


def test_json_object_regex_and_choice(smollm2_engine):
    specs = [
        StructuredSpec.json_object(),
        StructuredSpec.regex(r"[0-9]{3}-[a-z]{2,6}"),
        StructuredSpec.choice(["Paris", "London", "Rome"]),
    ]
    prompts = ["Give a JSON object with the name and age of one person.", "Write a code like 123-abc.", "What is the capital of France?"]
    params = [SamplingParams(max_new_tokens=64, structured=s) for s in specs]
    params += [p.replace(temperature=1.0, seed=7) for p in params]
    out = smollm2_engine.generate(prompts * 2, params, chat=True)
    for i in (0, 3):
        assert isinstance(json.loads(out[i].text), dict) and out[i].finish_reason == "stop", out[i].text
    for i in (1, 4):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", out[i].text) and out[i].finish_reason == "stop"
    for i in (2, 5):
        assert out[i].text in ("Paris", "London", "Rome") and out[i].finish_reason == "stop"


def test_constrained_neighbours_leave_unconstrained_requests_unchanged(smollm2_engine):
    prompts = ["The capital of France is", "Once upon a time", "List three fruits:"]
    free = [
        SamplingParams(max_new_tokens=24),
        SamplingParams(max_new_tokens=24, temperature=0.9, seed=3),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=40, seed=4),
    ]
    alone = smollm2_engine.generate(prompts, free)
    neighbours = [SamplingParams(max_new_tokens=48, structured=StructuredSpec.json_schema(SCHEMAS[n])) for n in ("person", "tags", "answer")]
    mixed = smollm2_engine.generate(
        [prompts[0], _prompt("person"), prompts[1], _prompt("tags"), prompts[2], _prompt("answer")],
        [free[0], neighbours[0], free[1], neighbours[1], free[2], neighbours[2]],
    )
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in alone]
    for output, name in zip(mixed[1::2], ("person", "tags", "answer")):
        if output.finish_reason == "stop":
            _assert_valid(output.text, SCHEMAS[name])


def test_uncompilable_schema_fails_at_submission_and_the_engine_keeps_serving(smollm2_engine):
    bad = SamplingParams(max_new_tokens=8, structured=StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(InvalidRequestError, match="nope") as error:
        smollm2_engine.generate(["hi", "hello"], [SamplingParams(max_new_tokens=8), bad])
    assert error.value.param == "structured"
    assert smollm2_engine.num_unfinished() == 0  # the good prompt of the call was never queued
    (ok,) = smollm2_engine.generate(["hi"], SamplingParams(max_new_tokens=4))
    assert len(ok.token_ids) == 4


# ---- over HTTP ----


@pytest.fixture(scope="module")
def smol_server(smollm2_engine):
    from graphexec.server.app import create_app

    with ServerThread(create_app(smollm2_engine, server_config())) as server:
        yield server


def _post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=120) as http:
        return http.post(f"{server.url}{path}", json={"model": SMOL, **body})


def test_http_response_format_and_guided_fields(smol_server, smollm2_engine):
    schema = SCHEMAS["answer"]
    chat = {"messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}], "max_tokens": 48}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    reply = _post(smol_server, "/v1/chat/completions", chat | {"response_format": fmt})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    _assert_valid(reply.json()["choices"][0]["message"]["content"], schema)

    reply = _post(smol_server, "/v1/chat/completions", chat | {"response_format": {"type": "json_object"}, "temperature": 0.8, "seed": 1})
    assert isinstance(json.loads(reply.json()["choices"][0]["message"]["content"]), dict)
    plain = _post(smol_server, "/v1/chat/completions", chat | {"response_format": {"type": "text"}, "max_tokens": 8})
    unconstrained = _post(smol_server, "/v1/chat/completions", chat | {"max_tokens": 8})
    assert plain.json()["choices"][0]["message"] == unconstrained.json()["choices"][0]["message"]

    completion = {"prompt": "The answer is", "max_tokens": 32}
    reply = _post(smol_server, "/v1/completions", completion | {"guided_json": json.dumps(SCHEMAS["booleans"])})
    _assert_valid(reply.json()["choices"][0]["text"], SCHEMAS["booleans"])
    reply = _post(smol_server, "/v1/completions", completion | {"guided_regex": "(yes|no)!"})
    assert reply.json()["choices"][0]["text"] in ("yes!", "no!")
    reply = _post(smol_server, "/v1/completions", completion | {"guided_choice": ["alpha", "beta"], "stream": True})
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) in ("alpha", "beta")
    wait_until(lambda: smollm2_engine.num_unfinished() == 0, what="the engine to go idle")
    assert_no_leak(smollm2_engine)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema", "nope"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format", "only with it"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name", "required"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "at most one"),
        ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": {"type": "integer"}, "ignore_eos": True}, "guided_json", "ignore_eos"),
    ],
)
def test_http_bad_constraints_are_400s_naming_the_field(smol_server, fields, param, words):
    reply = _post(smol_server, "/v1/completions", {"prompt": "hi", "max_tokens": 4} | fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = _post(smol_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_bounded_strings_refuse_raw_control_characters():
    """JSON forbids unescaped U+0000-U+001F in strings: no string the grammar allows, bounded or
    not, takes one raw (xgrammar's bounded strings did)."""
    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.text.tokenizer import ByteTokenizer

    backend = GrammarBackend(ByteTokenizer(300), 320, [257])
    for schema in ({"type": "string", "maxLength": 4}, {"type": "string", "minLength": 1}, {"type": "string"}):
        grammar = backend.matcher(StructuredSpec.json_schema(schema))
        assert grammar.accept(ord('"')) and grammar.accept(ord("a"))
        assert not grammar.accept(0x17) and not grammar.accept(ord("\n"))
        assert grammar.accept(ord('"')) and grammar.is_completed


def test_json_schema_output_is_strict_and_on_one_line():
    """Objects take only the properties they name (nested too, and through $ref), prefixItems no
    more items; an object schema naming nothing stays any object, and so does one built from
    several allOf members (closing them would refuse each other's properties); separators are ", "
    and ": " and no other whitespace."""
    from graphexec.structured.grammar_backend import GrammarBackend
    from graphexec.text.tokenizer import ByteTokenizer

    backend = GrammarBackend(ByteTokenizer(300), 320, [257])

    def matches(schema: dict, text: str) -> bool:
        grammar = backend.matcher(StructuredSpec.json_schema(schema))
        return all(grammar.accept(b) for b in text.encode()) and grammar.is_completed

    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    holder = {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}, "m": {"type": "object"}}, "$defs": {"point": point}}
    assert matches(point, '{"x": 1}') and not matches(point, '{"x": 1, "y": 2}')
    assert not matches(point, '{"x":1}') and not matches(point, '{ "x": 1}') and not matches(point, '{"x": 1}\n')
    assert matches(holder, '{"p": {"x": 1}, "m": {"any": [true, null]}}') and not matches(holder, '{"p": {"x": 1, "z": 0}}')
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}]}
    assert matches(pair, "[1, true]") and not matches(pair, "[1, true, 2]")
    both = {"allOf": [point, {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]}
    assert matches(both, '{"x": 1, "y": 2}')
    grammar = backend.matcher(StructuredSpec.json_object())
    assert all(grammar.accept(b) for b in b'{"k": [1, {"z": "s"}], "extra": null}') and grammar.is_completed


def test_vocabulary_bytes_for_each_encoding():
    """Byte-level strings go back through GPT-2's alphabet (a character outside it, in an added
    token spelled as text, is itself); byte-fallback tokens are their byte or their text with "▁" as
    a space; raw tokens are their UTF-8; the control token and the ids past the tokenizer are
    special and have no bytes of their own."""
    import tokenizers
    from tokenizers import decoders, models

    from graphexec.structured.vocabulary import token_bytes
    from graphexec.text.tokenizer import Tokenizer

    def tokenizer(vocab: list[str], decoder) -> Tokenizer:
        backend = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
        backend.decoder = decoder
        backend.add_special_tokens(["<|end|>"])  # id 5
        return Tokenizer(backend, bos_token_id=None, eos_token_ids=[5])

    byte_level = tokenizer(["<unk>", "ĠhÃ©", "Ċ", "ĉĀ", "x y"], decoders.ByteLevel())
    fallback = tokenizer(["<unk>", "▁hé", "<0x0A>", "<0xFF>", "a▁b"], decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]))
    raw = tokenizer(["<unk>", "hé", "\n", "▁", "x y"], decoders.Fuse())
    expected = {
        byte_level: [" hé".encode(), b"\n", b"\t\x00", b"x y"],
        fallback: [" hé".encode(), b"\n", b"\xff", b"a b"],
        raw: ["hé".encode(), b"\n", "▁".encode(), b"x y"],
    }
    for tok, spelled in expected.items():
        tokens, special = token_bytes(tok, 8)
        assert tokens[1:5] == spelled, tok.vocab_encoding
        assert special == {5, 6, 7} and tokens[6:] == [b"", b""]


def test_nothing_in_graphexec_imports_xgrammar():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "graphexec"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(root.parent)}:{node.lineno}" for name in names if name.partition(".")[0] == "xgrammar"]
    assert not offenders
