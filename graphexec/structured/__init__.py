"""Structured output: a request's text held to a grammar (a JSON schema, any JSON object, a regex,
one of a few strings) by masking, before each sampling step, every token the grammar cannot take.

The grammar engine is llguidance.  `spec.py` states the constraint (no llguidance: SamplingParams
imports it); `vocabulary.py` describes the engine's vocabulary to llguidance; `json_grammar.py`
turns a JSON schema into its grammar; `grammar_cache.py` compiles constraints, bounded and shared;
`request_grammar.py` is one request's matcher; `token_bitmask.py` masks a batch's logits (plain
torch); `grammar_backend.py` ties them together per engine.  llguidance is imported only once a
request asks for structure.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "StructuredSpec": "graphexec.structured.spec",
    "GrammarBackend": "graphexec.structured.grammar_backend",
    "RequestGrammar": "graphexec.structured.request_grammar",
    "TokenBitmask": "graphexec.structured.token_bitmask",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
