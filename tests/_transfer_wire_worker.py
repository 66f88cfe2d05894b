"""Runs in spawned processes: attacks on the wire of a state transfer (issue #32), rank 0 sending, rank 1 receiving.

Each case is a pair of functions (sender, receiver) over two real gloo
processes on 127.0.0.1; the ranks meet at barriers of the world group (which
the transfer does not use). A receiver's threads are real threads. Every case
ends with every state delivered exactly once, checked byte for byte, and both
sides idle (``tests/_transfer_link_worker.py`` holds the shared checks).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mambacache._handoff._link import Inbox

from ._transfer_link_worker import Side
from ._transfer_worker import HOST


class Waits:
    """Sets ``begun`` when the receiving side of the link starts to wait for a header (``Inbox.wait_key`` patched
    in this process only, for one case)."""

    def __init__(self) -> None:
        self.begun = threading.Event()
        self._real = Inbox.wait_key

    def __enter__(self) -> Waits:
        real, begun = self._real, self.begun

        def wait_key(inbox: Inbox, key: str, seconds: float) -> str | None:
            if key.startswith("hdr/"):
                begun.set()
            return real(inbox, key, seconds)

        Inbox.wait_key = wait_key  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Inbox.wait_key = self._real  # type: ignore[method-assign]


FIRST = [f"f{k}" for k in range(HOST)]


def room_freed_sender(me: Side) -> None:
    me.stage(FIRST, list(range(1, HOST + 1)), 40)
    assert me.xfer.send() == FIRST  # the receiver keeps them: no host slot left there
    ids = me.stage(["late1", "late2"], [1, 2], 41)
    dist.barrier()  # the receiver's step loop imported them all while its receive waited for this header
    assert me.xfer.send() == ids, "refused for the room the receiver had when it began to wait"
    me.idle()


def room_freed_receiver(me: Side) -> None:
    """A receive that begins to wait with a full host pool, while the step loop imports (frees) it all, judges the
    header that arrives by the room there is when it arrives. It judged it by the room when the wait began (0),
    refused the batch, and told the sender it had room for none."""
    assert me.xfer.receive() == FIRST
    got: list[Any] = []

    def receive() -> None:
        try:
            got.append(me.xfer.receive())
        except BaseException as exc:  # handed to the main thread's assertion
            got.append(exc)

    with Waits() as waits:
        thread = threading.Thread(target=receive)
        thread.start()
        assert waits.begun.wait(10)  # the receive waits for a header
        me.imports(FIRST, list(range(1, HOST + 1)), list(range(1, HOST + 1)), 40, "the batch before")
        assert me.mgr.landing_room() == HOST
        dist.barrier()
        thread.join()
    assert got == [["late1", "late2"]], got
    me.imports(["late1", "late2"], [1, 2], [1, 2], 41, "the batch judged by the room when it arrived")
    me.idle()


CASES = {
    "room freed while the receiver waits": (room_freed_sender, room_freed_receiver),
}

TIMEOUT = 5.0  # long enough for the receiver's step loop to free its host pool inside the receive's wait


def wire_worker(rank: int, port: int, cases: list[str]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        me = Side(rank, timeout=TIMEOUT)
        with me.mgr:
            for name in cases:
                dist.barrier()
                try:
                    CASES[name][rank](me)
                except AssertionError as exc:
                    raise AssertionError(f"{name} (rank {rank}): {exc}") from exc
    finally:
        dist.destroy_process_group()
