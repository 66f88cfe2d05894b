"""A transport by name: ``"gloo"`` (the default, no package beyond torch), ``"nixl"``, ``"mooncake"``."""

from __future__ import annotations

from typing import Any

from ..._core._errors import InvalidArgumentError, TransportUnavailableError
from ._base import Transport

__all__ = ["EXTRAS", "TRANSPORTS", "check_transport", "make", "one_host_ucx"]

# Each transport's package and the extra of mambacache that installs it.
EXTRAS = {"gloo": ("torch.distributed", ""), "nixl": ("nixl_cu12", "nixl"), "mooncake": ("mooncake", "mooncake")}
TRANSPORTS = tuple(EXTRAS)


def check_transport(transport: object) -> str:
    """``transport`` as one of :data:`TRANSPORTS`; :class:`~mambacache.TransportUnavailableError` (an
    ImportError) naming the extra to install when its package is missing."""
    if not isinstance(transport, str) or transport not in EXTRAS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}")
    module, extra = EXTRAS[transport]
    if extra:
        import importlib.util

        if importlib.util.find_spec(module) is None:
            raise TransportUnavailableError(
                f"the {transport} transport needs its package: pip install 'mambacache[{extra}]'", transport, extra
            )
    return transport


def make(transport: str, store: Any, rank: int, peer: int, timeout: float) -> Transport:
    """A transport ``transport`` (checked by :func:`check_transport`) for the transfer of ``rank`` with ``peer``
    over ``store`` (the group's, its root: both ends publish what the other needs there)."""
    kind = check_transport(transport)
    if kind == "nixl":
        from ._nixl import NixlTransport

        return NixlTransport(store, rank, peer, timeout)
    if kind == "mooncake":
        from ._mooncake import MooncakeTransport

        return MooncakeTransport(store, rank, peer, timeout)
    from ._gloo import GlooTransport

    return GlooTransport()


def one_host_ucx() -> None:
    """For the processes of a run on one host (``simulate --scenario pd``, ``bench --transfer``) over NIXL: UCX over
    TCP, shared memory and loopback, and without its InfiniBand module, unless the environment says otherwise.

    Why without it: the NIXL wheel's UCX brings a copy of libnl of its own, and
    its InfiniBand module loads the system's libibverbs, which loads the
    system's libnl; the two copies crash the process as it exits (a SIGSEGV in
    ``rtnl_tc_unregister``). Set in the environment, so the processes spawned inherit it."""
    import os

    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_MODULES", "^ib")
