"""The real transfer link in one process: ``StateTransfer`` on clients of one ``TCPStore`` on 127.0.0.1.

Each side runs in its own thread; the gloo pairs between them are built as between processes. Shared by the
transfer suite's tests that need no second process (``tests/handoff/transfer/``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import mambacache as mc

from .util import small_spec


def free_port() -> int:
    """A port of 127.0.0.1 free now, for the spawned ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def store() -> Any:
    """A store's master on a free port of 127.0.0.1 (the clients of :func:`transfer` connect to it)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def transfer(mgr: mc.CacheManager, master: Any, rank: int, peer: int, timeout: float) -> mc.StateTransfer:
    """``mgr``'s transfer as ``rank`` to ``peer``, on a client of its own of ``master``."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    return mc.StateTransfer(mgr, None, peer=peer, store=client, rank=rank, timeout=timeout)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` in a thread; its result (or its exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test's thread
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def fail_once(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, error: BaseException) -> None:
    """``module.name`` raises ``error`` at its next call, then is itself again."""
    real = getattr(module, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(module, name, real)
        raise error

    monkeypatch.setattr(module, name, failing)


def staged_and_in_place(mgr: mc.CacheManager) -> tuple[int, int]:
    """Slots ``a`` and ``b`` held and exported, ``a`` staged and ``b`` in place (a send takes them in two batches:
    a batch is read from one place), the flush that takes the exports run."""
    (a,) = mgr.alloc(1, "a", clear=False)
    (b,) = mgr.alloc(1, "b", clear=False)
    mgr.flush_nowait()
    mgr.export(a, "a")
    mgr.export(b, "b", in_place=True)
    mgr.flush_nowait()
    return a, b


TRANSPORTS = ("gloo", "nixl", "mooncake")
# The transport every StateTransfer and ReslicingSender of a test takes unless it names one: set by the transport
# fixture (tests/conftest.py) in the test's process, and through this variable in the processes it spawns.
TRANSPORT_ENV = "MAMBACACHE_TEST_TRANSPORT"


def default_transport(name: str, setitem: Callable[[dict[str, Any], str, Any], None] | None = None) -> None:
    """Make ``name`` the transport of every StateTransfer and ReslicingSender made without one (``setitem``: a
    monkeypatch's, undone after the test; None: for the process's life, in a spawned rank)."""
    from mambacache._handoff._reslice import ReslicingSender

    for init in (mc.StateTransfer.__init__, ReslicingSender.__init__):
        defaults = init.__kwdefaults__
        assert defaults is not None and "transport" in defaults
        if setitem is None:
            defaults["transport"] = name
        else:
            setitem(defaults, "transport", name)


# Two-layer pools, and one state at a time over the real link: the transfer suite's small cases.
SMALL = small_spec(2)


def small_manager(slots: int = 4, host: int = 2) -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(SMALL, slots), host_pool=mc.HostPool(SMALL, host))


def export_valued(
    mgr: mc.CacheManager, rid: str, value: float, *, in_place: bool = False, to: int | None = None
) -> int:
    (slot,) = mgr.alloc(1, rid, clear=False)
    mgr.flush_nowait()
    for t in mgr.pool.tensors:
        t[:, slot] = value
    mgr.export(slot, rid, to=to, in_place=in_place)
    mgr.flush_nowait()
    return slot


def deliver(out: mc.StateTransfer, into: mc.StateTransfer, rid: str, why: str = "") -> None:
    """One batch of ``rid`` over the real link: sent in a thread, received and acknowledged here."""
    thread, sent = in_thread(out.send)
    assert into.receive() == [rid], why
    thread.join(10)
    assert sent == [[rid]]


def imported(mgr: mc.CacheManager, slot: int, rid: str, value: float, release: bool = True) -> None:
    """``rid``'s state imported into ``slot`` holds ``value`` in every pool tensor (then released)."""
    mgr.import_into(slot, rid)
    mgr.flush_nowait()
    assert all(bool(t[:, slot].eq(value).all()) for t in mgr.pool.tensors)
    if release:
        mgr.release(slot, rid)
