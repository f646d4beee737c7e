"""One engine's structured-output state: its vocabulary described to llguidance (built once) and
its grammar cache; hands each constrained request a fresh matcher.

The engine creates it on the first constrained request, so engines that never see one never
import llguidance (a few ms) nor build the vocabulary (a few hundred ms for 49k tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from graphexec.structured.grammar_cache import GrammarCache
from graphexec.structured.request_grammar import RequestGrammar
from graphexec.structured.spec import StructuredSpec
from graphexec.structured.vocabulary import build_ll_tokenizer
from graphexec.text.tokenizer import ByteTokenizer, Tokenizer


class GrammarBackend:
    def __init__(
        self,
        tokenizer: Tokenizer | ByteTokenizer,
        logits_vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_capacity: int = 64,
    ):
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = logits_vocab_size
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, logits_vocab_size, self.eos_token_ids)
        self.cache = GrammarCache(self.ll_tokenizer, cache_capacity)

    def prepare(self, spec: StructuredSpec) -> None:
        """Compile `spec` into the cache now (off the event loop); InvalidRequestError if it cannot."""
        self.cache.get(spec)

    def matcher(self, spec: StructuredSpec, stop_token_ids: Sequence[int] = ()) -> RequestGrammar:
        """A new matcher at the start of `spec`'s grammar; it may end on EOS or `stop_token_ids`."""
        # An id past the logits can never be sampled, so it has no bit to set.
        stops = tuple(dict.fromkeys(t for t in (*self.eos_token_ids, *stop_token_ids) if t < self.vocab_size))
        return RequestGrammar(self.cache.get(spec), stops, self.eos_token_ids)
