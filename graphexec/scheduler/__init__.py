"""Requests and scheduling: what runs next.

`request.py` (one request's state), `admission.py` (may the head of the queue start?),
`schedule_batch.py` (one step's plan, built without side effects), `scheduler.py` (admit, retract,
step, record).  Asks the KV cache manager (graphexec/cache/) for memory and the model runner
(graphexec/runner/) for forwards; never touches a pool itself.
"""

import importlib

# Resolved on first access, so importing one module of the package does not load the others
# (and lower layers can import a module here without a cycle through this file).
_PUBLIC = {
    "Scheduler": "graphexec.scheduler.scheduler",
    "Req": "graphexec.scheduler.request",
    "ScheduleBatch": "graphexec.scheduler.schedule_batch",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
