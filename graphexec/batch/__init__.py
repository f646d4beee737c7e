"""The batch vocabulary every room speaks, at the bottom of the house: one request's state
(`request.py`), the kinds of forward (`forward_mode.py`), one step's host-side plan
(`schedule_batch.py`), the device-side contract of one forward (`forward_batch.py`), which extend
rows give prompt logprobs (`prompt_logprobs.py`) and what a padded row holds (`padding.py`).

Data and its pure constructors only: nothing here allocates KV, schedules or runs a model.  It
imports only capture/ (the library), graphexec/sampling/ and the top-level value types, so the
scheduler, the KV cache, the runner, attention and the tensor-parallel ranks can all name these
types without importing each other.  docs/ARCHITECTURE.md ("One request, from Engine.generate to
the attention op and back") walks seed 001's worked example through them.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "ForwardBatch": "graphexec.batch.forward_batch",
    "ForwardMode": "graphexec.batch.forward_mode",
    "Req": "graphexec.batch.request",
    "ScheduleBatch": "graphexec.batch.schedule_batch",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
