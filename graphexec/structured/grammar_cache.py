"""Compiled grammars, keyed by the constraint's text, least recently used dropped past a bound.

"Compiled" is an llguidance matcher at the start of the grammar, its grammar checked and its first
mask computed (so a grammar that admits nothing is refused here); each request gets a deep copy of
it (RequestGrammar).  llguidance builds a grammar's lexer lazily, so compiling takes a few ms and
a mask costs more where the grammar's states are new (bounded per step by llguidance's limits);
callers still compile off the event loop (the server's prepare worker) and the engine loop only
ever finds a compiled grammar on its requests.  Thread-safe: the HTTP worker and callers of Engine.generate compile concurrently; two
threads missing on the same key both compile it, which costs time but not correctness.  A cached
matcher is never advanced, only copied, so threads may copy it at once.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import llguidance

from graphexec.errors import InvalidRequestError
from graphexec.structured.json_grammar import json_schema_grammar
from graphexec.structured.spec import StructuredSpec

# llguidance prefixes some errors with a position in the grammar it built ("at 1(8): "), which is
# not the caller's text; dropped.
_GRAMMAR_POSITION = re.compile(r"^at \d+\(\d+\): ")
_MAX_REASON_CHARS = 300


class GrammarCache:
    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._tokenizer = ll_tokenizer
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """The compiled grammar of `spec` (copy it before use); InvalidRequestError naming
        spec.param if it cannot compile or admits no output."""
        with self._lock:
            compiled = self._compiled.get(spec.key)
            if compiled is not None:
                self._compiled.move_to_end(spec.key)
                self.hits += 1
                return compiled
            self.misses += 1
        compiled = self._compile(spec)  # outside the lock: a long compile must not block hits
        with self._lock:
            self._compiled[spec.key] = compiled
            self._compiled.move_to_end(spec.key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        what = spec.kind.replace("_", " ")
        # log_level 0: a bad request is reported to its caller, not printed on the server's stderr.
        matcher = llguidance.LLMatcher(self._tokenizer, _grammar(spec), log_level=0)
        if matcher.is_error():
            reason = _one_line(matcher.get_error())
            if reason.startswith("Unsatisfiable schema"):
                raise InvalidRequestError(f"{spec.param}: this {what} admits no output ({reason})", param=spec.param)
            raise InvalidRequestError(f"{spec.param}: cannot compile this {what}: {reason}", param=spec.param)
        # Some grammars compile yet admit nothing to sample, or (for JSON) only the empty text, which
        # is never JSON; refuse them here rather than let a request sample from an all -inf row or
        # answer "" as JSON.
        if not any(matcher.compute_bitmask()) or (spec.kind.startswith("json") and matcher.is_accepting()):
            raise InvalidRequestError(f"{spec.param}: this {what} admits no output", param=spec.param)
        return matcher


def _grammar(spec: StructuredSpec) -> str:
    if spec.kind == "json_object":
        return json_schema_grammar('{"type": "object"}', strict=False)
    if spec.kind == "json_schema":
        return json_schema_grammar(spec.value, strict=True)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    return _choice_lark(json.loads(spec.value))


def _choice_lark(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices`: llguidance reads a Lark string literal as a
    JSON string, so json.dumps escapes quotes, backslashes and control characters."""
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _one_line(error: str) -> str:
    """llguidance's reason on one line: a regex error spans several (the pattern, a caret, then
    "error: <why>"), so its first and "error:" lines are kept."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    head = _GRAMMAR_POSITION.sub("", lines[0])
    why = next((line[len("error: ") :] for line in lines[1:] if line.startswith("error: ")), None)
    reason = f"{head.rstrip(':')}: {why}" if why else head
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[: _MAX_REASON_CHARS - 3] + "..."
