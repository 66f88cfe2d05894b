"""mambacache: an event-driven asynchronous manager for hybrid models' recurrent state."""

import typing as _typing
from typing import Any as _Any

from ._core._errors import BindingError as BindingError
from ._core._errors import DistributedError as DistributedError
from ._core._errors import ExecutorError as ExecutorError
from ._core._errors import InvalidArgumentError as InvalidArgumentError
from ._core._errors import InvalidEventError as InvalidEventError
from ._core._errors import InvalidSlotError as InvalidSlotError
from ._core._errors import MambaCacheError as MambaCacheError
from ._core._errors import ManagerBrokenError as ManagerBrokenError
from ._core._errors import ManagerClosedError as ManagerClosedError
from ._core._errors import PlanError as PlanError
from ._core._errors import PoolAllocationError as PoolAllocationError
from ._core._errors import PoolExhaustedError as PoolExhaustedError
from ._core._errors import SlotLeakError as SlotLeakError
from ._core._errors import SlotStateError as SlotStateError
from ._core._errors import StaleHitError as StaleHitError
from ._core._errors import TraceError as TraceError
from ._core._errors import TransferError as TransferError
from ._core._errors import TransferRefusedError as TransferRefusedError
from ._core._errors import TransportUnavailableError as TransportUnavailableError
from ._core._errors import UnknownExecutorError as UnknownExecutorError
from ._core._errors import UnsupportedDtypeError as UnsupportedDtypeError

if _typing.TYPE_CHECKING:
    from ._core._channel import Channel as Channel
    from ._core._channel import LoopbackChannel as LoopbackChannel
    from ._core._events import Alloc as Alloc
    from ._core._events import Clear as Clear
    from ._core._events import CommitDraft as CommitDraft
    from ._core._events import CopyOnWrite as CopyOnWrite
    from ._core._events import DropHost as DropHost
    from ._core._events import Export as Export
    from ._core._events import Import as Import
    from ._core._events import Offload as Offload
    from ._core._events import Release as Release
    from ._core._events import Restore as Restore
    from ._core._events import StepReport as StepReport
    from ._core._indices import StateIndices as StateIndices
    from ._core._planner import Plan as Plan
    from ._core._planner import plan_step as plan_step
    from ._core._pool import StatePool as StatePool
    from ._core._spec import StateSpec as StateSpec
    from ._executors import Executor as Executor
    from ._executors import known_executors as known_executors
    from ._executors import register_executor as register_executor
    from ._handoff._transfer import StateTransfer as StateTransfer
    from ._manager import CacheManager as CacheManager
    from ._tiers._hostpool import HostPool as HostPool
    from ._tiers._prefix import PrefixCache as PrefixCache
    from ._tiers._prefix import PrefixHit as PrefixHit
    from ._tiers._prefix import PrefixStats as PrefixStats

__version__ = "0.1.0"

# The rest of the surface is imported on first use, so that `import mambacache` (and the `mambacache` command's
# --version and --help) stay free of torch until something needs it: the module that defines each name.
_LAZY = {
    **dict.fromkeys(("Channel", "LoopbackChannel"), "_core._channel"),
    **dict.fromkeys(
        (
            "Alloc",
            "Clear",
            "CommitDraft",
            "CopyOnWrite",
            "DropHost",
            "Export",
            "Import",
            "Offload",
            "Release",
            "Restore",
            "StepReport",
        ),
        "_core._events",
    ),
    **dict.fromkeys(("Executor", "known_executors", "register_executor"), "_executors"),
    **dict.fromkeys(("CacheManager",), "_manager"),
    **dict.fromkeys(("StateTransfer",), "_handoff._transfer"),
    **dict.fromkeys(("HostPool",), "_tiers._hostpool"),
    **dict.fromkeys(("StateIndices",), "_core._indices"),
    **dict.fromkeys(("Plan", "plan_step"), "_core._planner"),
    **dict.fromkeys(("StatePool",), "_core._pool"),
    **dict.fromkeys(("StateSpec",), "_core._spec"),
    **dict.fromkeys(("PrefixCache", "PrefixHit", "PrefixStats"), "_tiers._prefix"),
}
# Public submodules, imported on first use (as `mc.tracing.configure(...)`): the tools pull in argparse,
# matplotlib, transformers.
_SUBMODULES = frozenset({"audit", "bench", "hf", "sim", "testing", "tracing"})


def __getattr__(name: str) -> _Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value  # found in the module's namespace from now on, without this call
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "Alloc",
    "BindingError",
    "CacheManager",
    "Channel",
    "Clear",
    "CommitDraft",
    "CopyOnWrite",
    "DistributedError",
    "DropHost",
    "Executor",
    "ExecutorError",
    "Export",
    "HostPool",
    "Import",
    "InvalidArgumentError",
    "InvalidEventError",
    "InvalidSlotError",
    "LoopbackChannel",
    "MambaCacheError",
    "ManagerBrokenError",
    "ManagerClosedError",
    "Offload",
    "Plan",
    "PlanError",
    "PoolAllocationError",
    "PoolExhaustedError",
    "PrefixCache",
    "PrefixHit",
    "PrefixStats",
    "Release",
    "Restore",
    "SlotLeakError",
    "SlotStateError",
    "StaleHitError",
    "StateIndices",
    "StatePool",
    "StateSpec",
    "StateTransfer",
    "StepReport",
    "TraceError",
    "TransferError",
    "TransferRefusedError",
    "TransportUnavailableError",
    "UnknownExecutorError",
    "UnsupportedDtypeError",
    "known_executors",
    "plan_step",
    "register_executor",
]
