"""What a padded row holds: the reserved dummy KV slot and request row, and the padding policy a
capture backend fills its bucket's extra rows with.  Declared once, here, because three rooms must
agree on it: the KV pools reserve the dummies (graphexec/cache/), ForwardBatch builds with them, and
the attention backends read past nothing a padded row writes."""

from __future__ import annotations

from capture import PaddingPolicy

# Slot 0 is the dummy target for padded rows: they write there and nothing reads it as live KV.
DUMMY_SLOT = 0
# Row 0 is the dummy request that padded batch rows point at; it is never handed out.
DUMMY_REQ_ROW = 0


def padding_policy(attention_seq_len: int) -> PaddingPolicy:
    """What every padded row holds, declared once: the dummy request row (whose table entries all
    point at the dummy slot), the dummy KV slot, token 0 at position 0, and a sequence length the
    attention backend accepts (`AttentionBackend.padded_seq_len`)."""
    return PaddingPolicy(
        req_pool_index=DUMMY_REQ_ROW, out_cache_loc=DUMMY_SLOT, seq_len=attention_seq_len, input_id=0, position=0
    )
