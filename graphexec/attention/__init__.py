"""Attention over the paged KV pool: the opaque op the model calls, the backends behind it, and
the forward context through which the runner hands the op this forward's pool and metadata."""
