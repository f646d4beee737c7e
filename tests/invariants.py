"""Invariants every scenario must leave true."""


def assert_no_leak(engine) -> None:
    """Every KV slot and request row is back in the free lists, nothing is queued or reserved."""
    runner, scheduler = engine.runner, engine.scheduler
    assert runner.kv_pool.num_free == runner.kv_pool.num_slots
    assert runner.req_to_token_pool.num_free == runner.req_to_token_pool.max_requests
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.reserved_slots == 0
