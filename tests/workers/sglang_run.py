"""One run of a random request workload through SGLang's own scheduler-side calls, for
tests/integrations/test_sglang.py.

Run in the SGLang venv as ``python -m tests.workers.sglang_run MODE SEED STEPS``; MODE is
``plain`` (SGLang alone), ``plugin`` (``SGLANG_PLUGINS=mambacache``, hooks applied
as SGLang's scheduler applies them) or ``fault`` (the plugin with its
clears dropped, ``sglang-skip-clear`` of tests/support/engine_faults). Prints one JSON object: a digest of
the mamba pool's bytes after every step, and, with the plugin, the manager's
step count and whether ``check_idle`` passed after ``cache.reset()`` and
``pool.clear()``.

The pool starts dirty (random bytes in every slot), so a missed clear shows.
Requests draw their prompts from a few shared prefixes, so prefix hits copy a
tree checkpoint into the new request's slot (copy-on-write); each step's
forward folds a per-request value into its slot's state, so a state that
started wrong stays wrong.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import random
import sys
import time
import types
from array import array
from collections import Counter
from types import SimpleNamespace
from typing import Any


def _shim() -> None:
    """Stand-ins for torchvision and datasets, which SGLang imports at module level but the CPU venv lacks.

    transformers probes torchvision with find_spec first, so it is imported before the stubs exist.
    """
    import transformers  # noqa: F401

    class _Any:
        def __getattr__(self, k: str) -> Any:
            if k.startswith("__"):
                raise AttributeError(k)
            return _Any()

        def __call__(self, *a: Any, **k: Any) -> Any:
            return _Any()

    def _getattr(k: str) -> Any:
        if k.startswith("__"):
            raise AttributeError(k)
        return _Any()

    for name in (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.io",
        "torchvision.ops",
        "datasets",
    ):
        if name in sys.modules:
            continue
        try:
            __import__(name)
            continue
        except Exception:
            pass
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__path__ = []
        m.__getattr__ = _getattr  # type: ignore[method-assign]
        sys.modules[name] = m


class Reads:
    """Counts the device-to-host reads made from mambacache's own code, by phase of the workload.

    On CUDA each ``.tolist()``, ``.item()``, ``int(t)``, ``.cpu()``... of a
    device tensor waits for the device; on CPU none of them dispatches an op
    (``.tolist()`` reads the memory directly), so a dispatch mode cannot see
    them: the tensor methods themselves are wrapped, and a call counts when
    the frame that made it is in the mambacache package (the plugin, or a
    manager handed a tensor). SGLang's own reads and this harness's are not
    counted.
    """

    METHODS = ("tolist", "item", "numpy", "cpu", "to", "__int__", "__index__", "__float__", "__bool__")

    def __init__(self) -> None:
        import torch

        import mambacache

        self.root = os.path.dirname(os.path.abspath(mambacache.__file__)) + os.sep
        self.phase = "other"
        self.counts: Counter[str] = Counter()
        self.originals = {name: torch.Tensor.__dict__.get(name) for name in self.METHODS}  # None: inherited
        for name in self.METHODS:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def close(self) -> None:
        """Put torch's own methods back (a test process goes on after counting)."""
        import torch

        for name, original in self.originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        def read(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            to_host = name != "to" or any(str(a) == "cpu" for a in (*args, *kwargs.values()))
            if to_host and sys._getframe(1).f_code.co_filename.startswith(self.root):
                self.counts[self.phase] += 1
            return original(tensor, *args, **kwargs)

        return read

    def take(self, phase: str) -> int:
        """The reads counted in ``phase`` since the last take."""
        return self.counts.pop(phase, 0)


def main(mode: str, seed: int, steps: int) -> dict[str, Any]:
    if mode != "plain":
        os.environ["SGLANG_PLUGINS"] = "mambacache"
    _shim()
    import torch

    reads = Reads()
    if mode != "plain":
        from sglang.srt.plugins import load_plugins

        load_plugins()  # as run_scheduler_process does first: finds mambacache by its entry point
        if mode == "fault":
            import mambacache.integrations.sglang as plugin

            from ..support.engine_faults.mambacache_test_faults import inject

            inject("sglang-skip-clear", plugin)

    import sglang.test.kits.unified_radix_cache.fixtures as fx
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    fx.get_device = lambda *a, **k: "cpu"  # no accelerator here
    cache, allocator, pool = fx.build_fixture(
        CacheConfig(components=(ComponentType.FULL, ComponentType.MAMBA), mamba_cache_size=10, max_num_reqs=12)
    )
    mp = pool.mamba_pool
    tensors = [*mp.mamba_cache.conv, mp.mamba_cache.temporal]
    g = torch.Generator().manual_seed(seed)
    for t in tensors:  # dirty: every slot holds an old tenant's state
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
    running: list[Any] = []
    digests: list[str] = []
    counter = 0
    work = {"clears": 0, "cows": 0, "evictions": 0, "checkpoints": 0, "retractions": 0}
    tenant_errors: list[dict[str, Any]] = []
    step_us: list[float] = []  # host time of each step's deferred clears and copies
    step_ops: list[int] = []
    # mambacache's device reads per step: scheduling (frees, matches, allocations, evictions), the forward step's
    # flush, and the direct calls (retraction backups and loads, checkpoint copies) with how many there were.
    read_log: dict[str, list[int]] = {k: [] for k in ("schedule", "step", "retract", "retractions", "checkpoint")}
    audit = os.environ.get("MAMBACACHE_SGLANG_AUDIT") == "1"
    from mambacache.audit import OpAudit

    if mode != "plain":
        from mambacache.integrations import sglang as plugin

    def forward(reqs: list[Any], step: int) -> None:
        for r in reqs:
            s = int(r.kv.mamba_pool_idx)
            for t in tensors:
                t[:, s] = t[:, s] * 0.5 + float(int(r.rid[1:]) % 97 + step)

    schedule_us: list[float] = []  # host time of each step's scheduling: finishes, matches, allocations
    for step in range(steps):
        reads.phase = "schedule"
        t_schedule = time.perf_counter()
        # Finish some running requests: their slots become tree checkpoints or are freed.
        for r in [r for r in running if rng.random() < 0.4]:
            r.finished_reason = FINISH_LENGTH(length=0)
            release_kv_cache(r, cache, checkpoint=True)
            running.remove(r)
        new: list[Any] = []
        for _ in range(rng.randrange(0, 3)):
            if len(running) + len(new) >= 4:
                break
            if pool.mamba_allocator.available_size() < 2:
                cache.evict(EvictParams(mamba_num=2))
                work["evictions"] += 1
            if pool.mamba_allocator.available_size() < 2:
                break
            counter += 1
            ids = prefixes[rng.randrange(len(prefixes))] + [rng.randrange(1, 3) for _ in range(rng.randrange(0, 3))]
            r = Req(
                rid=f"r{counter}",
                origin_input_text="",
                origin_input_ids=array("q", ids),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
            )
            r.output_ids = array("q")
            r.extra_key = None
            r.lock = None
            r.last_node = cache.root_node_handle()
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids)), cow_mamba=True, req=r))
            r.prefix_len = r.kv.cache_protected_len = m.device_prefix_len
            r.last_node = m.last_device_node
            r.lock = cache.lock(m.last_device_node)
            pool.alloc([r])
            if m.device_prefix_len:
                pool.write((r.kv.req_pool_idx, slice(0, m.device_prefix_len)), cache.prefix_device_indices(r))
            new.append(r)
        schedule_us.append((time.perf_counter() - t_schedule) * 1e6)
        # The step: collect the deferred clears and copies (prepare_for_extend), run them (the forward).
        batch = SimpleNamespace()
        ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, new)
        for key, field in (("clears", "mamba_clear_indices"), ("cows", "mamba_cow_src_indices")):
            got = getattr(batch, field, None)
            work[key] += 0 if got is None else len(got)
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, **vars(batch))
        reads.phase = "step"
        if audit:  # aten ops of the step's clears and copies (a separate run: the audit's own cost skews timing)
            with OpAudit() as op_audit:
                ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(runner, fb)
            step_ops.append(op_audit.report().ops)
        else:
            t0 = time.perf_counter()
            ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(runner, fb)
            step_us.append((time.perf_counter() - t0) * 1e6)
        reads.phase = "other"
        for r in new:
            start, n = r.kv.cache_protected_len, len(r.origin_input_ids)
            pool.write((r.kv.req_pool_idx, slice(start, n)), allocator.alloc(n - start))
            r.full_untruncated_fill_ids = array("q", r.origin_input_ids)
            r.kv.kv_committed_len = r.kv.kv_allocated_len = n
        running += new
        forward(running, step)
        # A retraction with a backup (decode disaggregation's path): the state goes to the host, the slot is
        # freed, the request is admitted again into a new slot and its state loaded back.
        reads.phase, retractions = "retract", work["retractions"]
        for r in running:
            if rng.random() < 0.2 and pool.mamba_allocator.available_size() >= 1:
                backup = mp.get_cpu_copy(r.kv.mamba_pool_idx.unsqueeze(0))
                pool.free_mamba_cache(r)
                pool.alloc([r])
                r.kv.mamba_needs_clear = False  # the backup is the state: nothing to clear
                mp.load_cpu_copy(backup, r.kv.mamba_pool_idx.unsqueeze(0))
                work["retractions"] += 1
        # A chunked-prefill style checkpoint of a running request: SGLang copies its slot into a new tree slot.
        reads.phase = "checkpoint"
        for r in running:
            if rng.random() < 0.3 and pool.mamba_allocator.available_size() >= 1:
                cache.checkpoint(r, up_to=r.kv.kv_committed_len)
                work["checkpoints"] += 1
        reads.phase = "other"
        for phase in ("schedule", "step", "retract", "checkpoint"):
            read_log[phase].append(reads.take(phase))
        read_log["retractions"].append(work["retractions"] - retractions)
        if mode != "plain":  # held() names each slot's request, or the tree for its checkpoints
            plugin.settle()  # the allocator's frees and allocations since the step, one read (not counted)
            tree = {int(v) for v in cache.all_mamba_values_flatten().tolist()}
            want = {s: plugin.TREE_TENANT for s in tree} | {int(r.kv.mamba_pool_idx): r.rid for r in running}
            got = plugin.managers()[0].held()
            if got != dict(sorted(want.items())):
                tenant_errors.append({"step": step, "held": got, "want": want})
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(digest.hexdigest()[:16])
    for r in running:
        r.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(r, cache, checkpoint=True)
    out: dict[str, Any] = {"digests": digests, "work": work, "step_us": step_us, "step_ops": step_ops}
    out["reads"], out["schedule_us"] = read_log, schedule_us
    if mode != "plain":
        (mgr,) = plugin.managers()
        plugin.settle()
        out["tenant_errors"] = tenant_errors[:3]
        out["manager_steps"] = mgr.step
        out["counts"] = plugin.counts()
        out["held_matches"] = sorted(mgr.held()) == sorted(
            set(range(1, mp.size + 1)) - set(pool.mamba_allocator.free_slots.tolist())
        )
        cache.reset()
        pool.clear()
        try:
            mgr.check_idle()
            out["idle"] = True
        except Exception as exc:
            out["idle"] = repr(exc)
        trace = os.environ.get("MAMBACACHE_TRACE")
        if trace:  # the plugin turned tracing on in register(); what does the trace say about every slot?
            from mambacache import tracing

            tracing.disable()
            analysis = tracing.analyze(trace, expect_idle=True)
            out["trace_anomalies"] = sorted({a.kind for a in analysis.anomalies})
    return out


def run_json(module: str, *args: object, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m module args`` in a fresh process (SGLang's hooks are per process), from a clean
    environment (no SGLANG_PLUGINS, no MAMBACACHE_*) plus ``env``; returns the JSON of its last line."""
    import subprocess

    clean = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS" and not k.startswith("MAMBACACHE_")}
    out = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
