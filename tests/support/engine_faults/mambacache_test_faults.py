"""Deliberate faults in the engine plugins, for the tests that show the plugins' checks can fail.

The package reads no switch to fail: a fault is a patch of the plugin's module from outside. In the test's own
process, ``inject(name, module, monkeypatch.setattr)``. In an engine's processes (vLLM's workers, a script the
test runs), :func:`subprocess_env` gives the environment that puts this folder on ``PYTHONPATH`` and names the
fault in ``MAMBACACHE_TEST_FAULT``: this folder's ``sitecustomize`` then patches the plugin's module when the
engine imports it. Only this folder reads that variable.

* ``vllm-skip-clear``: the vLLM plugin allocates blocks without clearing them;
* ``vllm-skip-copy``: it drops vLLM's align-mode block copies (``VllmStates.copy_block``);
* ``sglang-skip-clear``: the SGLang plugin's clears do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "MAMBACACHE_TEST_FAULT"
HERE = Path(__file__).parent

# fault -> the plugin module it patches
FAULTS = {
    "vllm-skip-clear": "mambacache.integrations.vllm",
    "vllm-skip-copy": "mambacache.integrations.vllm",
    "sglang-skip-clear": "mambacache.integrations.sglang",
}


def never_clearing(base: type) -> type:
    """A subclass of the manager class ``base`` that allocates without clearing and ignores clears."""

    class NeverClearing(base):  # type: ignore[misc, valid-type]
        def alloc_slots(self, *args: Any, **kwargs: Any) -> Any:
            kwargs["clear"] = False
            return super().alloc_slots(*args, **kwargs)

        def clear(self, *args: Any, **kwargs: Any) -> None:
            del args, kwargs

        def clear_many(self, *args: Any, **kwargs: Any) -> None:
            del args, kwargs

    return NeverClearing


def _skip_copy(self: Any, *args: Any, **kwargs: Any) -> None:
    del self, args, kwargs


def inject(name: str, module: ModuleType, patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Patch the plugin ``module`` (the one :data:`FAULTS` names) with fault ``name``, through ``patch``
    (``setattr``, or pytest's ``monkeypatch.setattr`` to undo it after the test)."""
    if FAULTS.get(name) != module.__name__:
        raise ValueError(f"unknown fault {name!r} for {module.__name__} (known: {FAULTS})")
    if name.endswith("skip-clear"):
        patch(module, "CacheManager", never_clearing(module.CacheManager))
    else:
        patch(module.VllmStates, "copy_block", _skip_copy)


def subprocess_env(name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with fault ``name`` injected into every Python process
    started with it."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r} (known: {sorted(FAULTS)})")
    out = dict(os.environ if env is None else env)
    path = out.get("PYTHONPATH")
    out["PYTHONPATH"] = str(HERE) + (os.pathsep + path if path else "")
    out[ENV] = name
    return out
