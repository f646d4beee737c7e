"""Incremental detokenization: whole characters only, and the deltas add up to a full decode."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphexec.loader import default_smollm2_gguf, load_gguf_tokenizer
from graphexec.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from graphexec.text.stop_strings import StopStringMatcher
from graphexec.text.tokenizer import ByteTokenizer

MIXED_TEXT = "Hello 👋🏽 世界! 你好, 🤖 café — 日本語 😀 naïve"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_gguf_tokenizer(default_smollm2_gguf())


def _deltas(tokenizer, ids, chunk=1):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_smollm2_emoji_and_chinese_arrive_whole(smollm2_tokenizer, chunk):
    tok = smollm2_tokenizer
    ids = tok.encode(MIXED_TEXT)
    pieces = [tok.decode([i]) for i in ids]
    # The case under test: byte-level BPE splits these characters over several tokens.
    assert sum(REPLACEMENT_CHAR in p for p in pieces) >= 10
    deltas, tail = _deltas(tok, ids, chunk)
    assert "".join(deltas) == MIXED_TEXT and tail == ""
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "" in deltas  # some tokens completed no character and were held back


def test_smollm2_special_tokens_are_skipped(smollm2_tokenizer):
    tok = smollm2_tokenizer
    im_end = 2  # <|im_end|>
    ids = tok.encode("Hi 世") + [im_end] + tok.encode(" there")
    deltas, tail = _deltas(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == "Hi 世 there"


def test_byte_tokenizer_multibyte_chars_split_across_tokens():
    tok = ByteTokenizer()
    text = "aé世🙂z"
    ids = tok.encode(text)  # 1 + 2 + 3 + 4 + 1 bytes, one token each
    deltas, tail = _deltas(tok, ids)
    assert deltas == ["a", "", "é", "", "", "世", "", "", "", "🙂", "z"]
    assert tail == ""


def test_unfinished_character_is_flushed_as_replacement():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(list("ok".encode())) == "ok"
    assert detok.push(list("世".encode())[:2]) == ""  # two of three bytes
    assert detok.flush() == REPLACEMENT_CHAR


def test_invalid_byte_followed_by_text_is_not_held_forever():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push([0xE4]) == ""  # could still become a CJK character
    assert detok.push([ord("A")]) == REPLACEMENT_CHAR + "A"  # it did not: emit both


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.integers(0, 257), max_size=40), chunk=st.integers(1, 4))
def test_byte_tokenizer_deltas_add_up_to_full_decode(data, chunk):
    """Any byte soup, including invalid UTF-8 and special ids: deltas + flush == decode(all)."""
    tok = ByteTokenizer()
    deltas, tail = _deltas(tok, data, chunk)
    assert "".join(deltas) + tail == tok.decode(data)
    # A delta never ends in an unfinished character: those wait for the next token or the flush.
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30))
def test_smollm2_any_text_round_trips_incrementally(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    deltas, tail = _deltas(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert tail == "" or tok.decode(ids).endswith(REPLACEMENT_CHAR)


def test_stop_string_matcher_finds_earliest_and_holds_back_prefixes():
    matcher = StopStringMatcher(["END", "\n\n"])
    assert matcher.find("abc END x\n\n", 0) == 4
    assert matcher.find("a\n\nEND", 0) == 1
    assert matcher.find("no stop here", 0) is None
    # Only matches ending in the new text count, but one straddling the boundary is found.
    assert matcher.find("xxEN" + "D", 4) == 2
    # A short stop string wholly inside the text searched before is old, even near its end
    # (min_tokens marks text searched without searching it).
    assert matcher.find("a\n\nb", 3) is None and matcher.find("a\n\nb", 2) == 1
    assert matcher.held_back("text E") == 1
    assert matcher.held_back("text EN") == 2
    assert matcher.held_back("text\n") == 1
    assert matcher.held_back("text ENX") == 0
    assert not StopStringMatcher([]) and StopStringMatcher([]).held_back("abc") == 0
