"""A request aborted while retracted, through SGLang's own retraction and abort calls, for
tests/integrations/test_sglang.py.

Run in the SGLang venv as ``python -m tests.workers.sglang_abort``: with
``SGLANG_PLUGINS=mambacache``, two requests run a step; both are retracted with
a backup as decode disaggregation does (``backup_kv_cache(..., "cpu_tensor")``:
``Req.offload_kv_cache``, whose mamba part is ``MambaPool.get_cpu_copy``, then
``release_kv_cache``); one is aborted (``discard_kv_cache_backup``, which only
lets go of the backup), the other is admitted again and its backup loaded
(``restore_kv_cache``: ``Req.load_kv_cache``, whose mamba part is
``MambaPool.load_cpu_copy``). Prints one
JSON object: the host slots held after the retraction, after the abort and the
next forward step, whether the resumed request's state came back, and whether
``check_idle`` (host slots included) passes once the tree and pool are reset.
"""

from __future__ import annotations

import json
import os
from array import array
from types import SimpleNamespace
from typing import Any

from tests.workers.sglang_run import _shim


def main() -> dict[str, Any]:
    os.environ["SGLANG_PLUGINS"] = "mambacache"
    _shim()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.test.kits.unified_radix_cache.fixtures as fx
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import (
        backup_kv_cache,
        discard_kv_cache_backup,
        release_kv_cache,
        restore_kv_cache,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    from mambacache.integrations import sglang as plugin

    fx.get_device = lambda *a, **k: "cpu"
    cache, allocator, pool = fx.build_fixture(
        CacheConfig(components=(ComponentType.FULL, ComponentType.MAMBA), mamba_cache_size=10, max_num_reqs=12)
    )
    mp = pool.mamba_pool
    (mgr,) = plugin.managers()
    assert mgr.host_pool is not None
    runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)

    def step(reqs: list[Any]) -> None:
        """The forward step's deferred clears and copies (the plugin's one flush of the step)."""
        batch = SimpleNamespace()
        ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, reqs)
        ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(
            runner, SimpleNamespace(forward_mode=ForwardMode.EXTEND, **vars(batch))
        )

    def admit(r: Any) -> None:
        r.last_node = cache.root_node_handle()
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(r.origin_input_ids), cow_mamba=False, req=r))
        r.prefix_len = r.kv.cache_protected_len = m.device_prefix_len
        r.last_node = m.last_device_node
        r.lock = cache.lock(m.last_device_node)
        pool.alloc([r])
        n = len(r.origin_input_ids)
        pool.write((r.kv.req_pool_idx, slice(0, n)), allocator.alloc(n))
        r.kv.kv_committed_len = r.kv.kv_allocated_len = n
        r.full_untruncated_fill_ids = array("q", r.origin_input_ids)

    reqs = []
    for i, ids in enumerate(([5, 6, 7, 8], [9, 10, 11])):
        r = Req(
            rid=f"r{i}",
            origin_input_text="",
            origin_input_ids=array("q", ids),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=4),
        )
        r.output_ids = array("q", [1])  # one decoded token: seqlen - 1 tokens of KV to back up
        r.extra_key = None
        r.lock = None
        admit(r)
        reqs.append(r)
    step(reqs)
    states = {}
    for value, r in enumerate(reqs, start=1):  # what the forward wrote into each slot
        s = int(r.kv.mamba_pool_idx)
        for t in (*mp.mamba_cache.conv, mp.mamba_cache.temporal):
            t[:, s] = float(value)
        states[r.rid] = float(value)
    out: dict[str, Any] = {}
    for r in reqs:  # SGLang's retraction in decode disaggregation (release_req): backup, then release
        assert backup_kv_cache(r, cache, pool, allocator, "cpu_tensor")
        # A hybrid model's KV pool (HybridLinearKVPool) carries the mamba copy in its own: (kv, mamba).
        assert isinstance(r.kv.retraction_backup.cpu_tensors[1], plugin.HostCopy)
        release_kv_cache(r, cache, checkpoint=False)
    out["host_held_retracted"] = len(mgr.host_pool.held())
    aborted, resumed = reqs
    discard_kv_cache_backup(aborted, cache, "cpu_tensor")  # the scheduler's abort of a retracted request
    aborted.finished_reason = FINISH_ABORT()
    # The other request is admitted again into a new slot and its backup loaded (the prebuilt batch's restore).
    admit(resumed)
    resumed.kv.mamba_needs_clear = False  # the backup is the state
    restore_kv_cache(resumed, cache, pool, allocator, "cpu_tensor")
    step([resumed])
    s = int(resumed.kv.mamba_pool_idx)
    out["resumed_state"] = all(
        bool(t[:, s].eq(states[resumed.rid]).all()) for t in (*mp.mamba_cache.conv, mp.mamba_cache.temporal)
    )
    out["host_held_after_step"] = mgr.host_pool.held()
    resumed.finished_reason = FINISH_ABORT()
    release_kv_cache(resumed, cache, checkpoint=False)
    cache.reset()
    pool.clear()
    try:
        mgr.check_idle(host=True)
        out["idle"] = True
    except Exception as exc:
        out["idle"] = repr(exc)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
