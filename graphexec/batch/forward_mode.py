"""What kind of forward a batch runs; backends and metadata builders branch on predicates, not equality."""

from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    # A run of new tokens per request (prefill, or a later chunk of a long prompt).
    EXTEND = enum.auto()
    # Exactly one new token per request.
    DECODE = enum.auto()
    # Extends and one-token decodes packed into one batch; laid out like EXTEND.
    MIXED = enum.auto()
    # No request on this rank, but the forward must still run (kept for the graph plans).
    IDLE = enum.auto()
    # Speculative verification: each request's last token plus its draft tokens, laid out as
    # decode rows (one row per token: the request's table row, its own length and position), so
    # row i of a request attends causally over the cached KV and its drafts up to i.  Every
    # attention backend's decode path and every decode graph run it unchanged; every row samples.
    TARGET_VERIFY = enum.auto()

    def is_extend(self) -> bool:
        """Laid out as variable-length runs (extend_* fields are meaningful)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_graph_capturable(self) -> bool:
        """Shapes depend on the row count only, so a bucket list covers them (full-graph decode)."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY)

    @property
    def config_key(self) -> str:
        """The key of this mode in a capture plan (`capture.<key>.backend`)."""
        return self.name.lower()
