"""Invariants every scenario must leave true."""


def assert_no_leak(engine) -> None:
    """Every KV slot is free or owned by the prefix cache, no cached KV is still locked, every
    request row is free, nothing is queued; the KV cache manager's own audit agrees."""
    kv, scheduler = engine.kv_cache, engine.scheduler
    kv.audit()
    assert kv.num_free + kv.num_cached == kv.num_slots
    assert kv.num_locked == 0 and not kv.holders()
    assert kv.num_free_rows == kv.req_to_token_pool.max_requests
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.promised_slots == 0
