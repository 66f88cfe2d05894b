"""SGLang's own test kit fixtures (``sglang/test/kits/unified_radix_cache/core.py``), with and without the plugin.

Run in the SGLang venv as ``python -m tests.workers.sglang_kits MODE`` (``plain`` or
``plugin``); prints one JSON object with what each kit observed, for
tests/integrations/test_sglang.py to compare across the two modes, and, with the plugin, the
manager's view next to SGLang's allocator after each kit.

* LRU match refresh (``UnifiedMambaLRUMatchRefreshFixtures``): after inserts
  and a match, the mamba LRU order (a match refreshes only the best-match node);
* checkpoint grid (``MambaCheckpointGridFixtures._branching_seqlen``): where a
  match branches when the leaf's mamba value is gone, over page sizes and hit
  lengths (the kit asserts its own hit lengths);
* finished overshoot (``MambaFinishedOvershootCheckpointFixtures``): which
  ping-pong slot a finished request's checkpoint takes, with the extra buffer.
"""

from __future__ import annotations

import json
import os
import sys
import unittest
from array import array
from typing import Any

from tests.workers.sglang_run import _shim


def main(mode: str) -> dict[str, Any]:
    if mode != "plain":
        os.environ["SGLANG_PLUGINS"] = "mambacache"
    _shim()
    if mode != "plain":
        from sglang.srt.plugins import load_plugins

        load_plugins()
    import sglang.test.kits.unified_radix_cache.fixtures as fx

    fx.get_device = lambda *a, **k: "cpu"
    import sglang.test.kits.unified_radix_cache.core as core
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    core.build_fixture = fx.build_fixture  # the kit imported it before the device was forced
    mamba = (ComponentType.FULL, ComponentType.MAMBA)
    out: dict[str, Any] = {}
    views: list[Any] = []

    def view(pool: Any) -> None:
        """The plugin's manager against SGLang's allocator: the same held slots, each with a tenant."""
        if mode == "plain":
            return
        from mambacache.integrations import sglang as plugin

        mgr = plugin.adopt(pool)
        assert mgr is not None
        plugin.settle()  # the allocations and frees since the last step (the kits run no step)
        free = set(pool.mamba_allocator.free_slots.tolist())
        held = mgr.held()
        views.append(sorted(held) == sorted(set(range(1, mgr.pool.num_slots + 1)) - free) and None not in held.values())

    # -- LRU match refresh --------------------------------------------------------
    class Lru(core.UnifiedMambaLRUMatchRefreshFixtures, unittest.TestCase):
        cfg = CacheConfig(components=mamba)

    lru = Lru()
    cache, allocator, pool = fx.build_fixture(Lru.cfg)
    for n in (4, 8, 12):
        req = lru._make_req(pool)
        seq = list(range(1, n + 1))
        cache.insert(
            InsertParams(
                key=RadixKey(array("q", seq)),
                value=allocator.alloc(n),
                mamba_value=req.kv.mamba_pool_idx.unsqueeze(0),
            )
        )
    before = lru._mamba_lru_mru_to_lru(cache)
    fx.match_prefix(cache, list(range(1, 9)))
    out["lru"] = {"before": before, "after": lru._mamba_lru_mru_to_lru(cache)}
    view(pool)

    # -- checkpoint grid ----------------------------------------------------------
    class Grid(core.MambaCheckpointGridFixtures, unittest.TestCase):
        cfg = CacheConfig(components=mamba, enable_mamba_extra_buffer=True)

    grid = Grid()
    out["grid"] = {
        f"{page}/{hit}": grid._branching_seqlen(tree_page_size=page, full_hit_length=hit)
        for page, hit in ((4, 8), (16, 128), (32, 96), (64, 192))
    }

    # -- finished overshoot -------------------------------------------------------
    class Overshoot(core.MambaFinishedOvershootCheckpointFixtures, unittest.TestCase):
        cfg = CacheConfig(components=mamba, enable_mamba_extra_buffer=True)
        _rid = 0  # UnifiedRadixCacheFixtures._make_req counts request ids here

    overshoot = Overshoot()
    taken = {}
    for previous in (0, 4, 8):
        cache, allocator, pool = fx.build_fixture(Overshoot.cfg)
        req, tokens = overshoot._build_req(allocator, pool, previous)
        view(pool)  # the request's slot and its ping-pong track slots, all named by its rid
        req.full_untruncated_fill_ids = array("q", tokens)
        req.lock = None
        req.last_node = cache.root_node_handle()
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, cache, checkpoint=True)
        taken[previous] = {
            "tree": sorted(int(v) for v in cache.all_mamba_values_flatten().tolist()),
            "free": sorted(pool.mamba_allocator.free_slots.tolist()),
        }
        view(pool)
    out["overshoot"] = taken
    if mode != "plain":
        out["views_agree"] = all(views) and len(views) == 7
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
