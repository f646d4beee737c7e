"""Run torch work on a thread that ends, so the calling thread never becomes an OpenMP master.

Every thread that runs parallel CPU ops gets its own libgomp team, kept until the thread exits.
With two live teams on a machine with few cores, libgomp stops spinning its workers and every
parallel region pays a futex wake-up: on 2 cores the engine loop's decode steps ran ~40 % slower
once the main thread had loaded and captured the model.  A team is freed when its thread exits,
so one-off heavy work (loading, capture, a baseline run) goes through `call_in_thread`, and the
engine loop stays the process's only OpenMP master.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def call_in_thread(fn: Callable[[], T], name: str = "graphexec-setup") -> T:
    """fn() on a new thread, joined; its result, or its exception re-raised here."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # re-raised on the caller's thread, traceback intact
            outcome["error"] = error

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[return-value]
