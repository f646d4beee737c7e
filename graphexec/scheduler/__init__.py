"""Scheduling: what runs next.

`admission.py` (may the head of the queue start?), `scheduler.py` (admit, retract, step, record),
`hand_batches.py` (batches built by hand for tests and benchmarks, outside the scheduler);
the requests and the step plans it builds are graphexec/batch/'s `Req` and `ScheduleBatch`.
Asks the KV cache manager (graphexec/cache/) for memory and the model runner (graphexec/runner/)
for forwards; never touches a pool itself.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "HandBatches": "graphexec.scheduler.hand_batches",
    "Scheduler": "graphexec.scheduler.scheduler",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
