"""Model execution: `model_runner.py` turns a ForwardBatch (`forward_batch.py`) into sampled
tokens through a capture backend (capture/), with its forward scope (the forward context of
graphexec/attention/forward_context.py) as the one channel to the attention op, then
`logits_processor.py`, `prompt_logprobs.py` and `sampler.py` (which applies `penalties.py`
first).  Reads and writes the KV pools it is given; never allocates a slot.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "ModelRunner": "graphexec.runner.model_runner",
    "ForwardBatch": "graphexec.runner.forward_batch",
    "ForwardMode": "graphexec.forward_mode",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
