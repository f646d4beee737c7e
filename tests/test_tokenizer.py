"""Our tokenizers against transformers' reading of the same SmolLM2 GGUF, and the byte-level stand-in."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from graphexec.loader import default_smollm2_gguf, load_gguf_tokenizer  # noqa: E402
from graphexec.text.tokenizer import ByteTokenizer, Tokenizer  # noqa: E402

TEXTS = [
    "Hello, world!",
    "hello world",
    "12345",
    "3.14159 and 1,000,000 apples",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "Emoji: 🙂🎉👩‍💻",
    "中文测试：你好，世界。",
    "Ünïcödé naïve café — “quotes”",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     inner   spaces",
    "line one\nline two\n\n\nline five\r\n",
    "\ttabs\tand\nnewlines\t",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "I'm sure they'll say it's fine, we've done it",
    "",
    " ",
    "https://example.com/path?q=1&r=2#frag",
]

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
USER_ONLY = [{"role": "user", "content": "Hi there! 👋"}]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_gguf_tokenizer(default_smollm2_gguf())


@pytest.fixture(scope="module")
def theirs(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(ours, theirs, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skipped_on_decode(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"


def test_ids_and_vocab(ours):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.encode("hi")[0] != ours.bos_token_id  # SmolLM2's GGUF says add_bos_token = false


def test_decode_of_a_split_multibyte_char_replaces(ours):
    ids = ours.encode("🙂")
    assert len(ids) > 1  # byte-level pieces of one character
    assert "\ufffd" in ours.decode(ids[:1])


@pytest.mark.parametrize("messages", [SYSTEM_AND_USER, USER_ONLY], ids=["system+user", "user-only"])
def test_chat_template_matches_transformers(ours, theirs, messages):
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected
    assert ours.apply_chat_template(messages).endswith("<|im_start|>assistant\n")
    assert not ours.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_from_hf_dir_matches_gguf_tokenizer(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == ours.encode(text)
    assert from_dir.bos_token_id == 1 and from_dir.eos_token_ids == (2,)
    assert from_dir.apply_chat_template(USER_ONLY) == ours.apply_chat_template(USER_ONLY)


def test_model_without_template_raises():
    import tokenizers

    no_template = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), bos_token_id=None, eos_token_ids=[])
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(USER_ONLY)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(vocab_size=300)
    text = "héllo wörld 🙂 中文"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, *tok.eos_token_ids]) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut 3-byte character
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (300, 256, (257,), None)


def test_byte_tokenizer_has_no_chat_template():
    with pytest.raises(ValueError):
        ByteTokenizer().apply_chat_template(USER_ONLY)
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=100)


# ---- GGUF SentencePiece vocabularies ("llama": Llama 2, Mistral, Mixtral, Phi-3, Gemma) ---------

SPM_TEXTS = [
    "Hello world",
    "the quick brown fox jumps over the lazy dog",
    "  two leading spaces and   three inside",
    "numbers 12345 and punctuation!? (yes)",
    "naïve café — ünïcödé 日本語 🙂",  # characters outside the learned pieces: byte fallback
    "line one\nline two\ttab",
    "",
]


@pytest.fixture(scope="module")
def sentencepiece_model():
    """A small SentencePiece BPE model trained here (llama-style: byte fallback, no normalization)."""
    import io
    import random

    spm = pytest.importorskip("sentencepiece")
    words = "the quick brown fox jumps over lazy dog hello world model token graph engine serve cache".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    corpus += ["numbers 0123456789 punctuation !?()., and tabs\tnewlines"] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=1.0,
        bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_metadata(sp) -> dict:
    """What llama.cpp's converter writes for a SentencePiece vocabulary."""
    def kind(i: int) -> int:
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1

    n = sp.get_piece_size()
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_gguf_sentencepiece_encodes_as_sentencepiece(sentencepiece_model, text):
    ours = Tokenizer.from_gguf(_spm_metadata(sentencepiece_model))
    assert ours.encode(text) == [1, *sentencepiece_model.encode(text)]  # BOS: llama.cpp's default for "llama"
    assert ours.decode(ours.encode(text)) == text


def test_gguf_sentencepiece_keeps_control_tokens_whole_and_refuses_other_kinds(sentencepiece_model):
    from graphexec.errors import CheckpointError

    ours = Tokenizer.from_gguf(_spm_metadata(sentencepiece_model))
    assert ours.encode("hello</s>") == [1, *sentencepiece_model.encode("hello"), 2]
    with pytest.raises(CheckpointError, match="GGUF tokenizer 'bert' .*not supported"):
        Tokenizer.from_gguf({**_spm_metadata(sentencepiece_model), "tokenizer.ggml.model": "bert"})
