"""The ``mambacache`` command: simulate, bench, trace."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from . import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (and --help for the rest), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .bench import _cli as bench_cli
    from .sim import _cli as sim_cli
    from .tracing import _report as trace_cli

    parser = _Parser(
        prog="mambacache", description="Manage, simulate and benchmark hybrid models' recurrent state caches."
    )
    parser.add_argument("--version", action="version", version=f"mambacache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (sim_cli, bench_cli, trace_cli):
        module.add_parser(sub)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each subcommand of :func:`build_parser`'s ``parser``, by name."""
    return next(dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction) and a.choices)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 success, 1 a finding (anomalies, mismatches), 2 bad input or usage, 130 interrupted."""
    from ._console import UsageError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's error, naming it: "mambacache simulate: error: unrecognized arguments: ..."
        subcommands(parser)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except UsageError as exc:
        sys.stderr.write(f"mambacache {args.command}: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
