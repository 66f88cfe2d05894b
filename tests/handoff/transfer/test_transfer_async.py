"""StateTransfer.send_async / receive_async: the blocking wire runs in a worker thread, shielded once started."""

from __future__ import annotations

import threading

import anyio
import pytest

from mambacache import StateTransfer

pytestmark = [pytest.mark.anyio, pytest.mark.no_transport]  # a stand-in wire: no transfer made


class _Wire(StateTransfer):
    """The wire replaced by a call that blocks until released: no group, no peer (the async forms only wrap)."""

    def __init__(self) -> None:  # deliberately skips StateTransfer's checks: no torch.distributed here
        self.started, self.release, self.finished = threading.Event(), threading.Event(), []

    def send(self) -> list[str]:
        self.started.set()
        self.release.wait(5)
        self.finished.append("send")
        return ["a"]

    def receive(self) -> list[str]:
        self.started.set()
        self.release.wait(5)
        self.finished.append("receive")
        return ["b"]


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_cancelled_transfer_still_completes_its_batch_and_returns_its_ids(which: str) -> None:
    """Cancelled while its batch is on the wire, the call finishes the batch and returns the ids that moved (the
    states were delivered or arrived: raising instead would lose which); the cancellation comes at the caller's
    next checkpoint."""
    wire = _Wire()
    call = wire.send_async if which == "send" else wire.receive_async
    got: list[list[str]] = []
    after: list[str] = []
    scopes: list[anyio.CancelScope] = []

    async def caller() -> None:
        with anyio.CancelScope() as scope:  # the caller's alone: the test's own awaits stay uncancelled
            scopes.append(scope)
            got.append(await call())
            after.append("returned")
            await anyio.lowlevel.checkpoint()  # the cancellation is delivered here
            after.append("not cancelled")
        after.append("caught" if scope.cancelled_caught else "not caught")

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.to_thread.run_sync(wire.started.wait, 5)
        scopes[0].cancel()  # cancelled while the batch is on the wire
        await anyio.sleep(0.05)
        assert wire.finished == [] and got == []  # the shield keeps the thread's batch going
        wire.release.set()
    assert wire.finished == [which]
    assert got == [["a"] if which == "send" else ["b"]] and after == ["returned", "caught"]


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_transfer_cancelled_before_it_starts_moves_nothing_and_raises(which: str) -> None:
    wire = _Wire()
    wire.release.set()
    call = wire.send_async if which == "send" else wire.receive_async
    returned = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await call()
        returned = True
    assert scope.cancelled_caught and not returned and wire.finished == [] and not wire.started.is_set()


@pytest.mark.parametrize("which", ["send", "receive"])
async def test_an_uncancelled_transfer_returns_the_ids(which: str) -> None:
    wire = _Wire()
    wire.release.set()
    ids = await (wire.send_async() if which == "send" else wire.receive_async())
    assert ids == (["a"] if which == "send" else ["b"]) and wire.finished == [which]


@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("which", ["send", "receive"])
async def test_a_transfer_cancelled_at_any_checkpoint_moves_its_batch_once_and_returns_its_ids(
    which: str, how: str
) -> None:
    """Cancelled (a scope cancelled, or its deadline passing) as the call suspends for the k-th time, for every k:
    every suspension is the worker thread's batch, shielded, so the batch moves once and its ids come back."""
    from ...support.util import CancelAtSuspension

    at, total = 0, 1
    while at <= total:
        wire = _Wire()
        wire.release.set()
        cancel = CancelAtSuspension(at, how)
        ids = await cancel.run(wire.send_async() if which == "send" else wire.receive_async())
        assert ids == (["a"] if which == "send" else ["b"]) and wire.finished == [which], at
        assert not cancel.cancelled  # delivered at the caller's next checkpoint, after the scope
        if at == 0:
            total = cancel.suspensions
            assert total >= 1
        at += 1
