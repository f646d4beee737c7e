"""Attention over the paged KV pool: the opaque op the model calls, and the backends behind it."""
