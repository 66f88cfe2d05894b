"""A manager's objects form no reference cycle: dropping the last reference frees them at once.

What a manager holds (a torch.distributed process group through its channel,
pinned staging memory, a pool's claim) must go when the user lets go of it,
not when the cyclic garbage collector happens to run. A cycle once kept a
tensor-parallel manager's process group alive until interpreter exit, after
``destroy_process_group``, where gloo's destructor aborted the process
("terminate called without an active exception") on one run in three.
Each test runs a manager's life with the cyclic collector off, then asks the
collector what only it could have freed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest

import mambacache as mc
from mambacache._executors._torch import TorchExecutor

SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(4, 3)], temporal_shape=(3, 5))


@pytest.fixture
def cyclic_garbage() -> Iterator[Callable[[], list[str]]]:
    """Call it after the life under test: the mambacache objects that only the cyclic collector frees.

    A prefix trie's nodes point at their parents by design (a tree walked both
    ways); they hold tokens, slot numbers and the engine's payloads, never the
    manager, so they are left out.
    """
    gc.collect()
    gc.disable()

    def found() -> list[str]:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return sorted(
                type(o).__qualname__
                for o in gc.garbage
                if (type(o).__module__ or "").startswith("mambacache") and type(o).__qualname__ != "_Node"
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    try:
        yield found
    finally:
        gc.enable()


def _sync_life(host: bool, channel: bool, cache: bool, pending: bool) -> None:
    pool = mc.StatePool(SPEC, 12)
    hosts = mc.HostPool(SPEC, 4) if host else None
    chan = mc.LoopbackChannel.group(1, timeout=5)[0] if channel else None
    with mc.CacheManager(pool, host_pool=hosts, channel=chan) as mgr:
        slots = mgr.alloc(2, "r1")
        mgr.clear(slots[0])
        mgr.flush_nowait()
        if host:
            mgr.export(slots[1], "r1")
            mgr.flush_nowait()
            taken = mgr.take_exports()
            if not pending:  # else the manager closes with a send in flight
                mgr.exports_delivered(taken)
                mgr.flush_nowait()
        if cache:
            prefix = mc.PrefixCache(mgr, block_size=4, max_checkpoints=2)
            prefix.insert([1, 2, 3, 4], slots[0])
            mgr.flush_nowait()


@pytest.mark.parametrize(
    ("host", "channel", "cache", "pending"),
    [
        (False, False, False, False),
        (True, False, False, False),
        (True, False, False, True),
        (False, True, False, False),
        (False, False, True, False),
    ],
    ids=["plain", "hand-off", "send-in-flight", "channel", "prefix-cache"],
)
def test_a_closed_manager_is_freed_by_reference_counting(
    cyclic_garbage: Callable[[], list[str]], host: bool, channel: bool, cache: bool, pending: bool
) -> None:
    _sync_life(host, channel, cache, pending)
    assert cyclic_garbage() == []


@pytest.mark.anyio
async def test_an_async_managers_objects_are_freed_by_reference_counting(
    cyclic_garbage: Callable[[], list[str]],
) -> None:
    async def life() -> None:
        async with mc.CacheManager(mc.StatePool(SPEC, 8)) as mgr:
            mgr.clear(mgr.alloc(1)[0])
            await mgr.flush()

    await life()
    assert cyclic_garbage() == []


def test_the_check_sees_a_cycle(cyclic_garbage: Callable[[], list[str]]) -> None:
    """The check can fail: a cycle through the manager is found, with every object the manager holds (here its
    executor holds it back, as the book once held its queue)."""

    class Holding(TorchExecutor):
        manager: mc.CacheManager | None = None

    executor = Holding()
    with mc.CacheManager(mc.StatePool(SPEC, 8), host_pool=mc.HostPool(SPEC, 2), executor=executor) as mgr:
        mgr.flush_nowait()
        assert mgr.executor is executor
        executor.manager = mgr
    del mgr, executor
    assert {"CacheManager", "StepQueue", "HandOffBook"} <= set(cyclic_garbage())
