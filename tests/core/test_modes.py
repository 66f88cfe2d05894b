"""A pool flushed under any torch mode, in any order, from any thread, keeps working.

Engines run their model under ``torch.inference_mode`` (some under ``no_grad``)
and tear down outside it; a pool may even be allocated under inference mode
(its tensors are then inference tensors, which refuse an in-place op outside
it). The matrix: executors (reference, torch, torch-inline, npu) x the pool
made normally or under inference mode x the mode of a first flush x the mode
of a second one, made on the same thread or another, then a flush and the
close outside every mode; each flush against the sequential oracle. The states
are large enough that the torch executor cuts them into byte views under the
grain and shares a stage with its helper threads. Every cell under
``MAMBACACHE_FULL_SWEEP=1`` (CI), a deterministic sample otherwise
(``tests/support/sweep.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import mambacache as mc
from mambacache._executors._npu import NpuExecutor
from mambacache._executors._reference import ReferenceExecutor
from mambacache._executors._torch import TorchExecutor
from mambacache.testing import SequentialOracle

from ..support import link
from ..support.sweep import fault_points
from ..support.util import fill_random, small_spec

MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "inference": torch.inference_mode,
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "none": contextlib.nullcontext,
}
EXECUTORS: dict[str, Callable[[], mc.Executor]] = {
    "reference": ReferenceExecutor,
    "torch": TorchExecutor,
    "torch-inline": lambda: TorchExecutor(share_stages=False),
    "npu": NpuExecutor,
}
# A slot's temporal state is 65,536 fp32 elements (256 KiB): past the grain, so the torch executor cuts it
# into byte views, and a stage of nine slots (2.25 MiB) is shared with the crew.
SPEC = mc.StateSpec(num_layers=2, conv_shapes=[(6, 3)], temporal_shape=(8, 64, 64))
N, H = 20, 4
CELLS = list(itertools.product(sorted(EXECUTORS), [False, True], MODES, MODES, [False, True]))


class _Pool:
    def __init__(self, executor: str, made_in_inference: bool) -> None:
        with torch.inference_mode(made_in_inference):
            self.pool = mc.StatePool(SPEC, N)
            self.host = mc.HostPool(SPEC, H)
        self.mgr = mc.CacheManager(self.pool, executor=EXECUTORS[executor](), host_pool=self.host)
        self.mgr.__enter__()
        self.slots = self.mgr.alloc(N - 2)
        self.mgr.flush_nowait()
        with torch.inference_mode():  # the forward writes every state (inference tensors or not)
            fill_random(self.pool, 3)
        self.oracle = SequentialOracle(self.pool, self.host)
        self.hosts: list[int] = []

    def step(self, i: int) -> None:
        """A step with every stage kind and a crew-sized copy: forks, a rotate, clears, an offload, a restore."""
        mgr, s = self.mgr, self.slots
        before = mgr.pending
        a, b, t = s[i % 3], s[3 + i % 3], s[-1]
        mgr.submit(mc.CopyOnWrite(a, t), mc.CopyOnWrite(b, a), mc.CopyOnWrite(t, b))
        mgr.copy_many([s[6 + i % 2]] * 9, s[8:17])
        mgr.clear(s[17 - i % 2])
        if len(self.hosts) < H - 1:
            self.hosts.append(mgr.offload(s[i % 5]))
        mgr.restore(self.hosts[0], s[5], keep=True)
        self.oracle.apply(mgr.queued()[before:])

    def flush(self, i: int, mode: str, other_thread: bool) -> None:
        def run() -> None:
            with MODES[mode]():
                self.step(i)
                self.mgr.flush_nowait()

        if not other_thread:
            run()
        else:
            errors: list[BaseException] = []

            def guarded() -> None:
                try:
                    run()
                except BaseException as exc:  # re-raised on the test's thread
                    errors.append(exc)

            thread = threading.Thread(target=guarded)
            thread.start()
            thread.join()
            if errors:
                raise errors[0]
        self.oracle.assert_matches(self.pool, self.host)


def _cell(executor: str, made_in_inference: bool, first: str, second: str, other_thread: bool) -> None:
    case = _Pool(executor, made_in_inference)
    case.flush(0, first, False)
    case.flush(1, second, other_thread)
    case.flush(2, "none", False)
    case.step(3)  # the close's last flush runs it, outside every mode
    case.mgr.__exit__(None, None, None)
    case.oracle.assert_matches(case.pool, case.host)
    assert case.pool.unfinished == 0 and case.pool.ledger.owner is None


def test_a_pool_flushed_under_any_mode_in_any_order_from_any_thread_keeps_working() -> None:
    for k in fault_points(len(CELLS)):
        try:
            _cell(*CELLS[k - 1])
        except BaseException as exc:
            raise AssertionError(f"cell {CELLS[k - 1]}: {exc!r}") from exc


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_a_flush_under_inference_mode_then_one_outside_it(executor: str) -> None:
    """An engine's shape: the pool made normally, the model's steps under inference mode, the close outside."""
    _cell(executor, False, "inference", "none", True)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_a_pool_made_under_inference_mode_flushed_and_closed_outside_it(executor: str) -> None:
    _cell(executor, True, "inference", "no_grad", False)


@pytest.mark.anyio
async def test_an_async_flush_under_inference_mode_then_a_close_outside_it() -> None:
    for made_in_inference in (False, True):
        case = _Pool("torch", made_in_inference)
        with torch.inference_mode():
            case.step(0)
            await case.mgr.flush()
        case.oracle.assert_matches(case.pool, case.host)
        case.step(1)
        await case.mgr.__aexit__(None, None, None)
        case.oracle.assert_matches(case.pool, case.host)


@pytest.mark.parametrize("made_in_inference", [False, True], ids=["made-normally", "made-in-inference"])
def test_state_indices_updated_under_any_mode_from_any_thread_keep_working(made_in_inference: bool) -> None:
    pool = mc.StatePool(small_spec(), 8, pad_slots=2)
    with torch.inference_mode(made_in_inference):
        indices = mc.StateIndices.for_pool(pool, 6)
    for i, (mode, other_thread) in enumerate(itertools.product(MODES, [False, True])):
        slots = [1 + (i + j) % 8 for j in range(1 + i % 4)]
        got: list[torch.Tensor] = []

        def update(mode: str = mode, slots: list[int] = slots, got: list[torch.Tensor] = got) -> None:
            with MODES[mode]():
                got.append(indices.update(slots))

        if other_thread:
            thread = threading.Thread(target=update)
            thread.start()
            thread.join()
        else:
            update()
        assert got and got[0].tolist() == slots, f"{mode}, other thread {other_thread}"
        pads = pool.pad_ids
        assert indices.tensor.tolist() == slots + [pads[k % len(pads)] for k in range(len(slots), 6)]


def _send_one(
    mgr: mc.CacheManager, peer: mc.CacheManager, out: mc.StateTransfer, into: mc.StateTransfer, rid: str, **how: Any
) -> None:
    """``rid``'s state (every element ``how["value"]``) exported, sent and received (both sides under ``how["mode"]``,
    each on its own thread), imported into the peer's slot 2 and checked, then released on both sides."""
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    with torch.inference_mode():  # the forward writes it
        for t in mgr.pool.tensors:
            t[:, slot] = how["value"]
    mgr.export(slot, rid, in_place=how["in_place"])
    mgr.flush_nowait()
    if how["in_place"]:
        peer.expect_import(2, rid)
        peer.flush_nowait()

    def send() -> list[str]:
        with MODES[how["mode"]]():
            return out.send()

    thread, sent = link.in_thread(send)
    with MODES[how["mode"]]():
        assert into.receive() == [rid]
    thread.join(10)
    assert sent == [[rid]]
    peer.import_into(2, rid)
    peer.flush_nowait()
    assert all(bool(t[:, 2].eq(how["value"]).all()) for t in peer.pool.tensors)
    peer.release(2, rid)
    mgr.flush_nowait()
    peer.flush_nowait()


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
@pytest.mark.parametrize("made_in_inference", [False, True], ids=["made-normally", "made-in-inference"])
def test_states_sent_under_inference_mode_then_outside_it_land(made_in_inference: bool, in_place: bool) -> None:
    """The engine's transfer threads send and receive under inference mode, then outside it (the buffers a
    transfer keeps between batches are made in the first), over the real link (tests/support/link.py); both sides'
    pools and host pools made normally or under inference mode."""
    spec = small_spec(2)
    with torch.inference_mode(made_in_inference):
        pools = [(mc.StatePool(spec, 4), mc.HostPool(spec, 2)) for _ in range(2)]
    master = link.store()
    (pool, host), (peer_pool, peer_host) = pools
    with mc.CacheManager(pool, host_pool=host) as mgr, mc.CacheManager(peer_pool, host_pool=peer_host) as peer:
        out, into = link.transfer(mgr, master, 0, 1, 5.0), link.transfer(peer, master, 1, 0, 5.0)
        for i, mode in enumerate(["inference", "none", "no_grad", "inference"]):
            _send_one(mgr, peer, out, into, f"r{i}", value=3.0 + i, in_place=in_place, mode=mode)
        mgr.check_idle(host=True)
        peer.check_idle(host=True)
