"""Choosing the next token: `sampler.py` (a batch's sampling state, `SamplingBatchInfo`, and the
`Sampler` over a step's logits) and `penalties.py` (repetition, frequency and presence penalties,
applied first).  Takes logits and per-request parameters; knows nothing of KV, scheduling or the
model.  Below graphexec/batch/, which carries a SamplingBatchInfo in every ForwardBatch.
"""
