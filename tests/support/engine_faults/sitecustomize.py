"""Run at the start of every Python process with this folder on ``PYTHONPATH`` (tests that fault an engine
plugin, mambacache_test_faults.py): patches the plugin module that ``MAMBACACHE_TEST_FAULT`` names once it is
imported, and nothing else."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any


def _install(name: str) -> None:
    import mambacache_test_faults as faults

    target = faults.FAULTS.get(name)
    if target is None:
        raise SystemExit(f"{faults.ENV}={name!r}: unknown fault (known: {sorted(faults.FAULTS)})")

    class Finder(importlib.abc.MetaPathFinder):
        """Finds nothing itself: wraps the loader of the plugin's module so the fault lands as it loads."""

        def find_spec(self, fullname: str, path: Any, target_: Any = None) -> importlib.machinery.ModuleSpec | None:
            if fullname != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                faults.inject(name, module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())


if os.environ.get("MAMBACACHE_TEST_FAULT"):
    _install(os.environ["MAMBACACHE_TEST_FAULT"])
