"""The ``mambacache`` command: simulate, bench, trace."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mambacache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mambacache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import _trace_report

    for module in _command_modules():
        module.add_parser(sub)
    _trace_report.add_parser(sub)
    return parser


def _command_modules() -> list[Any]:
    import importlib

    out: list[Any] = []
    for name in ("mambacache.sim._cli", "mambacache.bench._cli"):
        try:
            out.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:  # pragma: no cover - until those land
            if not name.startswith(str(exc.name)):
                raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
