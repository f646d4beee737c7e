"""Compiled grammars, keyed by the constraint's text, least recently used dropped past a bound.

Compiling a non-trivial JSON schema takes tens of ms (75 ms for a 3-property schema with an enum
array on this machine), so callers compile off the event loop (the server's prepare worker) and
the engine loop only ever finds a compiled grammar on its requests.  xgrammar's own cache is
unbounded, so it is off and this one is the only one.  Thread-safe: the HTTP worker and callers of
Engine.generate compile concurrently; two threads missing on the same key both compile it, which
costs time but not correctness.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import xgrammar as xgr

from graphexec.errors import InvalidRequestError
from graphexec.structured.json_grammar import json_schema_ebnf
from graphexec.structured.spec import StructuredSpec

# Threads one compile may use; the engine loop needs the machine's cores for the model.
_COMPILE_THREADS = 1


class GrammarCache:
    def __init__(self, tokenizer_info: xgr.TokenizerInfo, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=_COMPILE_THREADS, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; InvalidRequestError naming spec.param if it cannot compile."""
        with self._lock:
            compiled = self._compiled.get(spec.key)
            if compiled is not None:
                self._compiled.move_to_end(spec.key)
                self.hits += 1
                return compiled
            self.misses += 1
        compiled = self._compile(spec)  # outside the lock: a long compile must not block hits
        _check_has_a_first_token(compiled, spec)
        with self._lock:
            self._compiled[spec.key] = compiled
            self._compiled.move_to_end(spec.key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_grammar(json_schema_ebnf('{"type": "object"}', strict=False))
            if spec.kind == "json_schema":
                return self._compiler.compile_grammar(json_schema_ebnf(spec.value, strict=True))
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            return self._compiler.compile_grammar(_choice_ebnf(json.loads(spec.value)))
        except RuntimeError as error:
            # xgrammar reports a bad schema or regex as a RuntimeError whose first line is its
            # source location; the rest is the reason.
            reason = str(error).strip().split("\n")[0]
            reason = reason.split(": ", 1)[1] if ".cc:" in reason else reason
            raise InvalidRequestError(f"{spec.param}: cannot compile this {spec.kind.replace('_', ' ')}: {reason}", param=spec.param) from None


def _check_has_a_first_token(compiled: xgr.CompiledGrammar, spec: StructuredSpec) -> None:
    """Some grammars compile yet admit nothing to sample, or (xgrammar's rendering of
    {"enum": []}) only the empty text, which is never JSON; refuse them here rather than let a
    request sample from an all -inf row or answer "" as JSON."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bitmask.any() or (spec.kind.startswith("json") and matcher.is_completed()):
        raise InvalidRequestError(f"{spec.param}: this {spec.kind.replace('_', ' ')} admits no output", param=spec.param)


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    """A double-quoted EBNF string matching `text` exactly."""
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
