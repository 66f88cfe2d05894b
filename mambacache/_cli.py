"""The ``mambacache`` command: simulate, bench, trace."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    from . import _trace_report
    from .bench import _cli as bench_cli
    from .sim import _cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="mambacache", description="Manage, simulate and benchmark hybrid models' recurrent state caches."
    )
    parser.add_argument("--version", action="version", version=f"mambacache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (sim_cli, bench_cli, _trace_report):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
