"""call_in_thread: heavy one-off torch work on a thread that ends (see graphexec/engine/threads.py)."""

import threading

import pytest

from graphexec.engine.threads import call_in_thread
from tests.conftest import TINY_OVERRIDES


def test_returns_the_value_from_another_thread():
    caller = threading.current_thread()
    ran_on = call_in_thread(threading.current_thread, name="worker")
    assert ran_on is not caller and ran_on.name == "worker" and not ran_on.is_alive()


def test_reraises_the_error_on_the_caller():
    def fail():
        raise KeyError("missing weight")

    with pytest.raises(KeyError, match="missing weight"):
        call_in_thread(fail)


def test_engine_loads_and_captures_off_the_calling_thread(monkeypatch):
    """So the engine loop's thread can be the process's only OpenMP master."""
    import graphexec.engine.engine as engine_module
    import graphexec.engine.rank_setup as rank_setup

    seen = []
    real_load = rank_setup.load_checkpoint

    def spy(*args, **kwargs):
        seen.append(threading.current_thread())
        return real_load(*args, **kwargs)

    # Every rank loads through rank_setup (the Engine's rank 0 included).
    monkeypatch.setattr(rank_setup, "load_checkpoint", spy)
    engine = engine_module.Engine(overrides=TINY_OVERRIDES)
    assert seen and seen[0] is not threading.current_thread() and not seen[0].is_alive()
    assert engine.generate([[5, 6, 7]])[0].completion_tokens > 0
    engine.shutdown()
