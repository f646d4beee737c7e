"""Model execution: `model_runner.py` turns a ForwardBatch (graphexec/batch/) into sampled
tokens through a capture backend (capture/), with its forward scope (the forward context of
graphexec/attention/forward_context.py) as the one channel to the attention op, then
`logits_processor.py`, the batch's prompt-logprob plan and graphexec/sampling/.  Reads and writes
the KV pools it is given; never allocates a slot.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "ModelRunner": "graphexec.runner.model_runner",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
