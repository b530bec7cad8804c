"""Structural checks of the expert cache, usable after any sequence of operations, and a helper that puts an
expert in it."""

from concurrent.futures import Future


def loaded(cache, key, grow: bool = True):
    """Acquire key (demand), mark its read done and release it: an idle entry."""
    e, created = cache.acquire(key, grow=grow)
    assert created
    e.future = Future()
    e.future.set_result(None)
    cache.release(e)
    return e


def assert_cache_consistent(cache) -> None:
    """Every slot is either free or owned by exactly one entry; the idle tier holds only unreferenced,
    unpinned, loaded entries; the pinned count matches; held bytes never exceed the arena."""
    owned = [e.slot for e in cache.entries.values()]
    assert sorted(owned + cache.free) == list(range(cache.n_slots)), "a slot is lost or shared"
    for key in cache.idle:
        e = cache.entries[key]
        assert e.refs == 0 and not e.pinned and e.future is not None and e.future.done(), key
    assert cache.n_pinned == sum(e.pinned for e in cache.entries.values()) <= cache.pin_capacity
    assert set(cache.used) <= set(cache.idle), "an expert in use or gone is a reuse candidate"
    assert all(cache.used[key] is cache.entries[key] for key in cache.used)
    assert cache.held_bytes <= cache.capacity_bytes == cache.arena.nbytes
