"""Invariants every scenario must leave true."""


def assert_no_leak(engine) -> None:
    """Every KV slot is free or owned by the prefix cache, no cached KV is still locked, every
    request row is free, nothing is queued or reserved."""
    runner, scheduler = engine.runner, engine.scheduler
    cache = scheduler.prefix_cache
    assert runner.kv_pool.num_free + scheduler.cached_slots == runner.kv_pool.num_slots
    assert cache is None or cache.locked_tokens == 0
    assert runner.req_to_token_pool.num_free == runner.req_to_token_pool.max_requests
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.reserved_slots == 0
