"""Model execution: `model_runner.py` turns a ForwardBatch (`forward_batch.py`, `forward_mode.py`)
into sampled tokens through a capture backend (capture/), with the forward context
(`forward_context.py`) as the one channel to the attention op, then `logits_processor.py` and
`sampler.py`.  Reads and writes the KV pools it is given; never allocates a slot.
"""

import importlib

# Resolved on first access, so importing one module of the package does not load the others
# (and lower layers can import a module here without a cycle through this file).
_PUBLIC = {
    "ModelRunner": "graphexec.runner.model_runner",
    "ForwardBatch": "graphexec.runner.forward_batch",
    "ForwardMode": "graphexec.runner.forward_mode",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
