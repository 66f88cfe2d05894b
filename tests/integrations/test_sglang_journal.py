"""The SGLang plugin's journal, property-tested without SGLang: SGLang's slot allocator's semantics, the plugin's
hooks called as SGLang's ``HookRegistry`` calls them, against a plain reference of which slots are held by whom.

SGLang's ``MambaSlotAllocator`` (0.5.23, ``mem_cache/allocator/mamba.py``) keeps
its free list as a device tensor that it slices and rebinds; ``Allocator`` below
is that class's free-list code. The hooks must read no slot id to the host
(each read is a synchronisation on CUDA); a step's flush, or ``settle()``, reads
everything recorded since in one transfer and brings the manager's ledger to
the allocator's held set, each slot named by its request or the tree.
tests/integrations/test_sglang.py drives SGLang's own objects in its own venv.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mambacache.integrations import sglang as plugin

from ..workers.sglang_run import Reads

SIZE = 8


class Allocator:
    """SGLang's ``MambaSlotAllocator`` free list: ``_do_alloc`` slices it, ``free`` appends with ``torch.cat``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def _do_alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_slots):
            return None
        select_index = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return select_index

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.free_slots = torch.cat((self.free_slots, free_index))

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)


class Sglang:
    """SGLang's objects as the hooks see them, each call followed by its hook; ``held`` is the reference."""

    def __init__(self) -> None:
        self.allocator = Allocator(SIZE)
        conv, temporal = torch.zeros(1, SIZE + 1, 4, 3), torch.zeros(1, SIZE + 1, 2, 2)
        self.mamba_pool = SimpleNamespace(mamba_cache=SimpleNamespace(conv=[conv], temporal=temporal))
        self.pool = SimpleNamespace(
            mamba_pool=self.mamba_pool, mamba_allocator=self.allocator, translate_mamba_indices=lambda t: t
        )
        self.mgr = plugin.adopt(self.pool)
        assert self.mgr is not None
        self.held: dict[int, str | None] = {}
        self.mapping = torch.zeros(4, dtype=torch.int64)  # a request-row mapping: a free's index may view it
        self.count = 0

    def alloc(self, n: int, named: bool) -> None:
        result = self.allocator._do_alloc(n)
        plugin._after_alloc(result, self.allocator, n)
        if result is None:
            return
        reqs = []
        for j, s in enumerate(result.tolist()):  # the reference reads; the hooks must not
            self.count += 1
            self.held[s] = f"r{self.count}" if named else None
            reqs.append(SimpleNamespace(rid=f"r{self.count}", kv=SimpleNamespace(mamba_pool_idx=result[j])))
        if named:  # HybridReqToTokenPool.alloc: each request's new slot gets its rid
            plugin._after_pool_alloc(True, self.pool, reqs)

    def free(self, slots: list[int]) -> None:
        """Free ``slots`` through a view of a mapping row, which a new request overwrites right after."""
        self.mapping[: len(slots)] = torch.tensor(slots)
        row = self.mapping[: len(slots)]
        self.allocator.free(row)
        plugin._after_free(None, self.allocator, row)
        self.mapping.fill_(-7)  # the row's next tenant: the journal must still replay the freed ids
        for s in slots:
            del self.held[s]

    def tree(self, slot: int) -> None:
        """The radix tree takes ``slot`` (a finished request's): no event in SGLang, a hand-over here."""
        component = SimpleNamespace(cache=SimpleNamespace(req_to_token_pool=self.pool))
        value = torch.tensor([slot])
        plugin._around_commit_insert(
            lambda *a, **k: None,
            component,
            node=None,
            is_new_leaf=True,
            params=SimpleNamespace(mamba_value=value),
            result=SimpleNamespace(mamba_exist=False),
            cache_actions=None,
        )
        self.held[slot] = plugin.TREE_TENANT

    def reset(self) -> None:
        self.allocator.clear()
        plugin._after_clear(None, self.allocator)
        self.held = {}

    def step(self, clear: list[int]) -> None:
        """A forward step's deferred clears (the model runner's hook): the journal and the indices, one read."""
        mode = SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False, is_draft_extend_v2=lambda: False)
        batch = SimpleNamespace(
            forward_mode=mode,
            mamba_clear_indices=torch.tensor(clear, dtype=torch.int64) if clear else None,
            mamba_cow_src_indices=None,
            mamba_cow_dst_indices=None,
        )
        runner = SimpleNamespace(req_to_token_pool=self.pool, is_draft_worker=False)
        plugin._deferred_cow_and_clear(lambda *a: None, runner, batch)


op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("free"), st.integers(1, 3), st.randoms(use_true_random=False)),
    st.tuples(st.just("tree"), st.randoms(use_true_random=False)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("settle")),
    st.tuples(st.just("step"), st.integers(0, 2), st.randoms(use_true_random=False)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(op, max_size=40))
def test_hooks_read_nothing_and_a_step_brings_the_ledger_to_sglangs_allocator(ops: list[Any]) -> None:
    sg = Sglang()
    reads = Reads()
    try:
        for o in ops:
            kind = o[0]
            if kind == "alloc":
                sg.alloc(o[1], o[2])
            elif kind == "free" and sg.held:
                sg.free(o[2].sample(sorted(sg.held), min(o[1], len(sg.held), len(sg.mapping))))
            elif kind == "tree" and sg.held:
                sg.tree(o[1].choice(sorted(sg.held)))
            elif kind == "reset":
                sg.reset()
            assert reads.take("other") == 0, o  # no hook reads a slot id
            if kind == "settle":
                plugin.settle(sg.pool)
                assert reads.take("other") <= 1  # the journal: one transfer (none when empty)
                assert sg.mgr.held() == dict(sorted(sg.held.items()))
            elif kind == "step":
                pool = sg.mamba_pool.mamba_cache
                pool.temporal.fill_(1.0)
                clear = o[2].sample(sorted(sg.held), min(o[1], len(sg.held)))
                sg.step(clear)
                assert all(bool(pool.temporal[:, s].eq(0).all()) == (s in clear) for s in range(1, SIZE + 1))
                # A step with clears reads the journal and its indices in one transfer; one without reads nothing
                # (the journal waits, unless it has grown long), and held() is then as of the last read.
                n = reads.take("other")
                assert n == 1 if clear else n <= 1
                if n:
                    assert sg.mgr.held() == dict(sorted(sg.held.items()))
        plugin.settle(sg.allocator)
        assert sg.mgr.held() == dict(sorted(sg.held.items()))
    finally:
        reads.close()
        sg.mgr.__exit__(None, None, None)
