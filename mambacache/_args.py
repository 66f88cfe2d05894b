"""The checks CacheManager's calls make on their arguments before anything is queued (shared by its mixins)."""

from __future__ import annotations

from typing import Any, Protocol

from ._errors import InvalidArgumentError, InvalidSlotError
from ._host import HostPool
from ._pool import StatePool
from ._validate import as_slot, check_request_id, slot_list

__all__ = ["host_slot", "many", "need_host", "paired", "slot_of"]


class Facade(Protocol):
    """What the checks read of the manager."""

    @property
    def pool(self) -> StatePool: ...

    @property
    def host_pool(self) -> HostPool | None: ...

    def check_open(self) -> None: ...


def many(mgr: Facade, slots: Any, request_id: Any, host: str = "") -> list[int]:
    """A bulk form's slots as ints in range, after the checks its single form makes first (``host``: it needs
    a host pool)."""
    if host:
        need_host(mgr, host)
    mgr.check_open()
    check_request_id(request_id)
    return slot_list(slots, mgr.pool.num_slots)


def paired(what: str, firsts: list[int], seconds: list[int]) -> list[int]:
    """``seconds``, checked to be as many as ``firsts``."""
    if len(firsts) != len(seconds):
        names = ("source(s)", "destination(s)") if what == "copy_many" else ("host slot(s)", "slot(s)")
        raise InvalidArgumentError(f"{what}: {len(firsts)} {names[0]} but {len(seconds)} {names[1]}")
    return seconds


def need_host(mgr: Facade, what: str) -> HostPool:
    mgr.check_open()
    if mgr.host_pool is None:
        raise InvalidArgumentError(f"{what} needs a host pool: CacheManager(pool, host_pool=HostPool(spec, n))")
    return mgr.host_pool


def slot_of(pool: StatePool, slot: Any, request_id: Any) -> int:
    check_request_id(request_id)
    return as_slot(slot, pool.num_slots)


def host_slot(hp: HostPool, host: Any) -> int:
    try:
        return as_slot(host, hp.num_slots)
    except InvalidSlotError as exc:
        raise InvalidSlotError(f"host {exc}") from None
