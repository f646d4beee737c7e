"""Requests and scheduling: what runs next.

`request.py` (one request's state), `admission.py` (may the head of the queue start?),
`schedule_batch.py` (one step's plan, built without side effects), `scheduler.py` (admit, retract,
step, record).  Asks the KV cache manager (graphexec/cache/) for memory and the model runner
(graphexec/runner/) for forwards; never touches a pool itself.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "Scheduler": "graphexec.scheduler.scheduler",
    "Req": "graphexec.scheduler.request",
    "ScheduleBatch": "graphexec.scheduler.schedule_batch",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
